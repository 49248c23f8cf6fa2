"""Training backends (``rollplex_backend``): the engine that holds and trains the policy (backends/base.py).

``hf`` (backends/hf.py) is the transformers model TRL built; ``megatron`` (backends/megatron/) a Megatron-Core
tensor-parallel copy of it, imported only when chosen (megatron-core is the ``megatron`` extra).
"""

from __future__ import annotations

from typing import Any

from rollplex_trl.backends.base import TrainingBackend
from rollplex_trl.backends.hf import HfBackend

__all__ = ["HfBackend", "TrainingBackend", "build_backend", "refuse_backend_setup"]


def refuse_backend_setup(config: Any, *, peft_config: Any, world_size: int, train_dataset: Any) -> None:
    """Refuse what the configured backend cannot run, naming the fields, before TRL loads any weights."""
    if getattr(config, "rollplex_backend", "hf") == "megatron":
        from rollplex_trl.backends.megatron.backend import refuse_megatron_setup

        refuse_megatron_setup(config, peft_config=peft_config, world_size=world_size, train_dataset=train_dataset)


def build_backend(trainer: Any) -> TrainingBackend:
    """The backend of a `RollplexGRPOTrainer` whose TRL setup has run (models, accelerator, options)."""
    if trainer.rollplex["rollplex_backend"] == "megatron":
        from rollplex_trl.backends.megatron.backend import MegatronBackend

        return MegatronBackend.from_trainer(trainer)
    return HfBackend(trainer.accelerator.unwrap_model)
