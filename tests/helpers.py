"""Small helpers shared by tests: writing real MP4 files and building reference model inputs independently."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The README's test command (scripts/test.sh, which CI runs) installs every extra and sets this: there a missing
# optional package is a failure, not ~170 silently skipped tests. A developer's bare `pytest` still skips.
REQUIRE_EXTRAS = os.environ.get("ROLLPLEX_REQUIRE_EXTRAS") == "1"


def require(module: str, reason: str | None = None):
    """`pytest.importorskip` for a package of an optional extra (megatron-core, tensorboard, matplotlib, ...); under
    the test command (ROLLPLEX_REQUIRE_EXTRAS=1) the import must succeed, and its error fails the run."""
    if REQUIRE_EXTRAS:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


def record_generations(trainer, key: str, into: list) -> None:
    """Append `output[key]` (a tensor: a detached copy) of every generation batch the trainer scores to `into`."""
    generate = trainer._generate_and_score_completions

    def recording(inputs):
        output = generate(inputs)
        into.append(output[key].detach().clone())
        return output

    trainer._generate_and_score_completions = recording


class RecordingReward:
    """A reward of the completion's length mod 5 that also records (problem_id, completion) for every row it
    scores, to compare what two runs sampled (problem_id is None for datasets without that column)."""

    __name__ = "recording_reward"

    def __init__(self):
        self.seen: list[tuple] = []

    def __call__(self, completions, **kwargs):
        texts = [c[0]["content"] for c in completions]
        self.seen.extend(zip(kwargs.get("problem_id") or [None] * len(texts), texts))
        return [float(len(t) % 5) for t in texts]


class WeightCasts(TorchDispatchMode):
    """Counts, on the thread it is entered on, the casts (`_to_copy`, what autocast calls) of float tensors lying in
    the storages of `weights`: a cast of a weight or of a view of one."""

    def __init__(self, weights):
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights if w.is_floating_point()}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._to_copy.default and args[0].is_floating_point()
                and args[0].untyped_storage().data_ptr() in self.storages):
            self.count += 1
        return func(*args, **(kwargs or {}))


def record_prefill_states(monkeypatch) -> list:
    """The `PrefixState` of every shared prefill (prefix/generation.py `_prefill_unique`) from now on, in order."""
    from rollplex_trl.prefix import generation

    states, original = [], generation._prefill_unique

    def recording(*args, **kwargs):
        state, groups = original(*args, **kwargs)
        states.append(state)
        return state, groups

    monkeypatch.setattr(generation, "_prefill_unique", recording)
    return states


def write_mp4(path: Path, num_frames: int, height: int, width: int, fps: int = 4, seed: int = 0) -> Path:
    """Write a real MP4 clip of smooth random colour blocks (compressible, but not constant)."""
    from rollplex_trl.data.synthetic import write_mp4 as encode

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    frames = np.stack([np.kron(np.roll(base, i, axis=1), np.ones((8, 8, 1), dtype=np.uint8))[:height, :width]
                       for i in range(num_frames)])
    path.parent.mkdir(parents=True, exist_ok=True)
    encode(path, np.ascontiguousarray(frames), fps)
    return path


def video_rows(folder: Path, question=lambda i: f"Question {i}?" * (i + 1),
               frames: int | None = None) -> list[dict]:
    """Four video prompts with clips of different sizes and lengths (different visual token counts); ``frames``:
    every clip that many frames long instead."""
    rows = []
    for i, (h, w, n) in enumerate([(56, 56, 8), (56, 84, 12), (84, 56, 8), (56, 56, 16)]):
        clip = write_mp4(folder / f"clip{i}.mp4", num_frames=frames or n, height=h, width=w, fps=4, seed=i)
        rows.append({"problem_id": i, "video": str(clip),
                     "prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                                                                 "text": question(i)}]}]})
    return rows


def reference_logps(model, processor, rows: list[dict], completion_ids: torch.Tensor,
                    completion_mask: torch.Tensor, pad_id: int, temperature: float = 1.0,
                    drop_vision: bool = False) -> torch.Tensor:
    """Per-token completion log-probs from one plain full-sequence forward, built without rollplex code.

    Each of `rows` is `{"text": chat-templated prompt, "images": [PIL], "videos": [SampledVideo]}`. Each row is
    processed on its own by the processor, left-padded by hand, and run with explicit vision inputs and
    `mm_token_type_ids` (what TRL 1.16 never passes for video). `drop_vision=True` leaves the vision inputs out of
    the forward, which is what TRL 1.16 silently does with video prompts.
    """
    from transformers.video_utils import VideoMetadata

    processed = []
    for row in rows:
        kwargs = {}
        if row.get("images"):
            kwargs["images"] = row["images"]
        if row.get("videos"):
            kwargs["videos"] = [v.frames for v in row["videos"]]
            kwargs["videos_kwargs"] = dict(
                video_metadata=[VideoMetadata(total_num_frames=v.total_frames, fps=v.video_fps,
                                              frames_indices=list(v.frame_indices)) for v in row["videos"]],
                do_sample_frames=False)
        processed.append(processor(text=[row["text"]], return_tensors="pt", **kwargs))
    P = max(r["input_ids"].size(1) for r in processed)
    B, C = len(processed), completion_ids.size(1)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    mm = torch.zeros(B, P + C, dtype=torch.long)
    for i, r in enumerate(processed):
        n = r["input_ids"].size(1)
        ids[i, P - n:] = r["input_ids"][0]
        mask[i, P - n:] = 1
        mm[i, P - n:P] = r["mm_token_type_ids"][0]
    vision = {}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [torch.as_tensor(r[key]) for r in processed if key in r]
        if parts and not drop_vision:
            vision[key] = torch.cat(parts)
    full_ids = torch.cat([ids, completion_ids], 1)
    full_mask = torch.cat([mask, completion_mask], 1)
    if drop_vision:
        mm = None
    logits = model(input_ids=full_ids, attention_mask=full_mask, mm_token_type_ids=mm, use_cache=False,
                   **vision).logits
    logits = logits[:, P - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def assert_is_a_drawn_chart(path: Path, min_size: tuple[int, int] = (300, 150)) -> None:
    """The file decodes as an image of at least `min_size` (width, height) with something drawn on it: not one
    flat colour, and several colours (axes, labels and data series), not just a PNG header."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG", image.format
        assert image.width >= min_size[0] and image.height >= min_size[1], image.size
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    colours = np.unique(pixels, axis=0)
    assert len(colours) >= 8, f"{path.name}: {len(colours)} colours, nothing drawn"
    background = np.all(pixels == pixels[0], axis=1).mean()
    assert background < 0.98, f"{path.name}: {background:.1%} of the pixels are the background"


