"""`TransformersRollout` (rollout/transformers_rollout.py), the trainer's transformers rollout engine, samples what
TRL's own `GRPOTrainer._generate_single_turn` samples on the same inputs and seed (bitwise: the same tokens), with
each prompt prefilled once and nothing patched on the model."""

import pytest
import torch
from datasets import Dataset
from PIL import Image
from trl import GRPOTrainer

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.prompt import generation_fields, prepare_prompt
from rollplex_trl.data.video import VideoSamplingConfig, frames_to_video


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


def _trainer(model_path, tmp_path, bf16, max_completion_length=6):
    config = RollplexGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=max_completion_length, report_to=[], seed=3, use_cpu=True, bf16=bf16,
        save_strategy="no", gradient_checkpointing=False)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4})
    return RollplexGRPOTrainer(model=str(model_path), reward_funcs=_reward, args=config, train_dataset=dataset)


def _both(trainer, prompt_ids, rows, fields, G, seed=11, **options):
    """(TRL's completions, the engine's), each from the same seed; the model's `generate` checked unpatched."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    generate = type(model).generate
    seen = []

    def check(rows_count, unique):  # called by the shared prefill, before the decode
        assert "generate" not in vars(model) and model.generate.__func__ is generate
        seen.append((rows_count, unique))

    torch.manual_seed(seed)
    theirs, logprobs = GRPOTrainer._generate_single_turn(trainer, prompt_ids, None, dict(fields), G)
    assert logprobs is None
    torch.manual_seed(seed)
    ours = trainer.rollout.transformers.generate(prompt_ids, rows, G, multimodal_fields=dict(fields),
                                                 on_prefill=check, **options)
    assert "generate" not in vars(model)
    assert seen == [(len(prompt_ids), len(prompt_ids) // G)]
    return theirs, ours


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("G", [1, 3])
def test_text_prompts_match_trl(tiny_qwen2_path, tmp_path, bf16, G):
    trainer = _trainer(tiny_qwen2_path, tmp_path, bf16)
    tok = trainer.processing_class
    texts = ["count to three", "a much longer prompt about counting objects in a row"]
    prompt_ids = [tok(t)["input_ids"] for t in texts for _ in range(G)]
    for shared_decode in ("off", "on") if G > 1 else ("off",):
        theirs, ours = _both(trainer, prompt_ids, None, {}, G, shared_decode=shared_decode)
        assert ours == theirs and len(ours) == 2 * G


def test_one_token_completions_match_trl(tiny_qwen2_path, tmp_path):
    """Rows whose first token is an end-of-sequence token keep just that token, the others all theirs."""
    trainer = _trainer(tiny_qwen2_path, tmp_path, bf16=False)
    tok = trainer.processing_class
    prompt_ids = [tok(t)["input_ids"] for t in ("one two", "three four five") for _ in range(4)]
    _, first = _both(trainer, prompt_ids, None, {}, 4)
    trainer.eos_token_ids = [*trainer.eos_token_ids, first[0][0]]  # TRL's mask: ends row 0 at its first token
    theirs, ours = _both(trainer, prompt_ids, None, {}, 4)
    assert ours == theirs
    assert ours[0] == [first[0][0]] and any(len(c) > 1 for c in ours)


def _vision_rows(trainer, kind):
    processor = trainer.processing_class
    sampling = VideoSamplingConfig(min_pixels=4 * 28 * 28, max_pixels=56 * 84)
    torch.manual_seed(0)
    prompts = []
    for i, (h, w) in enumerate([(56, 56), (56, 84)]):
        pixels = torch.randint(0, 255, (4, 3, h, w), dtype=torch.uint8)
        if kind == "video":
            media = {"videos": [frames_to_video(pixels, 2.0, sampling)]}
        else:
            media = {"images": [Image.fromarray(pixels[0].permute(1, 2, 0).numpy())]}
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "hi " * (3 * i + 1)}]}]
        prompts.append(prepare_prompt(processor, messages, sample_id=str(i), **media))
    return prompts


@pytest.mark.parametrize("kind", ["image", "video"])
@pytest.mark.parametrize("bf16", [False, True])
def test_vision_prompts_match_trl(tiny_vl_path, tmp_path, kind, bf16):
    trainer = _trainer(tiny_vl_path, tmp_path, bf16)
    prompts = _vision_rows(trainer, kind)
    for G, shared_decode in ((1, "off"), (3, "off"), (3, "on")):
        rows = [p for p in prompts for _ in range(G)]
        prompt_ids = [list(r.prompt_ids) for r in rows]
        theirs, ours = _both(trainer, prompt_ids, rows, generation_fields(rows), G, shared_decode=shared_decode)
        assert ours == theirs and len(ours) == 2 * G
