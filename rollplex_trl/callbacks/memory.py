"""``MemoryPhaseCallback``: marks the phase boundaries transformers' Trainer announces and logs the memory ledger.

Trainer events per optimizer step (trl-grpo-internals.md section 7): on_step_begin (first micro-batch) ->
micro-batches (generation happens inside the first one's training_step) -> on_pre_optimizer_step (after grad
clipping) -> on_optimizer_step -> on_step_end -> on_log. They map to phases:

    on_step_begin          -> train      (loss forward/backward of the micro-batches)
    on_pre_optimizer_step  -> optimizer
    on_optimizer_step      -> sync       (publish the new weights to the rollout engine)
    on_step_end            -> idle

No event fires around generation or scoring, so the trainer marks those itself:

    with manager.phase("rollout"):
        completions = self._generate(...)
    with manager.phase("score"):
        old_logps, ref_logps = ...

Logging: with ``trainer=`` (a TRL trainer), the ledger's ``rollplex/mem_*`` figures are added
to TRL's training metrics at every step end, so TRL averages them over the logging interval and they reach
every logger and ``state.log_history``. Without it, ``on_log`` adds them to the ``logs`` dict, which only the
callbacks registered after this one see (transformers copies ``logs`` into ``log_history`` before ``on_log``).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from rollplex_trl import trl_compat
from rollplex_trl.memory.ledger import MemoryLedger
from rollplex_trl.memory.lifetime import Phase
from rollplex_trl.memory.residency import ResidencyManager


class MemoryPhaseCallback(TrainerCallback):
    def __init__(self, manager: ResidencyManager, ledger: MemoryLedger | None = None, trainer: Any = None) -> None:
        self.manager = manager
        self.ledger = ledger if ledger is not None else manager.ledger
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.manager.enter(Phase.TRAIN)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.manager.enter(Phase.OPTIMIZER)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.manager.enter(Phase.SYNC)

    def on_step_end(self, args, state, control, **kwargs):
        self.manager.enter(Phase.IDLE)
        if self.ledger is not None and self.trainer is not None and trl_compat.has_trl_metrics(self.trainer):
            train_metrics = trl_compat.metrics(self.trainer, training=True)
            for key, value in self.ledger.metrics().items():
                train_metrics[key].append(value)
            self.ledger.reset_window()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.ledger is None or logs is None:
            return
        if self.trainer is not None and trl_compat.has_trl_metrics(self.trainer):
            return  # with a TRL trainer, the ledger's numbers went through its metrics at the step's end
        logs.update(self.ledger.metrics())
        self.ledger.reset_window()
