"""TrainerCallbacks: memory phases and rollplex/* metrics, a JSONL log writer, the timeline image for trackers, the
start-up banner, the no-learning-signal warning."""

from rollplex_trl.callbacks.banner import StartupBanner
from rollplex_trl.callbacks.jsonl import JsonlLoggerCallback
from rollplex_trl.callbacks.memory import MemoryPhaseCallback
from rollplex_trl.callbacks.signal import NoLearningSignal
from rollplex_trl.callbacks.trackers import TimelineImageCallback

__all__ = ["JsonlLoggerCallback", "MemoryPhaseCallback", "NoLearningSignal", "StartupBanner", "TimelineImageCallback"]
