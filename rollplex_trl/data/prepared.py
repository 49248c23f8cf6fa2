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
file, or, with `skip_invalid=True`, are replaced by a valid row drawn at random (seeded by the row index, so the same
in every run and on every process) and counted in `num_skipped`. When more than `max_skipped_fraction` of the rows
read are invalid, training stops: a dataset that broken more likely has a wrong data root, path or format.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from rollplex_trl.data.errors import RollplexDataError, SampleLabel
from rollplex_trl.data.prompt import content_key, prepare_prompt
from rollplex_trl.data.video import SampledVideo, VideoSamplingConfig, frames_to_video, load_video, probe_video
from rollplex_trl.models.families import frame_factor

logger = logging.getLogger(__name__)

VIDEO_COLUMNS = ("video", "videos")
IMAGE_COLUMNS = ("image", "images")
PREPARED_KEY = "rollplex_prompt"

# Seeds the choice of a stand-in for an invalid row. Fixed, so that a row gets the same stand-in in every run and on
# every process, whatever the order rows are read in; a private `random.Random` leaves the global RNGs alone.
_STAND_IN_SEED = "rollplex-stand-in"
# Random draws (with replacement) for a stand-in before falling back to a seeded permutation of all rows, which only
# a dataset that is almost entirely invalid needs (and which ends, unlike drawing, when no row is valid).
_MAX_STAND_IN_DRAWS = 64
# The skipped fraction is compared with `max_skipped_fraction` only once this many rows were read (or every row of a
# smaller dataset): before that, one bad file among the first few rows would read as a broken dataset.
MIN_ROWS_FOR_SKIPPED_FRACTION = 20
_LISTED_SKIPS = 5  # skipped samples quoted in the error that stops training


@dataclass
class MediaOptions:
    """How the wrapper turns a row's media into model inputs."""

    sampling: VideoSamplingConfig
    max_prompt_length: int | None = None
    skip_invalid: bool = False
    # with skip_invalid: the largest fraction of rows read that may be invalid before training stops
    max_skipped_fraction: float = 0.05
    cache_size: int = 64
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


def has_column(dataset: Any, columns: tuple[str, ...]) -> bool:
    """True when the dataset declares one of `columns` (datasets.Dataset) or its first row has one."""
    names = getattr(dataset, "column_names", None)
    if names is None:
        try:
            first = dataset[0] if hasattr(dataset, "__getitem__") else next(iter(dataset))  # a stream: peek a row
        except (IndexError, KeyError, StopIteration):  # empty: TRL reports it; any other error is raised
            return False
        if not isinstance(first, Mapping):  # not rows of columns: TRL refuses it with its own message
            return False
        names = list(first.keys())
    return any(c in names for c in columns)


def has_video_column(dataset: Any) -> bool:
    return has_column(dataset, VIDEO_COLUMNS)


def _first_rows(dataset: Any, rows: int, *, streams: bool) -> list[dict] | None:
    """The first `rows` rows of a map-style dataset (a `datasets.IterableDataset`'s through `take` if `streams`);
    None for anything else (a plain torch IterableDataset, which TRL refuses itself)."""
    import datasets
    import torch.utils.data

    if dataset is None:
        return None
    if isinstance(dataset, datasets.IterableDataset):  # (a torch IterableDataset subclass too)
        return list(dataset.take(rows)) if streams else None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        first = [dataset[i] for i in range(min(rows, len(dataset)))]
    except (TypeError, NotImplementedError, KeyError, IndexError):
        return None
    return first if all(isinstance(row, Mapping) for row in first) else None


