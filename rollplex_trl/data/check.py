"""`rollplex-trl check-data`: every row of a Video-R1-format annotation file through the training's data path.

Each row is validated (fields, problem type, media path inside the data root), its media decoded with the training's
frame sampling (`rollplex_video_*`), and its prompt built with the model's processor, exactly as the trainer's
dataset wrapper does it (`MediaPreparer.prepare_row`), in `workers` processes. The report lists the bad rows with
their reasons, the frames, pixels per frame, visual and prompt tokens per row (with histograms), the largest prompt,
and how many prompts a `max_prompt_length` would cut. The command's exit code is 1 when a row is bad.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from rollplex_trl.data.errors import RollplexDataError, SampleLabel
from rollplex_trl.data.video import VideoSamplingConfig


@dataclass
class RowReport:
    row: int
    problem_id: Any
    media: str | None
    error: str | None = None
    frames: int = 0  # sampled frames of the row's videos
    pixels_per_frame: int = 0  # of its first video (after resizing)
    visual_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class DataReport:
    source: str
    rows: list[RowReport] = field(default_factory=list)
    max_prompt_length: int | None = None

    @property
    def bad(self) -> list[RowReport]:
        return [r for r in self.rows if r.error is not None]

    @property
    def good(self) -> list[RowReport]:
        return [r for r in self.rows if r.error is None]

    @property
    def over_budget(self) -> list[RowReport]:
        limit = self.max_prompt_length
        return [] if limit is None else [r for r in self.good if r.prompt_tokens > limit]

    def to_json(self) -> dict[str, Any]:
        largest = max(self.good, key=lambda r: r.prompt_tokens, default=None)
        return {"source": self.source, "rows": len(self.rows), "bad_rows": len(self.bad),
                "max_prompt_length": self.max_prompt_length, "over_max_prompt_length": len(self.over_budget),
                "largest_prompt": asdict(largest) if largest else None,
                "per_row": [asdict(r) for r in self.rows]}


# ---- one row (runs in a worker process) ---------------------------------------------------------------------------

_PREPARER = None


def _init_worker(model: str, sampling: dict[str, Any]) -> None:
    global _PREPARER
    from transformers import AutoProcessor

    from rollplex_trl.data.prepared import MediaOptions, MediaPreparer

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _PREPARER = MediaPreparer(AutoProcessor.from_pretrained(model),
                              MediaOptions(sampling=VideoSamplingConfig(**sampling), cache_size=0))


def _check_row(item: tuple[int, dict[str, Any]]) -> RowReport:
    from rollplex_trl.data.prepared import PREPARED_KEY, VIDEO_COLUMNS

    index, row = item
    media = row.get("video") or row.get("image")
    report = RowReport(row=index, problem_id=row.get("problem_id"), media=media)
    try:
        label = SampleLabel(f"problem_id={row.get('problem_id')!r} (row {index})")
        prepared = _PREPARER.prepare_row(dict(row), sample_id=label)
    except RollplexDataError as error:
        report.error = str(error)
        return report
    prompt = prepared[PREPARED_KEY]
    report.prompt_tokens, report.visual_tokens = prompt.num_prompt_tokens, prompt.num_visual_tokens
    if prompt.video_grid_thw is not None and any(row.get(c) for c in VIDEO_COLUMNS):
        t, h, w = (int(x) for x in prompt.video_grid_thw[0].tolist())
        patch = 14  # Qwen2.5-VL's patch size: a grid cell is 14x14 pixels
        report.frames = int(prompt.video_grid_thw[:, 0].sum()) * 2
        report.pixels_per_frame = h * w * patch * patch
    return report


# ---- the whole file -----------------------------------------------------------------------------------------------

def check_data(annotations: str | os.PathLike[str], model: str | os.PathLike[str], *,
               data_root: str | os.PathLike[str] | None = None, sampling: VideoSamplingConfig | None = None,
               max_prompt_length: int | None = None, workers: int = 1, limit: int | None = None,
               progress: bool = False) -> DataReport:
    """Check every row (the first `limit`) of a Video-R1-format file with `model`'s processor; see the module doc."""
    from rollplex_trl.data.video_r1 import read_annotation_rows, validate_rows

    sampling = sampling or VideoSamplingConfig()
    raw = read_annotation_rows(annotations)
    if not isinstance(raw, list):
        raise RollplexDataError(f"{annotations}: the top level must be a list of rows, got {type(raw).__name__}")
    raw = raw[:limit] if limit is not None else raw
    report = DataReport(source=os.fspath(annotations), max_prompt_length=max_prompt_length)
    # rows invalid as Video-R1 rows (fields, problem type, missing files, paths outside the root): the loader's check
    root = data_root if data_root is not None else os.path.dirname(os.path.abspath(annotations))
    items, invalid = validate_rows(raw, root)
    for index, reason in invalid:
        report.rows.append(RowReport(row=index, problem_id=_problem_id(raw[index]), media=None, error=reason))
    if items:
        args = (os.fspath(model), asdict(sampling))
        _init_worker(*args)  # here first: a bad model path fails with its own error, not a broken worker pool
        if workers > 1:
            with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=args) as pool:
                results: Iterable[RowReport] = pool.map(_check_row, items, chunksize=4)
                report.rows.extend(_with_progress(results, len(items), progress))
        else:
            report.rows.extend(_with_progress(map(_check_row, items), len(items), progress))
    report.rows.sort(key=lambda r: r.row)
    return report


def _problem_id(raw: Any) -> Any:
    return raw.get("problem_id") if isinstance(raw, dict) else None


def _with_progress(results: Iterable[RowReport], total: int, show: bool) -> list[RowReport]:
    if not show:
        return list(results)
    from tqdm.auto import tqdm

    return list(tqdm(results, total=total, desc="check-data", unit="row"))


def histogram(values: list[int], bins: int = 8, width: int = 40) -> list[str]:
    """A text histogram of integers: one line per bin, `low-high count bar` (both ends inclusive)."""
    if not values:
        return ["(no values)"]
    low, high = min(values), max(values)
    step = max(1, -(-(high - low + 1) // bins))  # ceil: at most `bins` bins of whole numbers
    counts = [0] * ((high - low) // step + 1)
    for v in values:
        counts[(v - low) // step] += 1
    top = max(counts)
    return [f"{low + i * step:>8}-{low + (i + 1) * step - 1:<8} {c:>6} {'#' * round(width * c / top)}"
            for i, c in enumerate(counts)]


def format_report(report: DataReport) -> str:
    good, bad = report.good, report.bad
    lines = [f"{report.source}: {len(report.rows)} rows, {len(good)} good, {len(bad)} bad"]
    for r in bad:
        lines.append(f"  BAD row {r.row} (problem_id={r.problem_id!r}): {r.error}")
    for name, key in (("frames per row", "frames"), ("visual tokens per row", "visual_tokens"),
                      ("prompt tokens per row", "prompt_tokens")):
        lines.append(f"{name}:")
        lines.extend("  " + line for line in histogram([getattr(r, key) for r in good]))
    largest = max(good, key=lambda r: r.prompt_tokens, default=None)
    if largest is not None:
        lines.append(f"largest prompt: row {largest.row} (problem_id={largest.problem_id!r}), {largest.prompt_tokens} "
                     f"tokens ({largest.visual_tokens} visual), {largest.media}")
    if report.max_prompt_length is not None:
        over = report.over_budget
        lines.append(f"max_prompt_length={report.max_prompt_length}: {len(over)} prompt(s) over it"
                     + (f" (rows {', '.join(str(r.row) for r in over[:10])})" if over else ""))
    return "\n".join(lines)
