"""Loader for Video-R1-format annotations (Video-R1-260k.json as released, or JSONL with the same fields).

A row looks like::

    {"problem_id": 2, "problem": "...", "data_type": "video", "problem_type": "multiple choice",
     "options": ["A. ...", "B. ..."], "solution": "<answer>A</answer>",
     "path": "./LLaVA-Video-178K/.../ytb_7nRmsEw7nsE.mp4", "data_source": "LLaVA-Video-178K/30_60_s_youtube_v0_1"}

The prompt is built exactly as Video-R1's ``make_conversation_image_and_video`` (``src/r1-v/src/open_r1/grpo.py`` in
tulerfeng/Video-R1 @ 59d65c3). Media paths are resolved against a data root, by default the annotation file's
folder: Video-R1 keeps ``Video-R1-260k.json`` inside ``Video-R1-data/`` and resolves ``"./X"`` as
``Video-R1-data/X``. A path that leads outside the data root (``../../x.mp4``, ``/elsewhere/x.mp4``) is refused
unless ``allow_paths_outside_root=True``: an annotation file should not make the trainer read arbitrary files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from datasets import Dataset, DatasetInfo, Features, List, Value
from datasets.table import InMemoryTable
from PIL import Image, UnidentifiedImageError

from rollplex_trl.data.errors import RollplexDataError, describe_sample
from rollplex_trl.data.rewards import ANSWER_PATTERN
from rollplex_trl.data.video import pil_to_rgb

logger = logging.getLogger(__name__)

QUESTION_TEMPLATE = (
    "{Question}\n"
    "Please think about this question as if you were a human pondering deeply. "
    "Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
    "'let's break it down', etc, or other natural language thought expressions "
    "It's encouraged to include self-reflection or verification in the reasoning process. "
    "Provide your detailed reasoning between the <think> </think> tags, and then give your final answer between the "
    "<answer> </answer> tags."
)

TYPE_TEMPLATE: dict[str, str] = {
    "multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the "
    "<answer> </answer> tags.",
    "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    "OCR": " Please transcribe text from the image/video clearly and provide your text answer within the "
    "<answer> </answer> tags.",
    "free-form": " Please provide your text answer within the <answer> </answer> tags.",
    "regression": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
}

VALID_PROBLEM_TYPES: tuple[str, ...] = tuple(TYPE_TEMPLATE)
VALID_DATA_TYPES: tuple[str, ...] = ("image", "video")
REQUIRED_FIELDS: tuple[str, ...] = ("problem_id", "problem", "data_type", "problem_type", "solution", "path")

OnInvalid = Literal["error", "skip"]

# Explicit types, so that a dataset of only videos still has a string `image` column (Arrow would infer `null`) and
# `options` stays a list of strings when every row is numerical.
_CONTENT_PART = {"type": Value("string"), "text": Value("string")}
FEATURES = Features(
    {
        "prompt": List({"role": Value("string"), "content": List(_CONTENT_PART)}),
        "problem_id": Value("int64"),
        "problem_type": Value("string"),
        "solution": Value("string"),
        "options": List(Value("string")),
        "data_type": Value("string"),
        "data_source": Value("string"),
        "video": Value("string"),
        "image": Value("string"),
    }
)


# ---------------------------------------------------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------------------------------------------------


def format_question(row: dict[str, Any]) -> str:
    """The question text: the problem, plus ``"Options:\\n"`` and one ``option + "\\n"`` per option for multiple choice.

    This is Video-R1's loop ``question += op + "\\n"``, so the options end with a newline, and the template's own
    ``"\\n"`` follows it (an empty line before the instructions). ``"\\n".join(options)`` would drop that newline.
    """
    if row["problem_type"] != "multiple choice":
        return row["problem"]
    return row["problem"] + "Options:\n" + "".join(option + "\n" for option in row["options"])


def build_prompt(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Video-R1's conversational prompt for a row: one user turn with a media placeholder and the instruction text.

    No system prompt, as in Video-R1's image+video path.
    """
    text = QUESTION_TEMPLATE.format(Question=format_question(row)) + TYPE_TEMPLATE[row["problem_type"]]
    return [{"role": "user", "content": [{"type": row["data_type"]}, {"type": "text", "text": text}]}]


