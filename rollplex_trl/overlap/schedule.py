"""The overlap schedule: which prefix jobs a rollout window has, and whether they run during decoding or after it.

While the rollout (transformers' generate, or the vLLM engine) decodes at θ_k, a window's jobs compute, for the
generation batch's unique prompts:
- `ref`: the reference model's prefix (no grad), used by the reference log-prob pass;
- `old`: the policy's prefix (no grad), used by the old log-prob pass when TRL computes one;
- `actor`: the policy's prefix with its autograd graph, used by the loss (only when one generation batch is exactly
  one gradient-accumulation window and num_iterations == 1: otherwise the weights change before it would be used).

Every schedule runs the same jobs on the same inputs: "concurrent" submits them when decoding starts, "serial" runs
them on the caller's thread right after decoding. So `rollplex_overlap` never changes what is computed, only when
(computing a prefix at scoring time instead would group and pad the prompts differently, which changes bf16
rounding). The executor runs them under the caller's autocast, grad mode and thread count (`CallerState`).

The decoding thread and the worker only read θ_k (barrier 1, `WeightGuard`); scoring waits for its job (barrier 2,
the window's `StepPrefixes`); the optimizer step asserts the executor is idle (barrier 3, `assert_idle`).

`"auto"`: on CPU the serial schedule (decoding already uses the cores, and a thread split must never decide a
result). On CUDA training window 0 runs serially as a warm-up (one-time costs, e.g. vLLM's or the allocator's
first-call work, would bias the comparison), window 1 serially (measured), window 2 concurrently (measured); process
0 keeps whichever had the shorter critical path and broadcasts it, so every rank runs the same schedule. Evaluation
windows do not count.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rollplex_trl.overlap.executor import OverlapExecutor, Span, WeightGuard
from rollplex_trl.overlap.timeline import Timeline, WindowStats, window_stats
from rollplex_trl.prefix.batch import Precomputed, PrefixKind, StepPrefixes, precompute_prefix

logger = logging.getLogger(__name__)

# "auto" on CUDA: training window 0 is a serial warm-up, window 1 the serial measurement, window 2 the overlapped one
AUTO_SERIAL_WINDOW, AUTO_OVERLAP_WINDOW = 1, 2

Jobs = list[tuple[PrefixKind, Callable[[], Precomputed]]]


@dataclass
class PrefixJobs:
    """What a window computes: the models whose prefixes it precomputes and how (no trainer state inside)."""

    policy: torch.nn.Module
    ref_model: torch.nn.Module | None  # None when beta == 0 or the reference pass is not precomputed
    old: bool  # TRL computes old log-probs (and the policy is not PEFT, whose reference toggles module state)
    actor: bool  # the actor's prefix is built in the window (one generation batch == one accumulation window)
    autocast: Callable[[], contextlib.AbstractContextManager]
    prompts_per_chunk: int
    # how a model's prefix states are built: None for the transformers passes (`precompute_prefix`, looked up when
    # the job runs), or the Megatron backend's (same signature)
    precompute: Callable[..., Precomputed] | None = None
    # what the actor job runs inside: the policy's gradient checkpointing as training has it (the window opens inside
    # TRL's generation context, which turns checkpointing off; without it the prompt's activations, vision tower
    # included, would all be kept until the backward)
    actor_checkpointing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def for_window(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows, training: bool) -> Jobs:
        precompute = self.precompute or precompute_prefix

        def scoring(model: torch.nn.Module) -> Callable[[], Precomputed]:
            def run() -> Precomputed:
                with torch.no_grad(), self.autocast():
                    return precompute(model, input_ids, attention_mask, rows, keep_graph=False,
                                      prompts_per_chunk=self.prompts_per_chunk)
            return run

        def actor() -> Precomputed:
            with torch.enable_grad(), self.autocast(), self.actor_checkpointing():
                return precompute(self.policy, input_ids, attention_mask, rows, keep_graph=True,
                                  prompts_per_chunk=input_ids.size(0))

        jobs: Jobs = []
        if self.ref_model is not None:
            jobs.append(("ref", scoring(self.ref_model)))
        if self.old:
            jobs.append(("old", scoring(self.policy)))
        if self.actor and training:
            jobs.append(("actor", actor))
        return jobs


class OverlapSchedule:
    """Runs each rollout window's prefix jobs (concurrently or after decoding) into the step's `StepPrefixes`.

    `mode` is the user's `rollplex_overlap`; `executor` runs the jobs; `record` receives each window's metrics
    (a dict of `rollplex/*` values and whether the window was a training one); `broadcast` makes process 0's
    "auto" decision everyone's (identity in a single process); `warn` logs a notice once per job.
    """

    # "auto" measures on CUDA only; tests and benchmarks may set this to exercise the measuring path on CPU.
    auto_measures_on_cpu = False

    def __init__(self, mode: str, executor: OverlapExecutor, *, record: Callable[[dict[str, float], bool], None],
                 broadcast: Callable[[bool], bool] = lambda decision: decision,
                 warn: Callable[[str], None] = logger.warning) -> None:
        self.executor = executor
        self.timeline = Timeline()
        self.force_serial = False  # benchmarks: the serial schedule, same work, measured
        self.active = mode == "on"
        # True while a window's jobs run concurrently with decoding and one of them builds a graph on the policy
        # (the actor's): the decode must then leave the policy's requires_grad flags alone (trainers/grpo.py)
        self.graph_job_running = False
        self.decided = mode != "auto" or not (executor.device.type == "cuda" or self.auto_measures_on_cpu)
        self.training_windows = 0  # training windows with jobs (what "auto" counts; evaluation does not)
        self._record, self._broadcast, self._warn = record, broadcast, warn
        self._serial_decode_s: float | None = None  # baseline for rollplex/decode_slowdown
        self._auto_serial_s: float | None = None
        if mode == "auto" and self.decided:
            warn(f"rollplex_overlap=auto: serial schedule on {executor.device.type} (prefix jobs run right after "
                 "decoding; set rollplex_overlap='on' to run them concurrently)")

    @contextlib.contextmanager
    def window(self, jobs: Jobs, weights: Iterable[torch.nn.Parameter], training: bool, into: StepPrefixes
               ) -> Iterator[None]:
        """The rollout decodes inside; the jobs run during it (concurrent) or right after it (serial). Their states
        go to `into` once every job has finished and the weights were found unchanged (none if any failed)."""
        measuring = not self.decided and training and bool(jobs)
        concurrent = bool(jobs) and not self.force_serial and (
            self.active or (measuring and self.training_windows == AUTO_OVERLAP_WINDOW))
        guard = WeightGuard(weights)
        executor = self.executor
        start = time.perf_counter()
        decode_threads = torch.get_num_threads()
        if concurrent:
            self.graph_job_running = any(name == "actor" for name, _ in jobs)
            for name, fn in jobs:
                executor.submit(name, fn)
            if executor.device.type == "cpu" and executor.cpu_threads:  # an explicit split of the cores
                torch.set_num_threads(max(1, decode_threads - executor.cpu_threads))
        try:
            yield
        except BaseException:
            executor.abandon()  # Ctrl-C or a failed decode: no half-built state survives
            raise
        finally:
            torch.set_num_threads(decode_threads)
            self.graph_job_running = False
        decode = Span("decode", "decode", start, time.perf_counter())
        if not concurrent:  # the serial schedule: the same jobs, after decoding
            for name, fn in jobs:
                executor.submit(name, fn, concurrent_run=False)
        done = executor.wait_all()
        guard.check("the prefix jobs")  # barrier 1
        for job in done:
            into.put(job.name, job.future.result())
        self._finish_window(decode, [j.span for j in done if j.span is not None], concurrent, measuring, training)

    def assert_idle(self) -> None:
        self.executor.assert_idle()  # barrier 3: the optimizer step follows

    def close(self) -> None:
        self.executor.close()

    def write_timeline(self, out: Path) -> str | None:
        """Chrome-trace JSON and a Gantt PNG of the run's phases in `out`; returns a description, or None."""
        if not self.timeline.spans:
            return None
        trace = self.timeline.write_chrome_trace(out / "rollplex_timeline.json")
        png = self.timeline.write_gantt(out / "rollplex_timeline.png")
        return f"{trace}{f' and {png}' if png else ''}"

    # ------------------------------------------------------------------------------------------------------------

    def _finish_window(self, decode: Span, spans: list[Span], concurrent: bool, measuring: bool,
                       training: bool) -> None:
        self.timeline.add(decode)
        for span in spans:
            self.timeline.add(span)
        stats = window_stats(decode, spans)
        if not concurrent:
            self._serial_decode_s = stats.decode_s
        metrics = stats.metrics(self._serial_decode_s)
        metrics["rollplex/overlap_active"] = float(concurrent)
        self._record(metrics, training)
        if not measuring:
            return
        window, self.training_windows = self.training_windows, self.training_windows + 1
        if window == AUTO_SERIAL_WINDOW:
            self._auto_serial_s = stats.decode_s + stats.prefix_s
        elif window == AUTO_OVERLAP_WINDOW:
            self._decide(stats)

    def _decide(self, overlapped: WindowStats) -> None:
        """Process 0 decides from its measurements; every process runs what it decided (one schedule per job)."""
        self.active = bool(self._broadcast(overlapped.critical_path_s < self._auto_serial_s))
        self.decided = True
        self._warn(
            f"rollplex_overlap=auto: serial decode+prefix {self._auto_serial_s:.3f} s, overlapped critical path "
            f"{overlapped.critical_path_s:.3f} s (decode slowdown x"
            f"{overlapped.decode_s / (self._serial_decode_s or overlapped.decode_s):.2f}, hidden "
            f"{overlapped.hidden_s:.3f} s) -> overlap {'ON' if self.active else 'OFF'}")
