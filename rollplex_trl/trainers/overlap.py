"""The overlap schedule inside RollplexGRPOTrainer: prefix jobs run in the rollout's decode window.

While the rollout (transformers' generate, or the vLLM engine of trainers/vllm.py) decodes at θ_k, a worker
computes, for the step's unique prompts:
- `ref`: the reference model's prefix (no grad), used by the reference log-prob pass;
- `old`: the policy's prefix (no grad), used by the old log-prob pass when TRL computes one;
- `actor`: the policy's prefix with its autograd graph, used by the loss (when one generation batch is exactly one
  gradient-accumulation window and num_iterations == 1: otherwise the weights change before it would be used).
The decoding thread and the worker only read θ_k (barrier 1, `WeightGuard`); scoring waits for its job (barrier 2);
the optimizer step asserts the executor is idle (barrier 3). Jobs never toggle module state that the rollout reads:
PEFT reference passes (which disable the adapter, module-global state) are not overlapped.

Every schedule runs the same jobs on the same inputs: "concurrent" submits them when decoding starts, "serial" runs
them on the caller's thread right after decoding. So `rollplex_overlap` never changes what is computed, only when
(computing a prefix at scoring time instead would group and pad the prompts differently, which changes bf16
rounding). The worker runs under the caller's autocast and grad mode (executor/overlap.py, `CallerState`).

`rollplex_overlap="auto"`: on CPU the serial schedule (decoding already uses the cores; the worker would take some
of them, and a thread split must never decide a result). On CUDA the first training window runs serially as a
warm-up (one-time costs, e.g. vLLM's or the allocator's first-call work, would bias the comparison), the second
serially (measured), the third concurrently (measured); process 0 keeps whichever had the shorter critical path and
broadcasts the decision, so every rank runs the same schedule. Evaluation windows do not count.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rollplex_trl.executor import OverlapExecutor, Span, Timeline, WeightGuard, window_stats
from rollplex_trl.prefix.batch import Precomputed, precompute_prefix

logger = logging.getLogger(__name__)

# "auto" on CUDA: training window 0 is a serial warm-up, window 1 the serial measurement, window 2 the overlapped one
_AUTO_SERIAL_WINDOW, _AUTO_OVERLAP_WINDOW = 1, 2


class OverlapMixin:
    """Mixed into RollplexGRPOTrainer (before GRPOTrainer); uses its sharing decisions and prepared rows."""

    # "auto" measures on CUDA only; tests and benchmarks may set this to exercise the measuring path on CPU.
    overlap_auto_measures_on_cpu = False

    def _init_overlap(self) -> None:
        o = self.rollplex
        mode = o["rollplex_overlap"]
        self._precomputed: dict[str, Precomputed] = {}
        self.timeline = Timeline()
        self._serial_decode_s: float | None = None  # baseline for rollplex/decode_slowdown
        self._auto_serial_s: float | None = None
        self._training_windows = 0  # training windows with jobs (what "auto" counts; evaluation does not)
        # Benchmarks set this to run the window's jobs after decoding (the serial schedule, same work, measured).
        self.overlap_force_serial = False
        self.overlap_executor = None
        reasons = []
        if not self._share_scoring:
            reasons.append("the shared prefix is off")
        if self.use_transformers_continuous_batching:
            reasons.append("transformers' continuous batching has no decode window to run prefix work in")
        if reasons:
            if mode == "on":
                raise ValueError(f"rollplex_overlap: off: {'; '.join(reasons)} (set rollplex_overlap='auto' or 'off')")
            if mode == "auto":
                self._warn_once(f"rollplex_overlap: off: {'; '.join(reasons)}")
            self._overlap_active, self._auto_decided = False, True
            return
        # The executor exists whenever a window does: the serial schedule runs the same jobs on this thread.
        self.overlap_executor = OverlapExecutor(self.accelerator.device, cpu_threads=o["rollplex_overlap_threads"],
                                                timeout_s=o["rollplex_overlap_timeout_s"])
        self._overlap_active = mode == "on"
        self._auto_decided = mode != "auto" or not (self.accelerator.device.type == "cuda"
                                                    or self.overlap_auto_measures_on_cpu)
        if mode == "auto" and self._auto_decided:
            self._warn_once(f"rollplex_overlap=auto: serial schedule on {self.accelerator.device.type} (prefix jobs "
                            "run right after decoding; set rollplex_overlap='on' to run them concurrently)")

    # ------------------------------------------------------------------------------------------------------------
    # The jobs of one window
    # ------------------------------------------------------------------------------------------------------------

    def _needs_old_logps(self) -> bool:
        # TRL's own condition (GRPOTrainer._generate_and_score_completions)
        generate_every = self.args.steps_per_generation * self.num_iterations
        return (self.args.gradient_accumulation_steps % generate_every != 0
                or (self.use_vllm and self.vllm_importance_sampling_correction))

    def _window_jobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows) -> list[tuple[str, object]]:
        policy = self.accelerator.unwrap_model(self.model)
        is_peft = hasattr(policy, "peft_config")
        chunk = self.rollplex["rollplex_prefix_chunk_prompts"]
        jobs = []

        def scoring_job(model):
            def run() -> Precomputed:
                with torch.no_grad(), self.accelerator.autocast():
                    return precompute_prefix(model, input_ids, attention_mask, rows, keep_graph=False,
                                             prompts_per_chunk=chunk)
            return run

        if self.beta != 0.0 and self.ref_model is not None:
            jobs.append(("ref", scoring_job(self.accelerator.unwrap_model(self.ref_model))))
        if self._needs_old_logps() and not is_peft:
            jobs.append(("old", scoring_job(policy)))
        window_is_generation = (self.args.steps_per_generation == self.args.gradient_accumulation_steps
                                and self.num_iterations == 1)
        if self._share_actor and self.model.training and window_is_generation:
            def actor() -> Precomputed:
                with torch.enable_grad(), self.accelerator.autocast():
                    return precompute_prefix(policy, input_ids, attention_mask, rows, keep_graph=True,
                                             prompts_per_chunk=input_ids.size(0))
            jobs.append(("actor", actor))
        return jobs

    # ------------------------------------------------------------------------------------------------------------
    # The window
    # ------------------------------------------------------------------------------------------------------------

    def _decode_window_factory(self, rows):
        if self.overlap_executor is None:
            return None

        @contextlib.contextmanager
        def window(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Iterator[None]:
            self._precomputed.clear()  # never carry a state into another window
            jobs = self._window_jobs(input_ids, attention_mask, rows)
            measuring = (not self._auto_decided and self.model.training and bool(jobs))
            concurrent = bool(jobs) and not self.overlap_force_serial and (
                self._overlap_active or (measuring and self._training_windows == _AUTO_OVERLAP_WINDOW))
            guard = WeightGuard([*self.model.parameters(),
                                 *(self.ref_model.parameters() if self.ref_model is not None else [])])
            executor = self.overlap_executor
            start = time.perf_counter()
            decode_threads = torch.get_num_threads()
            if concurrent:
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
            decode = Span("decode", "decode", start, time.perf_counter())
            if not concurrent:  # the serial schedule: the same jobs, after decoding
                for name, fn in jobs:
                    executor.submit(name, fn, concurrent_run=False)
            try:
                done = executor.wait_all()
                guard.check("the prefix jobs")  # barrier 1
            except BaseException:
                self._precomputed.clear()
                raise
            for job in done:
                self._precomputed[job.name] = job.future.result()
            self._record_window(decode, [j.span for j in done if j.span is not None], concurrent, measuring)

        return window

    def _record_window(self, decode: Span, spans: list[Span], concurrent: bool, measuring: bool) -> None:
        self.timeline.add(decode)
        for span in spans:
            self.timeline.add(span)
        stats = window_stats(decode, spans)
        if not concurrent:
            self._serial_decode_s = stats.decode_s
        mode = "train" if self.model.training else "eval"
        for key, value in stats.metrics(self._serial_decode_s).items():
            self._metrics[mode][key].append(value)
        self._metrics[mode]["rollplex/overlap_active"].append(float(concurrent))
        if not measuring:
            return
        window, self._training_windows = self._training_windows, self._training_windows + 1
        if window == _AUTO_SERIAL_WINDOW:
            self._auto_serial_s = stats.decode_s + stats.prefix_s
        elif window == _AUTO_OVERLAP_WINDOW:
            self._decide_auto(stats)

    def _decide_auto(self, overlapped) -> None:
        """Process 0 decides from its measurements; every process runs what it decided (one schedule per job)."""
        decision = [overlapped.critical_path_s < self._auto_serial_s]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(decision, from_process=0)
        self._overlap_active, self._auto_decided = bool(decision[0]), True
        self._warn_once(
            f"rollplex_overlap=auto: serial decode+prefix {self._auto_serial_s:.3f} s, overlapped critical path "
            f"{overlapped.critical_path_s:.3f} s (decode slowdown x"
            f"{overlapped.decode_s / (self._serial_decode_s or overlapped.decode_s):.2f}, hidden "
            f"{overlapped.hidden_s:.3f} s) -> overlap {'ON' if self._overlap_active else 'OFF'}")

    def _take_precomputed(self, kind: str) -> Precomputed | None:
        return self._precomputed.pop(kind, None)

    def _write_timeline(self) -> None:
        if not self.rollplex["rollplex_timeline"] or not self.timeline.spans or not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        trace = self.timeline.write_chrome_trace(out / "rollplex_timeline.json")
        png = self.timeline.write_gantt(out / "rollplex_timeline.png")
        logger.warning("rollplex: phase timeline written to %s%s", trace, f" and {png}" if png else "")
