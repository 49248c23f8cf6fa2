"""Video-R1 rewards against hand-computed values, for every problem type and both completion formats."""

from __future__ import annotations

import pytest

from rollplex_trl.data import (
    RollplexDataError,
    accuracy_reward,
    extract_answer,
    format_reward,
    mean_rouge_f1,
    word_error_rate,
)


def as_conversation(text: str) -> list[dict]:
    """A completion the way TRL passes it for conversational datasets."""
    return [{"role": "assistant", "content": text}]


def score(answer_text: str, solution: str, problem_type: str) -> float:
    """Accuracy of one completion, checked to be the same in both completion formats."""
    as_string = accuracy_reward([answer_text], [solution], [problem_type])
    as_messages = accuracy_reward([as_conversation(answer_text)], [solution], [problem_type])
    assert as_string == as_messages
    return as_string[0]


def test_extract_answer():
    assert extract_answer("<think>hmm</think><answer> B </answer>") == "B"
    assert extract_answer("<answer>\n  two\n words \n</answer>") == "two\n words"
    assert extract_answer("<answer>A</answer> then <answer>C</answer>") == "A"  # first match
    assert extract_answer("The answer is B") == ""  # no tag: empty, as Video-R1 (no fallback to the text)
    assert extract_answer("<answer>B") == ""


def test_multiple_choice():
    assert score("<think>x</think><answer>B</answer>", "<answer>B</answer>", "multiple choice") == 1.0
    assert score("<answer> B </answer>", "<answer>B</answer>", "multiple choice") == 1.0
    assert score("<answer>C</answer>", "<answer>B</answer>", "multiple choice") == 0.0
    assert score("<answer>B. a phone</answer>", "<answer>B</answer>", "multiple choice") == 0.0  # exact match only
    assert score("B", "<answer>B</answer>", "multiple choice") == 0.0  # untagged answer is ""


@pytest.mark.parametrize(
    ("output", "truth", "expected"),
    [
        ("3", "3", 1.0),
        ("3.0", "3", 0.0),  # one side written with a decimal point, the other not
        ("3.00", "3.0", 1.0),  # both decimal, equal at 2 places
        ("3.14159", "3.14", 1.0),  # round(3.14159, 2) == 3.14
        ("3.146", "3.14", 0.0),  # round(3.146, 2) == 3.15
        ("1,000", "1000", 0.0),  # comma on one side only
        ("1,000.5", "1000.5", 1.0),  # both "decimal" (comma / point), commas removed -> 1000.5 == 1000.5
        ("three", "3", 0.0),  # not a number
        ("nan", "3", 0.0),  # non-finite counts as not a number
    ],
)
def test_numerical(output, truth, expected):
    assert score(f"<answer>{output}</answer>", f"<answer>{truth}</answer>", "numerical") == expected


def test_ocr_word_error_rate():
    # "the cat sat on the mat" -> "the cat sit on mat": substitute sat->sit, delete "the": 2 edits / 6 words.
    assert word_error_rate("the cat sat on the mat", "the cat sit on mat") == pytest.approx(2 / 6)
    assert score("<answer>the cat sit on mat</answer>", "<answer>the cat sat on the mat</answer>", "OCR") == (
        pytest.approx(1 - 2 / 6)
    )
    # 2 substitutions + 3 insertions = 5 edits / 2 words = 2.5 -> 1 - 2.5 clipped to 0.
    assert score("<answer>c d e f g</answer>", "<answer>a b</answer>", "OCR") == 0.0
    assert score("<answer>STOP here</answer>", "<answer>STOP here</answer>", "OCR") == 1.0
    assert score("<answer>stop here</answer>", "<answer>STOP here</answer>", "OCR") == pytest.approx(0.5)  # case


