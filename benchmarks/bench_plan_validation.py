"""Validation of plan-run's step model on this machine: calibrate once, then predict the CPU benchmarks' measured
phases and steps and their Rollplex/serial ratios.

The step model (rollplex_trl/planning/step_model.py) is priced with this machine's rates, measured by
rollplex_trl/planning/calibrate.py at the `small` preset's shapes (GEMM and attention FLOP/s, copy bandwidth, the
transformers per-call / per-layer / per-decode-step / per-vision-block overheads on tiny models). Nothing is fitted to
a benchmark's result.

The trainers' steps also pay per-step framework costs the step model does not count (data preparation and the
processor, TRL's generation loop and logits processors beyond one forward per token, rewards, logging, the
trainer's bookkeeping). They are measured on this machine by running each benchmark's own trainer code once on the
`tiny` preset (the same G, C, clip and schedule; its FLOPs are ~1000x smaller), and added as measured minus the step
model's own prediction for the tiny model ("framework" below; `--no-framework` leaves it out and the JSON keeps
both predictions). The measurements are the committed results of the CPU benchmarks (benchmarks/results/*.json, recorded
on this machine type, 2 cores): the shared-prefix passes (bench_shared_prefix.py: reference and actor pass, serial
vs shared, 9 points of G and C), the whole step TRL vs Rollplex (bench_vs_trl.py --fp32), the overlap benchmark
(bench_overlap.py: serial, shared, shared + overlap; decode and prefix-job seconds), and Megatron t = 2 against hf
(bench_megatron.py --bf16). Targets (issue 37): each phase and step within 25%, each Rollplex/serial ratio within 15%.

Usage:  OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_plan_validation.py [--rates FILE] [--quick]
        [--out benchmarks/results/plan_validation.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from bench_common import run_meta

RESULTS = Path(__file__).parent / "results"
SOURCE = {"dir": RESULTS}  # where the measurements are read: the committed results, or this run's (--measure)
PHASE_TOL, RATIO_TOL = 0.25, 0.15
BENCHMARKS = {  # --measure: each benchmark at modest settings (minutes, not hours), into this run's folder
    "shared_prefix.json": ["bench_shared_prefix.py", "--generations", "4", "16", "--completion-lengths", "15",
                           "72", "--steps", "2", "--repeats", "3", "--max-step-completion", "0"],
    "vs_trl.json": ["bench_vs_trl.py", "--fp32", "--steps", "3", "--repeats", "1"],
    "overlap.json": ["bench_overlap.py", "--steps", "3"],
    "megatron_bf16_t2.json": ["bench_megatron.py", "--bf16", "--steps", "4", "--repeats", "1", "--runs",
                              "hf (shared prefix)", "megatron t=2"],
}
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

    m = json.loads((SOURCE["dir"] / "megatron_bf16_t2.json").read_text())["meta"]
    args = argparse.Namespace(steps=steps + 1, G=m["G"], C=m["C"], bf16=True, frames=4, size=56)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-plan-validation-"))
    data = write_synthetic_video_dataset(tmp / "data", SyntheticVideoConfig(num_samples=16, seed=0, num_frames=4,
                                                                            height=56, width=56, fps=2))
    name = key.split(":")[1]
    run = next(r for r in bench_megatron.RUNS if r[0] == name)
    r = bench_megatron._run(quiet_checkpoint("tiny"), data, tmp, *run, args)
    return {"step": statistics.median(r["step_s"][1:]),
            "decode": statistics.median(r["decode_s"][1:]) if r["decode_s"] else None}


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


def shared_prefix_rows(dims, hw) -> list[dict]:
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads((SOURCE["dir"] / "shared_prefix.json").read_text())
    rows = []
    for r in data["rows"]:
        G, P, C = r["G"], r["P"], r["C"]
        spec = _spec(num_generations=G, prompt_len=P, visual_tokens=128, completion_len=C, micro_batch=G)
        serial, shared = predict_step(dims, spec, hw, "trl"), predict_step(dims, spec, hw, _mech("rollplex", G))
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


def vs_trl_rows(dims, tiny, hw, fw: Framework) -> list[dict]:
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads((SOURCE["dir"] / "vs_trl.json").read_text())
    m = data["meta"]
    G, C = m["G"], m["C"]
    visual = (m["image_size"] // 28) ** 2
    P = round(m["prompt_share"] * C / (1 - m["prompt_share"]))
    spec = _spec(num_generations=G, prompt_len=P, visual_tokens=visual, completion_len=C, micro_batch=G,
                 reference=False, recompute=False, prefill_feeds_actor=True)
    trl = predict_step(dims, spec, hw, "trl").step_s + fw.extra(
        "vs_trl:trl", "step", predict_step(tiny, spec, hw, "trl").step_s)
    rp = predict_step(dims, spec, hw, _mech("rollplex", G)).step_s + fw.extra(
        "vs_trl:rollplex", "step", predict_step(tiny, spec, hw, _mech("rollplex", G)).step_s)
    return [_row("vs_trl", "TRL step", trl, data["trl_step_s"]),
            _row("vs_trl", "Rollplex step", rp, data["rollplex_step_s"]),
            _row("vs_trl", "Rollplex/TRL step", rp / trl, data["rollplex_step_s"] / data["trl_step_s"], "ratio")]


def overlap_rows(dims, tiny, hw, fw: Framework) -> list[dict]:
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads((SOURCE["dir"] / "overlap.json").read_text())
    m, modes = data["meta"], data["modes"]
    G, C = m["G"], m["C"]
    visual = m["frames"] // 2 * (m["size"] // 28) ** 2
    spec = _spec(num_generations=G, prompt_len=visual + TEXT_TOKENS, visual_tokens=visual, completion_len=C,
                 micro_batch=G, prefill_feeds_actor=True)
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
    """hf (t = 1, both cores) vs Megatron t = 2 (two processes, one core each), bf16 autocast. Each rank is a device
    with half the machine's rates; the TP all-reduces go through gloo on this machine (priced at the copy
    bandwidth, no latency: not calibrated)."""
    from rollplex_trl.planning.calibrate import cpu_hardware
    from rollplex_trl.planning.step_model import predict_step

    data = json.loads((SOURCE["dir"] / "megatron_bf16_t2.json").read_text())
    m = data["meta"]
    G, C = m["G"], m["C"]
    visual = 4 // 2 * (56 // 28) ** 2  # bench_megatron.py's defaults: 4 frames of 56 x 56
    spec = _spec(num_generations=G, prompt_len=visual + TEXT_TOKENS, visual_tokens=visual, completion_len=C,
                 batch=2, micro_batch=2 * G, precision="bf16", autocast=True, prefill_feeds_actor=True)
    rows_by_run = {r["run"]: r for r in data["rows"]}
    t2_spec = replace(spec, num_gpus=2, train_tp=2, rollout_tp=2, batch=2)
    pred = {}
    for run, sp, hw in (("hf (shared prefix)", spec, cpu_hardware(rates)),
                        ("megatron t=2", t2_spec, cpu_hardware(rates, threads_share=0.5))):
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


def measure(folder: Path) -> None:
    """Run the four CPU benchmarks now (the same machine and moment as the calibration), into `folder`."""
    import os
    import subprocess
    import sys

    folder.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")])}
    for name, (script, *flags) in BENCHMARKS.items():
        cmd = [sys.executable, str(here / script), *flags, "--out", str(folder / name)]
        print("measuring:", " ".join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{script} failed:\n{done.stderr[-4000:]}")


DOC_BEGIN, DOC_END = "<!-- plan-validation:begin -->", "<!-- plan-validation:end -->"


def markdown(out: dict) -> str:
    """The validation table for docs/planning.md (between its markers), from the JSON this script writes."""
    s, meta = out["summary"], out["meta"]
    r = out["rates"]
    when = "in the same run as the calibration" if meta.get("measured_now") else "earlier (committed results)"
    lines = [
        f"Measured {when} · commit {meta.get('commit') or 'not recorded'} · {meta.get('cpu') or 'CPU not recorded'} · "
        f"{meta.get('date') or ''}",
        "",
        f"Rates: GEMM {r['fp32_flops'] / 1e9:.0f} GFLOP/s fp32, {r['bf16_flops'] / 1e9:.0f} bf16; attention "
        f"{r['fp32_attention_flops'] / 1e9:.0f} / {r['bf16_attention_flops'] / 1e9:.0f}; copy "
        f"{r['mem_bw'] / 1e9:.1f} GB/s; overheads per call {r['call_overhead_s'] * 1e3:.2f} ms, per layer "
        f"{r['layer_overhead_s'] * 1e3:.2f} ms, per decode step {r['decode_step_overhead_s'] * 1e3:.2f} ms, per "
        f"vision block {r.get('vision_block_overhead_s', 0) * 1e3:.2f} ms.",
        "",
        "| benchmark | quantity | framework s added | predicted | measured | error | within |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in out["rows"]:
        tol = "25%" if row["kind"] == "phase" else "15%"
        fw = "yes" if row.get("framework") else "no"
        lines.append(f"| {row['benchmark']} | {row['quantity']} | {fw} | {row['predicted']:.3f} | "
                     f"{row['measured']:.3f} | {row['error']:+.1%} | {'yes' if row['within'] else '**no**'} ({tol}) |")
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
    parser.add_argument("--no-framework", action="store_true",
                        help="leave out the per-step framework seconds measured on the tiny preset")
    parser.add_argument("--out", default=str(RESULTS / "plan_validation.json"))
    parser.add_argument("--docs", metavar="FILE.md", help="write the table into FILE.md between its markers")
    parser.add_argument("--from-json", metavar="FILE", help="only write --docs from an earlier run's JSON")
    args = parser.parse_args()
    if args.from_json:
        write_docs(json.loads(Path(args.from_json).read_text()), Path(args.docs))
        return
    from rollplex_trl.planning.calibrate import calibrate, cpu_hardware

    if args.measure:
        SOURCE["dir"] = Path(args.measure)
        measure(SOURCE["dir"])
    dims = _dims()
    rates = json.loads(Path(args.rates).read_text()) if args.rates else calibrate(dims, quick=args.quick)
    hw = cpu_hardware(rates)
    tiny = _dims("tiny")
    rows = []
    for with_framework in ((False, True) if not args.no_framework else (False,)):
        fw = Framework(with_framework)
        part = (shared_prefix_rows(dims, hw) + vs_trl_rows(dims, tiny, hw, fw) + overlap_rows(dims, tiny, hw, fw)
                + megatron_rows(dims, tiny, rates, fw))
        for r in part:
            r["framework"] = with_framework
        if with_framework:
            part = [r for r in part if r["benchmark"] != "shared_prefix"]  # passes measured alone: no framework
        rows += part
        extras = fw.extras if with_framework else {}
    final = [r for r in rows if r["framework"] or r["benchmark"] == "shared_prefix" or args.no_framework]
    phases = [r for r in final if r["kind"] == "phase"]
    ratios = [r for r in final if r["kind"] == "ratio"]
    summary = {"phases": len(phases), "phases_within_25pct": sum(r["within"] for r in phases),
               "max_abs_phase_error": max(abs(r["error"]) for r in phases),
               "ratios": len(ratios), "ratios_within_15pct": sum(r["within"] for r in ratios),
               "max_abs_ratio_error": max(abs(r["error"]) for r in ratios)}
    measured = {name: json.loads((SOURCE["dir"] / name).read_text()).get("meta") for name in BENCHMARKS}
    out = {"meta": run_meta() | {"measured_now": bool(args.measure)}, "rates": rates, "framework_s": extras,
           "benchmark_meta": measured, "rows": rows, "summary": summary}
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
