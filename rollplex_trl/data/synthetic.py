"""A built-in synthetic video task with verifiable answers, written as real MP4 files in Video-R1 format.

Each sample is a short clip of filled circles and squares in a few named colours on a black background:

- ``count``: "How many red objects are in the video?" (numerical) — static objects, some in distractor colours;
- ``direction``: "In which direction does the blue object move?" (multiple choice: left/right/up/down);
- ``first_appeared``: "What colour is the object that appears first?" (multiple choice over colours) — objects
  appear at different frames and stay;
- ``left_right``: "Does the blue square move left or right?" (multiple choice: A. left / B. right) — one object
  slides along a row in whole-pixel steps. It needs the frames in order: a left clip played backwards is exactly a
  right clip, so one frame or the shuffled frames do not reveal the answer. Not in the default mix (``DEFAULT_TASKS``).

``split`` picks the train or the held-out split: the held-out samples come from other random streams (seeds), and
``left_right`` scenes are also disjoint by content (each scene, whatever its direction, belongs to one split only).

Objects sit in distinct cells of a grid with gaps of at least one radius, so they never touch and a colour threshold
plus connected components recovers the answer from the pixels (the tests do exactly that).

:func:`write_synthetic_video_dataset` writes ``videos/*.mp4`` and ``annotations.jsonl`` (the Video-R1 fields), so the
same loader (:func:`rollplex_trl.data.video_r1.load_video_r1`) reads it and the real Video-R1 data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import av
import numpy as np

logger = logging.getLogger(__name__)

TASKS: tuple[str, ...] = ("count", "direction", "first_appeared", "left_right")
# The mix a config without ``tasks`` generates (the one the main job has always trained on).
DEFAULT_TASKS: tuple[str, ...] = ("count", "direction", "first_appeared")
SPLITS: tuple[str, ...] = ("train", "heldout")

# Saturated colours far apart in RGB, so that they stay separable after 4:2:0 chroma subsampling.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (25, 200, 25),
    "blue": (40, 70, 240),
    "yellow": (240, 225, 30),
    "white": (240, 240, 240),
}
BACKGROUND: tuple[int, int, int] = (0, 0, 0)
SHAPES: tuple[str, ...] = ("circle", "square")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
DIRECTION_OPTIONS: list[str] = ["A. left", "B. right", "C. up", "D. down"]
LEFT_RIGHT: tuple[str, ...] = ("left", "right")
LEFT_RIGHT_OPTIONS: list[str] = ["A. left", "B. right"]
# One left_right scene in HELDOUT_BUCKETS goes to the held-out split (by a hash of the scene), the others to train.
HELDOUT_BUCKETS = 4
# Extra entropy word of the held-out split's random streams: (seed, index, HELDOUT_STREAM) vs (seed, index) for train.
HELDOUT_STREAM = 0x4E1D
OPTION_LETTERS = "ABCDEFGH"

ANNOTATIONS_NAME = "annotations.jsonl"
MANIFEST_NAME = "manifest.json"
VIDEOS_DIR = "videos"
# Bump when the rendering or the annotation format changes, so that existing datasets are rebuilt.
FORMAT_VERSION = 2

MAX_COUNT = 5
MAX_COUNT_DISTRACTORS = 3
MAX_DIRECTION_DISTRACTORS = 2
FIRST_APPEARED_OBJECTS = 3
# left_right's object is big (radius 3/14 of the frame, a 12-pixel radius in the 56-pixel frames the main job samples):
# with the grid's radius (1/14) a tiny model could not even read its colour after the processor's resize, and with
# 3/14 it learns the direction (benchmarks/probe_left_right.md).
LEFT_RIGHT_RADIUS_FRACTION = 3 / 14


@dataclass(frozen=True)
class SyntheticVideoConfig:
    """Size and content of the synthetic video dataset.

    Attributes:
        num_samples: number of clips; tasks are assigned round-robin so every task in ``tasks`` is covered.
        seed: everything (colours, positions, answers) is a deterministic function of the seed and the sample index.
        num_frames: frames per clip.
        height: frame height in pixels (even: H.264 stores 4:2:0 chroma).
        width: frame width in pixels (even).
        fps: frame rate written into the MP4.
        tasks: which task types to generate, a subset of ``TASKS`` (default ``DEFAULT_TASKS``).
        split: ``"train"`` or ``"heldout"`` (other random streams; for ``left_right`` also disjoint scenes).
    """

    num_samples: int = 32
    seed: int = 0
    num_frames: int = 16
    height: int = 112
    width: int = 112
    fps: int = 8
    tasks: tuple[str, ...] = field(default=DEFAULT_TASKS)
    split: str = "train"

    def __post_init__(self) -> None:
        problems = []
        if self.num_samples < 1:
            problems.append(f"num_samples must be >= 1, got {self.num_samples}")
        if self.num_frames < 4:
            problems.append(f"num_frames must be >= 4 (motion and appearance order need time), got {self.num_frames}")
        if self.height < 48 or self.width < 48 or self.height % 2 or self.width % 2:
            problems.append(f"height and width must be even and >= 48, got {self.height}x{self.width}")
        if self.fps < 1:
            problems.append(f"fps must be >= 1, got {self.fps}")
        unknown = sorted(set(self.tasks) - set(TASKS))
        if not self.tasks or unknown or len(set(self.tasks)) != len(self.tasks):
            problems.append(f"tasks must be a non-empty subset of {TASKS} without repeats, got {self.tasks}")
        if self.split not in SPLITS:
            problems.append(f"split must be one of {SPLITS}, got {self.split!r}")
        if "left_right" in self.tasks and not problems:
            radius = _left_right_radius(self.height, self.width)
            if self.num_frames - 1 > _max_travel(self.width, radius):
                problems.append(f"left_right moves one whole pixel per frame at least: num_frames ({self.num_frames}) "
                                f"must be <= {_max_travel(self.width, radius) + 1} at width {self.width}")
        if problems:
            raise ValueError("invalid SyntheticVideoConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class SyntheticObject:
    """One shape in a clip: it is drawn from frame ``onset`` on, moving linearly from ``start`` to ``end``.

    Positions are (row, column) centres in pixels; a static object has ``start == end``.
    """

    colour: str
    shape: str
    radius: int
    start: tuple[float, float]
    end: tuple[float, float]
    onset: int = 0

    def centre_at(self, frame: int, num_frames: int) -> tuple[float, float]:
        """Centre at ``frame`` (linear interpolation from ``start`` at frame 0 to ``end`` at the last frame)."""
        fraction = frame / (num_frames - 1)
        return (
            self.start[0] + (self.end[0] - self.start[0]) * fraction,
            self.start[1] + (self.end[1] - self.start[1]) * fraction,
        )


@dataclass(frozen=True)
class SyntheticSample:
    """One generated question with everything needed to render and to check it."""

    problem_id: int
    task: str
    problem: str
    problem_type: str
    options: list[str]
    answer: str
    objects: list[SyntheticObject]

    @property
    def solution(self) -> str:
        """The ground truth in Video-R1's form."""
        return f"<answer>{self.answer}</answer>"

    @property
    def video_name(self) -> str:
        """File name of the clip inside ``videos/``."""
        return f"{self.task}_{self.problem_id:05d}.mp4"

    def to_record(self) -> dict[str, Any]:
        """The Video-R1 annotation row (same keys and order as Video-R1-260k.json)."""
        return {
            "problem_id": self.problem_id,
            "problem": self.problem,
            "data_type": "video",
            "problem_type": self.problem_type,
            "options": list(self.options),
            "solution": self.solution,
            "path": f"./{VIDEOS_DIR}/{self.video_name}",
            "data_source": f"rollplex-synthetic/{self.task}",
        }


