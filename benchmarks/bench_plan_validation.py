"""Validation of plan-run's step model on this machine: calibrate, then predict the CPU benchmarks' measured
phases and steps and their Rollplex/serial ratios.

The step model (rollplex_trl/planning/step_model.py) is priced with this machine's rates, measured by
rollplex_trl/planning/calibrate.py at the `small` preset's shapes (GEMM and attention FLOP/s, copy bandwidth, the
weight-read bandwidth of a decode step's few-row GEMMs, transformers' per-call and per-layer costs, the decode
loop's per-step and per-layer costs through Rollplex's own rollout, the vision tower's per-block cost, a gloo
all-reduce's latency). Nothing is fitted to a benchmark's result.

With --measure the benchmarks run now, each between two calibrations, and each is priced at their mean: this VM's
speed moves by tens of percent within minutes (its GEMM rate 89-177 GFLOP/s within one run), so one calibration
for a 15-minute run misprices most benchmarks. --runs N repeats the whole measurement and compares medians (every
run's own error stays in the JSON and the table: the measurements' spread); --measured prices earlier runs' folders.

The trainers' steps also pay per-step framework costs the step model does not count (data preparation and the
processor, rewards, logging, the trainer's bookkeeping). They are measured on this machine by running each
benchmark's own trainer code once on the `tiny` preset (the same G, C, clip and schedule; its FLOPs are ~1000x
smaller), and added as measured minus the step model's own prediction for the tiny model ("framework" below;
`--no-framework` leaves it out and the JSON keeps both predictions). The benchmarks: the shared-prefix passes
(bench_shared_prefix.py: reference and actor pass, serial vs shared, G in {4, 16} x C in {15, 72}), the whole step
TRL vs Rollplex (bench_vs_trl.py --fp32), the overlap benchmark (bench_overlap.py: serial, shared, shared + overlap;
decode and prefix-job seconds), and Megatron t = 2 against hf (bench_megatron.py, bf16 autocast, or fp32 on a CPU
without native bf16 GEMMs). Without --measure the committed results (benchmarks/results/*.json) are priced at one
calibration made now. Targets (issue 37): each phase and step within 25%, each Rollplex/serial ratio within 15%.

Usage:  OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_plan_validation.py --measure DIR [--runs 3]
        [--docs docs/planning.md] [--out benchmarks/results/plan_validation.json]
        ... --measured DIR/run0 DIR/run1 ...   (price measured folders again)
        ... --from-json FILE --docs FILE.md    (only rewrite the docs table)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from bench_common import run_meta

RESULTS = Path(__file__).parent / "results"
SOURCE = {"dir": RESULTS}  # where the measurements are read: the committed results, or this run's (--measure)
PHASE_TOL, RATIO_TOL = 0.25, 0.15
SHARED_PREFIX_POINTS = [(4, 15), (4, 72), (16, 15), (16, 72)]  # (G, C): one benchmark process each
BENCHMARKS = {  # --measure: each benchmark at modest settings (minutes, not hours), into this run's folder
    **{f"shared_prefix_G{G}_C{C}.json": ["bench_shared_prefix.py", "--generations", str(G), "--completion-lengths",
                                         str(C), "--steps", "2", "--repeats", "5", "--max-step-completion", "0"]
       for G, C in SHARED_PREFIX_POINTS},
    "vs_trl.json": ["bench_vs_trl.py", "--fp32", "--steps", "3", "--repeats", "1"],
    "overlap.json": ["bench_overlap.py", "--steps", "4"],
    "megatron_bf16_t2.json": ["bench_megatron.py", "--bf16", "--steps", "6", "--repeats", "1", "--runs",
                              "hf (shared prefix)", "megatron t=2"],
}
# a CPU without native bf16 GEMMs (AVX2 only: ~100x slower than fp32) runs the Megatron comparison in fp32
MEGATRON_FP32 = ("megatron_fp32_t2.json", [a for a in BENCHMARKS["megatron_bf16_t2.json"] if a != "--bf16"])
# glibc's malloc hands large freed blocks back to the kernel (blocks over its mmap threshold, and the heap's top
# beyond its trim threshold), so the next pass writes into fresh pages: a page fault per 4 KiB, ~3 GB/s instead of
# ~30 (measured: G = 16 C = 72's serial reference pass faults 1.4 GiB per pass and takes 2.86 s, 2.16 s without).
# A GPU's caching allocator keeps its blocks, and the step model prices no page faults, so --measure runs the
# benchmarks, calibrations included, with glibc told to keep them (mmap only above 32 MiB, its largest setting;
# never trim): the CPU analogue of the CUDA caching allocator. Tensors over 32 MiB still fault (none here).
CACHING_HOST_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}
TEXT_TOKENS = 161  # the synthetic video task's prompt besides the clip (P = 289 with 128 visual tokens)


def _dims(preset: str = "small"):
    from transformers import AutoConfig

    from rollplex_trl.memory.model_dims import dims_from_config
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return dims_from_config(AutoConfig.from_pretrained(get_checkpoint("qwen2_5_vl", preset)), preset)


class Framework:
    """Per-step framework seconds of each benchmark's trainers, measured on the tiny preset (see the docstring):
    `extra(key, quantity, tiny_prediction)` = measured on tiny - the step model's tiny prediction (>= 0)."""

    def __init__(self, enabled: bool, steps: int = 3) -> None:
        self.enabled, self.steps = enabled, steps
        self.measured: dict[str, dict] = {}
        self.extras: dict[str, float] = {}

    def _measure(self, key: str) -> dict:
        if key not in self.measured:
            self.measured[key] = globals()[f"_tiny_{key.split(':')[0]}"](key, self.steps)
        return self.measured[key]

    def extra(self, key: str, quantity: str, tiny_predicted: float) -> float:
        if not self.enabled:
            return 0.0
        value = self._measure(key).get(quantity)
        if value is None:
            return 0.0
        self.extras[f"{key} {quantity}"] = extra = max(0.0, value - tiny_predicted)
        return extra


