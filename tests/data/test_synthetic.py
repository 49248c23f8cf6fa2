"""The synthetic video task: real MP4s whose pixels prove the recorded answers, in Video-R1 format."""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from rollplex_trl.data import (
    SyntheticVideoConfig,
    VideoSamplingConfig,
    load_video,
    load_video_r1,
    make_synthetic_samples,
    render_frames,
    write_synthetic_video_dataset,
)
from rollplex_trl.data.synthetic import COLOURS, DIRECTION_OPTIONS

CONFIG = SyntheticVideoConfig(num_samples=6, seed=3)
ALL_FRAMES = VideoSamplingConfig(nframes=CONFIG.num_frames)  # decode every frame, at the native 112x112
MIN_BLOB_PIXELS = 20  # objects cover ~200 px; anything smaller is a coding artefact at an edge


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("synthetic")
    write_synthetic_video_dataset(out_dir, CONFIG)
    return out_dir


@pytest.fixture(scope="module")
def decoded(dataset_dir: Path) -> dict[int, np.ndarray]:
    """Every clip decoded with the package's reader: problem_id -> uint8 (T, H, W, 3)."""
    clips = {}
    for sample in make_synthetic_samples(CONFIG):
        video = load_video(dataset_dir / "videos" / sample.video_name, ALL_FRAMES, sample_id=sample.problem_id)
        clips[sample.problem_id] = video.frames.permute(0, 2, 3, 1).numpy()
    return clips


def colour_mask(frame: np.ndarray, colour: str, tolerance: int = 60) -> np.ndarray:
    """Pixels within ``tolerance`` (per channel) of a named colour."""
    reference = np.array(COLOURS[colour], dtype=np.int16)
    return (np.abs(frame.astype(np.int16) - reference) <= tolerance).all(axis=-1)


def blobs(mask: np.ndarray) -> list[list[tuple[int, int]]]:
    """4-connected components of a boolean mask, ignoring specks (plain BFS; no scipy)."""
    seen = np.zeros_like(mask, dtype=bool)
    components = []
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        seen[start] = True
        queue, pixels = deque([start]), []
        while queue:
            row, col = queue.popleft()
            pixels.append((row, col))
            for next_row, next_col in ((row + 1, col), (row - 1, col), (row, col + 1), (row, col - 1)):
                inside = 0 <= next_row < mask.shape[0] and 0 <= next_col < mask.shape[1]
                if inside and mask[next_row, next_col] and not seen[next_row, next_col]:
                    seen[next_row, next_col] = True
                    queue.append((next_row, next_col))
        if len(pixels) >= MIN_BLOB_PIXELS:
            components.append(pixels)
    return components


def option_text(sample, letter: str) -> str:
    return next(option for option in sample.options if option.startswith(f"{letter}."))[3:]


