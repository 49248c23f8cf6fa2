"""Benchmark: rollplex_memory off vs on, side by side in one run: peak memory per phase and step time.

The `small` local Qwen2.5-VL on the synthetic video task, beta > 0 (a reference model), GRPO with transformers'
rollout. Each (mode, repeat) trains in a fresh worker process (a process's RSS keeps the history of what it
allocated before, so two runs must not share one), alternating off/on; the table shows medians over the repeats of:
- the peak resident set (CPU: process RSS, `VmHWM` reset at each phase start) or peak allocated bytes (CUDA) per
  phase (rollout, score = the reference pass, train, optimizer, sync, idle) and over the step, after a warm-up step;
- the step time on the wall clock (`bench_common.wall_step_clock`, warm-up step dropped; TRL's `step_time` in
  the JSON);
- with memory on: the ledger's registered device-resident bytes per phase (real storage sizes) next to the planner's
  prediction for the same objects (policy and reference weights, gradients, optimizer state in flight).
The target (issue 14): the step's peak drops by at least the reference model's bytes plus the optimizer state's
bytes, and the step is at most 1.1x slower on CPU.

What the RSS figure is NOT (CPU): "offloaded" bytes go to a `HostArena`, an unlinked file in `/dev/shm`, which is
RAM (tmpfs). They leave the process's resident set, so its RSS drops, but the machine still holds them: the RSS drop
is memory moved out of the process, not memory saved. The point of the CPU run is that the moves happen, exactly,
and what they cost; on a GPU the same moves free device memory into host memory. So every run also reports, per
phase, the machine's used memory (`MemTotal - MemAvailable` from /proc/meminfo, sampled every 10 ms: it counts
/dev/shm, and everything else the machine runs, so on a shared machine it is mostly other people's noise) and the
step's peak RSS plus the bytes in this run's arenas (`rss_plus_arena_step_peak_bytes`: the RAM the run holds;
the activation arena counted at the bytes it parked per step, an upper bound of its peak).

`--offload` adds a third mode, "offload": memory on with `rollplex_offload_activations="on"` (the actor's saved
activations parked in the host arena until their backward), with the bytes it parked per step.

Both modes run the same trainer with the same hooks; "off" only marks the phases (PhaseMemory(active=False)), so
both measure the same way (the ledger also trims malloc's free lists at each phase start in both).

Usage:  .venv/bin/python benchmarks/bench_memory.py [--quick] [--out benchmarks/results/memory.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

PHASES = ("rollout", "score", "train", "optimizer", "sync", "idle")
MIB = 2**20


def machine_used_bytes() -> int:
    """The machine's used memory: MemTotal - MemAvailable (tmpfs such as /dev/shm counts as used)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


class MachineMemorySampler:
    """Samples `machine_used_bytes()` on a thread; `peak(start, end)` over a span of `time.perf_counter()` times."""

    def __init__(self, interval_s: float = 0.01) -> None:
        import threading

        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import time

        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), machine_used_bytes()))
            self._stop.wait(self.interval_s)

    def start(self) -> MachineMemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float, end: float) -> int:
        inside = [b for t, b in self.samples if start <= t <= end]
        if inside:
            return max(inside)
        before = [b for t, b in self.samples if t <= end]  # a phase shorter than the interval: the last sample
        return before[-1] if before else 0


def _trainer_class():
    from rollplex_trl import RollplexGRPOTrainer
    from rollplex_trl.trainers.memory import PhaseMemory

    class Trainer(RollplexGRPOTrainer):
        # "off" gets an observer that only marks the phases, so both modes are measured the same way
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.phase_memory = self.phase_memory or PhaseMemory(self, active=False)

    return Trainer


