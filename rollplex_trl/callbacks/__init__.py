"""TrainerCallbacks that apply memory phases and log rollplex/* metrics."""

from rollplex_trl.callbacks.memory import MemoryPhaseCallback

__all__ = ["MemoryPhaseCallback"]
