"""Overlap of prefix work with rollout decoding: the executor, its barriers and the phase timeline."""

from rollplex_trl.executor.overlap import Job, OverlapError, OverlapExecutor, Span, WeightGuard
from rollplex_trl.executor.timeline import Timeline, WindowStats, window_stats

__all__ = ["Job", "OverlapError", "OverlapExecutor", "Span", "Timeline", "WeightGuard", "WindowStats", "window_stats"]
