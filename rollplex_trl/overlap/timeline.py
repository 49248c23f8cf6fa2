"""The phase timeline: spans per lane (decode, prefix, ...), step metrics, Chrome-trace JSON and a Gantt PNG."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollplex_trl.overlap.executor import Span


@dataclass
class WindowStats:
    """What one rollout window achieved (all seconds)."""

    decode_s: float
    prefix_s: float  # total run time of the prefix jobs
    hidden_s: float  # prefix time that ran while decoding
    critical_path_s: float  # decode start -> both the responses and every prefix state ready

    def metrics(self, baseline_decode_s: float | None) -> dict[str, float]:
        slowdown = self.decode_s / baseline_decode_s if baseline_decode_s else 1.0
        return {"rollplex/decode_s": self.decode_s, "rollplex/prefix_s": self.prefix_s,
                "rollplex/hidden_s": self.hidden_s, "rollplex/critical_path_s": self.critical_path_s,
                "rollplex/decode_slowdown": slowdown}


def window_stats(decode: Span, jobs: list[Span]) -> WindowStats:
    prefix_s = sum(s.seconds for s in jobs)
    hidden = sum(max(0.0, min(s.end, decode.end) - max(s.start, decode.start)) for s in jobs)
    end = max([decode.end, *(s.end for s in jobs)])
    return WindowStats(decode_s=decode.seconds, prefix_s=prefix_s, hidden_s=hidden,
                       critical_path_s=end - decode.start)


class Timeline:
    """Collects spans of a run; exports them as Chrome trace events (chrome://tracing, Perfetto) and a Gantt PNG."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._origin: float | None = None

    def add(self, span: Span) -> None:
        if self._origin is None:
            self._origin = span.start
        self.spans.append(span)

    def chrome_trace(self) -> dict:
        origin = self._origin or 0.0
        lanes = sorted({s.lane for s in self.spans})
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
                  for i, lane in enumerate(lanes)]
        for s in self.spans:
            events.append({"name": s.name, "ph": "X", "pid": 0, "tid": lanes.index(s.lane),
                           "ts": (s.start - origin) * 1e6, "dur": s.seconds * 1e6, "args": s.args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def write_gantt(self, path: str | Path, title: str = "Rollplex phase timeline") -> Path | None:
        """Draw the spans as a Gantt chart (matplotlib, Agg). Returns None when matplotlib is missing."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        origin = self._origin or 0.0
        lanes = ["step", "decode", "prefix"]
        lanes += sorted({s.lane for s in self.spans} - set(lanes))
        lanes = [lane for lane in lanes if any(s.lane == lane for s in self.spans)]
        colours = {"decode": "tab:blue", "prefix": "tab:orange", "step": "tab:gray"}
        fig, ax = plt.subplots(figsize=(11, 1.0 + 0.6 * len(lanes)))
        for s in self.spans:
            y = lanes.index(s.lane)
            ax.barh(y, s.seconds, left=s.start - origin, height=0.6, color=colours.get(s.lane, "tab:gray"),
                    edgecolor="black", linewidth=0.3)
        labels = {"step": "training micro-step\n(rollout included)", "decode": "rollout decode",
                  "prefix": "prefix jobs"}
        ax.set_yticks(range(len(lanes)), [labels.get(lane, lane) for lane in lanes])
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the first rollout")
        ax.set_title(title)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
