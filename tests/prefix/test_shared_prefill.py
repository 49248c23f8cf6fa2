"""The transformers rollout with a shared prefill samples exactly what plain `generate` samples."""

import pytest
import torch
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
)
from trl.trainer.utils import pad

from rollplex_trl.data.prompt import generation_fields, prepare_prompt
from rollplex_trl.data.video import VideoSamplingConfig, frames_to_video
from rollplex_trl.prefix.generation import shared_prefill


def _generate_both(model, inputs, rows, do_sample):
    config = GenerationConfig(max_new_tokens=8, do_sample=do_sample, pad_token_id=0, eos_token_id=[])
    seen = []
    with torch.no_grad():
        torch.manual_seed(5)
        plain = model.generate(**inputs, generation_config=config)
        torch.manual_seed(5)
        with shared_prefill(model, rows, on_prefill=lambda r, u: seen.append((r, u))):
            shared = model.generate(**inputs, generation_config=config)
    assert "generate" not in vars(model), "the wrapper must be removed after the block"
    return plain, shared, seen


@pytest.mark.parametrize("do_sample", [False, True])
def test_video_prompts(tiny_vl_path, do_sample):
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path).eval()
    sampling = VideoSamplingConfig(min_pixels=4 * 28 * 28, max_pixels=56 * 84)
    torch.manual_seed(0)
    prompts = []
    # the 16-frame clip has time-scaled M-RoPE positions beyond the text after it: HF's decode rule must be kept
    for i, (h, w, frames) in enumerate([(56, 56, 4), (56, 84, 16)]):
        video = frames_to_video(torch.randint(0, 255, (frames, 3, h, w), dtype=torch.uint8), 2.0, sampling)
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hello " * (i + 1)}]}]
        prompts.append(prepare_prompt(processor, messages, sample_id=str(i), videos=[video]))
    G = 3
    rows = [p for p in prompts for _ in range(G)]
    pad_id = processor.tokenizer.pad_token_id
    fields = generation_fields(rows)
    inputs = dict(
        input_ids=pad([torch.tensor(r.prompt_ids) for r in rows], padding_value=pad_id, padding_side="left"),
        attention_mask=pad([torch.ones(r.num_prompt_tokens, dtype=torch.long) for r in rows], padding_value=0,
                           padding_side="left"),
        mm_token_type_ids=pad([torch.tensor(x) for x in fields.pop("mm_token_type_ids")], padding_value=0,
                              padding_side="left"),
        **fields,
    )
    plain, shared, seen = _generate_both(model, inputs, rows, do_sample)
    assert torch.equal(plain, shared)
    assert seen == [(6, 2)]


def test_text_prompts(tiny_qwen2_path):
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_path)
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_path).eval()
    texts = ["count to three", "a much longer prompt about counting objects"]
    enc = tok([t for t in texts for _ in range(4)], return_tensors="pt", padding=True)
    plain, shared, seen = _generate_both(model, dict(enc), None, do_sample=True)
    assert torch.equal(plain, shared)
    assert seen == [(8, 2)]