# ---------------------------------------------------------------------------------------------------------------------
# Reading the annotation file
# ---------------------------------------------------------------------------------------------------------------------


def _parse_jsonl(text: str, source: Path) -> list[Any]:
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise RollplexDataError(
                f"{source}: line {line_number} is not valid JSON ({error}); fix or remove that line"
            ) from error
    return rows


def read_annotation_rows(path: str | os.PathLike[str]) -> list[Any]:
    """Read a Video-R1 annotation file: a JSON list (like Video-R1-260k.json) or JSON Lines, whatever its suffix.

    The format is chosen by content (a leading ``[`` means a JSON list), because such files are often renamed.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise RollplexDataError(f"annotation file {source} not found; check the path") from error
    except (OSError, UnicodeDecodeError) as error:
        raise RollplexDataError(f"cannot read annotation file {source} ({error}); check the file") from error
    if not text.lstrip().startswith("["):
        return _parse_jsonl(text, source)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise RollplexDataError(
            f"{source}: not valid JSON ({error}); the file must be a JSON list of rows or JSON Lines"
        ) from error
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Validating rows
# ---------------------------------------------------------------------------------------------------------------------


class _InvalidRow(Exception):
    """A row that cannot be used; ``reason`` says why and what to change."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def resolve_media_path(raw_path: str, data_root: str | os.PathLike[str]) -> str:
    """Absolute path of a row's media file.

    Absolute paths (and ``file://`` URLs) are kept; relative ones, including Video-R1's ``"./..."``, are joined to
    ``data_root``. The result is normalised but symlinks are not resolved, so paths stay the ones the user sees.
    """
    if raw_path.startswith("file://"):
        raw_path = raw_path[len("file://") :]
    if os.path.isabs(raw_path):
        return os.path.normpath(raw_path)
    return os.path.normpath(os.path.join(os.path.abspath(data_root), raw_path))


def is_inside_root(media_path: str, data_root: str | os.PathLike[str]) -> bool:
    """Whether a resolved media path (see :func:`resolve_media_path`) lies inside ``data_root``.

    Symlinks are followed, not judged: the normalised path is the one that is opened, and a link found under the
    root (say ``Video-R1-data/LLaVA-Video-178K -> /mnt/disk2/...``) is part of the root's layout, set up by whoever
    owns it, so a path through it counts as inside. What is refused is a path that leaves the root by itself
    (``..``, an absolute path elsewhere). An absolute path that reaches the root through another name (the root or
    a parent of it is a symlink) counts as inside too: both sides are compared with symlinks resolved as well.
    """
    root = os.path.normpath(os.path.abspath(data_root))
    if _is_under(os.path.normpath(media_path), root):
        return True
    return _is_under(os.path.realpath(media_path), os.path.realpath(root))


