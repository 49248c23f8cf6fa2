"""OverlapExecutor: run response-independent prefix work while the rollout decodes, without going off-policy.

The prefix of step k (vision tower, reference prefix, old-policy prefix, the actor prefix with its graph) depends
only on the prompts and on the weights θ_k, so it can run inside the decode window. Three barriers keep learning
synchronous and on-policy:

1. θ_k is read-only from rollout start until every reader has finished: `WeightGuard` snapshots every parameter's
   version counter when the window opens and `check()` raises if any in-place write (an optimizer step, a weight
   sync, a stray `add_`) happened before the readers were collected.
2. The suffix starts only when both the response and the boundary state are ready: consumers call `result()`,
   which waits for the job (bounded by a timeout) and re-raises its exception with the original traceback.
3. The optimizer step commits only after every θ_k reader is quiet: `assert_idle()` is called before the step.

Where it runs: on CUDA a dedicated side stream (ordered after the current stream with an event; the consumer's
stream waits on the job's event, never a device-wide synchronize). On CPU a single worker thread with its own
intra-op thread budget (PyTorch's thread count is per thread). For multi-process rollout engines (vLLM in another
process) the same jobs run on the trainer's default stream while the engine decodes; on one GPU, CUDA MPS lets both
processes share the SMs (start `nvidia-cuda-mps-control -d` before both).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rollplex_trl.torch_compat import tensor_version


class OverlapError(RuntimeError):
    """A prefix job failed, timed out, or a barrier was violated."""


@dataclass
class Span:
    """One interval of the phase timeline (seconds on `time.perf_counter`)."""

    name: str
    lane: str
    start: float
    end: float
    args: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


class WeightGuard:
    """Barrier 1: detects writes to parameters while θ_k readers may still run.

    Every in-place write to a tensor bumps its version counter (`Tensor._version`), optimizers included.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        self._params = list(parameters)
        self._versions = [tensor_version(p) for p in self._params]

    def check(self, what: str) -> None:
        changed = [i for i, (p, v) in enumerate(zip(self._params, self._versions)) if tensor_version(p) != v]
        if changed:
            raise OverlapError(
                f"{len(changed)} parameter(s) were written while {what} was reading θ_k (first: index {changed[0]}, "
                f"shape {tuple(self._params[changed[0]].shape)}); prefix states computed in this window would be "
                "off-policy. Do not step the optimizer or sync weights inside the rollout window."
            )


class Job:
    """A submitted prefix job: its future, its timing and (on CUDA) the event that marks its completion."""

    def __init__(self, name: str, future: concurrent.futures.Future, timeout_s: float) -> None:
        self.name = name
        self.future = future
        self.timeout_s = timeout_s
        self.span: Span | None = None
        self.event: torch.cuda.Event | None = None

    def result(self) -> Any:
        """Wait (bounded) for the job; re-raise its exception, chained, with the job's name."""
        try:
            value = self.future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as err:
            raise OverlapError(f"prefix job '{self.name}' did not finish within {self.timeout_s:.0f} s "
                               "(rollplex_overlap_timeout_s)") from err
        except Exception as err:
            raise OverlapError(f"prefix job '{self.name}' failed: {type(err).__name__}: {err}") from err
        if self.event is not None:  # the consumer's stream waits for the side stream's work, no host sync
            torch.cuda.current_stream().wait_event(self.event)
        return value