def test_annotations_are_video_r1_rows(dataset_dir):
    lines = (dataset_dir / "annotations.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["problem_id"] for row in rows] == list(range(6))
    assert [row["data_source"] for row in rows] == [f"rollplex-synthetic/{task}" for task in CONFIG.tasks] * 2
    expected_keys = ["problem_id", "problem", "data_type", "problem_type", "options", "solution", "path", "data_source"]
    for row in rows:
        assert list(row) == expected_keys
        assert row["data_type"] == "video"
        assert row["path"].startswith("./videos/") and (dataset_dir / row["path"]).is_file()
        assert row["solution"].startswith("<answer>") and row["solution"].endswith("</answer>")
        if row["problem_type"] == "numerical":
            assert row["options"] == []
        else:
            assert row["problem_type"] == "multiple choice" and len(row["options"]) == 4


def test_video_r1_loader_reads_the_synthetic_dataset(dataset_dir):
    dataset = load_video_r1(dataset_dir / "annotations.jsonl")
    assert len(dataset) == 6
    assert all(Path(path).is_file() for path in dataset["video"])
    assert dataset["image"] == [None] * 6


def test_decoded_clips_match_the_rendering(decoded):
    for sample in make_synthetic_samples(CONFIG):
        rendered = render_frames(sample, CONFIG)
        assert decoded[sample.problem_id].shape == rendered.shape == (16, 112, 112, 3)
        mean_error = np.abs(decoded[sample.problem_id].astype(np.int16) - rendered).mean()
        assert mean_error < 6, (sample.problem_id, mean_error)


def test_count_answers_match_the_pixels(decoded):
    samples = [sample for sample in make_synthetic_samples(CONFIG) if sample.task == "count"]
    assert samples
    for sample in samples:
        colour = sample.problem.split()[2]  # "How many <colour> objects ..."
        middle = decoded[sample.problem_id][CONFIG.num_frames // 2]
        assert len(blobs(colour_mask(middle, colour))) == int(sample.answer), sample


def test_direction_answers_match_the_pixels(decoded):
    samples = [sample for sample in make_synthetic_samples(CONFIG) if sample.task == "direction"]
    assert samples
    for sample in samples:
        assert sample.options == DIRECTION_OPTIONS
        colour = sample.problem.split()[5]  # "In which direction does the <colour> object move?"
        clip = decoded[sample.problem_id]
        first = np.argwhere(colour_mask(clip[0], colour)).mean(axis=0)
        last = np.argwhere(colour_mask(clip[-1], colour)).mean(axis=0)
        d_row, d_col = last - first
        if abs(d_col) > abs(d_row):
            seen = "right" if d_col > 0 else "left"
        else:
            seen = "down" if d_row > 0 else "up"
        assert option_text(sample, sample.answer) == seen, sample


def test_first_appeared_answers_match_the_pixels(decoded):
    samples = [sample for sample in make_synthetic_samples(CONFIG) if sample.task == "first_appeared"]
    assert samples
    for sample in samples:
        clip = decoded[sample.problem_id]
        first_visible = {}
        for obj in sample.objects:
            visible = [len(blobs(colour_mask(frame, obj.colour))) > 0 for frame in clip]
            first_visible[obj.colour] = visible.index(True)
            assert first_visible[obj.colour] == obj.onset, (sample, obj)
        assert option_text(sample, sample.answer) == min(first_visible, key=first_visible.get)
        # The extra option colour is absent from the whole clip.
        shown = {obj.colour for obj in sample.objects}
        (absent,) = {option[3:] for option in sample.options} - shown
        assert not any(len(blobs(colour_mask(frame, absent))) for frame in clip)


def test_generation_is_deterministic():
    assert make_synthetic_samples(CONFIG) == make_synthetic_samples(CONFIG)
    assert make_synthetic_samples(CONFIG) != make_synthetic_samples(SyntheticVideoConfig(num_samples=6, seed=4))
    # A sample depends only on (seed, index), not on how many samples are generated.
    assert make_synthetic_samples(SyntheticVideoConfig(num_samples=3, seed=3)) == make_synthetic_samples(CONFIG)[:3]


def test_rewriting_is_idempotent_and_a_new_config_rebuilds(tmp_path):
    small = SyntheticVideoConfig(num_samples=3, seed=0, num_frames=8, height=64, width=64)
    annotations = write_synthetic_video_dataset(tmp_path, small)
    stamps = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()}

    assert write_synthetic_video_dataset(tmp_path, small) == annotations
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()} == stamps

    write_synthetic_video_dataset(tmp_path, SyntheticVideoConfig(num_samples=2, seed=0, tasks=("count",)))
    assert sorted(path.name for path in (tmp_path / "videos").iterdir()) == ["count_00000.mp4", "count_00001.mp4"]
    assert len(annotations.read_text().splitlines()) == 2
    assert json.loads((tmp_path / "manifest.json").read_text())["config"]["tasks"] == ["count"]

    # A deleted video makes the directory stale, so it is rebuilt.
    (tmp_path / "videos" / "count_00001.mp4").unlink()
    write_synthetic_video_dataset(tmp_path, SyntheticVideoConfig(num_samples=2, seed=0, tasks=("count",)))
    assert (tmp_path / "videos" / "count_00001.mp4").is_file()


def test_config_validation():
    with pytest.raises(ValueError, match="tasks"):
        SyntheticVideoConfig(tasks=("count", "juggling"))
    with pytest.raises(ValueError, match="even"):
        SyntheticVideoConfig(height=113)


