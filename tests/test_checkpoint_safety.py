"""Checkpoints are crash-safe: written atomically, and a resume never picks (or silently half-uses) an incomplete one.

transformers 5.24 writes `checkpoint-N` in place and `resume_from_checkpoint=True` takes the highest-numbered folder:
a job killed mid-save leaves `checkpoint-N/config.json` only and every restart fails on it; a truncated weights file
fails with a safetensors error naming no file; a checkpoint without `optimizer.pt` resumes with a fresh optimizer.
The kill test really SIGKILLs a child process, at a moment pinned by a marker file (not by timing).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import PretrainedConfig, Trainer, TrainerCallback

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.trainers.checkpoint import CheckpointError, checkpoint_problems

from helpers import RecordingReward

LOGGER = "rollplex_trl.trainers.checkpoint"


def _trainer(model, output_dir, callbacks=None, **overrides):
    kwargs = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=5,
                  use_cpu=True, bf16=False, save_strategy="steps", save_steps=1, rollplex_overlap="off")
    kwargs.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count {i} " * (i + 1)}] for i in range(4)]})
    return RollplexGRPOTrainer(model=str(model), reward_funcs=RecordingReward(), train_dataset=dataset,
                               args=RollplexGRPOConfig(**kwargs), callbacks=[_Steps(), *(callbacks or [])])


class _Steps(TrainerCallback):
    """The optimizer steps this process ran (a resumed run starts after its checkpoint's step)."""

    def __init__(self):
        self.ran = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ran.append(state.global_step)


def _steps(trainer) -> list[int]:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, _Steps)).ran


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def two_checkpoints(tiny_qwen2_path, tmp_path_factory):
    """A 2-step run that saved checkpoint-1 and checkpoint-2 (tests copy it, then damage the copy)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    trainer = _trainer(tiny_qwen2_path, out)
    trainer.train()
    assert _names(out) == ["checkpoint-1", "checkpoint-2"]
    return out


@pytest.fixture()
def run_dir(two_checkpoints, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    return out


# ---- (a) a real SIGKILL during a save ----

def _child(model: str, output_dir: str, marker: str) -> None:
    """Train 3 steps, saving every step; while saving step 2, right after config.json: say so, and hang (killed)."""
    original = PretrainedConfig.save_pretrained

    def save_then_hang(self, save_directory, *args, **kwargs):
        original(self, save_directory, *args, **kwargs)
        if Path(save_directory).name == "checkpoint-2":
            Path(marker).write_text(str(save_directory))
            while True:  # until SIGKILL
                time.sleep(60)

    PretrainedConfig.save_pretrained = save_then_hang
    _trainer(model, output_dir, max_steps=3).train()


def test_kill_during_save_resumes_from_the_last_complete_checkpoint(tiny_qwen2_path, tmp_path, caplog):
    out, marker, log = tmp_path / "killed", tmp_path / "marker", tmp_path / "child.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as stream:
        child = subprocess.Popen([sys.executable, __file__, str(tiny_qwen2_path), str(out), str(marker)],
                                 cwd=Path(__file__).parent, env=env, stdout=stream, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600  # only a bound for a broken child: the marker decides when to kill
        while not marker.exists():
            assert child.poll() is None, f"the child exited before the save: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the child never reached the save of step 2"
            time.sleep(0.2)
    finally:
        child.kill()  # SIGKILL: no cleanup, no atexit
        child.wait()
    assert child.returncode == -9
    assert "config.json" in os.listdir(marker.read_text())  # killed with the checkpoint half written
    assert "checkpoint-2" not in os.listdir(out)  # the half-written one is not a checkpoint-N folder
    assert not checkpoint_problems(str(out / "checkpoint-1"))

    full = _trainer(tiny_qwen2_path, tmp_path / "full", max_steps=3)
    full.train()
    resumed = _trainer(tiny_qwen2_path, out, max_steps=3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and _steps(resumed) == [2, 3]
    assert _names(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # the leftover removed, 2 rewritten
    assert any("tmp-checkpoint-2" in r.getMessage() for r in caplog.records)
    for (name, a), b in zip(resumed.model.named_parameters(), full.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


# ---- (b) a truncated weights file ----

@pytest.mark.parametrize("keep, problem", [(40, "truncated safetensors header"), (-1000, "truncated safetensors file")])
def test_truncated_weights_are_named_and_skipped(tiny_qwen2_path, run_dir, caplog, keep, problem):
    weights = run_dir / "checkpoint-2" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep])
    trainer = _trainer(tiny_qwen2_path, run_dir)
    with pytest.raises(CheckpointError, match=problem) as info:
        trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))
    assert str(weights) in str(info.value) and "checkpoint-1" in str(info.value)  # the file, and what to pick
    assert trainer.state.global_step == 0
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 2 and _steps(trainer) == [2]  # resumed from checkpoint-1
    assert any(str(run_dir / "checkpoint-2") in r.getMessage() and problem in r.getMessage() for r in caplog.records)


def test_no_complete_checkpoint_says_what_it_found(tiny_qwen2_path, run_dir):
    (run_dir / "checkpoint-2" / "model.safetensors").write_bytes(b"")
    (run_dir / "checkpoint-1" / "trainer_state.json").unlink()
    (run_dir / "tmp-checkpoint-3" / "checkpoint-3").mkdir(parents=True)
    trainer = _trainer(tiny_qwen2_path, run_dir)
    with pytest.raises(CheckpointError, match="no complete checkpoint") as info:
        trainer.train(resume_from_checkpoint=True)
    message = str(info.value)
    assert str(run_dir / "checkpoint-2" / "model.safetensors") in message
    assert str(run_dir / "checkpoint-1" / "trainer_state.json") in message


# ---- (c) a checkpoint without optimizer state ----

def test_missing_optimizer_raises_naming_the_path_and_is_skipped(tiny_qwen2_path, run_dir, caplog):
    optimizer = run_dir / "checkpoint-2" / "optimizer.pt"
    optimizer.unlink()
    trainer = _trainer(tiny_qwen2_path, run_dir)
    with pytest.raises(CheckpointError, match="missing") as info:
        trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))
    assert str(optimizer) in str(info.value)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 2 and _steps(trainer) == [2]
    assert any(str(optimizer) in r.getMessage() for r in caplog.records)


def test_save_only_model_resumes_without_optimizer_with_a_warning(tiny_qwen2_path, run_dir, caplog):
    for name in ("optimizer.pt", "scheduler.pt"):
        (run_dir / "checkpoint-1" / name).unlink()
    trainer = _trainer(tiny_qwen2_path, run_dir, save_only_model=True, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
    assert trainer.state.global_step == 2 and _steps(trainer) == [2]
    assert any("without optimizer" in r.getMessage() for r in caplog.records)


# ---- (d) atomicity, rotation, best checkpoint, hub push ----

def test_a_checkpoint_folder_appears_only_once_complete(tiny_qwen2_path, tmp_path, monkeypatch):
    out = tmp_path / "run"
    seen = []  # (step being saved, folders of output_dir) at moments inside the save
    original_config, original_rng = PretrainedConfig.save_pretrained, Trainer._save_rng_state

    def look(step):
        seen.append((step, sorted(os.listdir(out))))

    def config_save(self, save_directory, *args, **kwargs):
        original_config(self, save_directory, *args, **kwargs)
        look(Path(save_directory).name)

    def rng_save(self, output_dir):
        original_rng(self, output_dir)
        look(Path(output_dir).name)

    monkeypatch.setattr(PretrainedConfig, "save_pretrained", config_save)
    monkeypatch.setattr(Trainer, "_save_rng_state", rng_save)
    trainer = _trainer(tiny_qwen2_path, out)
    trainer.train()
    assert {step for step, _ in seen} == {"checkpoint-1", "checkpoint-2"}
    assert all(step not in folders for step, folders in seen)
    assert _names(out) == ["checkpoint-1", "checkpoint-2"]
    assert not checkpoint_problems(str(out / "checkpoint-1")) and not checkpoint_problems(str(out / "checkpoint-2"))

    # a push (an async upload) starts on the final, complete folder; saving a step again replaces its folder
    pushed = []
    monkeypatch.setattr(Trainer, "_push_from_checkpoint",
                        lambda self, folder: pushed.append((folder, checkpoint_problems(folder))))
    monkeypatch.setattr(trainer.args, "push_to_hub", True)
    trainer._save_checkpoint(trainer.model, None)
    assert pushed == [(str(out / "checkpoint-2"), [])]
    assert _names(out) == ["checkpoint-1", "checkpoint-2"]


class _BestAtStep2(TrainerCallback):
    """What an evaluation that found step 2 best does to the state (`Trainer._determine_best_metric`)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            state.best_global_step = 2


def test_rotation_keeps_the_best_and_the_latest(tiny_qwen2_path, tmp_path):
    out = tmp_path / "run"
    trainer = _trainer(tiny_qwen2_path, out, callbacks=[_BestAtStep2()], max_steps=4, save_total_limit=2)
    trainer.train()
    best = str(out / "checkpoint-2")
    assert trainer.state.best_model_checkpoint == best
    assert _names(out) == ["checkpoint-2", "checkpoint-4"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["best_model_checkpoint"] == best
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["best_model_checkpoint"] == best


if __name__ == "__main__":  # the child of the kill test
    _child(*sys.argv[1:4])


@pytest.mark.parametrize("word", ["latest", "true", "True"])
def test_command_line_words_resume_from_the_newest_complete_checkpoint(tiny_qwen2_path, run_dir, word):
    """`--resume_from_checkpoint latest` arrives as a string: it means resume_from_checkpoint=True."""
    (run_dir / "checkpoint-2" / "model.safetensors").write_bytes(b"")  # the newest is incomplete: checkpoint-1
    trainer = _trainer(tiny_qwen2_path, run_dir)
    trainer.train(resume_from_checkpoint=word)
    assert trainer.state.global_step == 2 and _steps(trainer) == [2]