def run_two_processes(worker: Path, args: list[str], out: Path, pattern: str, port: int) -> list[dict]:
    """Run `worker ARGS` as 2 processes under torchrun (gloo, 1 thread each) and return the JSON results they wrote
    into `out` under `pattern` (one file per rank, in rank order); fails with both processes' output tails."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
           str(worker), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    results = [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]
    assert done.returncode == 0 and len(results) == 2, done.stdout[-3000:] + done.stderr[-6000:]
    return results


def broken_take_scoring(scale: float = 1e-3):
    """A `StepPrefixes.take_scoring` whose prefix states (built in the decode window) have their values off by
    `scale`: a fault in the prefix jobs only, for the exactness audit's tests."""
    from rollplex_trl.prefix.batch import StepPrefixes

    take = StepPrefixes.take_scoring

    def broken(self, **kwargs):
        pre = take(self, **kwargs)
        if pre is not None:
            pre.state.values = [v + scale for v in pre.state.values]
        return pre

    return broken


class RecordingAccuracy:
    """An accuracy reward that depends on the sampled text, and records what it was asked to score."""

    __name__ = "accuracy"

    def __init__(self) -> None:
        self.calls: list[list[float]] = []

    def __call__(self, completions, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        values = [1.0 if len(t) % 3 else 0.0 for t in texts]
        self.calls.append(values)
        return values


# ----------------------------------------------------------------------------------------------------------------
# Parity with trl.GRPOTrainer (tests/test_trl_parity.py, and per family in tests/models/test_family_contract.py)
# ----------------------------------------------------------------------------------------------------------------

PARITY_KEYS = ("loss", "reward", "kl", "grad_norm", "entropy", "completions/mean_length")


def length_reward(completions, **kwargs):
    """A reward that varies between completions, so advantages and gradients are non-zero."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 7) for t in texts]


def content_reward(completions, **kwargs):
    """A reward that varies with the tokens, not only the length (a random model's completions often all run to the
    length limit, which would leave `length_reward` equal within a group and every advantage zero)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(sum(map(ord, t)) % 7) for t in texts]


def parity_config(cls, tmp_path, **overrides):
    """The parity runs' config (`cls`: TRL's GRPOConfig or RollplexGRPOConfig): fp32, 3 steps, lr 1e-2."""
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, beta=0.1, logging_steps=1, report_to=[], seed=7,
        use_cpu=True, bf16=False, save_strategy="no", gradient_checkpointing=False,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def parity_train(trainer_cls, config_cls, model_path, dataset, tmp_path, completions=None, reward=length_reward,
                 **overrides):
    """Train `trainer_cls` (TRL's or ours) and return its logged steps and the trainer; with `completions`, the
    sampled completion ids of every generation batch are appended to it."""
    from rollplex_trl import RollplexGRPOTrainer

    trainer = trainer_cls(model=str(model_path), reward_funcs=reward, args=parity_config(config_cls, tmp_path,
                          **overrides), train_dataset=dataset)
    if completions is not None:
        record_generations(trainer, "completion_ids", completions)
    trainer.train()
    if isinstance(trainer, RollplexGRPOTrainer):  # parity is only news if the shared paths actually ran
        assert trainer.plan.share_scoring and trainer.plan.share_actor
        assert all(r["rollplex/prefix_rows_per_prompt"] > 1 for r in trainer.state.log_history if "loss" in r)
    return [r for r in trainer.state.log_history if "loss" in r], trainer


def assert_same_history(ours, theirs):
    """Step 1 (same weights) at 1e-5. The shared prefix sums the same terms in another order (prompts grouped once),
    so gradients agree to fp32 rounding; after an AdamW step (lr 1e-2) rounding on near-zero gradient entries moves
    weights by O(lr * rounding / eps): later steps at 1e-4 (measured: 1.1e-5 relative in grad_norm at step 2)."""
    assert len(ours) == len(theirs) == 3
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for key in PARITY_KEYS:
            assert key in a and key in b, f"{key} missing at step {step}"
            rel = 1e-5 if step == 0 else 1e-4
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-5), f"{key} differs at step {step}"


def text_parity_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i} please"}] for i in range(8)]})


def image_parity_dataset():
    """Eight image prompts of three sizes (multiples of 28: Qwen2.5-VL patches them as they are; other families'
    processors resize them, the same for TRL's trainer and ours)."""
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(56, 56), (56, 84), (84, 56), (56, 56)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes * 2]
    prompts = [[{"role": "user", "content": f"What is in picture {i}?"}] for i in range(8)]
    return Dataset.from_dict({"prompt": prompts, "image": images})