def _tiny_vs_trl(key: str, steps: int) -> dict:
    import tempfile

    import bench_vs_trl
    from bench_common import quiet_checkpoint

    data = json.loads((SOURCE["dir"] / "vs_trl.json").read_text())["meta"]
    args = argparse.Namespace(steps=steps, generations=data["G"], completion_length=data["C"], fp32=True, peft=False)
    kind = key.split(":")[1]
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-plan-validation-"))
    result = bench_vs_trl._run(kind, quiet_checkpoint("tiny"), bench_vs_trl._image_dataset(steps, data["image_size"]),
                               tmp, args, 0)
    return {"step": result["step_s"]}


def _tiny_overlap(key: str, steps: int) -> dict:
    import tempfile

    import bench_overlap
    from bench_common import quiet_checkpoint, synthetic_video_dataset

    m = json.loads((SOURCE["dir"] / "overlap.json").read_text())["meta"]
    args = argparse.Namespace(steps=steps, generations=m["G"], completion_length=m["C"], frames=m["frames"],
                              size=m["size"], prefix_threads=m["prefix_threads"], engine="transformers")
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-plan-validation-"))
    dataset = synthetic_video_dataset(tmp / "data", max(8, steps), m["frames"], m["size"])
    r = bench_overlap._run(key.split(":")[1], quiet_checkpoint("tiny"), dataset, tmp, args)
    return {"step": r["step_s"], "decode": r["decode_s"], "prefix": r["prefix_s"]}


