"""Video-R1's rule-based rewards, as TRL reward functions.

Mirrors ``accuracy_reward`` and ``format_reward`` of ``src/r1-v/src/open_r1/grpo.py`` (tulerfeng/Video-R1 @ 59d65c3),
with these deliberate differences:

- The problem type is read per sample (``problem_type[i]``); Video-R1 reads ``problem_type[0]`` for the whole batch,
  which is the same thing there because it trains with one prompt per device batch.
- An unknown problem type raises :class:`RollplexDataError` instead of silently scoring 0.0.
- Video-R1 wraps the scoring in ``except Exception: reward = 0.0``. Here only the expected failure, an answer that is
  not a number, scores 0.0; anything else is a bug and propagates.
- Numbers that parse to NaN or infinity count as parse failures (score 0.0). Video-R1 accepts them, and an output of
  ``nan`` then scores 1.0 on a regression question, because ``max(0.0, nan)`` is 0.0.
- Free-form answers use ROUGE-1/2/L F-measures computed here with ``rouge_score``'s default tokenizer (lowercase,
  runs of characters other than ``a-z0-9`` split tokens) but **without the Porter stemmer** Video-R1 enables, so
  "running" and "run" do not match. This is a small, documented deviation that avoids a dependency.

Kept on purpose, for parity with Video-R1:

- :func:`extract_answer` returns ``""`` when there is no ``<answer>`` tag (on both sides).
- Regression uses ``(|out - gt| + 1e-9) / (|gt| + 1e-9)``: epsilon in numerator *and* denominator, so an exact
  answer scores ``1 - 1e-9 / (|gt| + 1e-9)``, and a ground truth of exactly 0 scores 0.0 even for the output 0.
- OCR word error rate is case-sensitive and splits on whitespace.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollplex_trl.data.errors import RollplexDataError, describe_sample

ANSWER_PATTERN = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
SCORED_PROBLEM_TYPES: tuple[str, ...] = ("multiple choice", "numerical", "OCR", "free-form", "regression")
REGRESSION_EPSILON = 1e-9

# A completion as TRL passes it: the decoded text, or a list of chat messages (conversational datasets).
Completion = str | Sequence[dict[str, Any]]


def extract_answer(text: str) -> str:
    """Text between the first ``<answer>`` and the next ``</answer>``, stripped; ``""`` if there is no such tag.

    Same regex as Video-R1 (``<answer>\\s*(.*?)\\s*</answer>``, DOTALL, first match). Video-R1 does *not* fall back
    to the whole text when the tag is missing, so neither does this: an untagged completion answers ``""``.
    """
    match = ANSWER_PATTERN.search(text)
    return match.group(1).strip() if match else ""


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal content parts: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return ""


def completion_text(completion: Completion) -> str:
    """The text of one completion, whether TRL passed a string or a conversational list of messages.

    For a message list the contents of the assistant messages are concatenated; TRL produces a single assistant
    message, whose content is what Video-R1 reads as ``completion[0]["content"]``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _message_text(completion.get("content"))
    if isinstance(completion, Sequence):
        return "".join(
            _message_text(message.get("content"))
            for message in completion
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant"
        )
    raise RollplexDataError(
        f"a completion of type {type(completion).__name__} is neither a string nor a list of chat messages; "
        f"pass TRL's completions unchanged"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------------


def parse_number(text: str) -> float | None:
    """``float(text)`` after removing thousands separators (commas), or ``None`` if it is not a finite number."""
    try:
        number = float(text.replace(",", ""))
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _edit_distance(reference: Sequence[str], hypothesis: Sequence[str]) -> int:
    """Levenshtein distance between token sequences (unit cost insert/delete/substitute), two rows of the table."""
    previous = list(range(len(hypothesis) + 1))
    for i, ref_token in enumerate(reference, start=1):
        current = [i]
        for j, hyp_token in enumerate(hypothesis, start=1):
            if ref_token == hyp_token:
                current.append(previous[j - 1])
            else:
                current.append(1 + min(previous[j], current[j - 1], previous[j - 1]))
        previous = current
    return previous[-1]


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance divided by the reference length (at least 1), as Video-R1's ``wer``."""
    reference_words = reference.split()
    return _edit_distance(reference_words, hypothesis.split()) / max(1, len(reference_words))


def rouge_tokenize(text: str) -> list[str]:
    """``rouge_score``'s default tokenizer without stemming: lowercase, split on anything but ``a-z0-9``."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _f_measure(overlap: int, hypothesis_size: int, reference_size: int) -> float:
    precision = overlap / max(hypothesis_size, 1)
    recall = overlap / max(reference_size, 1)
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge_n_f1(reference: Sequence[str], hypothesis: Sequence[str], n: int) -> float:
    """ROUGE-N F-measure: clipped n-gram overlap, as ``rouge_score``."""
    reference_ngrams = Counter(tuple(reference[i : i + n]) for i in range(len(reference) - n + 1))
    hypothesis_ngrams = Counter(tuple(hypothesis[i : i + n]) for i in range(len(hypothesis) - n + 1))
    overlap = sum((reference_ngrams & hypothesis_ngrams).values())
    return _f_measure(overlap, sum(hypothesis_ngrams.values()), sum(reference_ngrams.values()))


def _longest_common_subsequence(reference: Sequence[str], hypothesis: Sequence[str]) -> int:
    previous = [0] * (len(hypothesis) + 1)
    for ref_token in reference:
        current = [0]
        for j, hyp_token in enumerate(hypothesis, start=1):
            current.append(previous[j - 1] + 1 if ref_token == hyp_token else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l_f1(reference: Sequence[str], hypothesis: Sequence[str]) -> float:
    """ROUGE-L F-measure (sentence-level longest common subsequence), as ``rouge_score``'s ``rougeL``."""
    if not reference or not hypothesis:
        return 0.0
    return _f_measure(_longest_common_subsequence(reference, hypothesis), len(hypothesis), len(reference))


def mean_rouge_f1(reference: str, hypothesis: str) -> float:
    """Mean of the ROUGE-1, ROUGE-2 and ROUGE-L F-measures (Video-R1's free-form score, without stemming)."""
    reference_tokens, hypothesis_tokens = rouge_tokenize(reference), rouge_tokenize(hypothesis)
    scores = (
        rouge_n_f1(reference_tokens, hypothesis_tokens, 1),
        rouge_n_f1(reference_tokens, hypothesis_tokens, 2),
        rouge_l_f1(reference_tokens, hypothesis_tokens),
    )
    return sum(scores) / len(scores)


def _clip_unit(value: float) -> float:
    return max(0.0, min(1.0, value))


# ---------------------------------------------------------------------------------------------------------------------
# Scoring one answer
# ---------------------------------------------------------------------------------------------------------------------


def _score_numerical(output: str, ground_truth: str) -> float:
    # "3" vs "3.0" scores 0: Video-R1 requires both or neither to be written with a decimal point or comma.
    if (("." in output) or ("," in output)) != (("." in ground_truth) or ("," in ground_truth)):
        return 0.0
    output_number, ground_truth_number = parse_number(output), parse_number(ground_truth)
    if output_number is None or ground_truth_number is None:
        return 0.0
    return 1.0 if round(output_number, 2) == round(ground_truth_number, 2) else 0.0


def _score_regression(output: str, ground_truth: str) -> float:
    output_number, ground_truth_number = parse_number(output), parse_number(ground_truth)
    if output_number is None or ground_truth_number is None:
        return 0.0
    relative_error = (abs(output_number - ground_truth_number) + REGRESSION_EPSILON) / (
        abs(ground_truth_number) + REGRESSION_EPSILON
    )
    return 1.0 - _clip_unit(relative_error)


def score_answer(output: str, ground_truth: str, problem_type: str, *, sample: str = "sample") -> float:
    """Score an extracted answer against an extracted ground truth for one Video-R1 problem type.

    Raises:
        RollplexDataError: ``problem_type`` is not one of ``SCORED_PROBLEM_TYPES``.
    """
    if problem_type == "multiple choice":
        return 1.0 if output.strip() == ground_truth.strip() else 0.0
    if problem_type == "numerical":
        return _score_numerical(output, ground_truth)
    if problem_type == "OCR":
        return _clip_unit(1.0 - word_error_rate(ground_truth, output))
    if problem_type == "free-form":
        return _clip_unit(mean_rouge_f1(ground_truth, output))
    if problem_type == "regression":
        return _score_regression(output, ground_truth)
    raise _unknown_problem_type(problem_type, sample)


def _unknown_problem_type(problem_type: str, sample: str) -> RollplexDataError:
    return RollplexDataError(
        f"{sample}: unknown problem_type {problem_type!r}; accuracy_reward scores only {SCORED_PROBLEM_TYPES}. "
        f"Fix the dataset row, drop it, or pass a reward function for this type"
    )


# ---------------------------------------------------------------------------------------------------------------------
# TRL reward functions
# ---------------------------------------------------------------------------------------------------------------------


def _per_sample(value: Sequence[Any] | str | None, count: int, name: str) -> list[Any]:
    """A TRL column as one value per completion (a single string is broadcast, for calls by hand)."""
    if value is None or isinstance(value, str):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"accuracy_reward: got {count} completions but {len(values)} values of {name!r}")
    return values


