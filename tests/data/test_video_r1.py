"""Video-R1-format loading: prompts, path resolution, invalid rows, images."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rollplex_trl.data import (
    RollplexDataError,
    build_prompt,
    load_image,
    load_video_r1,
    load_video_r1_with_report,
    resolve_media_path,
)

from media_files import numbered_frames, write_video

# Written out by hand from Video-R1's grpo.py, not built with the module's constants.
INSTRUCTIONS = (
    "Please think about this question as if you were a human pondering deeply. Engage in an internal dialogue using "
    "expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', 'let's break it down', etc, or other natural "
    "language thought expressions It's encouraged to include self-reflection or verification in the reasoning "
    "process. Provide your detailed reasoning between the <think> </think> tags, and then give your final answer "
    "between the <answer> </answer> tags."
)
EXPECTED_MC_TEXT = (
    "What is the man holding?Options:\nA. a cup\nB. a phone\n\n"
    + INSTRUCTIONS
    + " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the <answer> </answer> tags."
)
EXPECTED_NUMERICAL_TEXT = (
    "How many birds are there?\n"
    + INSTRUCTIONS
    + " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags."
)
EXPECTED_OCR_SUFFIX = (
    " Please transcribe text from the image/video clearly and provide your text answer within the <answer> </answer> "
    "tags."
)
EXPECTED_FREE_FORM_SUFFIX = " Please provide your text answer within the <answer> </answer> tags."


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    """A Video-R1-like data folder with real media: two PNGs and one MP4."""
    (tmp_path / "images").mkdir()
    (tmp_path / "videos").mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "images" / "chart.png")
    Image.new("L", (40, 30), 128).save(tmp_path / "images" / "text.png")
    write_video(tmp_path / "videos" / "clip.mp4", numbered_frames(8), fps=4)
    return tmp_path


def make_rows(data_root: Path) -> list[dict]:
    return [
        {
            "problem_id": 10,
            "problem": "What is the man holding?",
            "data_type": "video",
            "problem_type": "multiple choice",
            "options": ["A. a cup", "B. a phone"],
            "solution": "<answer>B</answer>",
            "path": "./videos/clip.mp4",
            "data_source": "LLaVA-Video-178K/30_60_s_youtube_v0_1",
        },
        {
            "problem_id": 11,
            "problem": "How many birds are there?",
            "data_type": "image",
            "problem_type": "numerical",
            "options": [],
            "solution": "<answer>3</answer>",
            "path": "./images/chart.png",
            "data_source": "Math",
        },
        {
            "problem_id": 12,
            "problem": "What does the sign say?",
            "data_type": "image",
            "problem_type": "OCR",
            "options": [],
            "solution": "<answer>STOP</answer>",
            "path": "images/text.png",  # relative without "./"
            "data_source": "OCR",
            "process": "<think>extra COT field, ignored</think>",
        },
        {
            "problem_id": 13,
            "problem": "Describe the clip.",
            "data_type": "video",
            "problem_type": "free-form",
            "solution": "<answer>a grey screen fading in</answer>",  # no options key at all
            "path": str(data_root / "videos" / "clip.mp4"),  # absolute
            "data_source": "STAR",
        },
        {
            "problem_id": 14,
            "problem": "How many seconds long is the clip?",
            "data_type": "video",
            "problem_type": "regression",
            "options": [],
            "solution": "<answer>2.0</answer>",
            "path": "./videos/../videos/clip.mp4",
        },
    ]


def write_json(path: Path, rows: list) -> Path:
    path.write_text(json.dumps(rows, indent=1))
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_build_prompt_matches_video_r1_text():
    mc_row = {
        "problem": "What is the man holding?",
        "problem_type": "multiple choice",
        "data_type": "video",
        "options": ["A. a cup", "B. a phone"],
    }
    assert build_prompt(mc_row) == [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": EXPECTED_MC_TEXT}]}
    ]
    numerical_row = {"problem": "How many birds are there?", "problem_type": "numerical", "data_type": "image"}
    assert build_prompt(numerical_row)[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": EXPECTED_NUMERICAL_TEXT},
    ]


@pytest.mark.parametrize("writer", [write_json, write_jsonl], ids=["json-list", "jsonl"])
def test_load_mixed_image_and_video_rows(data_root, writer):
    annotation = writer(data_root / "annotations.data", make_rows(data_root))  # format detected by content
    dataset, report = load_video_r1_with_report(annotation)

    assert report.num_rows == 5 and report.num_skipped == 0 and report.skipped == []
    assert set(dataset.column_names) == {
        "prompt",
        "problem_id",
        "problem_type",
        "solution",
        "options",
        "data_type",
        "data_source",
        "video",
        "image",
    }
    clip = str(data_root / "videos" / "clip.mp4")
    chart, text = str(data_root / "images" / "chart.png"), str(data_root / "images" / "text.png")
    assert dataset["video"] == [clip, None, None, clip, clip]
    assert dataset["image"] == [None, chart, text, None, None]
    assert dataset["problem_id"] == [10, 11, 12, 13, 14]
    assert dataset["options"] == [["A. a cup", "B. a phone"], [], [], [], []]
    assert dataset["data_source"][3:] == ["STAR", ""]

    first = dataset[0]["prompt"]
    assert first[0]["role"] == "user"
    assert first[0]["content"][0]["type"] == "video"  # Arrow adds "text": None to the placeholder
    assert first[0]["content"][1]["text"] == EXPECTED_MC_TEXT
    assert dataset[1]["prompt"][0]["content"][1]["text"] == EXPECTED_NUMERICAL_TEXT
    assert dataset[1]["prompt"][0]["content"][0]["type"] == "image"
    assert dataset[2]["prompt"][0]["content"][1]["text"].endswith(EXPECTED_OCR_SUFFIX)
    assert dataset[3]["prompt"][0]["content"][1]["text"].startswith("Describe the clip.\nPlease think")
    assert dataset[3]["prompt"][0]["content"][1]["text"].endswith(EXPECTED_FREE_FORM_SUFFIX)


def test_data_root_defaults_to_annotation_folder_and_can_be_overridden(data_root, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("annotations")
    annotation = write_json(elsewhere / "Video-R1-260k.json", make_rows(data_root)[:2])
    with pytest.raises(RollplexDataError, match="not found"):
        load_video_r1(annotation)  # the media are not next to this annotation file
    dataset = load_video_r1(annotation, data_root=data_root)
    assert dataset["video"][0] == str(data_root / "videos" / "clip.mp4")


def test_resolve_media_path():
    assert resolve_media_path("./LLaVA-Video-178K/a/b.mp4", "/data/Video-R1-data") == (
        "/data/Video-R1-data/LLaVA-Video-178K/a/b.mp4"
    )
    assert resolve_media_path("/abs/x.png", "/data") == "/abs/x.png"
    assert resolve_media_path("file:///abs/x.png", "/data") == "/abs/x.png"
    assert resolve_media_path("rel/../y.png", "/data") == "/data/y.png"


def test_invalid_rows_raise_with_sample_row_and_file(data_root):
    rows = make_rows(data_root)
    rows[1]["problem_type"] = "yes/no"
    annotation = write_json(data_root / "bad.json", rows)
    with pytest.raises(RollplexDataError) as caught:
        load_video_r1(annotation)
    message = str(caught.value)
    assert str(annotation) in message and "problem_id=11" in message and "(row 1)" in message
    assert "unknown problem_type 'yes/no'" in message and "on_invalid='skip'" in message

    rows = make_rows(data_root)
    rows[2]["path"] = "./images/missing.png"
    write_json(annotation, rows)
    with pytest.raises(RollplexDataError) as caught:
        load_video_r1(annotation)
    message = str(caught.value)
    assert "problem_id=12" in message and str(data_root / "images" / "missing.png") in message
    assert "check the path / data_root" in message


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda row: row.pop("solution"), "missing required field(s) ['solution']"),
        (lambda row: row.update(data_type="audio"), "unknown data_type 'audio'"),
        (lambda row: row.update(options=[]), "needs a non-empty options list"),
        (lambda row: row.update(solution="B"), "has no <answer>...</answer> tag"),
        (lambda row: row.update(problem_id="10"), "problem_id must be an integer"),
    ],
)
def test_each_kind_of_invalid_row_is_reported(data_root, change, reason):
    rows = make_rows(data_root)
    change(rows[0])
    annotation = write_jsonl(data_root / "bad.jsonl", rows)
    with pytest.raises(RollplexDataError) as caught:
        load_video_r1(annotation)
    assert "sample problem_id=" in str(caught.value) and "(row 0)" in str(caught.value)
    assert reason in str(caught.value)


def test_skip_drops_invalid_rows_and_reports_them(data_root, caplog):
    rows = make_rows(data_root)
    rows[1]["problem_type"] = "yes/no"
    rows[3]["path"] = "./videos/gone.mp4"
    annotation = write_json(data_root / "mixed.json", rows)

    dataset, report = load_video_r1_with_report(annotation, on_invalid="skip")
    assert dataset["problem_id"] == [10, 12, 14]
    assert report.num_rows == 3 and report.num_skipped == 2
    assert [problem_id for problem_id, _ in report.skipped] == [11, 13]
    assert "unknown problem_type" in report.skipped[0][1] and "gone.mp4" in report.skipped[1][1]

    with caplog.at_level(logging.WARNING, logger="rollplex_trl.data.video_r1"):
        assert len(load_video_r1(annotation, on_invalid="skip")) == 3
    assert "skipped 2 invalid row(s), kept 3" in caplog.text


def test_check_files_false_keeps_rows_with_missing_media(data_root):
    rows = make_rows(data_root)
    rows[0]["path"] = "./videos/not-downloaded-yet.mp4"
    dataset = load_video_r1(write_json(data_root / "a.json", rows), check_files=False)
    assert dataset["video"][0] == str(data_root / "videos" / "not-downloaded-yet.mp4")


def test_empty_or_unusable_files(data_root):
    with pytest.raises(RollplexDataError, match="no usable rows in .*empty.json"):
        load_video_r1(write_json(data_root / "empty.json", []))
    with pytest.raises(RollplexDataError, match="no usable rows"):
        load_video_r1(write_jsonl(data_root / "blank.jsonl", []))
    rows = make_rows(data_root)[:2]
    for row in rows:
        row["problem_type"] = "yes/no"
    with pytest.raises(RollplexDataError, match="all 2 rows were invalid"):
        load_video_r1(write_json(data_root / "all-bad.json", rows), on_invalid="skip")
    with pytest.raises(RollplexDataError, match="not found"):
        load_video_r1(data_root / "no-such-file.json")
    (data_root / "broken.jsonl").write_text('{"problem_id": 1}\n{not json\n')
    with pytest.raises(RollplexDataError, match="line 2 is not valid JSON"):
        load_video_r1(data_root / "broken.jsonl")
    with pytest.raises(ValueError, match="on_invalid"):
        load_video_r1(data_root / "broken.jsonl", on_invalid="ignore")


def test_load_image(data_root):
    chart = load_image(data_root / "images" / "chart.png", sample_id=11)
    assert chart.mode == "RGB" and chart.size == (40, 30) and chart.getpixel((0, 0)) == (200, 10, 10)
    assert load_image(data_root / "images" / "text.png").mode == "RGB"  # greyscale converted

    rgba = data_root / "images" / "transparent.png"
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(rgba)
    assert load_image(rgba).getpixel((1, 1)) == (255, 255, 255)  # transparent -> white, as qwen-vl-utils

    with pytest.raises(RollplexDataError, match=r"problem_id=11.*missing\.png.*check the path"):
        load_image(data_root / "images" / "missing.png", sample_id=11)
    corrupt = data_root / "images" / "corrupt.png"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 512, dtype=np.uint8).tobytes())
    with pytest.raises(RollplexDataError, match=r"problem_id=12.*corrupt\.png.*cannot read the image"):
        load_image(corrupt, sample_id=12)


# ---------------------------------------------------------------------------------------------------------------------
# Paths outside the data root
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def outside_clip(data_root: Path, tmp_path_factory) -> Path:
    """A real video in a folder that is not under ``data_root`` (a sibling temp folder)."""
    folder = tmp_path_factory.mktemp("elsewhere")
    clip = write_video(folder / "secret.mp4", numbered_frames(8), fps=4)
    assert not clip.resolve().is_relative_to(data_root.resolve())
    return clip


def _escaping_rows(data_root: Path, outside_clip: Path) -> list[dict]:
    rows = make_rows(data_root)[:2]
    relative_escape = os.path.relpath(outside_clip, data_root)  # "../elsewhere0/secret.mp4"
    assert relative_escape.startswith("..") and (data_root / relative_escape).resolve() == outside_clip.resolve()
    rows.append(dict(rows[0], problem_id=20, path=relative_escape))
    rows.append(dict(rows[0], problem_id=21, path=str(outside_clip)))
    return rows


@pytest.mark.parametrize(("which", "problem_id"), [(2, 20), (3, 21)], ids=["relative-escape", "absolute-outside"])
def test_paths_outside_the_data_root_are_refused(data_root, outside_clip, which, problem_id):
    rows = _escaping_rows(data_root, outside_clip)
    annotation = write_json(data_root / "escape.json", [rows[0], rows[which]])
    with pytest.raises(RollplexDataError) as caught:
        load_video_r1(annotation)
    message = str(caught.value)
    assert f"sample problem_id={problem_id} (row 1)" in message
    assert repr(rows[which]["path"]) in message and str(outside_clip) in message  # as written, and where it leads
    assert f"outside the data root {data_root}" in message and "allow_paths_outside_root=True" in message

    dataset, report = load_video_r1_with_report(annotation, on_invalid="skip")
    assert dataset["problem_id"] == [10] and [pid for pid, _ in report.skipped] == [problem_id]


def test_paths_outside_the_data_root_can_be_allowed(data_root, outside_clip):
    annotation = write_json(data_root / "escape.json", _escaping_rows(data_root, outside_clip))
    dataset = load_video_r1(annotation, allow_paths_outside_root=True)
    assert dataset["video"][2:] == [str(outside_clip), str(outside_clip)]
    _, report = load_video_r1_with_report(annotation, allow_paths_outside_root=True)
    assert report.num_skipped == 0


def test_paths_inside_the_data_root_are_kept(data_root):
    rows = make_rows(data_root)
    rows[0]["path"] = str(data_root / "videos" / "clip.mp4")  # absolute, inside
    rows[1]["path"] = "images/../images/chart.png"  # ".." that stays inside
    dataset = load_video_r1(write_json(data_root / "inside.json", rows))
    assert dataset["video"][0] == str(data_root / "videos" / "clip.mp4")
    assert dataset["image"][1] == str(data_root / "images" / "chart.png")


def test_symlinks_under_the_root_are_followed(data_root, outside_clip, tmp_path_factory):
    # A link inside the root (e.g. a dataset folder on another disk) is part of the root's layout: allowed.
    (data_root / "other-disk").symlink_to(outside_clip.parent, target_is_directory=True)
    rows = make_rows(data_root)[:1]
    rows[0]["path"] = "./other-disk/secret.mp4"
    dataset = load_video_r1(write_json(data_root / "linked.json", rows))
    assert dataset["video"] == [str(data_root / "other-disk" / "secret.mp4")]
    # The root reached through another name (a symlink to it): an absolute path by its real name is inside.
    alias = tmp_path_factory.mktemp("alias") / "root-link"
    alias.symlink_to(data_root, target_is_directory=True)
    rows[0]["path"] = str(data_root / "videos" / "clip.mp4")
    assert len(load_video_r1(write_json(data_root / "aliased.json", rows), data_root=alias)) == 1
    # ... but a link does not make ".." acceptable: the normalised path, the one opened, leaves the root.
    rows[0]["path"] = "./other-disk/../../elsewhere.mp4"
    with pytest.raises(RollplexDataError, match="outside the data root"):
        load_video_r1(write_json(data_root / "dotdot.json", rows), check_files=False)


# ---------------------------------------------------------------------------------------------------------------------
# Options and labels
# ---------------------------------------------------------------------------------------------------------------------


def test_null_options_are_accepted_outside_multiple_choice(data_root):
    rows = make_rows(data_root)
    rows[1]["options"] = None  # numerical: Video-R1 never reads its options
    rows[4]["options"] = None  # regression
    dataset = load_video_r1(write_json(data_root / "null-options.json", rows))
    assert dataset["options"][1] == [] and dataset["options"][4] == []
    assert dataset[1]["prompt"][0]["content"][1]["text"] == EXPECTED_NUMERICAL_TEXT

    rows[0]["options"] = None  # multiple choice needs them
    with pytest.raises(RollplexDataError, match="problem_id=10 \\(row 0\\).*needs a non-empty options list"):
        load_video_r1(write_json(data_root / "null-mc.json", rows))


def test_skip_warning_names_the_sample_naturally(data_root, caplog):
    rows = make_rows(data_root)
    rows[1]["problem_type"] = "yes/no"
    with caplog.at_level(logging.WARNING, logger="rollplex_trl.data.video_r1"):
        load_video_r1(write_json(data_root / "warn.json", rows), on_invalid="skip")
    assert "first: sample problem_id=11, row 1: unknown problem_type" in caplog.text