def check_prompt_format(dataset: Any, name: str, rows: int = 4) -> None:
    """Before any model loads: a row with a video or image but a plain-string prompt cannot carry the media (the
    chat template has nowhere to put it), and fails only at the first training step otherwise. Checks the first
    `rows` rows of a map-style dataset (or a stream's, through `take`)."""
    first = _first_rows(dataset, rows, streams=True)
    if not first:
        return
    for index, row in enumerate(first):
        media = [c for c in (*VIDEO_COLUMNS, *IMAGE_COLUMNS) if row.get(c) is not None]
        if media and isinstance(row.get("prompt"), str):
            raise ValueError(
                f"the {name} dataset's {_sample_id(row, index)} has a '{media[0]}' but its prompt is a plain string: "
                "a prompt with media must be conversational, e.g. "
                "[{'role': 'user', 'content': [{'type': 'video'}, {'type': 'text', 'text': 'What happens?'}]}] "
                "(one {'type': 'video'} or {'type': 'image'} entry per item, where it belongs in the text; "
                "docs/video-data.md).")


def check_first_media(dataset: Any, name: str, sampling: VideoSamplingConfig, rows: int) -> None:
    """Before any model loads: open the media files of the first `rows` rows (videos: container and stream
    metadata, no frames decoded; images: loaded), so a missing or unreadable file raises `RollplexDataError` naming
    the sample and the file now, not at the first training step. Files only: in-memory frames and images were
    already loaded by the caller. Map-style datasets only: a stream's rows are read when training reads them."""
    first = _first_rows(dataset, rows, streams=False) if rows > 0 else None
    if not first:
        return
    from rollplex_trl.data.video_r1 import load_image

    for index, row in enumerate(first):
        label = _sample_id(row, index)
        for value in _as_list(row, VIDEO_COLUMNS):
            if isinstance(value, (str, os.PathLike)):
                probe_video(str(value), sampling, sample_id=label)
        for value in _as_list(row, IMAGE_COLUMNS):
            if isinstance(value, (str, os.PathLike)):
                load_image(str(value), sample_id=label)


def first_video_rows(dataset: Any, rows: int) -> list[tuple[int, dict]]:
    """(index, row) of the rows with a video among the first `rows` rows of a map-style dataset. (Image rows may
    take TRL's own path, which this package's preparation does not stand for: they are left to it.)"""
    first = _first_rows(dataset, rows, streams=False) if rows > 0 else None
    return [(index, row) for index, row in enumerate(first or [])
            if any(row.get(column) is not None for column in VIDEO_COLUMNS)]


def check_first_prompts(media_rows: list[tuple[int, dict]], name: str, processor: Any, options: MediaOptions,
                        rows: int) -> None:
    """Before any model loads: run a dataset's first video rows (:func:`first_video_rows`) through the training's
    own preparation (frames decoded, chat template, processor, the `rollplex_max_prompt_length` budget), so a prompt
    over budget, a frame the processor rejects or a media placeholder that does not match the files is reported at
    start-up, naming the sample, instead of at the first step."""
    preparer = MediaPreparer(processor, replace(options, cache_size=0))
    for index, row in media_rows:
        try:
            preparer.prepare_row(dict(row), sample_id=_sample_id(row, index))
        except RollplexDataError as error:
            raise RollplexDataError(f"{error} (found at start-up, in the {name} dataset's first {rows} rows: "
                                    "rollplex_check_rows)") from error


def _sample_id(row: dict, index: int) -> SampleLabel:
    """How messages name a row, e.g. `problem_id=100 (row 0)` (they read `sample problem_id=100 (row 0): ...`)."""
    for key in ("problem_id", "id", "sample_id"):
        if row.get(key) is not None:
            return SampleLabel(f"{key}={row[key]!r} (row {index})")
    return SampleLabel(f"row {index}")


def _skip_reason(error: RollplexDataError) -> str:
    """The error without its advice to enable skipping, which is already on where this is recorded."""
    return getattr(error, "reason", str(error))