def accuracy_reward(
    completions: Sequence[Completion], solution: Sequence[str], problem_type: Sequence[str] | str, **kwargs: Any
) -> list[float]:
    """Video-R1's accuracy reward: 0..1 per completion, scored by the sample's problem type.

    Both the completion and the solution are reduced with :func:`extract_answer` first. Per type:
    multiple choice: exact match; numerical: same value to 2 decimals, and both or neither written with ``.``/``,``;
    OCR: ``1 - WER``; free-form: mean ROUGE-1/2/L F-measure; regression: ``1 - relative error`` (see module doc).
    All clipped to [0, 1].

    Args:
        completions: TRL's completions (strings, or lists of chat messages).
        solution: the dataset's ``solution`` column, e.g. ``"<answer>B</answer>"``.
        problem_type: the dataset's ``problem_type`` column (a single string applies to all completions).
        **kwargs: other dataset columns; ``problem_id`` is used in error messages.

    Raises:
        RollplexDataError: a problem type is unknown (checked before any scoring).
    """
    count = len(completions)
    solutions = _per_sample(solution, count, "solution")
    problem_types = _per_sample(problem_type, count, "problem_type")
    problem_ids = _per_sample(kwargs.get("problem_id"), count, "problem_id")
    # Check every type before scoring any, so a bad row fails the same way whatever the completions say.
    for problem_id, kind in zip(problem_ids, problem_types, strict=True):
        if kind not in SCORED_PROBLEM_TYPES:
            raise _unknown_problem_type(kind, describe_sample(problem_id))
    rewards = []
    samples = zip(completions, solutions, problem_types, problem_ids, strict=True)
    for completion, ground_truth, kind, problem_id in samples:
        output_answer = extract_answer(completion_text(completion))
        ground_truth_answer = extract_answer(ground_truth)
        rewards.append(score_answer(output_answer, ground_truth_answer, kind, sample=describe_sample(problem_id)))
    return rewards


def format_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float]:
    """1.0 if the whole completion is ``<think>...</think>`` then ``<answer>...</answer>`` (Video-R1's regex), else 0.0.

    The match is over the entire text, so leading or trailing text (even whitespace) scores 0.0, as in Video-R1.
    """
    return [1.0 if FORMAT_PATTERN.fullmatch(completion_text(completion)) else 0.0 for completion in completions]


# TRL logs a reward function under its __name__ (rewards/accuracy_reward/mean, ...); pin the names so that wrapping
# or re-exporting these functions never changes the logged keys.
accuracy_reward.__name__ = accuracy_reward.__qualname__ = "accuracy_reward"
format_reward.__name__ = format_reward.__qualname__ = "format_reward"
