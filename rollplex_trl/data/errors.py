"""The one exception type of the data module.

Every message names the sample at fault (problem id and/or dataset row) and the file, and says what to do, so that a
failure deep inside a 260k-row dataset can be fixed without a debugger.
"""

from __future__ import annotations

from typing import Any


class RollplexDataError(ValueError):
    """A dataset row, annotation file, image or video cannot be used.

    Subclasses `ValueError` so that callers which already guard data parsing with `except ValueError` keep working.
    """


def describe_sample(problem_id: Any = None, row: int | None = None) -> str:
    """Return a short human label for a sample, e.g. ``"sample problem_id=17 (row 3)"``.

    Both parts are optional because some callers know only one of them (a reward function sees the problem id, a
    video reader called by hand sees neither).
    """
    parts = []
    if problem_id is not None:
        parts.append(f"problem_id={problem_id!r}")
    if row is not None:
        parts.append(f"(row {row})")
    return "sample " + " ".join(parts) if parts else "sample <unknown id>"