def _tiny_megatron(key: str, steps: int) -> dict:
    import statistics
    import tempfile

    import bench_megatron
    from bench_common import quiet_checkpoint

    from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset

    m = json.loads(_megatron_file().read_text())["meta"]
    args = argparse.Namespace(steps=steps + 1, G=m["G"], C=m["C"], bf16=m["precision"] != "fp32", frames=4, size=56)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-plan-validation-"))
    data = write_synthetic_video_dataset(tmp / "data", SyntheticVideoConfig(num_samples=16, seed=0, num_frames=4,
                                                                            height=56, width=56, fps=2))
    name = key.split(":")[1]
    run = next(r for r in bench_megatron.RUNS if r[0] == name)
    r = bench_megatron._run(quiet_checkpoint("tiny"), data, tmp, *run, args)
    return {"step": statistics.median(r["step_s"][1:]),
            "decode": statistics.median(r["decode_s"][1:]) if r["decode_s"] else None}


def _megatron_file() -> Path:
    """The Megatron comparison's results: bf16 autocast, or fp32 where this run measured that instead."""
    fp32 = SOURCE["dir"] / MEGATRON_FP32[0]
    return fp32 if fp32.exists() and SOURCE["dir"] != RESULTS else SOURCE["dir"] / "megatron_bf16_t2.json"


def _hw(data: dict, rates: dict, threads_share: float = 1.0):
    """The CPU priced at the rates measured around this benchmark (--measure: a calibration just before and just
    after it, averaged: the machine's speed drifts by tens of percent over minutes), else the run's one calibration."""
    from rollplex_trl.planning.calibrate import cpu_hardware

    return cpu_hardware(data.get("calibration") or rates, threads_share=threads_share)


def _spec(**kw):
    from rollplex_trl.planning.step_model import StepSpec

    base = dict(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, precision="fp32", weight_sync=False,
                max_num_seqs=10**6)
    base.update(kw)
    return StepSpec(**base)


def _mech(name: str, G: int, overlap: bool = False):
    """The CPU trainers' schedules: TRL's (or Rollplex with sharing off), and Rollplex's transformers engine with
    the actor's prefix from the prefill, shared-prefix decoding from G = 8, the overlap only where it was on."""
    from rollplex_trl.planning.step_model import SCHEDULES

    if name == "trl":
        return SCHEDULES["trl"]
    return replace(SCHEDULES["rollplex"], shared_decode=G >= 8, overlap=overlap, weight_sharing=False,
                   streamed_optimizer=False)


def _row(bench: str, quantity: str, predicted: float, measured: float, kind: str = "phase") -> dict:
    err = predicted / measured - 1
    tol = PHASE_TOL if kind == "phase" else RATIO_TOL
    return {"benchmark": bench, "quantity": quantity, "kind": kind, "predicted": round(predicted, 4),
            "measured": round(measured, 4), "error": round(err, 4), "within": abs(err) <= tol}


def shared_prefix_rows(dims, rates) -> list[dict]:
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads((SOURCE["dir"] / "shared_prefix.json").read_text())
    rows = []
    for r in data["rows"]:
        G, P, C = r["G"], r["P"], r["C"]
        hw = _hw(r, rates)
        spec = _spec(num_generations=G, prompt_len=P, visual_tokens=128, completion_len=C, micro_batch=G,
                     frame_patches=(8, 8))  # 16 frames of 112 x 112
        # gradient checkpointing is switched on by the Trainer's train(): on in the passes of a trainer that trained
        # first (the whole-step measurement), off where the passes were measured alone (--max-step-completion)
        serial = predict_step(dims, replace(spec, recompute=bool(r["serial"].get("step_s"))), hw, "trl")
        shared = predict_step(dims, replace(spec, recompute=bool(r["shared"].get("step_s"))), hw,
                              _mech("rollplex", G))
        pred = {"serial ref": serial.seconds("reference"), "serial actor": serial.seconds("actor"),
                "shared ref": shared.seconds("ref_prefix") + shared.seconds("reference"),
                "shared actor": shared.seconds("actor_prefix") + shared.seconds("actor")}
        meas = {"serial ref": r["serial"]["ref_s"], "serial actor": r["serial"]["actor_s"],
                "shared ref": r["shared"]["ref_s"], "shared actor": r["shared"]["actor_s"]}
        tag = f"G={G} C={C}"
        rows += [_row("shared_prefix", f"{tag}: {k} pass", pred[k], meas[k]) for k in pred]
        rows.append(_row("shared_prefix", f"{tag}: shared/serial (ref + actor)",
                         (pred["shared ref"] + pred["shared actor"]) / (pred["serial ref"] + pred["serial actor"]),
                         (meas["shared ref"] + meas["shared actor"]) / (meas["serial ref"] + meas["serial actor"]),
                         "ratio"))
    return rows


