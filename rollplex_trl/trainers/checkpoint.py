"""Resuming from a checkpoint: the model's own key conversion, and the data order of later epochs.

transformers 5.x saves some models under their legacy parameter names (`save_pretrained` reverses the model's
checkpoint conversion mapping: Qwen2.5-VL writes `model.layers.*` and `visual.*` for what it holds as
`model.language_model.layers.*` and `model.visual.*`), but `Trainer._load_from_checkpoint` reads those files with a
plain, non-strict `load_state_dict`. For such models nothing is loaded and training silently restarts from the
initial weights (seen with transformers 5.24 and TRL 1.16's own GRPOTrainer, which is affected the same way: the
resumed run's KL dropped to a tenth of the uninterrupted run's). `load_model_weights` loads them through
`from_pretrained`, which applies the conversion, and copies them with a strict `load_state_dict`, so a mismatch
raises instead of passing silently. It is used only when the file's names differ from the model's; when they match,
the Trainer's own loading runs unchanged.

Data order: TRL's `RepeatSampler` draws one permutation per epoch from a generator seeded once, and has no
`set_epoch`, so a run resumed in epoch e starts the generator afresh and replays epoch 0's order instead of epoch
e's. `ResumableRepeatSampler` adds `set_epoch` (which the Trainer calls at every epoch): it reseeds and draws the e
earlier permutations, so every epoch's order is the uninterrupted run's, resumed or not.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open
from trl.trainer.utils import RepeatSampler

logger = logging.getLogger(__name__)

_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"


def saved_parameter_names(checkpoint_dir: str) -> set[str] | None:
    """Tensor names in the checkpoint's safetensors weights, or None if it has none (PEFT adapters, FSDP, .bin)."""
    index = os.path.join(checkpoint_dir, _SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(checkpoint_dir, _SAFE_WEIGHTS)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def needs_converted_load(model: torch.nn.Module, checkpoint_dir: str) -> bool:
    """Whether the checkpoint's weight names differ from `model`'s (then the Trainer's plain load would miss them)."""
    saved = saved_parameter_names(checkpoint_dir)
    if saved is None or not hasattr(model, "config") or hasattr(model, "peft_config"):
        return False
    return saved != set(model.state_dict())


def load_model_weights(model: torch.nn.Module, checkpoint_dir: str) -> None:
    """Load `checkpoint_dir`'s weights into `model` through `from_pretrained` (key conversion), strictly."""
    dtype = next(model.parameters()).dtype
    fresh = type(model).from_pretrained(checkpoint_dir, dtype=dtype, device_map="cpu")
    result = model.load_state_dict(fresh.state_dict(), strict=True)
    del fresh
    logger.warning("rollplex: resumed the model weights from %s through from_pretrained (the file uses the model's "
                   "legacy parameter names, which Trainer's own loading would skip)%s", checkpoint_dir,
                   "" if not result.missing_keys else f"; missing: {result.missing_keys[:5]}")


class ResumableRepeatSampler(RepeatSampler):
    """TRL's RepeatSampler whose epoch-e order does not depend on whether epochs 0..e-1 ran in this process."""

    @classmethod
    def from_sampler(cls, sampler: RepeatSampler) -> ResumableRepeatSampler:
        resumable = cls.__new__(cls)
        resumable.__dict__.update(vars(sampler))  # same data, sizes, seed and generator: TRL builds, we extend
        return resumable

    def set_epoch(self, epoch: int) -> None:
        if not self.shuffle or self.seed is None:  # sequential, or unseeded (not reproducible anyway)
            return
        self.generator.manual_seed(self.seed)
        for _ in range(epoch):  # the permutations the earlier epochs drew, one per epoch (RepeatSampler.__iter__)
            torch.randperm(self.num_samples, generator=self.generator)