def worker(args) -> dict:
    """One training run in this process; returns its measurements."""
    import torch
    from transformers.utils import logging as hf_logging

    from rollplex_trl import RollplexGRPOConfig
    from rollplex_trl.data import accuracy_reward, format_reward, load_video_r1

    hf_logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    dataset = load_video_r1(args.annotations)
    out = Path(tempfile.mkdtemp(prefix=f"rollplex-bench-mem-{args.mode}-"))
    config = RollplexGRPOConfig(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.generations * args.prompts,
        num_generations=args.generations, max_completion_length=args.completion,
        generation_kwargs={"min_new_tokens": args.completion}, beta=0.04, learning_rate=1e-6, logging_steps=1,
        report_to=[], save_strategy="no", seed=0, use_cpu=not cuda, bf16=False, gradient_checkpointing=True,
        rollplex_memory="off" if args.mode == "off" else "on",
        rollplex_offload_activations="on" if args.mode == "offload" else "auto",
        rollplex_video_max_frames=args.frames, rollplex_video_min_pixels=28 * 28 * 4,
        rollplex_video_max_pixels=args.size * args.size, rollplex_prefix_chunk_prompts=args.prompts,
        disable_tqdm=True,
    )
    trainer = _trainer_class()(model=args.model, reward_funcs=[accuracy_reward, format_reward], args=config,
                               train_dataset=dataset)
    memory = trainer.phase_memory
    from bench_common import wall_step_clock  # the script's folder is on sys.path (run as a script)

    clock = wall_step_clock()
    trainer.add_callback(clock)
    machine = MachineMemorySampler().start()
    trainer.train()
    machine.stop()
    ledger = memory.ledger
    # records of the steps after the warm-up: the first "idle" record ends step 1
    idle = [i for i, r in enumerate(ledger.records) if r.phase.value == "idle"]
    records = ledger.records[idle[0] + 1:] if idle else ledger.records
    peak_key = "allocator_peak_bytes" if cuda else "rss_peak_bytes"
    phase_peak: dict[str, int] = {}
    registered: dict[str, int] = {}
    machine_peak: dict[str, int] = {}
    for r in records:
        value = getattr(r, peak_key) or 0
        phase_peak[r.phase.value] = max(phase_peak.get(r.phase.value, 0), value)
        registered[r.phase.value] = max(registered.get(r.phase.value, 0), r.peak_bytes)
        if r.end_s is not None:
            used = machine.peak(ledger.t0 + r.start_s, ledger.t0 + r.end_s)
            machine_peak[r.phase.value] = max(machine_peak.get(r.phase.value, 0), used)
    steps = clock.steps[1:]  # the wall-clock step, the warm-up step dropped
    trl_steps = [r["step_time"] for r in trainer.state.log_history if "step_time" in r][1:]
    # seconds per phase per step (a phase may come in several pieces in one step: train around rollout and score)
    per_step: list[dict[str, float]] = [{}]
    for r in records:
        if r.end_s is None:
            continue
        per_step[-1][r.phase.value] = per_step[-1].get(r.phase.value, 0.0) + r.end_s - r.start_s
        if r.phase.value == "idle":
            per_step.append({})
    per_step = [d for d in per_step if "idle" in d]
    phase_s = {p: statistics.median([d.get(p, 0.0) for d in per_step]) for p in PHASES} if per_step else {}
    sizes = memory.movable_bytes(trainer)
    batch = trainer.train_dataset[0]["rollplex_prompt"]
    plan = memory.planned(trainer, prompt_len=batch.num_prompt_tokens, completion_len=args.completion) \
        if memory.active else None
    offloaded = [r["rollplex/mem_activations_offloaded_bytes"] for r in trainer.state.log_history
                 if "rollplex/mem_activations_offloaded_bytes" in r][1:]
    return {"mode": args.mode, "device": "cuda" if cuda else "cpu", "step_s": steps, "trl_step_time_s": trl_steps,
            "phase_s": phase_s,
            "activations_offloaded_bytes": statistics.median(offloaded) if offloaded else 0.0,
            "phase_peak_bytes": phase_peak, "step_peak_bytes": max(phase_peak.values()),
            "machine_used_phase_peak_bytes": machine_peak,
            "machine_used_step_peak_bytes": max(machine_peak.values()) if machine_peak else 0,
            "registered_peak_bytes": registered if memory.active else None, "plan_bytes": plan, "sizes": sizes,
            "prompt_tokens": batch.num_prompt_tokens,
            "streamed_optimizer": memory.optimizer is not None,
            "arena_bytes": memory.arena.nbytes() if memory.arena is not None else 0,
            "arena_dir": os.path.dirname(memory.arena.path) if memory.arena is not None else None}