def _check_skipped_fraction(skipped: dict, rows_read: int, options: MediaOptions, total: int | None) -> None:
    """Stop once more than `options.max_skipped_fraction` of the dataset is known to be invalid.

    `total` is the dataset's length: then the invalid rows found must exceed the limit times `total`, which is
    certain, not an estimate (a sample of the first rows read would stop a run with 3% bad rows at a 5% limit now
    and then). A stream's length is unknown (None): its fraction among the `rows_read` distinct rows is judged from
    `MIN_ROWS_FOR_SKIPPED_FRACTION` rows on.
    """
    limit = options.max_skipped_fraction
    if total is not None:
        exceeded = len(skipped) > limit * total
    else:
        exceeded = rows_read >= MIN_ROWS_FOR_SKIPPED_FRACTION and len(skipped) > limit * rows_read
    if not exceeded:
        return
    listed = "\n  ".join(list(skipped.values())[:_LISTED_SKIPS])
    of_what = f"the {total} samples of the dataset" if total is not None else f"the {rows_read} samples read so far"
    raise RollplexDataError(
        f"{len(skipped)} of {of_what} are invalid ({'at least ' if total is not None else ''}"
        f"{len(skipped) / (total or rows_read):.0%}), more "
        f"than rollplex_max_skipped_fraction={limit} allows; so many usually means a wrong data root, path or format "
        f"rather than a few broken files. The first skipped samples:\n  {listed}\nFix the data, or raise "
        "rollplex_max_skipped_fraction (1.0 never stops) to train on the valid samples anyway."
    )


def _all_invalid_error(what: str, skipped: dict) -> RollplexDataError:
    listed = "\n  ".join(list(skipped.values())[:_LISTED_SKIPS])
    return RollplexDataError(
        f"{what} invalid, so rollplex_skip_invalid_samples has no valid sample to stand in for them. The first "
        f"problems:\n  {listed}\nCheck the data root and the media paths."
    )


class MediaPreparer:
    """Turns one dataset row into a prepared row: media loaded once, processor run once, budget checked."""

    def __init__(self, processor, options: MediaOptions) -> None:
        self.processor = processor
        factor = frame_factor(processor)  # frames at the multiple the model patches (28 Qwen2.5-VL, 32 Qwen3-VL)
        if factor is not None and factor != options.sampling.image_factor:
            options = replace(options, sampling=replace(options.sampling, image_factor=factor))
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
                "budget, lower rollplex_video_max_frames / rollplex_video_max_pixels",
                skippable=True,
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
            raise RollplexDataError(f"sample {sample_id}: the image column is empty for this row; fill it",
                                    skippable=True)
        return value


class _SkipCounts:
    """What both row sources report about skipped rows: `skipped` (row -> reason) and `_valid` (valid rows read)."""

    skipped: dict
    _valid: set

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def skipped_fraction(self) -> float:
        """Invalid rows among the distinct rows read so far (0.0 before any row was read)."""
        rows_read = len(self._valid) + len(self.skipped)
        return len(self.skipped) / rows_read if rows_read else 0.0


class PreparedPromptDataset(_SkipCounts, torch.utils.data.Dataset):
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
        self._valid: set[int] = set()  # rows read and found valid (with `skipped`: every distinct row read)
        self.skipped: dict[int, str] = {}  # invalid row -> reason

    def __len__(self) -> int:
        return len(self.base)

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
        if index in self._substitute:  # read before (its row left the cache): the same stand-in again
            return self._prepare(self._substitute[index])
        row = self._try_prepare(index)
        if row is not None:
            return row
        # The first valid row among seeded random draws is uniform over the valid rows: each stand-in is drawn
        # independently, so a block of invalid rows spreads over the dataset instead of repeating its next row.
        for candidate in self._stand_in_candidates(index):
            row = self._try_prepare(candidate)
            if row is not None:
                self._substitute[index] = candidate
                return row
        raise _all_invalid_error(f"all {len(self.base)} samples are", self.skipped)

    def _stand_in_candidates(self, index: int):
        """Rows to try, in order, as the stand-in for invalid row `index`: the same sequence in every run."""
        n = len(self.base)
        rng = random.Random(f"{_STAND_IN_SEED}:{index}")  # str seeds are hashed with SHA-512: stable across runs
        for _ in range(_MAX_STAND_IN_DRAWS):
            yield rng.randrange(n)
        order = list(range(n))
        rng.shuffle(order)
        yield from order

    def _try_prepare(self, index: int) -> dict | None:
        """The prepared row, or None for an invalid row (recorded in `skipped`, counted against the limit)."""
        if index in self.skipped:
            return None
        try:
            row = self._prepare(index)
        except RollplexDataError as err:
            self.skipped[index] = _skip_reason(err)
            logger.warning("skipping invalid sample (%d skipped so far): %s", len(self.skipped), _skip_reason(err))
            row = None
        else:
            self._valid.add(index)
        _check_skipped_fraction(self.skipped, len(self._valid) + len(self.skipped), self.options, len(self.base))
        return row

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


