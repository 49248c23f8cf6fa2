"""`PreparedPromptDataset`: decodes a row's media and runs the processor when the row is read.

The wrapper sits between the user's dataset (TRL format: a conversational `prompt` plus `video`/`videos` and
`image`/`images` columns) and TRL's dataloader. Reading a row:
1. loads its videos (file paths are decoded with PyAV and sampled the way qwen-vl-utils does; lists of frames are
   taken as already sampled) and its images;
2. runs the chat template and the processor once (`prepare_prompt`), checks the prompt-token budget;
3. returns the row with a `rollplex_prompt` entry and without the image columns, so TRL's image-only code paths
   stay out of the way and the reward functions still see every other column (the `video` path included).
TRL's sampler yields each prompt G times in a row and repeats generation batches, so prepared rows are cached.

Invalid rows (missing/undecodable media, over-budget prompts) raise a `RollplexDataError` naming the sample and the
file, or, with `skip_invalid=True`, are replaced by the next valid row and counted in `num_skipped`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollplex_trl.data.errors import RollplexDataError
from rollplex_trl.data.video import SampledVideo, VideoSamplingConfig, frames_to_video, load_video
from rollplex_trl.multimodal.prompt import prepare_prompt

logger = logging.getLogger(__name__)

VIDEO_COLUMNS = ("video", "videos")
IMAGE_COLUMNS = ("image", "images")
PREPARED_KEY = "rollplex_prompt"


@dataclass
class MediaOptions:
    """How the wrapper turns a row's media into model inputs."""

    sampling: VideoSamplingConfig
    max_prompt_length: int | None = None
    skip_invalid: bool = False
    cache_size: int = 64
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


def has_column(dataset: Any, columns: tuple[str, ...]) -> bool:
    """True when the dataset declares one of `columns` (datasets.Dataset) or its first row has one."""
    names = getattr(dataset, "column_names", None)
    if names is None:
        try:
            first = dataset[0] if hasattr(dataset, "__getitem__") else next(iter(dataset))  # a stream: peek a row
            names = list(first.keys())
        except Exception:  # an empty or unreadable dataset is reported elsewhere
            return False
    return any(c in names for c in columns)


def has_video_column(dataset: Any) -> bool:
    return has_column(dataset, VIDEO_COLUMNS)


def _sample_id(row: dict, index: int) -> str:
    for key in ("problem_id", "id", "sample_id"):
        if row.get(key) is not None:
            return f"{row[key]} (row {index})"
    return f"row {index}"


class MediaPreparer:
    """Turns one dataset row into a prepared row: media loaded once, processor run once, budget checked."""

    def __init__(self, processor, options: MediaOptions) -> None:
        self.processor = processor
        self.options = options

    def prepare_row(self, row: dict, sample_id: str) -> dict:
        """`row` (a copy the caller owns) with a `PreparedPrompt` under `rollplex_prompt`, without image columns."""
        videos = [self._load_video(v, sample_id) for v in _as_list(row, VIDEO_COLUMNS)]
        images = [self._load_image(im, sample_id) for im in _as_list(row, IMAGE_COLUMNS)]
        if "prompt" not in row:
            raise RollplexDataError(f"sample {sample_id}: the row has no `prompt` column")
        prepared = prepare_prompt(
            self.processor, row["prompt"], sample_id=sample_id, images=images, videos=videos,
            chat_template=self.options.chat_template, chat_template_kwargs=self.options.chat_template_kwargs,
            video_pixel_bounds=(self.options.sampling.min_pixels, self.options.sampling.max_pixels),
        )
        budget = self.options.max_prompt_length
        if budget is not None and prepared.num_prompt_tokens > budget:
            raise RollplexDataError(
                f"{prepared.describe()}: the prompt has {prepared.num_prompt_tokens} tokens "
                f"({prepared.num_visual_tokens} of them visual), over rollplex_max_prompt_length={budget}. Raise the "
                "budget, lower rollplex_video_max_frames / rollplex_video_max_pixels, or set "
                "rollplex_skip_invalid_samples=True to skip such samples."
            )
        # TRL treats `image`/`images` columns as its own image inputs: remove them (the pixels are in the prepared
        # prompt). `video`/`videos` stay, so reward functions still see which file a completion answered.
        for col in IMAGE_COLUMNS:
            row.pop(col, None)
        row[PREPARED_KEY] = prepared
        return row

    def _load_video(self, value: Any, sample_id: str) -> SampledVideo:
        if isinstance(value, SampledVideo):
            return value
        if isinstance(value, (str, os.PathLike)):
            return load_video(str(value), self.options.sampling, sample_id=sample_id)
        # A list of frames (PIL images / arrays) or a frame tensor: already sampled, at the configured fps.
        return frames_to_video(value, self.options.sampling.fps, self.options.sampling, sample_id=sample_id)

    def _load_image(self, value: Any, sample_id: str):
        if isinstance(value, (str, os.PathLike)):
            from rollplex_trl.data.video_r1 import load_image

            return load_image(str(value), sample_id=sample_id)
        if value is None:
            raise RollplexDataError(f"sample {sample_id}: the image column is empty for this row")
        return value


