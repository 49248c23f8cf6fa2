"""The memory ledger: per phase, the peak and the resident bytes by lifetime class.

Two sources, stated in every figure's name:
- registered bytes (any device): the sum of ``nbytes()`` of registry objects placed on the device, plus transient
  bytes that a mechanism reports while it runs (the optimizer chunks in flight). On CPU this is the only source.
- CUDA allocator statistics: ``torch.cuda.max_memory_allocated`` per phase (the peak counter is reset at each
  phase start) and ``memory_reserved``. They see every tensor, registered or not, but cannot tell classes apart.

Metrics (``metrics()``), over the window since the last ``reset_window()`` (one logging interval). A figure is
logged only where the ledger measures it, never as a 0 that means "not measured" (a default run registers only the
actor prefix: no weights, no optimizer state, so no resident/host totals and no permanent/regenerable class):
    rollplex/mem_<class>_bytes        highest device-resident registered bytes of that class; classes with a
                                      registered object or reported transient bytes only
    rollplex/mem_peak_<phase>_bytes   highest total in that phase (CUDA: allocator peak, every phase; CPU: registered
                                      bytes, phases inside a registered object's window or with transient bytes)
    rollplex/mem_resident_bytes       registered bytes on the device now   } only where objects that outlive a step
    rollplex/mem_host_bytes           registered bytes parked on the host  } (permanent, regenerable) are registered
    rollplex/mem_reserved_bytes       CUDA only: bytes the caching allocator holds now
    rollplex/mem_rss_peak_<phase>_bytes  with ``track_rss=True`` (Linux): the process's peak resident set in that phase
    rollplex/mem_rss_bytes               with ``track_rss=True``: the process's resident set now

Process RSS per phase: at each phase start the kernel's high-water mark is reset (``/proc/self/clear_refs`` "5"), at
its end ``VmHWM`` is the phase's peak; where the reset is not allowed, the peak of the RSS sampled at the ledger's
samples stands in. It sees everything the process holds (registered or not), on CPU the counterpart of the CUDA
allocator peak.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from rollplex_trl.memory.lifetime import LifetimeClass, Phase, Placement
from rollplex_trl.memory.registry import MemoryRegistry
from rollplex_trl.memory.storage import release_free_memory

METRIC_PREFIX = "rollplex/mem_"


@dataclass
class Sample:
    time_s: float
    phase: Phase | None
    by_class: dict[LifetimeClass, int]

    @property
    def total(self) -> int:
        return sum(self.by_class.values())


@dataclass
class PhaseRecord:
    phase: Phase
    start_s: float
    end_s: float | None = None
    peak_bytes: int = 0  # registered bytes
    peak_by_class: dict[LifetimeClass, int] = field(default_factory=lambda: dict.fromkeys(LifetimeClass, 0))
    allocator_peak_bytes: int | None = None  # CUDA only
    rss_peak_bytes: int | None = None  # with track_rss


class MemoryLedger:
    def __init__(self, registry: MemoryRegistry, device: torch.device | str | None = None, *,
                 track_rss: bool = False) -> None:
        self.registry = registry
        self.manager = None  # the ResidencyManager that drives this ledger (set by the manager)
        self.track_rss = track_rss and os.path.exists("/proc/self/status")
        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda" and torch.cuda.is_available()
        self.t0 = time.perf_counter()
        self.records: list[PhaseRecord] = []
        self.samples: list[Sample] = []
        self._current: PhaseRecord | None = None
        # classes and phases that transient bytes were reported for (they are measured, registered or not)
        self._transient_classes: set[LifetimeClass] = set()
        self._transient_phases: set[Phase] = set()
        self.reset_window()

    # --- sampling -------------------------------------------------------------------------------------------------

    def sample(self, transient: Mapping[LifetimeClass | str, int] | None = None) -> Sample:
        """Record the device-resident registered bytes now, plus ``transient`` bytes per class."""
        by_class = self.registry.bytes_by_class(Placement.DEVICE)
        rec = self._current
        for cls, nbytes in (transient or {}).items():
            by_class[LifetimeClass(cls)] += nbytes
            self._transient_classes.add(LifetimeClass(cls))
            if rec is not None:
                self._transient_phases.add(rec.phase)
        s = Sample(time.perf_counter() - self.t0, rec.phase if rec else None, by_class)
        self.samples.append(s)
        for cls, nbytes in by_class.items():
            self._class_peak[cls] = max(self._class_peak[cls], nbytes)
            if rec is not None:
                rec.peak_by_class[cls] = max(rec.peak_by_class[cls], nbytes)
        if rec is not None:
            rec.peak_bytes = max(rec.peak_bytes, s.total)
            self._phase_peak[rec.phase] = max(self._phase_peak.get(rec.phase, 0), s.total)
            if self.track_rss:
                rss = process_rss()
                rec.rss_peak_bytes = max(rec.rss_peak_bytes or 0, rss)
        return s

    def begin_phase(self, phase: Phase | str) -> None:
        if self._current is not None:
            self.end_phase()
        self._current = PhaseRecord(Phase(phase), time.perf_counter() - self.t0)
        self.records.append(self._current)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.track_rss:
            # freed heap pages back to the OS first, so that a phase's peak is what it holds, not what an earlier
            # phase left in malloc's free lists (the same in every run, memory moves on or off)
            release_free_memory()
            reset_rss_peak()
        self.sample()

    def end_phase(self) -> None:
        rec = self._current
        if rec is None:
            return
        self.sample()
        rec.end_s = time.perf_counter() - self.t0
        if self.cuda:
            rec.allocator_peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self._allocator_peak[rec.phase] = max(self._allocator_peak.get(rec.phase, 0), rec.allocator_peak_bytes)
        if self.track_rss:
            rec.rss_peak_bytes = max(rec.rss_peak_bytes or 0, process_rss_peak())
            self._rss_peak[rec.phase] = max(self._rss_peak.get(rec.phase, 0), rec.rss_peak_bytes)
        self._current = None

    # --- reporting ------------------------------------------------------------------------------------------------

    def reset_window(self) -> None:
        """Start a new logging window (the peaks in ``metrics()`` cover one window)."""
        self._class_peak: dict[LifetimeClass, int] = dict.fromkeys(LifetimeClass, 0)
        self._phase_peak: dict[Phase, int] = {}
        self._allocator_peak: dict[Phase, int] = {}
        self._rss_peak: dict[Phase, int] = {}
        if self._current is not None:
            # the phase in progress keeps counting in the new window
            self._phase_peak[self._current.phase] = 0

    def metrics(self) -> dict[str, float]:
        if self._current is not None and self.cuda:
            # the open phase's allocator peak so far
            self._allocator_peak[self._current.phase] = max(
                self._allocator_peak.get(self._current.phase, 0), torch.cuda.max_memory_allocated(self.device))
        classes, phases, residency = self._measured()
        out: dict[str, float] = {f"{METRIC_PREFIX}{cls.value}_bytes": float(n) for cls, n in self._class_peak.items()
                                 if cls in classes}
        peaks = self._allocator_peak if self.cuda else self._phase_peak
        for phase, n in peaks.items():
            if self.cuda or phase in phases:
                out[f"{METRIC_PREFIX}peak_{phase.value}_bytes"] = float(n)
        if residency:
            out[f"{METRIC_PREFIX}resident_bytes"] = float(sum(self.registry.bytes_by_class(Placement.DEVICE).values()))
            out[f"{METRIC_PREFIX}host_bytes"] = float(sum(self.registry.bytes_by_class(Placement.HOST).values()))
        if self.cuda:
            out[f"{METRIC_PREFIX}reserved_bytes"] = float(torch.cuda.memory_reserved(self.device))
        if self.track_rss:
            for phase, n in self._rss_peak.items():
                out[f"{METRIC_PREFIX}rss_peak_{phase.value}_bytes"] = float(n)
            out[f"{METRIC_PREFIX}rss_bytes"] = float(process_rss())
        return out

    def _measured(self) -> tuple[set[LifetimeClass], set[Phase], bool]:
        """What the registered objects and reported transients cover: the lifetime classes, the phases whose
        registered bytes mean something (an object's window, or every phase once an object outlives the step), and
        whether resident/host totals do (only with a permanent or regenerable object: the others are gone by the
        time a step's metrics are read, so their totals would read 0 in every run)."""
        objects = list(self.registry)
        registered = {obj.lifetime for obj in objects}
        classes = registered | self._transient_classes
        residency = bool(registered & {LifetimeClass.PERMANENT, LifetimeClass.REGENERABLE})
        phases = set(Phase) if residency else {p for obj in objects for p in obj.window} | self._transient_phases
        return classes, phases, residency

    def trace_events(self, pid: int = 0, tid: str = "memory") -> list[dict]:
        """Chrome-trace events (``chrome://tracing``, Perfetto) to merge into the phase timeline: one span per phase
        and one stacked counter per sample (registered device bytes by lifetime class)."""
        events: list[dict] = []
        for rec in self.records:
            end = rec.end_s if rec.end_s is not None else time.perf_counter() - self.t0
            events.append({"name": rec.phase.value, "cat": "memory-phase", "ph": "X", "pid": pid, "tid": tid,
                           "ts": rec.start_s * 1e6, "dur": max(end - rec.start_s, 0.0) * 1e6,
                           "args": {"peak_bytes": rec.peak_bytes, "allocator_peak_bytes": rec.allocator_peak_bytes}})
        for s in self.samples:
            events.append({"name": "device memory by lifetime class (registered bytes)", "ph": "C", "pid": pid,
                           "ts": s.time_s * 1e6, "args": {cls.value: n for cls, n in s.by_class.items()}})
        return events


# --- process resident set (Linux) ---------------------------------------------------------------------------------

_HWM_RESETTABLE: bool | None = None


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_rss() -> int:
    """The process's resident set size now (bytes; 0 where /proc is not available)."""
    return _status_bytes("VmRSS")


def process_rss_peak() -> int:
    """The process's peak resident set since the last ``reset_rss_peak()`` (or its start)."""
    return _status_bytes("VmHWM") if _HWM_RESETTABLE is not False else process_rss()


def reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False where that is not allowed."""
    global _HWM_RESETTABLE
    if _HWM_RESETTABLE is False:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _HWM_RESETTABLE = True
    except OSError:
        _HWM_RESETTABLE = False
    return _HWM_RESETTABLE