# ---------------------------------------------------------------------------------------------------------------------
# Layout: objects live in distinct grid cells so that they never overlap
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Grid:
    radius: int
    rows: int
    cols: int
    cell: int
    top: int
    left: int

    @classmethod
    def for_frame(cls, height: int, width: int) -> _Grid:
        radius = max(3, min(height, width) // 14)
        # A cell of 4 radii leaves at least one radius between neighbours even after jitter of half a radius.
        cell = 4 * radius
        rows, cols = height // cell, width // cell
        return cls(radius, rows, cols, cell, (height - rows * cell) // 2, (width - cols * cell) // 2)

    def centre(self, row: int, col: int) -> tuple[float, float]:
        return (self.top + (row + 0.5) * self.cell, self.left + (col + 0.5) * self.cell)

    def all_cells(self) -> list[tuple[int, int]]:
        return [(row, col) for row in range(self.rows) for col in range(self.cols)]

    def jittered_centre(self, rng: np.random.Generator, row: int, col: int) -> tuple[float, float]:
        jitter = self.radius // 2
        centre_row, centre_col = self.centre(row, col)
        return (
            centre_row + float(rng.integers(-jitter, jitter + 1)),
            centre_col + float(rng.integers(-jitter, jitter + 1)),
        )


def _pick_cells(rng: np.random.Generator, cells: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    chosen = rng.choice(len(cells), size=count, replace=False)
    return [cells[int(index)] for index in chosen]


def _static_object(rng: np.random.Generator, grid: _Grid, cell: tuple[int, int], colour: str) -> SyntheticObject:
    centre = grid.jittered_centre(rng, *cell)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    return SyntheticObject(colour=colour, shape=shape, radius=grid.radius, start=centre, end=centre)


def _other_colours(rng: np.random.Generator, exclude: str, count: int) -> list[str]:
    others = [name for name in COLOURS if name != exclude]
    return [others[int(index)] for index in rng.choice(len(others), size=count, replace=True)]


# ---------------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------------


def _make_count(
    problem_id: int, rng: np.random.Generator, grid: _Grid, config: SyntheticVideoConfig
) -> SyntheticSample:
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    num_targets = int(rng.integers(1, MAX_COUNT + 1))
    num_distractors = int(rng.integers(0, MAX_COUNT_DISTRACTORS + 1))
    cells = _pick_cells(rng, grid.all_cells(), num_targets + num_distractors)
    colours = [colour] * num_targets + _other_colours(rng, colour, num_distractors)
    objects = [_static_object(rng, grid, cell, name) for cell, name in zip(cells, colours, strict=True)]
    return SyntheticSample(
        problem_id=problem_id,
        task="count",
        problem=f"How many {colour} objects are in the video?",
        problem_type="numerical",
        options=[],
        answer=str(num_targets),
        objects=objects,
    )


def _make_direction(
    problem_id: int, rng: np.random.Generator, grid: _Grid, config: SyntheticVideoConfig
) -> SyntheticSample:
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    direction_index = int(rng.integers(len(DIRECTIONS)))
    direction = DIRECTIONS[direction_index]
    horizontal = direction in ("left", "right")
    # The mover travels along one lane (a grid row or column) from the first cell centre to the last.
    lane = int(rng.integers(grid.rows if horizontal else grid.cols))
    if horizontal:
        first, last = grid.centre(lane, 0), grid.centre(lane, grid.cols - 1)
    else:
        first, last = grid.centre(0, lane), grid.centre(grid.rows - 1, lane)
    start, end = (last, first) if direction in ("left", "up") else (first, last)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    mover = SyntheticObject(colour=colour, shape=shape, radius=grid.radius, start=start, end=end)
    # Distractors stay off the mover's lane, so the two never overlap.
    free_cells = [cell for cell in grid.all_cells() if (cell[0] if horizontal else cell[1]) != lane]
    num_distractors = int(rng.integers(0, MAX_DIRECTION_DISTRACTORS + 1))
    cells = _pick_cells(rng, free_cells, num_distractors)
    colours = _other_colours(rng, colour, num_distractors)
    distractors = [_static_object(rng, grid, cell, name) for cell, name in zip(cells, colours, strict=True)]
    return SyntheticSample(
        problem_id=problem_id,
        task="direction",
        problem=f"In which direction does the {colour} object move?\n",
        problem_type="multiple choice",
        options=list(DIRECTION_OPTIONS),
        answer=OPTION_LETTERS[direction_index],
        objects=[mover, *distractors],
    )


def _make_first_appeared(
    problem_id: int, rng: np.random.Generator, grid: _Grid, config: SyntheticVideoConfig
) -> SyntheticSample:
    names = list(COLOURS)
    picked = [names[int(index)] for index in rng.choice(len(names), size=FIRST_APPEARED_OBJECTS + 1, replace=False)]
    shown, absent = picked[:FIRST_APPEARED_OBJECTS], picked[FIRST_APPEARED_OBJECTS]
    # Onsets spread evenly over the clip (0, T/3, 2T/3, ...), so a 2-fps sampling still sees the order.
    onsets = [round(rank * config.num_frames / FIRST_APPEARED_OBJECTS) for rank in range(FIRST_APPEARED_OBJECTS)]
    cells = _pick_cells(rng, grid.all_cells(), FIRST_APPEARED_OBJECTS)
    objects = []
    for colour, onset, cell in zip(shown, onsets, cells, strict=True):
        static = _static_object(rng, grid, cell, colour)
        objects.append(SyntheticObject(static.colour, static.shape, static.radius, static.start, static.end, onset))
    option_colours = [*shown, absent]
    order = rng.permutation(len(option_colours))
    option_colours = [option_colours[int(index)] for index in order]
    options = [f"{OPTION_LETTERS[position]}. {colour}" for position, colour in enumerate(option_colours)]
    return SyntheticSample(
        problem_id=problem_id,
        task="first_appeared",
        problem="What colour is the object that appears first in the video?\n",
        problem_type="multiple choice",
        options=options,
        answer=OPTION_LETTERS[option_colours.index(shown[0])],
        objects=objects,
    )


def _left_right_radius(height: int, width: int) -> int:
    """The left_right object's radius: LEFT_RIGHT_RADIUS_FRACTION of the smaller side, at least the grid's radius."""
    return max(_Grid.for_frame(height, width).radius, int(min(height, width) * LEFT_RIGHT_RADIUS_FRACTION))


def _max_travel(width: int, radius: int) -> int:
    """Longest left_right path (pixels): half the width, and the object stays one pixel inside the frame."""
    return min(width - 2 * radius - 2, width // 2)


def _scene_split(key: tuple[Any, ...]) -> str:
    """The split a left_right scene belongs to: a stable hash of its direction-free description."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % HELDOUT_BUCKETS == 0 else "train"


def _make_left_right(
    problem_id: int, rng: np.random.Generator, grid: _Grid, config: SyntheticVideoConfig
) -> SyntheticSample:
    # Labels alternate over this task's own samples (tasks are assigned round-robin), so each split is balanced.
    direction = LEFT_RIGHT[(problem_id // len(config.tasks)) % 2]
    radius = _left_right_radius(config.height, config.width)
    max_step = _max_travel(config.width, radius) // (config.num_frames - 1)
    min_travel = -(-config.width // 4)  # a quarter of the width, rounded up
    min_step = max(1, min(max_step, -(-min_travel // (config.num_frames - 1))))
    # Draw scenes until one falls in this split: the two splits never share a scene (in either direction).
    while True:
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        step = int(rng.integers(min_step, max_step + 1))
        travel = step * (config.num_frames - 1)
        row = int(rng.integers(radius + 1, config.height - radius - 1))
        low = int(rng.integers(radius + 1, config.width - radius - 1 - travel + 1))
        scene = (config.height, config.width, config.num_frames, colour, shape, row, low, step)
        if _scene_split(scene) == config.split:
            break
    # Whole-pixel positions (exact in floating point), so the reversed clip is exactly the other direction's clip.
    west, east = (float(row), float(low)), (float(row), float(low + travel))
    start, end = (east, west) if direction == "left" else (west, east)
    mover = SyntheticObject(colour=colour, shape=shape, radius=radius, start=start, end=end)
    return SyntheticSample(
        problem_id=problem_id,
        task="left_right",
        problem=f"Does the {colour} {shape} move left or right?\n",
        problem_type="multiple choice",
        options=list(LEFT_RIGHT_OPTIONS),
        answer=OPTION_LETTERS[LEFT_RIGHT.index(direction)],
        objects=[mover],
    )


_TASK_BUILDERS = {
    "count": _make_count,
    "direction": _make_direction,
    "first_appeared": _make_first_appeared,
    "left_right": _make_left_right,
}


def make_synthetic_samples(config: SyntheticVideoConfig) -> list[SyntheticSample]:
    """Generate the questions and scene descriptions (no files); a pure function of ``config``."""
    grid = _Grid.for_frame(config.height, config.width)
    samples = []
    for index in range(config.num_samples):
        task = config.tasks[index % len(config.tasks)]
        # One generator per sample, seeded by (seed, index): a sample does not change when num_samples grows.
        # The held-out split draws from other streams, (seed, index, HELDOUT_STREAM).
        entropy = [config.seed, index] if config.split == "train" else [config.seed, index, HELDOUT_STREAM]
        rng = np.random.default_rng(entropy)
        samples.append(_TASK_BUILDERS[task](index, rng, grid, config))
    return samples


# ---------------------------------------------------------------------------------------------------------------------
# Rendering and encoding
# ---------------------------------------------------------------------------------------------------------------------


def _shape_mask(obj: SyntheticObject, centre: tuple[float, float], rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    d_row, d_col = rows - centre[0], cols - centre[1]
    if obj.shape == "circle":
        return d_row**2 + d_col**2 <= obj.radius**2
    # A square of about the circle's area (side ~ 1.77 r), so that both shapes are equally easy to see.
    half_side = 0.886 * obj.radius
    return (np.abs(d_row) <= half_side) & (np.abs(d_col) <= half_side)


def render_frames(sample: SyntheticSample, config: SyntheticVideoConfig) -> np.ndarray:
    """Draw a sample's clip: a uint8 array of shape (num_frames, height, width, 3)."""
    frames = np.empty((config.num_frames, config.height, config.width, 3), dtype=np.uint8)
    frames[:] = BACKGROUND
    rows, cols = np.mgrid[0 : config.height, 0 : config.width]
    for index in range(config.num_frames):
        for obj in sample.objects:
            if index >= obj.onset:
                mask = _shape_mask(obj, obj.centre_at(index, config.num_frames), rows, cols)
                frames[index][mask] = COLOURS[obj.colour]
    return frames


def pick_video_codec() -> str:
    """The encoder to use: H.264 (libx264) when this FFmpeg build has it, else MPEG-4 part 2."""
    for codec in ("libx264", "mpeg4"):
        if codec in av.codec.codecs_available:
            return codec
    raise RuntimeError("this PyAV/FFmpeg build has neither the libx264 nor the mpeg4 encoder; install PyAV wheels")


def write_mp4(path: str | os.PathLike[str], frames: np.ndarray, fps: int, codec: str | None = None) -> None:
    """Encode uint8 (T, H, W, 3) RGB frames into an MP4 file with PyAV (H and W must be even)."""
    codec = codec or pick_video_codec()
    with av.open(os.fspath(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = int(frames.shape[1]), int(frames.shape[2])
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            # Near-lossless, so that colours and edges survive for pixel-level checks; the clips are tiny anyway.
            # No macroblock-tree / lookahead: with them x264 read uninitialized memory for frame sizes that are not
            # multiples of 16 and the same frames encoded to different bytes (decoded pixels 2/255 apart) from one
            # process to the next, so two ranks writing "the same" clip trained on different videos.
            stream.options = {"crf": "8", "preset": "veryfast", "x264-params": "no-mbtree=1:rc-lookahead=0"}
        else:
            stream.bit_rate = 4_000_000
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


# ---------------------------------------------------------------------------------------------------------------------
# Dataset directory
# ---------------------------------------------------------------------------------------------------------------------


def _manifest_key(config: SyntheticVideoConfig) -> dict[str, Any]:
    # A JSON round trip turns tuples into lists, so this compares equal to what a manifest file holds.
    return json.loads(json.dumps({"format_version": FORMAT_VERSION, "config": asdict(config)}))


def _read_manifest(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_up_to_date(out_dir: Path, manifest: dict[str, Any] | None, config: SyntheticVideoConfig) -> bool:
    if manifest is None or {key: manifest.get(key) for key in ("format_version", "config")} != _manifest_key(config):
        return False
    if not (out_dir / ANNOTATIONS_NAME).is_file():
        return False
    return all((out_dir / VIDEOS_DIR / name).is_file() for name in manifest.get("videos", []))


def _remove_previous_outputs(out_dir: Path, manifest: dict[str, Any] | None) -> None:
    """Delete only the files a previous run listed in its manifest, never anything else in the directory."""
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    if manifest is None:
        return
    for name in manifest.get("videos", []):
        if isinstance(name, str) and "/" not in name and name.endswith(".mp4"):
            (out_dir / VIDEOS_DIR / name).unlink(missing_ok=True)


def _write_text_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def write_synthetic_video_dataset(out_dir: str | os.PathLike[str], config: SyntheticVideoConfig | None = None) -> Path:
    """Write the synthetic dataset (``videos/*.mp4`` + ``annotations.jsonl``) and return the annotation file's path.

    Idempotent: a ``manifest.json`` records the config; when it matches and all files exist, nothing is rewritten.
    Otherwise the files of the previous run are deleted and the dataset is rebuilt. The manifest is written last,
    so an interrupted run is rebuilt next time.
    """
    config = config or SyntheticVideoConfig()
    out_dir = Path(out_dir)
    annotations_path = out_dir / ANNOTATIONS_NAME
    previous = _read_manifest(out_dir)
    if _is_up_to_date(out_dir, previous, config):
        logger.debug("synthetic dataset in %s is up to date", out_dir)
        return annotations_path

    _remove_previous_outputs(out_dir, previous)
    (out_dir / VIDEOS_DIR).mkdir(parents=True, exist_ok=True)
    codec = pick_video_codec()
    samples = make_synthetic_samples(config)
    for sample in samples:
        write_mp4(out_dir / VIDEOS_DIR / sample.video_name, render_frames(sample, config), config.fps, codec)
    lines = [json.dumps(sample.to_record()) for sample in samples]
    _write_text_atomically(annotations_path, "\n".join(lines) + "\n")
    manifest = {**_manifest_key(config), "codec": codec, "videos": [sample.video_name for sample in samples]}
    _write_text_atomically(out_dir / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    logger.info("wrote %d synthetic video samples to %s (codec %s)", len(samples), out_dir, codec)
    return annotations_path