def vs_trl_rows(dims, tiny, rates, fw: Framework) -> list[dict]:
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads((SOURCE["dir"] / "vs_trl.json").read_text())
    hw = _hw(data, rates)
    m = data["meta"]
    G, C = m["G"], m["C"]
    visual = (m["image_size"] // 28) ** 2
    P = round(m["prompt_share"] * C / (1 - m["prompt_share"]))
    spec = _spec(num_generations=G, prompt_len=P, visual_tokens=visual, completion_len=C, micro_batch=G,
                 reference=False, recompute=False, prefill_feeds_actor=True,
                 frame_patches=(m["image_size"] // 14,) * 2)
    trl = predict_step(dims, spec, hw, "trl").step_s + fw.extra(
        "vs_trl:trl", "step", predict_step(tiny, spec, hw, "trl").step_s)
    rp = predict_step(dims, spec, hw, _mech("rollplex", G)).step_s + fw.extra(
        "vs_trl:rollplex", "step", predict_step(tiny, spec, hw, _mech("rollplex", G)).step_s)
    return [_row("vs_trl", "TRL step", trl, data["trl_step_s"]),
            _row("vs_trl", "Rollplex step", rp, data["rollplex_step_s"]),
            _row("vs_trl", "Rollplex/TRL step", rp / trl, data["rollplex_step_s"] / data["trl_step_s"], "ratio")]


def overlap_rows(dims, tiny, rates, fw: Framework) -> list[dict]:
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads((SOURCE["dir"] / "overlap.json").read_text())
    hw = _hw(data, rates)
    m, modes = data["meta"], data["modes"]
    G, C = m["G"], m["C"]
    visual = m["frames"] // 2 * (m["size"] // 28) ** 2
    spec = _spec(num_generations=G, prompt_len=visual + TEXT_TOKENS, visual_tokens=visual, completion_len=C,
                 micro_batch=G, prefill_feeds_actor=True, frame_patches=(m["size"] // 14,) * 2)
    pred = {}
    for mode, mech in (("serial", "trl"), ("shared", _mech("rollplex", G)),
                       ("overlap", _mech("rollplex", G, overlap=True))):
        small, small_tiny = predict_step(dims, spec, hw, mech), predict_step(tiny, spec, hw, mech)
        pred[mode] = small.step_s + fw.extra(f"overlap:{mode}", "step", small_tiny.step_s)
        if mode == "shared":
            def prefix_s(p):
                return sum(x.seconds for x in p.phases if x.name.endswith("_prefix"))

            decode = small.seconds("rollout_decode") + fw.extra("overlap:shared", "decode",
                                                                small_tiny.seconds("rollout_decode"))
            prefix = prefix_s(small) + fw.extra("overlap:shared", "prefix", prefix_s(small_tiny))
    return [_row("overlap", "serial step", pred["serial"], modes["serial"]["step_s"]),
            _row("overlap", "shared step", pred["shared"], modes["shared"]["step_s"]),
            _row("overlap", "overlap step", pred["overlap"], modes["overlap"]["step_s"]),
            _row("overlap", "decode (shared)", decode, modes["shared"]["decode_s"]),
            _row("overlap", "prefix jobs (shared)", prefix, modes["shared"]["prefix_s"]),
            _row("overlap", "shared/serial step", pred["shared"] / pred["serial"],
                 modes["shared"]["step_s"] / modes["serial"]["step_s"], "ratio"),
            _row("overlap", "overlap/serial step", pred["overlap"] / pred["serial"],
                 modes["overlap"]["step_s"] / modes["serial"]["step_s"], "ratio")]


def megatron_rows(dims, tiny, rates, fw: Framework) -> list[dict]:
    """hf (t = 1, both cores) vs Megatron t = 2 (two processes, one core each), bf16 autocast (or fp32, see
    `MEGATRON_FP32`). Each rank is a device with half the machine's rates; the TP all-reduces go through gloo on
    this machine: their bytes at the copy bandwidth, each paying the gloo all-reduce latency that --measure times
    around this benchmark (committed results without it: none)."""
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads(_megatron_file().read_text())
    m = data["meta"]
    fp32 = m["precision"] == "fp32"
    G, C = m["G"], m["C"]
    visual = 4 // 2 * (56 // 28) ** 2  # bench_megatron.py's defaults: 4 frames of 56 x 56
    spec = _spec(num_generations=G, prompt_len=visual + TEXT_TOKENS, visual_tokens=visual, completion_len=C,
                 batch=2, micro_batch=2 * G, precision="fp32" if fp32 else "bf16", autocast=not fp32,
                 prefill_feeds_actor=True, frame_patches=(56 // 14, 56 // 14))
    rows_by_run = {r["run"]: r for r in data["rows"]}
    t2_spec = replace(spec, num_gpus=2, train_tp=2, rollout_tp=2, batch=2)
    pred = {}
    for run, sp, hw in (("hf (shared prefix)", spec, _hw(data, rates)),
                        ("megatron t=2", t2_spec, _hw(data, rates, threads_share=0.5))):
        small, small_tiny = predict_step(dims, sp, hw, _mech("rollplex", G)), predict_step(tiny, sp, hw,
                                                                                            _mech("rollplex", G))
        pred[run] = (small.step_s + fw.extra(f"megatron:{run}", "step", small_tiny.step_s),
                     small.seconds("rollout_decode") + fw.extra(f"megatron:{run}", "decode",
                                                                 small_tiny.seconds("rollout_decode")))
    hf, t2 = pred["hf (shared prefix)"], pred["megatron t=2"]
    hf_meas, t2_meas = rows_by_run["hf (shared prefix)"], rows_by_run["megatron t=2"]
    return [_row("megatron", "hf t=1 step", hf[0], hf_meas["step_s"]),
            _row("megatron", "megatron t=2 step", t2[0], t2_meas["step_s"]),
            _row("megatron", "hf t=1 decode", hf[1], hf_meas["decode_s"]),
            _row("megatron", "megatron t=2 decode", t2[1], t2_meas["decode_s"]),
            _row("megatron", "t=2 / t=1 step", t2[0] / hf[0], t2_meas["step_s"] / hf_meas["step_s"], "ratio")]


def _combine(runs: list[list[dict]]) -> list[dict]:
    """One row per quantity over several runs: the median prediction against the median measurement (each run
    priced at its own calibrations), with every run's own error kept (`run_errors`: the measurement's spread)."""
    import statistics

    combined = []
    for same in zip(*runs, strict=True):
        first = same[0]
        predicted = statistics.median(r["predicted"] for r in same)
        measured = statistics.median(r["measured"] for r in same)
        row = _row(first["benchmark"], first["quantity"], predicted, measured, first["kind"])
        row["framework"] = first["framework"]
        row["run_errors"] = [r["error"] for r in same]
        combined.append(row)
    return combined


def _mean_rates(before: dict, after: dict) -> dict:
    return {k: (before[k] + after[k]) / 2 if k in after else before[k] for k in before}


def measure(folder: Path, dims, quick: bool) -> dict:
    """Run the CPU benchmarks now into `folder`, each between two calibrations of this machine; their mean is
    written into the benchmark's JSON as "calibration" (for shared_prefix: into each of its rows, one process per
    (G, C) point). Returns the first calibration (the run's rates where a benchmark has none)."""
    import subprocess

    from rollplex_trl.planning.calibrate import calibrate, collective_latency

    folder.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")])}
    rates = calibrate(dims, quick=quick)  # ~10 s: before and after each benchmark
    first = rates
    runs = dict(BENCHMARKS)
    if rates["bf16_flops"] < rates["fp32_flops"]:
        del runs["megatron_bf16_t2.json"]
        runs[MEGATRON_FP32[0]] = MEGATRON_FP32[1]
        print(f"bf16 GEMMs run at {rates['bf16_flops'] / 1e9:.1f} GFLOP/s here (fp32: "
              f"{rates['fp32_flops'] / 1e9:.0f}): the Megatron comparison runs in fp32", flush=True)
    for name, (script, *flags) in runs.items():
        tensor_parallel = name.startswith("megatron")  # its ranks all-reduce through gloo: time that too
        if tensor_parallel:
            rates = {**rates, "collective_latency_s": collective_latency()}
        cmd = [sys.executable, str(here / script), *flags, "--out", str(folder / name)]
        print("measuring:", " ".join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{script} failed:\n{done.stderr[-4000:]}")
        after = calibrate(dims, quick=quick, collectives=tensor_parallel)
        data = json.loads((folder / name).read_text())
        data["calibration"] = _mean_rates(rates, after)
        data["host_allocator_env"] = {k: os.environ[k] for k in CACHING_HOST_ALLOCATOR if k in os.environ}
        data["calibration_drift"] = {k: after[k] / rates[k] - 1 for k in rates if rates[k] and k in after}
        (folder / name).write_text(json.dumps(data, indent=2) + "\n")
        print("  GEMM fp32 GFLOP/s before / after: "
              f"{rates['fp32_flops'] / 1e9:.0f} / {after['fp32_flops'] / 1e9:.0f}", flush=True)
        rates = after
    points = [json.loads((folder / f"shared_prefix_G{G}_C{C}.json").read_text()) for G, C in SHARED_PREFIX_POINTS]
    merged = {"meta": points[0]["meta"], "rows": [{**p["rows"][0], "calibration": p["calibration"]} for p in points]}
    (folder / "shared_prefix.json").write_text(json.dumps(merged, indent=2) + "\n")
    return first


DOC_BEGIN, DOC_END = "<!-- plan-validation:begin -->", "<!-- plan-validation:end -->"


def markdown(out: dict) -> str:
    """The validation table for docs/planning.md (between its markers), from the JSON this script writes."""
    s, meta = out["summary"], out["meta"]
    r = out["rates"]
    when = ("with calibrations around each benchmark" if meta.get("measured_now")
            else "earlier (committed results)")
    runs = s.get("runs", 1)
    lines = [
        f"Measured {when} · {runs} run{'s' if runs > 1 else ''} · commit {meta.get('commit') or 'not recorded'} · "
        f"{meta.get('cpu') or 'CPU not recorded'} · {meta.get('date') or ''}",
        "",
        f"Rates (the first run's first calibration): GEMM {r['fp32_flops'] / 1e9:.0f} GFLOP/s fp32, "
        f"{r['bf16_flops'] / 1e9:.0f} bf16; attention "
        f"{r['fp32_attention_flops'] / 1e9:.0f} / {r['bf16_attention_flops'] / 1e9:.0f}, at one query per row "
        f"{r.get('fp32_decode_attention_flops', 0) / 1e9:.0f} / {r.get('bf16_decode_attention_flops', 0) / 1e9:.0f}; "
        f"vision tower factors fp32 {r.get('fp32_vision_forward_factor', 1):.2f} forward, "
        f"{r.get('fp32_vision_train_factor', 1):.2f} trained, bf16 {r.get('bf16_vision_forward_factor', 1):.2f} / "
        f"{r.get('bf16_vision_train_factor', 1):.2f}; copy "
        f"{r['mem_bw'] / 1e9:.1f} GB/s; decode weight reads {r.get('decode_bw', 0) / 1e9:.1f} GB/s; overheads per "
        f"call {r['call_overhead_s'] * 1e3:.2f} ms, per layer {r['layer_overhead_s'] * 1e3:.2f} ms, per decode step "
        f"{r['decode_step_overhead_s'] * 1e3:.2f} ms + per layer {r.get('decode_layer_overhead_s', 0) * 1e3:.2f} "
        f"(shared-prefix decoding {r.get('shared_decode_layer_overhead_s', 0) * 1e3:.2f}) ms, per vision block "
        f"{r.get('vision_block_overhead_s', 0) * 1e3:.2f} ms. Each benchmark is priced at the mean of the "
        "calibrations just before and after it; with several runs each row compares the median prediction with the "
        "median measurement, and the last column shows each run's own error (the measurements' spread).",
        "",
        "| benchmark | quantity | framework s added | predicted | measured | error | within | each run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in out["rows"]:
        tol = "25%" if row["kind"] == "phase" else "15%"
        fw = "yes" if row.get("framework") else "no"
        each = ", ".join(f"{e:+.0%}" for e in row.get("run_errors", [row["error"]]))
        lines.append(f"| {row['benchmark']} | {row['quantity']} | {fw} | {row['predicted']:.3f} | "
                     f"{row['measured']:.3f} | {row['error']:+.1%} | {'yes' if row['within'] else '**no**'} ({tol}) | "
                     f"{each} |")
    lines += ["", f"Summary (steps with the framework seconds, passes without): phases and steps within 25%: "
                  f"{s['phases_within_25pct']}/{s['phases']} (max |error| {s['max_abs_phase_error']:.0%}); "
                  f"Rollplex/serial ratios within 15%: {s['ratios_within_15pct']}/{s['ratios']} (max |error| "
                  f"{s['max_abs_ratio_error']:.0%})."]
    return "\n".join(lines)


def write_docs(out: dict, path: Path) -> None:
    text = path.read_text()
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    path.write_text(f"{head}{DOC_BEGIN}\n{markdown(out)}\n{DOC_END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", help="a calibration JSON to reuse (default: measure now)")
    parser.add_argument("--quick", action="store_true", help="fewer calibration repeats")
    parser.add_argument("--measure", metavar="DIR",
                        help="run the benchmarks now into DIR and validate against them (default: read the committed "
                             "benchmarks/results/*.json)")
    parser.add_argument("--runs", type=int, default=1,
                        help="--measure: measure every benchmark this many times (DIR/run0, run1, ...); each row "
                             "compares the median prediction with the median measurement")
    parser.add_argument("--measured", nargs="+", metavar="RUN_DIR",
                        help="price earlier --measure runs' folders (DIR/runN) instead of measuring again")
    parser.add_argument("--no-framework", action="store_true",
                        help="leave out the per-step framework seconds measured on the tiny preset")
    parser.add_argument("--out", default=str(RESULTS / "plan_validation.json"))
    parser.add_argument("--docs", metavar="FILE.md", help="write the table into FILE.md between its markers")
    parser.add_argument("--from-json", metavar="FILE", help="only write --docs from an earlier run's JSON")
    args = parser.parse_args()
    if args.measure and any(os.environ.get(k) != v for k, v in CACHING_HOST_ALLOCATOR.items()):
        print("re-running under glibc settings that keep freed memory:", CACHING_HOST_ALLOCATOR, flush=True)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_HOST_ALLOCATOR})
    if args.from_json:
        write_docs(json.loads(Path(args.from_json).read_text()), Path(args.docs))
        return
    from rollplex_trl.planning.calibrate import calibrate

    dims = _dims()
    tiny = _dims("tiny")
    if args.measure:
        folders = [Path(args.measure) / f"run{i}" for i in range(args.runs)]
    else:
        folders = [Path(d) for d in args.measured] if args.measured else [RESULTS]
    flags = (False, True) if not args.no_framework else (False,)
    frameworks = {flag: Framework(flag) for flag in flags}  # the tiny runs depend on the settings only: once
    runs = []
    for folder in folders:
        SOURCE["dir"] = folder
        if args.measure:
            rates = measure(folder, dims, args.quick)
        elif (folder / "rates.json").exists():
            rates = json.loads((folder / "rates.json").read_text())
        else:
            rates = json.loads(Path(args.rates).read_text()) if args.rates else calibrate(dims, quick=args.quick)
        if folder != RESULTS:  # the run's first calibration, kept for pricing the folder again (--measured)
            (folder / "rates.json").write_text(json.dumps(rates, indent=2) + "\n")
        rows = []
        for with_framework in flags:
            fw = frameworks[with_framework]
            part = (shared_prefix_rows(dims, rates) + vs_trl_rows(dims, tiny, rates, fw)
                    + overlap_rows(dims, tiny, rates, fw) + megatron_rows(dims, tiny, rates, fw))
            for r in part:
                r["framework"] = with_framework
            if with_framework:
                part = [r for r in part if r["benchmark"] != "shared_prefix"]  # passes measured alone: no framework
            rows += part
        names = ["shared_prefix.json", "vs_trl.json", "overlap.json", _megatron_file().name]
        runs.append({"folder": str(folder), "rates": rates, "rows": rows, "host_allocator_env": {
                         n: json.loads((folder / n).read_text()).get("host_allocator_env") for n in names},
                     "benchmark_meta": {n: json.loads((folder / n).read_text()).get("meta") for n in names},
                     "calibration_drift": {n: json.loads((folder / n).read_text()).get("calibration_drift")
                                           for n in names}})
    rows = _combine([run["rows"] for run in runs])
    extras = frameworks[True].extras if True in frameworks else {}
    final = [r for r in rows if r["framework"] or r["benchmark"] == "shared_prefix" or args.no_framework]
    phases = [r for r in final if r["kind"] == "phase"]
    ratios = [r for r in final if r["kind"] == "ratio"]
    summary = {"runs": len(runs), "phases": len(phases), "phases_within_25pct": sum(r["within"] for r in phases),
               "max_abs_phase_error": max(abs(r["error"]) for r in phases),
               "ratios": len(ratios), "ratios_within_15pct": sum(r["within"] for r in ratios),
               "max_abs_ratio_error": max(abs(r["error"]) for r in ratios)}
    out = {"meta": run_meta() | {"measured_now": bool(args.measure or args.measured), "runs": len(runs)},
           "rates": runs[0]["rates"],
           "framework_s": extras, "calibration_drift": runs[0]["calibration_drift"],
           "benchmark_meta": runs[0]["benchmark_meta"], "rows": rows, "summary": summary,
           "runs": [{k: v for k, v in run.items() if k != "benchmark_meta"} for run in runs]}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'benchmark':14s} {'quantity':44s} {'predicted':>10s} {'measured':>10s} {'error':>8s}")
    for r in rows:
        flag = "" if r["within"] else "  MISS"
        fw_tag = " +fw" if r["framework"] else ""
        print(f"{r['benchmark'] + fw_tag:14s} {r['quantity']:44s} {r['predicted']:10.3f} {r['measured']:10.3f} "
              f"{r['error']:+8.1%}{flag}")
    print("summary (steps with the framework seconds, passes without):")
    print(f"phases within 25%: {summary['phases_within_25pct']}/{summary['phases']} (max |error| "
          f"{summary['max_abs_phase_error']:.0%}); ratios within 15%: {summary['ratios_within_15pct']}/"
          f"{summary['ratios']} (max |error| {summary['max_abs_ratio_error']:.0%})")
    print(f"written to {args.out}")
    if args.docs:
        write_docs(out, Path(args.docs))


if __name__ == "__main__":
    main()
