"""Held-out accuracy (rollplex_trl/evaluation.py) against answers asked one by one through `ask_about_video` and
scored by hand with Video-R1's multiple-choice rule."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import SFTConfig, SFTTrainer

from rollplex_trl.data import (
    SyntheticVideoConfig,
    VideoSamplingConfig,
    extract_answer,
    load_video_r1,
    write_synthetic_video_dataset,
)
from rollplex_trl.data.sft import VideoSFTCollator
from rollplex_trl.evaluation import heldout_accuracy
from rollplex_trl.inference import ask_about_video

SAMPLING = VideoSamplingConfig(max_frames=4, max_pixels=56 * 56, min_pixels=56 * 56)


@pytest.fixture(scope="module")
def formatted_model(tiny_vl_path, tmp_path_factory):
    """The tiny model after a short SFT on four left_right rows, so that it writes <answer> tags (a random model
    answers nothing, and every score would be a vacuous 0)."""
    folder = tmp_path_factory.mktemp("evaluation")
    config = SyntheticVideoConfig(num_samples=4, seed=2, num_frames=4, height=56, width=56, tasks=("left_right",))
    rows = load_video_r1(write_synthetic_video_dataset(folder / "data", config))
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path)
    args = SFTConfig(output_dir=str(folder / "sft"), per_device_train_batch_size=4, max_steps=60, learning_rate=5e-3,
                     lr_scheduler_type="constant", report_to=[], use_cpu=True, bf16=False,
                     remove_unused_columns=False, save_strategy="no", dataset_kwargs={"skip_prepare_dataset": True},
                     disable_tqdm=True)
    SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=processor,
               data_collator=VideoSFTCollator(processor, SAMPLING)).train()
    return model.eval(), processor, rows


def test_greedy_score_is_the_answers_asked_one_by_one(formatted_model):
    model, processor, rows = formatted_model
    score = heldout_accuracy(model, processor, rows, SAMPLING, max_new_tokens=24)
    answers = [ask_about_video(model, processor, row["video"], row["prompt"], sampling=SAMPLING, max_new_tokens=24)
               for row in rows]
    assert [text.strip() for text in score.texts] == answers
    assert any("<answer>" in answer for answer in answers), answers  # not a vacuous 0
    right = [extract_answer(a) == extract_answer(row["solution"]) for a, row in zip(answers, rows, strict=True)]
    assert score.answers == len(rows) and score.accuracy == pytest.approx(sum(right) / len(rows))
    # the same answers scored against the other option: every right answer turns wrong, and a wrong one right
    flipped = rows.map(lambda row: {"solution": "<answer>A</answer>" if "B" in row["solution"]
                                    else "<answer>B</answer>"})
    flipped_score = heldout_accuracy(model, processor, flipped, SAMPLING, max_new_tokens=24)
    answered = sum(extract_answer(a) in ("A", "B") for a in answers) / len(rows)
    assert flipped_score.accuracy == pytest.approx(answered - score.accuracy)


def test_sampled_score_is_seeded_and_leaves_the_global_generator_alone(formatted_model):
    model, processor, rows = formatted_model
    torch.manual_seed(123)
    first = heldout_accuracy(model, processor, rows, SAMPLING, max_new_tokens=24, samples=3, do_sample=True)
    after_call = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), after_call)  # the call drew nothing from the global generator
    again = heldout_accuracy(model, processor, rows, SAMPLING, max_new_tokens=24, samples=3, do_sample=True)
    assert first == again and first.answers == 3 * len(rows)
    other = heldout_accuracy(model, processor, rows, SAMPLING, max_new_tokens=24, samples=3, do_sample=True, seed=1)
    assert other.texts != first.texts
    assert model.training is False
