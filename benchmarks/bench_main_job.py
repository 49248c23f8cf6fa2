"""The main job learns: held-out accuracy of the random, the SFT and the GRPO model over several seeds.

Runs `rollplex-trl demo` (its defaults unless options are passed after `--`) once per seed, each in a fresh process,
and writes the per-seed tables, their mean and range, and a picture of every seed's curves:

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_main_job.py [--seeds 0 1 2] \
        --out benchmarks/results/main_job.json --picture docs/main-job.png [-- --steps 50]

`benchmarks/report.py` prints the table in docs/benchmarks.md and in the README (between its
`<!-- main-job-table -->` markers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import run_meta  # noqa: E402

MODELS = ("random", "SFT", "GRPO")
COLUMNS = ("sampled", "greedy", "format")


def run_seed(seed: int, folder: Path, demo_args: list[str]) -> dict:
    """One main job in a fresh process; returns its results.json."""
    out = folder / f"seed{seed}"
    command = [sys.executable, "-m", "rollplex_trl.demo", "--output-dir", str(out), "--seed", str(seed), *demo_args]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text())


def summarise(runs: dict[str, dict]) -> dict:
    """Mean, min and max over the seeds of every (model, column) of the held-out table."""
    summary = {}
    for model in MODELS:
        rows = [run["heldout"][model] for run in runs.values() if model in run["heldout"]]
        if rows:
            summary[model] = {column: {"mean": sum(r[column] for r in rows) / len(rows),
                                       "min": min(r[column] for r in rows), "max": max(r[column] for r in rows)}
                              for column in COLUMNS}
    return summary


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    for index, (seed, run) in enumerate(runs.items()):
        colour = f"C{index}"
        axis.plot(*zip(*run["accuracy_reward_curve"], strict=True), color=colour, alpha=0.3, linewidth=1)
        axis.plot(*zip(*run["heldout_curve"], strict=True), "o-", color=colour, label=f"seed {seed}: held-out")
    axis.set_xlabel("GRPO step (step 0: the SFT model)")
    axis.set_ylabel("accuracy")
    axis.set_ylim(0, 1.02)
    axis.set_title("held-out accuracy (sampled answers); faint: the rollouts' accuracy reward", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def print_table(summary: dict) -> None:
    print(f"{'model':<8} " + " ".join(f"{c + ' mean [min, max]':>26}" for c in COLUMNS))
    for model, row in summary.items():
        cells = [f"{row[c]['mean']:.3f} [{row[c]['min']:.3f}, {row[c]['max']:.3f}]" for c in COLUMNS]
        print(f"{model:<8} " + " ".join(f"{cell:>26}" for cell in cells))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    demo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="benchmarks/results/main_job.json")
    parser.add_argument("--picture", default="docs/main-job.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollplex-main-job-") as folder:
        runs = {}
        for seed in args.seeds:
            runs[str(seed)] = run_seed(seed, Path(folder), demo_args)
            print(f"seed {seed}: {runs[str(seed)]['heldout']} ({runs[str(seed)]['seconds']} s)", flush=True)
    summary = summarise(runs)
    print_table(summary)
    meta = {**run_meta(), "seeds": args.seeds, "demo_args": " ".join(demo_args) or "defaults",
            "questions": runs[str(args.seeds[0])]["args"]["heldout_samples"],
            "answers_sampled": runs[str(args.seeds[0])]["args"]["eval_samples"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs, "table": summary}, indent=2) + "\n")
    plot(runs, Path(args.picture))
    print(f"wrote {args.out} and {args.picture}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
