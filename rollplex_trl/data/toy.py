"""Toy text and image datasets written as files `datasets.load_dataset` reads, and their answer reward.

The recipes in `examples/recipes/` train from files, as a user's own data would be read (`--dataset_name <folder>`),
and must run offline: `rollplex-trl make-toy-data --kind text|image` writes them. Text rows ask for a sum
("What is 3 + 4?"), image rows for the colour of a square; each row has a `solution` column that
:func:`answer_reward` compares with the completion's words.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Literal

COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220),
                                             "yellow": (230, 210, 20)}


def toy_rows(kind: Literal["text", "image"], size: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """`size` rows in TRL's conversational format, each with a `solution`; image rows carry a PIL `image`."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    if kind == "text":
        for _ in range(size):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
                         "solution": str(a + b)})
        return rows
    if kind != "image":
        raise ValueError(f"unknown toy dataset kind {kind!r}; choose 'text' or 'image'")
    from PIL import Image

    for _ in range(size):
        name = rng.choice(list(COLOURS))
        image = Image.new("RGB", (56, 56), (255, 255, 255))
        image.paste(COLOURS[name], (14, 14, 42, 42))
        rows.append({"prompt": [{"role": "user", "content": "What colour is the square? Answer with one word."}],
                     "image": image, "solution": name})
    return rows


def write_toy_dataset(out_dir: str | os.PathLike[str], kind: Literal["text", "image"], size: int = 64,
                      seed: int = 0) -> Path:
    """Write a toy dataset to `out_dir` and return the folder (`load_dataset(str(folder))` gives a `train` split).

    Text: `train.jsonl` (readable, one row a line). Image: `train.parquet`, whose schema keeps the `image` column a
    `datasets.Image` feature, so rows come back as PIL images as TRL's image path expects.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = toy_rows(kind, size, seed)
    if kind == "text":
        (out / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        from datasets import Dataset

        Dataset.from_list(rows).to_parquet(str(out / "train.parquet"))
    return out


def answer_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the row's answer (a number or a colour) is one of the completion's words, else 0.0."""
    from rollplex_trl.data.rewards import completion_text

    return [1.0 if sol.lower() in completion_text(c).lower().replace(".", " ").split() else 0.0
            for c, sol in zip(completions, solution, strict=True)]
