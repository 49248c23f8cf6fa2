"""TrainerCallbacks: memory phases and rollplex/* metrics, a JSONL log writer, the timeline image for trackers."""

from rollplex_trl.callbacks.jsonl import JsonlLoggerCallback
from rollplex_trl.callbacks.memory import MemoryPhaseCallback
from rollplex_trl.callbacks.trackers import TimelineImageCallback

__all__ = ["JsonlLoggerCallback", "MemoryPhaseCallback", "TimelineImageCallback"]
