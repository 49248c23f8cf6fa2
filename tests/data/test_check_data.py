"""`rollplex-trl check-data`: a folder with good, missing, corrupt and over-long clips, through the real command."""

import json
import os
import subprocess
import sys

from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset
from rollplex_trl.data.check import check_data
from rollplex_trl.data.prepared import PREPARED_KEY, PreparedPromptDataset
from rollplex_trl.data.video import VideoSamplingConfig

from helpers import write_mp4

SAMPLING = dict(fps=2.0, min_frames=4, max_frames=8, min_pixels=3136, max_pixels=112 * 112)


def _folder(tmp_path):
    annotations = write_synthetic_video_dataset(
        tmp_path / "data", SyntheticVideoConfig(num_samples=4, num_frames=4, height=56, width=56))
    rows = [json.loads(line) for line in annotations.read_text().splitlines()]
    os.remove(annotations.parent / rows[1]["path"])  # missing
    (annotations.parent / rows[2]["path"]).write_bytes(b"\x00" * 2048)  # corrupt
    write_mp4(annotations.parent / "videos" / "long.mp4", num_frames=16, height=112, width=112, fps=2, seed=9)
    rows.append({**rows[0], "problem_id": 99, "path": "./videos/long.mp4"})  # over-long
    annotations.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return annotations


def test_check_data_reports_each_kind_of_row(tiny_vl_path, tmp_path):
    from transformers import AutoProcessor

    from rollplex_trl.data import load_video_r1
    from rollplex_trl.data.prepared import MediaOptions

    annotations = _folder(tmp_path)
    report = check_data(annotations, tiny_vl_path, sampling=VideoSamplingConfig(**SAMPLING), max_prompt_length=200)
    by_row = {r.row: r for r in report.rows}
    assert len(report.rows) == 5 and [r.row for r in report.bad] == [1, 2]
    assert "not found" in by_row[1].error and "cannot decode" in by_row[2].error
    assert [r.row for r in report.over_budget] == [4]
    # the counts are the trainer's: its dataset wrapper on the good rows, same processor and sampling
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    good = load_video_r1(annotations, on_invalid="skip", check_files=True).select([0, 2])  # rows 0 and 3 (4 is long)
    wrapped = PreparedPromptDataset(good, processor, MediaOptions(sampling=VideoSamplingConfig(**SAMPLING)))
    for i, row in enumerate((0, 3)):
        prompt = wrapped[i][PREPARED_KEY]
        assert (by_row[row].prompt_tokens, by_row[row].visual_tokens) == (prompt.num_prompt_tokens,
                                                                          prompt.num_visual_tokens)
    assert by_row[4].frames == 8 and by_row[4].pixels_per_frame == 112 * 112
    assert by_row[4].prompt_tokens > by_row[0].prompt_tokens


def test_check_data_command(tiny_vl_path, tmp_path):
    annotations = _folder(tmp_path)
    report_file = tmp_path / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "rollplex_trl.cli", "check-data", "--annotations", str(annotations), "--model",
         str(tiny_vl_path), "--workers", "2", "--max-frames", "8", "--min-pixels", "3136", "--max-pixels",
         str(112 * 112), "--max-prompt-length", "200", "--report", str(report_file)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # bad rows: non-zero
    assert "5 rows, 3 good, 2 bad" in proc.stdout and "BAD row 1" in proc.stdout and "BAD row 2" in proc.stdout
    assert "largest prompt: row 4" in proc.stdout and "1 prompt(s) over it (rows 4)" in proc.stdout
    saved = json.loads(report_file.read_text())
    assert saved["bad_rows"] == 2 and saved["over_max_prompt_length"] == 1 and len(saved["per_row"]) == 5