def test_mp4_bytes_do_not_depend_on_the_heap(tmp_path):
    """The same frames encode to the same file whatever the process's heap holds: with x264's defaults, frames whose
    sides are not multiples of 16 (84 x 56 here) encoded differently once memory had been reused (uninitialized
    reads), so two ranks writing one clip read different pixels."""
    import hashlib

    from rollplex_trl.data.synthetic import pick_video_codec, write_mp4

    if pick_video_codec() != "libx264":
        pytest.skip("the x264 settings are what this checks")
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 255, (84 // 8 + 1, 56 // 8 + 1, 3), dtype=np.uint8)  # smooth blocks, as the tests' clips
    frames = np.stack([np.kron(np.roll(blocks, i, axis=1), np.ones((8, 8, 1), np.uint8))[:84, :56] for i in range(8)])
    digests, junk = set(), []
    for k in range(12):
        junk.append(bytearray(rng.bytes(int(rng.integers(1_000, 200_000)))))  # leave freed memory with contents
        del junk[: int(rng.integers(0, len(junk)))]
        path = tmp_path / f"clip{k}.mp4"
        write_mp4(path, frames, fps=4)
        digests.add(hashlib.md5(path.read_bytes()).hexdigest())
    assert len(digests) == 1


# ---------------------------------------------------------------------------------------------------------------------
# left_right: a task that needs the frames in order
# ---------------------------------------------------------------------------------------------------------------------

LEFT_RIGHT_CONFIG = SyntheticVideoConfig(num_samples=8, seed=5, num_frames=8, height=64, width=64,
                                         tasks=("left_right",))
HELDOUT_CONFIG = dataclasses.replace(LEFT_RIGHT_CONFIG, split="heldout")


def _mover_columns(clip: np.ndarray, colour: str) -> list[float]:
    """Mean column of the ``colour`` pixels in each frame."""
    return [float(np.argwhere(colour_mask(frame, colour))[:, 1].mean()) for frame in clip]


def _scene(sample) -> tuple:
    """What a clip shows, whatever the direction: colour, shape, row and the set of centres it passes through."""
    (mover,) = sample.objects
    return (mover.colour, mover.shape, mover.start[0], tuple(sorted((mover.start[1], mover.end[1]))))


def test_left_right_decoded_clips_move_monotonically(tmp_path):
    write_synthetic_video_dataset(tmp_path, LEFT_RIGHT_CONFIG)
    every_frame = VideoSamplingConfig(nframes=LEFT_RIGHT_CONFIG.num_frames)
    for sample in make_synthetic_samples(LEFT_RIGHT_CONFIG):
        assert sample.options == ["A. left", "B. right"] and sample.problem_type == "multiple choice"
        video = load_video(tmp_path / "videos" / sample.video_name, every_frame, sample_id=sample.problem_id)
        clip = video.frames.permute(0, 2, 3, 1).numpy()
        assert clip.shape[0] == 8  # the reader may resize the frames (min_pixels); columns scale with the width
        (mover,) = sample.objects
        columns = np.array(_mover_columns(clip, mover.colour)) * 64 / clip.shape[2]
        steps = np.diff(columns)
        expected = [mover.centre_at(index, 8)[1] for index in range(8)]
        assert np.abs(columns - expected).max() < 1.0, (sample, columns)
        if option_text(sample, sample.answer) == "right":
            assert (steps > 0).all(), (sample, columns)
        else:
            assert (steps < 0).all(), (sample, columns)


def test_left_right_rows_are_video_r1_rows_the_rewards_score(tmp_path):
    from rollplex_trl.data import accuracy_reward

    annotations = write_synthetic_video_dataset(tmp_path, LEFT_RIGHT_CONFIG)
    rows = [json.loads(line) for line in annotations.read_text().splitlines()]
    assert {row["data_source"] for row in rows} == {"rollplex-synthetic/left_right"}
    dataset = load_video_r1(annotations)
    completions = [f"<think>it slides</think><answer>{solution[8:9]}</answer>" for solution in dataset["solution"]]
    assert accuracy_reward(completions, dataset["solution"], dataset["problem_type"]) == [1.0] * len(rows)


def test_left_right_labels_are_balanced_in_each_split():
    for config in (LEFT_RIGHT_CONFIG, HELDOUT_CONFIG):
        answers = [sample.answer for sample in make_synthetic_samples(config)]
        assert answers.count("A") == answers.count("B") == 4
    # Mixed with another task (round-robin), the left_right samples alone are still balanced.
    mixed = SyntheticVideoConfig(num_samples=8, seed=5, tasks=("count", "left_right"))
    answers = [sample.answer for sample in make_synthetic_samples(mixed) if sample.task == "left_right"]
    assert sorted(answers) == ["A", "A", "B", "B"]


def test_left_right_splits_are_disjoint():
    many = dataclasses.replace(LEFT_RIGHT_CONFIG, num_samples=200)
    train = {_scene(sample) for sample in make_synthetic_samples(many)}
    heldout = {_scene(sample) for sample in make_synthetic_samples(dataclasses.replace(many, split="heldout"))}
    assert len(train) > 150 and len(heldout) > 150
    assert not train & heldout
    # Other tasks: the held-out split draws from other random streams.
    count = SyntheticVideoConfig(num_samples=6, seed=3, tasks=("count",))
    assert make_synthetic_samples(count) != make_synthetic_samples(dataclasses.replace(count, split="heldout"))


def test_left_right_shuffled_frames_are_ambiguous():
    """The frames as a multiset (or one frame at an unknown time) do not tell left from right: each clip reversed
    is exactly the clip of the same scene moving the other way, so only the order of the frames holds the label."""
    for sample in make_synthetic_samples(LEFT_RIGHT_CONFIG):
        (mover,) = sample.objects
        flipped = dataclasses.replace(mover, start=mover.end, end=mover.start)
        twin = dataclasses.replace(sample, answer="A" if sample.answer == "B" else "B", objects=[flipped])
        clip, twin_clip = render_frames(sample, LEFT_RIGHT_CONFIG), render_frames(twin, LEFT_RIGHT_CONFIG)
        assert not np.array_equal(clip, twin_clip)  # in order, the clips differ ...
        assert np.array_equal(clip[::-1], twin_clip)  # ... as sets of frames they are the same
        assert sorted(frame.tobytes() for frame in clip) == sorted(frame.tobytes() for frame in twin_clip)


def test_left_right_config_validation():
    with pytest.raises(ValueError, match="split"):
        SyntheticVideoConfig(split="test")
    with pytest.raises(ValueError, match="num_frames"):
        SyntheticVideoConfig(num_frames=64, height=48, width=48, tasks=("left_right",))
    assert SyntheticVideoConfig().tasks == ("count", "direction", "first_appeared")  # the default mix is unchanged