class StreamPreparer(_SkipCounts):
    """Prepares the rows of a generation batch read from an iterable (streaming) `datasets.IterableDataset`.

    TRL reorders a stream itself (`repeat_iterable_dataset`: each prompt G times in a row, generation batches
    repeated), so no map-style wrapper can sit in front of it; the rows are prepared when a generation batch reaches
    the trainer. Identical rows share one prepared row (media decoded once per prompt), and an LRU of recent rows
    serves the repeats of later steps. With `skip_invalid`, an invalid prompt's rows are replaced by the rows of a
    valid prompt drawn at random (seeded by the row's content) from the same batch, or, when the whole batch is
    invalid, from the recently prepared prompts (group structure kept), and counted; otherwise the error names the
    sample. The skipped fraction is checked against `max_skipped_fraction` as for map-style datasets, from
    `MIN_ROWS_FOR_SKIPPED_FRACTION` distinct rows on (a stream's length is unknown).
    """

    def __init__(self, preparer: MediaPreparer, options: MediaOptions) -> None:
        self.preparer = preparer
        self.options = options
        self._cache: OrderedDict[tuple, dict] = OrderedDict()
        self._valid: set[str] = set()  # digests of the distinct valid rows read (keys would hold every prompt)
        self.skipped: dict[tuple, str] = {}

    def prepare_batch(self, rows: list[dict]) -> list[dict]:
        keys = [content_key(row) for row in rows]  # the G repeats arrive as separate, equal dicts
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
                self.skipped[key] = _skip_reason(err)
                logger.warning("skipping invalid sample (%d skipped so far): %s", len(self.skipped), _skip_reason(err))
            else:
                self._valid.add(_key_digest(key))
                self._cache[key] = ready[key]
                while len(self._cache) > max(1, self.options.cache_size):
                    self._cache.popitem(last=False)
            _check_skipped_fraction(self.skipped, len(self._valid) + len(self.skipped), self.options, None)
        invalid = list(dict.fromkeys(k for k in keys if k not in ready))
        if invalid:
            ready.update(self._stand_ins(invalid, ready))
        # a shallow copy per row (TRL adds nothing to rows, but callers may); the PreparedPrompt itself is shared
        return [dict(ready[key]) for key in keys]

    def _stand_ins(self, invalid: list[tuple], ready: dict[tuple, dict]) -> dict[tuple, dict]:
        """A valid prepared row for each invalid key, drawn uniformly from the batch's valid prompts (or, if it has
        none, from the cached ones); seeded by the key's content, so a row gets the same stand-in in every run."""
        pool = list(ready.values()) or list(self._cache.values())
        if not pool:
            raise _all_invalid_error("all prompts of this generation batch are", {k: self.skipped[k] for k in invalid})
        return {key: pool[random.Random(f"{_STAND_IN_SEED}:{_key_digest(key)}").randrange(len(pool))]
                for key in invalid}


def _stream_sample_id(row: dict) -> SampleLabel:
    for key in ("problem_id", "id", "sample_id"):
        if row.get(key) is not None:
            return SampleLabel(f"{key}={row[key]!r} (streamed)")
    return SampleLabel("without problem_id/id (streamed)")


def _key_digest(key: tuple) -> str:
    """A digest of a content key that is the same in every process (`hash()` of strings is salted per process)."""
    return hashlib.sha1(repr(key).encode()).hexdigest()