class OverlapExecutor:
    """Runs prefix jobs concurrently with the caller (CPU: a worker thread; CUDA: a side stream in that thread).

    `concurrent=False` runs each job inline at submit time (the serial schedule, same code path), which is what
    `rollplex_overlap="off"` and the measurement step of "auto" use.
    """

    def __init__(self, device: torch.device | str, cpu_threads: int = 0, timeout_s: float = 600.0) -> None:
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        # 0: each job runs with its caller's intra-op thread count. On CPU a different count can split a reduction
        # differently (fp32 GEMMs with few rows do), so only the caller's count gives the serial path's numbers.
        self.cpu_threads = cpu_threads
        self._worker: _DaemonWorker | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._jobs: list[Job] = []
        self._lock = threading.Lock()

    def _ensure_worker(self) -> _DaemonWorker:
        if self._worker is None:
            self._worker = _DaemonWorker()
        return self._worker

    def submit(self, name: str, fn: Callable[[], Any], concurrent_run: bool = True) -> Job:
        """Queue `fn` (jobs run one after another, in submission order) and return its `Job`."""
        job_box: dict[str, Job] = {}
        caller = CallerState.capture()  # the worker computes under the caller's numerics (autocast, grad mode)
        ready = None
        if self._stream is not None:  # the side stream must see everything queued before the window opened
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))

        def run() -> Any:
            start = time.perf_counter()
            try:
                if self._stream is None:
                    if concurrent_run and self.device.type == "cpu":  # intra-op threads are per thread
                        torch.set_num_threads(self.cpu_threads or caller.num_threads)
                    with caller.applied():
                        return fn()
                self._stream.wait_event(ready)
                with torch.cuda.stream(self._stream), caller.applied():
                    value = fn()
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    job_box["job"].event = event
                return value
            finally:
                job_box["job"].span = Span(name, "prefix", start, time.perf_counter())

        future: concurrent.futures.Future
        if concurrent_run:
            job = Job(name, concurrent.futures.Future(), self.timeout_s)
            job_box["job"] = job
            job.future = self._ensure_worker().submit(run)
        else:
            future = concurrent.futures.Future()
            job = Job(name, future, self.timeout_s)
            job_box["job"] = job
            try:
                future.set_result(run())
            except BaseException as err:  # noqa: BLE001 - delivered to whoever waits, like the threaded path
                future.set_exception(err)
        with self._lock:
            self._jobs.append(job)
        return job

    def wait_all(self) -> list[Job]:
        """Wait for every submitted job (raising the first failure); returns them and forgets them."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        try:
            for job in jobs:
                job.result()
        except BaseException:
            self._abandon(jobs)
            raise
        return jobs

    def abandon(self) -> None:
        """Drop every pending job (Ctrl-C, a failure elsewhere): queued ones are cancelled, a running one finishes
        in the background and its result is discarded, so no half-built state reaches the next step."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        self._abandon(jobs)

    @staticmethod
    def _abandon(jobs: list[Job]) -> None:
        for job in jobs:
            job.future.cancel()

    def assert_idle(self) -> None:
        """Barrier 3: no θ_k reader may still be pending when the optimizer commits."""
        with self._lock:
            pending = [j.name for j in self._jobs if not j.future.done()]
        if pending:
            raise OverlapError(f"optimizer step while prefix jobs {pending} still read θ_k")

    def close(self) -> None:
        self.abandon()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


@dataclass(frozen=True)
class CallerState:
    """The thread-local state that decides a computation's numerics, read on the submitting thread.

    PyTorch keeps grad mode, inference mode and autocast (enabled, dtype, weight-cast cache) per thread: a job that
    ran on a fresh worker thread would otherwise compute in fp32 without grad even when its caller was under TRL's
    bf16 autocast. Jobs may still set their own modes inside (the actor's prefix enables grad explicitly).
    """

    grad_enabled: bool
    inference_mode: bool
    num_threads: int
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
    autocast_cache: bool

    @classmethod
    def capture(cls) -> CallerState:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        return cls(grad_enabled=torch.is_grad_enabled(), inference_mode=torch.is_inference_mode_enabled(),
                   num_threads=torch.get_num_threads(),
                   autocast=tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices),
                   autocast_cache=torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference_mode))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            yield


class _DaemonWorker:
    """One daemon thread running submitted functions in order.

    Not a ThreadPoolExecutor: the interpreter joins those threads at exit, so a job stuck in a kernel or a
    deadlock (the case `rollplex_overlap_timeout_s` reports) would keep the process alive after the error.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="rollplex-prefix", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - delivered to whoever waits on the future
                future.set_exception(err)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn))
        return future

    def stop(self) -> None:
        """Let the thread end after its current job (never waits for it: it is a daemon)."""
        self._queue.put(None)
