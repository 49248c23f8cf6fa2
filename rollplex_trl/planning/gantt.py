"""The predicted step as a Gantt chart: one band per schedule, lanes as in the measured timeline
(overlap/timeline.py: rollout decode, prefix jobs, training), so a prediction and a measurement read alike."""

from __future__ import annotations

from pathlib import Path

from rollplex_trl.planning.step_model import StepPrediction

COLOURS = {"rollout_prefill": "tab:cyan", "rollout_decode": "tab:blue", "ref_prefix": "tab:orange",
           "old_prefix": "gold", "actor_prefix": "tab:red", "reference": "tab:orange", "old": "gold",
           "actor": "tab:red", "optimizer": "tab:green", "weight_sync": "tab:purple"}
LANES = ("rollout", "prefix", "train", "optimizer", "sync")


def write_gantt(predictions: dict[str, StepPrediction], path: str | Path, title: str) -> Path | None:
    """Draw each schedule's phases on its lanes (matplotlib, Agg). Returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows: list[tuple[str, str]] = []
    for name, pred in predictions.items():
        lanes = [lane for lane in LANES if any(p.lane == lane for p in pred.phases)]
        rows += [(name, lane) for lane in lanes]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.42 * len(rows)))
    labelled: set[str] = set()
    for name, pred in predictions.items():
        for p in pred.phases:
            if p.seconds <= 0:
                continue
            y = rows.index((name, p.lane))
            ax.barh(y, p.seconds, left=p.start, height=0.6, color=COLOURS.get(p.name, "tab:gray"),
                    edgecolor="black", linewidth=0.3, label=None if p.name in labelled else p.name)
            labelled.add(p.name)
        end = pred.step_s
        ys = [i for i, r in enumerate(rows) if r[0] == name]
        ax.plot([end, end], [min(ys) - 0.4, max(ys) + 0.4], color="black", linewidth=1)
        ax.text(end, min(ys) - 0.45, f" {name}: {end:.3g} s", va="bottom", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{n}: {lane}" for n, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step (predicted)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
