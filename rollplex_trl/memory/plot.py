"""Figures: the three plans as stacked bars, and the runtime ledger as a phase timeline (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollplex_trl.memory.lifetime import LifetimeClass
from rollplex_trl.memory.planner import CLASSES, GIB, MemoryPlanReport

if TYPE_CHECKING:
    from rollplex_trl.memory.ledger import MemoryLedger

COLORS = {"boundary": "#d62728", "permanent": "#1f77b4", "regenerable": "#2ca02c", "phase_local": "#ff7f0e",
          "runtime": "#7f7f7f"}
LABELS = {"serial": "serial colocation", "naive_overlap": "naive overlap", "rollplex": "Rollplex plan"}


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install -c constraints.txt matplotlib "
                           "(or the project's dev extra)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_plans(report: MemoryPlanReport, path: str | Path) -> Path:
    """Per-GPU memory of each plan at its peak phase, stacked by lifetime class, with the device limit."""
    plt = _pyplot()
    names = list(report.plans)
    fig, ax = plt.subplots(figsize=(7, 5))
    bottoms = [0.0] * len(names)
    for cls in CLASSES:
        heights = [report.plans[n].by_class()[cls] / GIB for n in names]
        ax.bar([LABELS.get(n, n) for n in names], heights, bottom=bottoms, color=COLORS[cls], label=cls)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    limit = report.workload.device_mem_gib
    ax.axhline(limit, color="black", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, limit, f" device {limit:g} GiB", va="bottom", ha="right")
    for i, n in enumerate(names):
        plan = report.plans[n]
        ax.text(i, bottoms[i], f"{bottoms[i]:.1f} GiB\n(peak: {plan.peak_phase.value})", ha="center", va="bottom")
    wl = report.workload
    ax.set_ylabel("GiB per GPU")
    ax.set_ylim(0, max(bottoms + [limit]) * 1.18)
    ax.set_title(f"{report.model.name}: train TP {wl.train_tp}, rollout TP {wl.rollout_tp}, B={wl.batch}, "
                 f"G={wl.num_generations}, P={wl.prompt_len}, C={wl.completion_len}", fontsize=9)
    ax.legend(title="lifetime class", loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_ledger(ledger: MemoryLedger, path: str | Path) -> Path:
    """The ledger's samples as stacked areas by lifetime class over time, phases shaded and labelled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    times = [s.time_s for s in ledger.samples]
    stacks = [[s.by_class[cls] / 2**20 for s in ledger.samples] for cls in LifetimeClass]
    if times:
        ax.stackplot(times, stacks, labels=[c.value for c in LifetimeClass],
                     colors=[COLORS[c.value] for c in LifetimeClass], step="post")
    for i, rec in enumerate(ledger.records):
        end = rec.end_s if rec.end_s is not None else (times[-1] if times else rec.start_s)
        ax.axvspan(rec.start_s, end, color="0.9" if i % 2 else "0.8", alpha=0.3, zorder=0)
        ax.text((rec.start_s + end) / 2, 0, rec.phase.value, ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xlabel("seconds")
    ax.set_ylabel("registered device MiB")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