def _run_worker(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--model", str(args.model), "--annotations",
           str(args.annotations), "--steps", str(args.steps), "--generations", str(args.generations),
           "--prompts", str(args.prompts), "--completion", str(args.completion), "--frames", str(args.frames),
           "--size", str(args.size)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"worker {mode} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(line[len("RESULT "):])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for mode, rs in runs.items():
        out[mode] = {
            "step_s": _median([_median(r["step_s"]) for r in rs]),
            "step_peak_bytes": _median([r["step_peak_bytes"] for r in rs]),
            "phase_peak_bytes": {p: _median([r["phase_peak_bytes"].get(p, 0) for r in rs]) for p in PHASES},
            "phase_s": {p: _median([r["phase_s"].get(p, 0.0) for r in rs]) for p in PHASES},
            "activations_offloaded_bytes": _median([r.get("activations_offloaded_bytes", 0.0) for r in rs]),
            "machine_used_step_peak_bytes": _median([r["machine_used_step_peak_bytes"] for r in rs]),
            "machine_used_phase_peak_bytes": {p: _median([r["machine_used_phase_peak_bytes"].get(p, 0) for r in rs])
                                              for p in PHASES},
            "arena_bytes": _median([r["arena_bytes"] for r in rs]),
            "rss_plus_arena_step_peak_bytes": _median([r["step_peak_bytes"] + r["arena_bytes"]
                                                       + r.get("activations_offloaded_bytes", 0.0) for r in rs]),
        }
    on, off = runs["on"][0], runs["off"][0]
    sizes = on["sizes"]
    target = sizes["reference_weights"] + sizes["optimizer_state"]
    drop = out["off"]["step_peak_bytes"] - out["on"]["step_peak_bytes"]
    out["sizes"] = sizes
    out["peak_drop_bytes"] = drop
    # on CPU the moved bytes sit in /dev/shm (RAM): the machine's used memory barely drops, whatever the RSS does
    out["machine_used_drop_bytes"] = (out["off"]["machine_used_step_peak_bytes"]
                                      - out["on"]["machine_used_step_peak_bytes"])
    out["target_drop_bytes"] = target
    out["step_ratio"] = out["on"]["step_s"] / out["off"]["step_s"]
    out["meets_memory_target"] = drop >= target
    out["meets_time_target"] = out["step_ratio"] <= 1.1
    out["registered_vs_plan"] = {p: {"registered": on["registered_peak_bytes"].get(p),
                                     "planned": (on["plan_bytes"]["rollplex"].get(p) if p != "idle" else None)}
                                 for p in PHASES}
    out["plan_num_params"] = on["plan_bytes"]["num_params"]
    out["prompt_tokens"] = on["prompt_tokens"]
    del off
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run (the first is a warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (fresh processes, alternating)")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument("--completion", type=int, default=32, help="completion length (forced)")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--quick", action="store_true", help="3 steps, 2 repeats")
    parser.add_argument("--out", default="benchmarks/results/memory.json")
    parser.add_argument("--offload", action="store_true",
                        help="also memory on + rollplex_offload_activations='on' (the actor's activations parked)")
    parser.add_argument("--worker", choices=["off", "on", "offload"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--annotations", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if args.worker:
        args.mode = args.worker
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    if args.quick:
        args.steps, args.repeats = 3, 2

    import torch

    from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset
    from rollplex_trl.testing.checkpoints import get_checkpoint

    args.model = get_checkpoint("qwen2_5_vl", args.preset)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-bench-mem-"))
    args.annotations = write_synthetic_video_dataset(
        tmp / "data", SyntheticVideoConfig(num_samples=max(8, args.prompts * args.steps), seed=0,
                                           num_frames=args.frames, height=args.size, width=args.size, fps=2))
    modes = ("off", "on", "offload") if args.offload else ("off", "on")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i in range(args.repeats):
        for mode in modes if i % 2 == 0 else tuple(reversed(modes)):
            r = _run_worker(args, mode)
            runs[mode].append(r)
            print(f"repeat {i} {mode:>3}: step {_median(r['step_s']):.3f}s  peak {r['step_peak_bytes'] / MIB:.0f} MiB"
                  f"  ({', '.join(f'{p} {v / MIB:.0f}' for p, v in r['phase_peak_bytes'].items())})", flush=True)
    summary = summarize(runs)
    from bench_common import run_meta  # the script's folder is on sys.path (run as a script)

    meta = {**run_meta(), "preset": args.preset, "steps": args.steps, "repeats": args.repeats,
            "generations": args.generations, "prompts_per_step": args.prompts, "completion": args.completion,
            "frames": args.frames, "size": args.size, "device": "cuda" if torch.cuda.is_available() else "cpu",
            "threads": int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())), "torch": torch.__version__,
            "peak": "allocated (CUDA)" if torch.cuda.is_available() else "process RSS (VmHWM per phase)",
            "machine_used": "MemTotal - MemAvailable, sampled every 10 ms (the whole machine: /dev/shm included, "
                            "and whatever else runs on it)",
            "arena": None if torch.cuda.is_available() else "an unlinked file in /dev/shm (RAM): offloaded bytes "
                     "leave the process's RSS, not the machine"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=2))

    s = summary
    print()
    print("| phase | peak off (MiB) | peak on (MiB) | drop (MiB) | machine used off / on (MiB) | registered on (MiB) "
          "| planned (MiB) | time off (s) | time on (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in PHASES:
        off, on = s["off"]["phase_peak_bytes"][p], s["on"]["phase_peak_bytes"][p]
        used = f"{s['off']['machine_used_phase_peak_bytes'][p] / MIB:.0f} / " \
               f"{s['on']['machine_used_phase_peak_bytes'][p] / MIB:.0f}"
        reg, plan = s["registered_vs_plan"][p]["registered"], s["registered_vs_plan"][p]["planned"]
        print(f"| {p} | {off / MIB:.0f} | {on / MIB:.0f} | {(off - on) / MIB:.0f} | {used} | "
              f"{'-' if reg is None else f'{reg / MIB:.1f}'} | {'-' if plan is None else f'{plan / MIB:.1f}'} | "
              f"{s['off']['phase_s'][p]:.3f} | {s['on']['phase_s'][p]:.3f} |")
    print(f"| **step** | **{s['off']['step_peak_bytes'] / MIB:.0f}** | **{s['on']['step_peak_bytes'] / MIB:.0f}** | "
          f"**{s['peak_drop_bytes'] / MIB:.0f}** | {s['off']['machine_used_step_peak_bytes'] / MIB:.0f} / "
          f"{s['on']['machine_used_step_peak_bytes'] / MIB:.0f} | | | {s['off']['step_s']:.3f} | "
          f"{s['on']['step_s']:.3f} |")
    z = s["sizes"]
    used_off, used_on = s["off"]["machine_used_step_peak_bytes"], s["on"]["machine_used_step_peak_bytes"]
    print(f"machine used memory (MemTotal - MemAvailable), step peak: off {used_off / MIB:.0f} MiB, on "
          f"{used_on / MIB:.0f} MiB (drop {s['machine_used_drop_bytes'] / MIB:.0f} MiB); the arena (/dev/shm, RAM) "
          f"holds {s['on']['arena_bytes'] / MIB:.1f} MiB with memory on: on CPU the RSS drop is moved, not saved")
    print("step peak RSS + arena bytes (the RAM the run holds): "
          + ", ".join(f"{m} {s[m]['rss_plus_arena_step_peak_bytes'] / MIB:.0f} MiB" for m in runs))
    print(f"\nreference weights {z['reference_weights'] / MIB:.1f} MiB + optimizer state "
          f"{z['optimizer_state'] / MIB:.1f} MiB = target drop {s['target_drop_bytes'] / MIB:.1f} MiB: "
          f"{'met' if s['meets_memory_target'] else 'NOT met'}")
    print(f"step time off {s['off']['step_s']:.3f}s, on {s['on']['step_s']:.3f}s: {s['step_ratio']:.3f}x "
          f"({'within' if s['meets_time_target'] else 'NOT within'} 1.1x)")
    if "offload" in s:
        o = s["offload"]
        print("\n| phase | peak on (MiB) | peak on + activation offload (MiB) | drop (MiB) |")
        print("|---|---:|---:|---:|")
        for p in PHASES:
            on, off_ = s["on"]["phase_peak_bytes"][p], o["phase_peak_bytes"][p]
            print(f"| {p} | {on / MIB:.0f} | {off_ / MIB:.0f} | {(on - off_) / MIB:.0f} |")
        print(f"activations parked per step {o['activations_offloaded_bytes'] / MIB:.1f} MiB; step "
              f"{o['step_s']:.3f}s vs {s['on']['step_s']:.3f}s ({o['step_s'] / s['on']['step_s']:.3f}x)")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
