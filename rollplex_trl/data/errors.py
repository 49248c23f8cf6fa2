"""The one exception type of the data module.

Every message names the sample at fault (problem id and/or dataset row) and the file, and says what to do, so that a
failure deep inside a 260k-row dataset can be fixed without a debugger.
"""

from __future__ import annotations

from typing import Any

# The advice appended to errors about a single sample that training could skip. Kept apart from the reason so that
# the wrapper, which reports skipped samples when skipping is already on, can quote the reason without it.
SKIP_HINT = "skip such samples with rollplex_skip_invalid_samples=True"


class RollplexDataError(ValueError):
    """A dataset row, annotation file, image or video cannot be used.

    Subclasses `ValueError` so that callers which already guard data parsing with `except ValueError` keep working.

    Args:
        message: what is wrong and what to do about it.
        skippable: the problem concerns one sample, which `rollplex_skip_invalid_samples` would skip; the message
            then ends with that advice. `reason` is the message without it.
    """

    def __init__(self, message: str, *, skippable: bool = False) -> None:
        super().__init__(f"{message}, or {SKIP_HINT}" if skippable else message)
        self.reason = message


class SampleLabel(str):
    """A sample already described (e.g. ``problem_id=100 (row 0)``): `describe_sample` prints it as it is.

    The dataset wrapper knows both the id column and the row; the media loaders, which take a single `sample_id`,
    would otherwise quote the combined text as if it were a string problem id (``problem_id='100 (row 0)'``).
    """


def describe_sample(problem_id: Any = None, row: int | None = None) -> str:
    """Return a short human label for a sample, e.g. ``"sample problem_id=17 (row 3)"``.

    Both parts are optional because some callers know only one of them (a reward function sees the problem id, a
    video reader called by hand sees neither). A `SampleLabel` is used as it is.
    """
    if isinstance(problem_id, SampleLabel):
        return f"sample {problem_id}"
    parts = []
    if problem_id is not None:
        parts.append(f"problem_id={problem_id!r}")
    if row is not None:
        parts.append(f"(row {row})")
    return "sample " + " ".join(parts) if parts else "sample <unknown id>"