def _is_under(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives (Windows) or a mix of absolute and relative paths
        return False


def _check_field_types(raw: dict[str, Any]) -> None:
    missing = [name for name in REQUIRED_FIELDS if name not in raw]
    if missing:
        raise _InvalidRow(f"missing required field(s) {missing}; every row needs {list(REQUIRED_FIELDS)}")
    if not isinstance(raw["problem_id"], int) or isinstance(raw["problem_id"], bool):
        raise _InvalidRow(f"problem_id must be an integer, got {raw['problem_id']!r}")
    for name in ("problem", "solution", "path"):
        if not isinstance(raw[name], str):
            raise _InvalidRow(f"field {name!r} must be a string, got {type(raw[name]).__name__}")
    if raw["problem_type"] not in VALID_PROBLEM_TYPES:
        raise _InvalidRow(f"unknown problem_type {raw['problem_type']!r}; expected one of {list(VALID_PROBLEM_TYPES)}")
    if raw["data_type"] not in VALID_DATA_TYPES:
        raise _InvalidRow(f"unknown data_type {raw['data_type']!r}; expected one of {list(VALID_DATA_TYPES)}")


def _check_options(raw: dict[str, Any]) -> list[str]:
    options = raw.get("options")
    if options is None:  # Video-R1 reads options only for multiple choice; other rows may omit them or carry null
        options = []
    if not isinstance(options, list) or not all(isinstance(option, str) for option in options):
        raise _InvalidRow(f"options must be a list of strings, got {options!r}")
    if raw["problem_type"] == "multiple choice" and not options:
        raise _InvalidRow("a multiple choice row needs a non-empty options list")
    return options


def _validate_row(raw: Any, data_root: str, check_files: bool, allow_outside_root: bool) -> dict[str, Any]:
    """Turn an annotation row into a dataset row, or raise :class:`_InvalidRow`."""
    if not isinstance(raw, dict):
        raise _InvalidRow(f"a row must be a JSON object, got {type(raw).__name__}")
    _check_field_types(raw)
    options = _check_options(raw)
    if not ANSWER_PATTERN.search(raw["solution"]):
        raise _InvalidRow(
            f"solution {raw['solution']!r} has no <answer>...</answer> tag, so every completion would score 0"
        )
    data_source = raw.get("data_source", "")
    if not isinstance(data_source, str):
        raise _InvalidRow(f"data_source must be a string, got {data_source!r}")
    media_path = resolve_media_path(raw["path"], data_root)
    if not allow_outside_root and not is_inside_root(media_path, data_root):
        raise _InvalidRow(
            f"path {raw['path']!r} leads to {media_path}, outside the data root {data_root}; fix the path or the "
            "data root, or pass allow_paths_outside_root=True to load_video_r1 to read files outside it"
        )
    if check_files and not os.path.isfile(media_path):
        raise _InvalidRow(
            f"{raw['data_type']} file {media_path} not found (path {raw['path']!r} resolved against data root "
            f"{data_root}); check the path / data_root"
        )
    row = {
        "problem_id": raw["problem_id"],
        "problem": raw["problem"],
        "problem_type": raw["problem_type"],
        "data_type": raw["data_type"],
        "options": options,
    }
    return {
        "prompt": build_prompt(row),
        "problem_id": raw["problem_id"],
        "problem_type": raw["problem_type"],
        "solution": raw["solution"],
        "options": options,
        "data_type": raw["data_type"],
        "data_source": data_source,
        "video": media_path if raw["data_type"] == "video" else None,
        "image": media_path if raw["data_type"] == "image" else None,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Public loaders
# ---------------------------------------------------------------------------------------------------------------------


def validate_rows(raw_rows: list[Any], data_root: str | os.PathLike[str], *, check_files: bool = True,
                  allow_paths_outside_root: bool = False) -> tuple[list[tuple[int, dict[str, Any]]],
                                                                    list[tuple[int, str]]]:
    """Each annotation row checked as the loader checks it: ((index, training row) for the valid ones,
    (index, reason) for the others)."""
    root = os.path.abspath(data_root)
    valid, invalid = [], []
    for index, raw in enumerate(raw_rows):
        try:
            valid.append((index, _validate_row(raw, root, check_files, allow_paths_outside_root)))
        except _InvalidRow as error:
            invalid.append((index, error.reason))
    return valid, invalid


@dataclass
class LoadReport:
    """What :func:`load_video_r1_with_report` kept and dropped.

    Attributes:
        source: the annotation file.
        num_rows: rows in the returned dataset.
        skipped: ``(problem_id, reason)`` for each dropped row (problem_id is ``None`` if the row had none).
    """

    source: str
    num_rows: int
    skipped: list[tuple[Any, str]] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        """Rows dropped because they were invalid."""
        return len(self.skipped)


def _columns(rows: Iterable[dict[str, Any]]) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {name: [] for name in FEATURES}
    for row in rows:
        for name, values in columns.items():
            values.append(row[name])
    return columns


def load_video_r1_with_report(
    path: str | os.PathLike[str],
    data_root: str | os.PathLike[str] | None = None,
    *,
    on_invalid: OnInvalid = "error",
    check_files: bool = True,
    allow_paths_outside_root: bool = False,
) -> tuple[Dataset, LoadReport]:
    """Load a Video-R1-format annotation file into a TRL-ready dataset, and report the rows that were dropped.

    Args:
        path: the annotation file (JSON list or JSON Lines).
        data_root: folder that relative media paths are resolved against; defaults to the annotation file's folder.
        on_invalid: ``"error"`` raises on the first invalid row; ``"skip"`` drops invalid rows and reports them.
        check_files: check that every media file exists (one ``stat`` per row).
        allow_paths_outside_root: read media whose path leads outside ``data_root`` (``../x``, an absolute path
            elsewhere); such rows are invalid by default. Symlinks under the root are followed either way (see
            :func:`is_inside_root`).

    Returns:
        The dataset, with columns ``prompt, problem_id, problem_type, solution, options, data_type, data_source,
        video, image`` (``video``/``image`` hold the absolute media path, ``None`` for the other kind), and the report.

    Raises:
        RollplexDataError: the file cannot be read, a row is invalid (with ``on_invalid="error"``), or no row is left.
    """
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    source = Path(path)
    root = os.path.abspath(data_root if data_root is not None else source.parent)
    raw_rows = read_annotation_rows(source)
    if not isinstance(raw_rows, list):
        raise RollplexDataError(f"{source}: the top level must be a list of rows, got {type(raw_rows).__name__}")

    rows, skipped = [], []
    for row_index, raw in enumerate(raw_rows):
        problem_id = raw.get("problem_id") if isinstance(raw, dict) else None
        try:
            rows.append(_validate_row(raw, root, check_files, allow_paths_outside_root))
        except _InvalidRow as invalid:
            if on_invalid == "error":
                raise RollplexDataError(
                    f"{source}: {describe_sample(problem_id, row_index)}: {invalid.reason}. Fix or remove the row, "
                    f"or pass on_invalid='skip' to drop invalid rows"
                ) from None
            skipped.append((problem_id, f"row {row_index}: {invalid.reason}"))

    if not rows:
        detail = f"; all {len(skipped)} rows were invalid, first: {skipped[0][1]}" if skipped else ""
        raise RollplexDataError(f"no usable rows in {source} (data root {root}){detail}. Check the file and data_root")
    report = LoadReport(source=str(source), num_rows=len(rows), skipped=skipped)
    # Straight to Arrow with the schema: Dataset.from_dict(features=...) re-encodes every nested value in Python,
    # which takes 12 s instead of 3.5 s for the 260k rows of Video-R1-260k.
    table = InMemoryTable.from_pydict(_columns(rows), schema=FEATURES.arrow_schema)
    return Dataset(table, info=DatasetInfo(features=FEATURES)), report


def load_video_r1(
    path: str | os.PathLike[str],
    data_root: str | os.PathLike[str] | None = None,
    *,
    on_invalid: OnInvalid = "error",
    check_files: bool = True,
    allow_paths_outside_root: bool = False,
) -> Dataset:
    """Load a Video-R1-format annotation file; like :func:`load_video_r1_with_report`, logging a warning on skips."""
    dataset, report = load_video_r1_with_report(
        path, data_root, on_invalid=on_invalid, check_files=check_files,
        allow_paths_outside_root=allow_paths_outside_root,
    )
    if report.num_skipped:
        first_problem_id, first_reason = report.skipped[0]
        logger.warning(
            "%s: skipped %d invalid row(s), kept %d; first: %s, %s",
            report.source,
            report.num_skipped,
            report.num_rows,
            describe_sample(first_problem_id),
            first_reason,
        )
    return dataset


def load_image(path: str | os.PathLike[str], sample_id: object = None) -> Image.Image:
    """Open an image file as RGB (transparent pixels become white, as qwen-vl-utils' ``to_rgb``).

    Raises:
        RollplexDataError: the file is missing or is not a readable image; the message names the sample and file.
    """
    path_str = os.fspath(path)
    where = f"{describe_sample(sample_id)}, image {path_str!r}"
    if not os.path.isfile(path_str):
        raise RollplexDataError(f"{where}: file not found; check the path / data root", skippable=True)
    try:
        with Image.open(path_str) as image:
            image.load()
            return pil_to_rgb(image)
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise RollplexDataError(
            f"{where}: cannot read the image ({type(error).__name__}: {error}); replace the file", skippable=True
        ) from error
