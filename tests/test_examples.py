"""The scripts in examples/ run as a user runs them (a subprocess each), for 1-2 steps on tiny local checkpoints, and
leave a checkpoint and a log with a finite loss."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Flags that keep a CPU run to seconds: fp32, no gradient checkpointing, short completions, no reporting.
CPU_FLAGS = ["--use_cpu", "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
             "--logging_steps", "1", "--seed", "0"]


def _run(script: str, args: list[str], cache: Path, timeout: int = 240) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2",
           "ROLLPLEX_CACHE": str(cache), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _losses(records: list[dict]) -> list[float]:
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses, f"no loss logged in {records}"
    assert all(math.isfinite(x) for x in losses), losses
    return losses


def _trainer_state_losses(output_dir: Path) -> list[float]:
    return _losses(json.loads((output_dir / "trainer_state.json").read_text())["log_history"])


def _cache_of(checkpoint: Path) -> Path:
    """The $ROLLPLEX_CACHE under which `get_checkpoint` finds `checkpoint` (so a script reuses the fixture's build)."""
    assert checkpoint.parent.name == "checkpoints"
    return checkpoint.parent.parent


def test_trl_drop_in_text(tiny_qwen2_path, tmp_path):
    out = tmp_path / "drop_in"
    _run("trl_drop_in.py", ["--model_name_or_path", str(tiny_qwen2_path), "--output_dir", str(out),
                            "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
                            "--max_completion_length", "8", "--toy_size", "8", *CPU_FLAGS],
         _cache_of(tiny_qwen2_path))
    assert len(_trainer_state_losses(out)) == 2
    assert (out / "model.safetensors").exists() and (out / "checkpoint-2" / "model.safetensors").exists()


def test_train_video_r1(tiny_vl_path, tmp_path):
    annotations = write_synthetic_video_dataset(
        tmp_path / "data", SyntheticVideoConfig(num_samples=4, num_frames=4, height=56, width=56, seed=0))
    out = tmp_path / "video_r1"
    stdout = _run("train_video_r1.py", [
        "--annotations", str(annotations), "--model_name_or_path", str(tiny_vl_path), "--output_dir", str(out),
        "--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--max_completion_length", "8", "--rollplex_video_max_frames", "4",
        "--rollplex_video_min_pixels", "3136", "--rollplex_video_max_pixels", "3136", *CPU_FLAGS,
    ], _cache_of(tiny_vl_path))
    assert "Trained 1 steps on 4 Video-R1 rows" in stdout
    records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    assert len(_losses(records)) == 1
    step = next(r for r in records if "loss" in r)
    assert "rewards/accuracy_reward/mean" in step and "rewards/format_reward/mean" in step
    assert (out / "checkpoint-1" / "model.safetensors").exists()


def test_demo_example(tiny_vl_path, tmp_path):
    """examples/demo.py is the main job (`rollplex-trl demo`): same options, same final line, same outputs."""
    out = tmp_path / "demo"
    stdout = _run("demo.py", ["--output-dir", str(out), "--preset", "tiny", "--sft-steps", "1", "--steps", "1",
                              "--num-samples", "2", "--heldout-samples", "1", "--eval-samples", "1",
                              "--num-generations", "2", "--prompts-per-step", "1", "--max-completion-length", "8",
                              "--frames", "4", "--size", "56", "--threads", "2"], _cache_of(tiny_vl_path))
    checkpoint, log_file = out / "checkpoints" / "checkpoint-1", out / "logs.jsonl"
    assert stdout.strip().splitlines()[-1] == (f"[rollplex-trl] done. checkpoint: {checkpoint} | logs: {log_file} | "
                                               f"results: {out / 'results.json'}")
    assert (checkpoint / "model.safetensors").exists()
    assert len(_losses([json.loads(line) for line in log_file.read_text().splitlines()])) == 1


@pytest.mark.parametrize("script", ["trl_drop_in.py", "train_video_r1.py", "demo.py"])
def test_examples_do_not_download(script):
    """Checkpoints come from rollplex_trl.testing.checkpoints (or the command line), never from a model hub."""
    text = (EXAMPLES / script).read_text()
    assert "from_pretrained(" not in text and "hf_hub" not in text and "snapshot_download" not in text


def test_package_does_not_import_examples():
    """examples/ is not installed: the package may share code with it only the other way round."""
    for path in (ROOT / "rollplex_trl").rglob("*.py"):
        text = path.read_text()
        assert "from examples" not in text and "import examples" not in text, path