def test_free_form_rouge():
    # reference: the cat sat on the mat / hypothesis: the cat lay on the mat (6 tokens each)
    # ROUGE-1: overlap the x2, cat, on, mat = 5 -> P = R = F = 5/6
    # ROUGE-2: reference bigrams (the cat)(cat sat)(sat on)(on the)(the mat); shared (the cat)(on the)(the mat)
    #          = 3 of 5 each side -> F = 3/5
    # ROUGE-L: LCS "the cat on the mat" = 5 -> F = 5/6
    # mean = (5/6 + 3/5 + 5/6) / 3 = 0.755556
    expected = (5 / 6 + 3 / 5 + 5 / 6) / 3
    assert mean_rouge_f1("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(expected)
    assert score(
        "<answer>the cat lay on the mat</answer>", "<answer>the cat sat on the mat</answer>", "free-form"
    ) == pytest.approx(0.755556, abs=1e-6)
    # Tokenization: lowercase, punctuation splits -> identical token lists.
    assert score("<answer>hello world</answer>", "<answer>Hello, World!</answer>", "free-form") == 1.0
    # Unrelated or empty answers.
    assert score("<answer>blue sky</answer>", "<answer>red car</answer>", "free-form") == 0.0
    assert score("<think>no answer tag</think>", "<answer>red car</answer>", "free-form") == 0.0
    # Known difference from Video-R1: no Porter stemmer, so inflections do not match (Video-R1 would give 1.0).
    assert score("<answer>cat run</answer>", "<answer>cats running</answer>", "free-form") == 0.0


def test_free_form_unequal_lengths():
    # reference "a b c d" (4 tokens), hypothesis "a b" (2 tokens):
    # ROUGE-1: overlap 2, P = 1, R = 1/2 -> F = 2/3; ROUGE-2: overlap 1 of (3 ref, 1 hyp) -> P = 1, R = 1/3 -> F = 1/2;
    # ROUGE-L: LCS 2 -> F = 2/3. Mean = (2/3 + 1/2 + 2/3) / 3 = 11/18.
    assert mean_rouge_f1("a b c d", "a b") == pytest.approx(11 / 18)


def test_regression():
    # |8 - 10| / 10 = 0.2 -> 0.8 (epsilon 1e-9 in numerator and denominator, as Video-R1)
    assert score("<answer>8</answer>", "<answer>10</answer>", "regression") == pytest.approx(0.8)
    assert score("<answer>10</answer>", "<answer>10</answer>", "regression") == pytest.approx(1.0, abs=1e-9)
    assert score("<answer>25</answer>", "<answer>10</answer>", "regression") == 0.0  # 150% off, clipped
    assert score("<answer>1,200</answer>", "<answer>1000</answer>", "regression") == pytest.approx(0.8)
    assert score("<answer>about ten</answer>", "<answer>10</answer>", "regression") == 0.0
    # Video-R1 quirk kept on purpose: ground truth 0 gives (0 + 1e-9) / (0 + 1e-9) = 1 -> score 0 even when exact.
    assert score("<answer>0</answer>", "<answer>0</answer>", "regression") == 0.0


def test_per_sample_problem_types_and_trl_keyword_arguments():
    completions = [as_conversation("<answer>B</answer>"), as_conversation("<answer>4</answer>")]
    rewards = accuracy_reward(
        prompts=[[{"role": "user", "content": "q"}]] * 2,
        completions=completions,
        completion_ids=[[1], [2]],
        solution=["<answer>B</answer>", "<answer>4</answer>"],
        problem_type=["multiple choice", "numerical"],
        problem_id=[1, 2],
        trainer_state=None,
        log_extra=None,
        log_metric=None,
    )
    assert rewards == [1.0, 1.0]
    # A single problem type string applies to every completion (for calls by hand).
    assert accuracy_reward(
        ["<answer>A</answer>", "<answer>B</answer>"], ["<answer>A</answer>"] * 2, "multiple choice"
    ) == [
        1.0,
        0.0,
    ]


def test_content_parts_are_read():
    completion = [{"role": "assistant", "content": [{"type": "text", "text": "<answer>B</answer>"}]}]
    assert accuracy_reward([completion], ["<answer>B</answer>"], ["multiple choice"]) == [1.0]


def test_unknown_problem_type_raises_naming_the_sample():
    with pytest.raises(RollplexDataError) as caught:
        accuracy_reward(
            ["<answer>B</answer>", "<answer>yes</answer>"],
            ["<answer>B</answer>", "<answer>yes</answer>"],
            ["multiple choice", "yes/no"],
            problem_id=[6, 7],
        )
    message = str(caught.value)
    assert "problem_id=7" in message and "'yes/no'" in message


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 completions but 1 values of 'solution'"):
        accuracy_reward(["a", "b"], ["<answer>a</answer>"], ["OCR", "OCR"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>reasoning</think><answer>B</answer>", 1.0),
        ("<think>line one\nline two</think>\n\n<answer>B</answer>", 1.0),  # DOTALL, whitespace between blocks
        ("<answer>B</answer>", 0.0),  # no think block
        ("Sure! <think>r</think><answer>B</answer>", 0.0),  # text before
        ("<think>r</think><answer>B</answer> done", 0.0),  # text after
        ("<think>r</think><answer>B</answer>\n", 0.0),  # even a trailing newline (fullmatch), as Video-R1
        ("<think>r</think> so <answer>B</answer>", 0.0),  # only whitespace may separate the blocks
    ],
)
def test_format_reward(text, expected):
    assert format_reward([text]) == [expected]
    assert format_reward([as_conversation(text)], solution=["unused"]) == [expected]


def test_reward_function_names_for_trl_logging():
    assert accuracy_reward.__name__ == "accuracy_reward"
    assert format_reward.__name__ == "format_reward"
