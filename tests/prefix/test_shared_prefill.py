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
from rollplex_trl.prefix.generation import generate_with_shared_prefill

from helpers import record_prefill_states


def _generate_both(model, inputs, rows, do_sample):
    config = GenerationConfig(max_new_tokens=8, do_sample=do_sample, pad_token_id=0, eos_token_id=[])
    seen = []
    with torch.no_grad():
        torch.manual_seed(5)
        plain = model.generate(**inputs, generation_config=config)
        torch.manual_seed(5)
        shared = generate_with_shared_prefill(model, **inputs, rows=rows, generation_config=config,
                                              on_prefill=lambda r, u: seen.append((r, u)))
    assert "generate" not in vars(model), "nothing patches the model's generate"
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


@pytest.mark.parametrize("shared_decode", ["off", "on"])
def test_prefill_under_the_wrapped_forwards_autocast(tiny_vl_path, monkeypatch, shared_decode):
    """Under bf16 accelerate wraps the model's `forward` in autocast and TRL's `generate` runs through it; the shared
    prefill calls the layers directly, so it must run in that autocast itself (`forward_context`): its K/V are then
    exactly the wrapped forward's (computed in fp32 they differ by ~1% of their scale), and decoding from them, with
    the prompt's K/V expanded or shared, gives HF's greedy tokens."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState


    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    # an earlier test's trainer leaves the process-wide state at its precision: start afresh, as TrainingArguments
    # does (accelerate refuses to change the precision of an initialised state)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path).eval())
    sampling = VideoSamplingConfig(min_pixels=4 * 28 * 28, max_pixels=56 * 84)
    torch.manual_seed(0)
    prompts = []
    for i, (h, w, frames) in enumerate([(56, 56, 4), (56, 84, 8)]):
        video = frames_to_video(torch.randint(0, 255, (frames, 3, h, w), dtype=torch.uint8), 2.0, sampling)
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi " * (3 * i + 1)}]}]
        prompts.append(prepare_prompt(processor, messages, sample_id=str(i), videos=[video]))

    def batch(rows):
        fields = generation_fields(rows)
        ids = pad([torch.tensor(r.prompt_ids) for r in rows], padding_value=processor.tokenizer.pad_token_id,
                  padding_side="left")
        mask = pad([torch.ones(r.num_prompt_tokens, dtype=torch.long) for r in rows], padding_value=0,
                   padding_side="left")
        mm = pad([torch.tensor(x) for x in fields.pop("mm_token_type_ids")], padding_value=0, padding_side="left")
        return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm, **fields)

    unique = batch(prompts)
    with torch.no_grad():  # HF's own forward through accelerate's wrapper: the K/V TRL's generate prefills with
        wrapped = model(**{k: v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                           for k, v in unique.items()}, use_cache=True).past_key_values
    states = record_prefill_states(monkeypatch)

    G = 4
    inputs = batch([p for p in prompts for _ in range(G)])
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=[])
    with torch.no_grad():
        plain = model.generate(**inputs, generation_config=config)
        shared = generate_with_shared_prefill(model, **inputs, rows=[p for p in prompts for _ in range(G)],
                                              shared_decode=shared_decode, forward_context=accelerator.autocast,
                                              generation_config=config)
    assert torch.equal(plain, shared)
    (state,) = states
    width = state.keys[0].size(2)
    for layer, (k, v) in enumerate(zip(state.keys, state.values, strict=True)):
        assert k.dtype == wrapped.layers[layer].keys.dtype and v.dtype == wrapped.layers[layer].values.dtype
        assert torch.equal(k, wrapped.layers[layer].keys[:, :, -width:]), f"layer {layer} keys"
        assert torch.equal(v, wrapped.layers[layer].values[:, :, -width:]), f"layer {layer} values"
