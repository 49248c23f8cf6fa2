"""TrainerCallbacks: memory phases and rollplex/* metrics, and a JSONL log writer."""

from rollplex_trl.callbacks.jsonl import JsonlLoggerCallback
from rollplex_trl.callbacks.memory import MemoryPhaseCallback

__all__ = ["JsonlLoggerCallback", "MemoryPhaseCallback"]