class PreparedPromptDataset(torch.utils.data.Dataset):
    """Map-style dataset that returns rows with a `PreparedPrompt` under `rollplex_prompt`."""

    preparer_cls: type[MediaPreparer] = MediaPreparer

    def __init__(self, base: Sequence, processor, options: MediaOptions) -> None:
        if len(base) == 0:
            raise RollplexDataError("the dataset is empty: there is nothing to train on. Check the annotation file "
                                    "and the data root, or whether every sample was filtered out.")
        self.base = base
        self.processor = processor
        self.options = options
        self.preparer = self.preparer_cls(processor, options)
        self._cache: OrderedDict[int, dict] = OrderedDict()
        self._substitute: dict[int, int] = {}  # invalid row -> the valid row that stands in for it
        self.skipped: dict[int, str] = {}  # invalid row -> reason

    def __len__(self) -> int:
        return len(self.base)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        row = self._read_valid(index)
        if self.options.cache_size > 0:
            self._cache[index] = row
            while len(self._cache) > self.options.cache_size:
                self._cache.popitem(last=False)
        return row

    def _read_valid(self, index: int) -> dict:
        if not self.options.skip_invalid:
            return self._prepare(index)
        n = len(self.base)
        candidate = self._substitute.get(index, index)
        for _ in range(n):
            if candidate in self.skipped:
                candidate = (candidate + 1) % n
                continue
            try:
                row = self._prepare(candidate)
            except RollplexDataError as err:
                self.skipped[candidate] = str(err)
                logger.warning("skipping invalid sample (%d skipped so far): %s", len(self.skipped), err)
                candidate = (candidate + 1) % n
                continue
            self._substitute[index] = candidate
            return row
        raise RollplexDataError(f"every one of the {n} samples is invalid; the first problem: "
                                f"{next(iter(self.skipped.values()))}")

    def _prepare(self, index: int) -> dict:
        row = dict(self.base[index])
        return self.preparer.prepare_row(row, _sample_id(row, index))


def _as_list(row: dict, columns: tuple[str, str]) -> list:
    """Media of a row: the single column (`video`/`image`) or the list column (`videos`/`images`)."""
    single, many = columns
    items: list = []
    if row.get(single) is not None:
        value = row[single]
        # A video given as a list of frames is one video, not several.
        items.append(value)
    if row.get(many) is not None:
        items.extend(row[many])
    return items


class StreamPreparer:
    """Prepares the rows of a generation batch read from an iterable (streaming) `datasets.IterableDataset`.

    TRL reorders a stream itself (`repeat_iterable_dataset`: each prompt G times in a row, generation batches
    repeated), so no map-style wrapper can sit in front of it; the rows are prepared when a generation batch reaches
    the trainer. Identical rows share one prepared row (media decoded once per prompt), and an LRU of recent rows
    serves the repeats of later steps. With `skip_invalid`, an invalid prompt's rows are replaced by the rows of a
    valid prompt of the same batch (group structure kept) and counted; otherwise the error names the sample.
    """

    def __init__(self, preparer: MediaPreparer, options: MediaOptions) -> None:
        self.preparer = preparer
        self.options = options
        self._cache: OrderedDict[tuple, dict] = OrderedDict()
        self.skipped: dict[tuple, str] = {}

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def prepare_batch(self, rows: list[dict]) -> list[dict]:
        keys = [_row_key(row) for row in rows]
        ready: dict[tuple, dict] = {}
        for key, row in zip(keys, rows):
            if key in ready or key in self.skipped:
                continue
            if key in self._cache:
                self._cache.move_to_end(key)
                ready[key] = self._cache[key]
                continue
            try:
                ready[key] = self.preparer.prepare_row(dict(row), _stream_sample_id(row))
            except RollplexDataError as err:
                if not self.options.skip_invalid:
                    raise
                self.skipped[key] = str(err)
                logger.warning("skipping invalid sample (%d skipped so far): %s", len(self.skipped), err)
                continue
            self._cache[key] = ready[key]
            while len(self._cache) > max(1, self.options.cache_size):
                self._cache.popitem(last=False)
        valid = list(ready)
        if not valid:
            raise RollplexDataError(f"every sample of this generation batch is invalid; the first problem: "
                                    f"{self.skipped[keys[0]]}")
        invalid = list(dict.fromkeys(k for k in keys if k not in ready))
        stand_in = {key: valid[i % len(valid)] for i, key in enumerate(invalid)}
        # a shallow copy per row (TRL adds nothing to rows, but callers may); the PreparedPrompt itself is shared
        return [dict(ready[stand_in.get(key, key)]) for key in keys]


def _stream_sample_id(row: dict) -> str:
    for key in ("problem_id", "id", "sample_id"):
        if row.get(key) is not None:
            return f"{row[key]} (streamed)"
    return "a streamed row (no problem_id/id column)"


def _row_key(row: dict) -> tuple:
    """Content identity of a streamed row: the G repeats of a prompt arrive as separate, equal dicts."""
    return content_key(row)


def content_key(value: Any) -> Any:
    """A hashable key equal for equal content: nested dicts/lists by value, images and arrays by a digest of their
    bytes (the G copies of a prompt are separate objects after TRL's repeat and arrow round trips)."""
    if value is None or isinstance(value, (str, int, float, bool, bytes)):
        return value
    if isinstance(value, dict):
        return tuple(sorted((str(k), content_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(content_key(v) for v in value)
    if hasattr(value, "tobytes"):  # PIL images, numpy arrays: by content
        shape = getattr(value, "shape", getattr(value, "size", ""))
        return ("bytes", hashlib.sha1(value.tobytes()).hexdigest(), str(shape))
    if isinstance(value, torch.Tensor):
        return content_key(value.numpy())
    return repr(value)
