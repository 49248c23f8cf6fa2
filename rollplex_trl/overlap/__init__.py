"""Prefix work inside the rollout's decode window: the schedule (when jobs run), the executor (where they run, with
the three barriers) and the phase timeline."""

from rollplex_trl.overlap.executor import CallerState, Job, OverlapError, OverlapExecutor, Span, WeightGuard
from rollplex_trl.overlap.schedule import OverlapSchedule, PrefixJobs
from rollplex_trl.overlap.timeline import Timeline, WindowStats, window_stats

__all__ = ["CallerState", "Job", "OverlapError", "OverlapExecutor", "OverlapSchedule", "PrefixJobs", "Span",
           "Timeline", "WeightGuard", "WindowStats", "window_stats"]
