"""The SFT cold start's targets and collator (rollplex_trl/data/sft.py), checked against the chat template and a
plain forward's cross-entropy."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import SFTConfig, SFTTrainer

from rollplex_trl.data import (
    RollplexDataError,
    SyntheticVideoConfig,
    VideoSamplingConfig,
    load_video_r1,
    write_synthetic_video_dataset,
)
from rollplex_trl.data.sft import IGNORE_INDEX, VideoSFTCollator, cold_start_target

SAMPLING = VideoSamplingConfig(max_frames=4, max_pixels=56 * 56, min_pixels=56 * 56)


@pytest.fixture()
def mixed_rows(tmp_path):
    """A left_right and a count row (a Dataset): prompts of different lengths, multiple-choice and numerical answers."""
    config = SyntheticVideoConfig(num_samples=2, seed=1, num_frames=4, height=56, width=56,
                                  tasks=("left_right", "count"))
    return load_video_r1(write_synthetic_video_dataset(tmp_path / "data", config))


def test_cold_start_target_names_the_option_and_the_answer():
    row = {"problem_id": 3, "options": ["A. left", "B. right"], "solution": "<answer>B</answer>"}
    assert cold_start_target(row) == "<think>right</think><answer>B</answer>"
    assert cold_start_target({"options": [], "solution": "<answer>4</answer>"}) == "<think>4</think><answer>4</answer>"
    with pytest.raises(RollplexDataError, match="problem_id=7.*no <answer>"):
        cold_start_target({"problem_id": 7, "solution": "B"})


def test_collator_rows_are_the_chat_template_of_prompt_and_answer(tiny_vl_path, mixed_rows):
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    batch = VideoSFTCollator(processor, SAMPLING)(list(mixed_rows))
    tokenizer = processor.tokenizer
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths[0] != lengths[1]  # the two prompts differ, so one row is padded
    grid = batch["video_grid_thw"]
    for i, row in enumerate(mixed_rows):
        # reference: the chat template over the whole conversation, the video placeholder expanded to its tokens
        conversation = [*row["prompt"], {"role": "assistant", "content": [
            {"type": "text", "text": cold_start_target(row)}]}]
        text = processor.apply_chat_template(conversation, tokenize=False).rstrip("\n")
        video_tokens = int(grid[i].prod()) // processor.image_processor.merge_size ** 2
        expected = text.replace("<|video_pad|>", "<|video_pad|>" * video_tokens)
        ids = batch["input_ids"][i, :lengths[i]].tolist()
        assert tokenizer.decode(ids) == expected
        assert batch["attention_mask"][i, lengths[i]:].sum() == 0
        # the loss sees exactly the answer and the end of the turn
        labelled = batch["labels"][i][batch["labels"][i] != IGNORE_INDEX].tolist()
        assert tokenizer.decode(labelled) == cold_start_target(row) + "<|im_end|>"
        assert (batch["mm_token_type_ids"][i] != 0).sum() == video_tokens


@pytest.mark.parametrize("bf16", [False, True])
def test_sft_trainer_loss_is_the_answer_cross_entropy_of_a_plain_forward(tiny_vl_path, mixed_rows, tmp_path, bf16):
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path)
    collator = VideoSFTCollator(processor, SAMPLING)
    config = SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, max_steps=1, report_to=[],
                       use_cpu=True, bf16=bf16, remove_unused_columns=False,
                       dataset_kwargs={"skip_prepare_dataset": True}, save_strategy="no")
    trainer = SFTTrainer(model=model, args=config, train_dataset=mixed_rows, processing_class=processor,
                         data_collator=collator)
    batch = collator(list(mixed_rows))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = trainer.compute_loss(trainer.model, dict(batch))
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
    labels = batch["labels"][:, 1:]
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(),
                                                  ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss.float(), reference, rtol=2e-2 if bf16 else 1e-5, atol=1e-5)


def test_collator_names_the_sample_without_an_answer(tiny_vl_path, mixed_rows):
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    broken = {**mixed_rows[0], "solution": "right"}
    with pytest.raises(RollplexDataError, match=f"problem_id={broken['problem_id']}"):
        VideoSFTCollator(processor, SAMPLING)([broken])
