"""Local checkpoints are real: saved with save_pretrained, loaded with from_pretrained, Qwen tokens and processors."""

import pytest
from transformers import AutoConfig, AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from rollplex_trl.testing.checkpoints import PRESETS, SPECIAL_TOKENS, get_checkpoint


def test_tiny_vl_checkpoint_loads_fast_with_processor(tiny_vl_path):
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path)
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert processor.image_processor is not None and processor.video_processor is not None
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and None not in ids
    assert model.config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.text_config.vocab_size >= len(tok)
    assert model.config.text_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                          "text": "hi"}]}], tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|video_pad|><|vision_end|>hi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # byte-level BPE round trip on text the tokenizer never saw
    s = "Zebras jumped 123 times: naïve café!"
    assert tok.decode(tok(s)["input_ids"]) == s


def test_tiny_qwen2_checkpoint(tiny_qwen2_path):
    config = AutoConfig.from_pretrained(tiny_qwen2_path)
    assert config.model_type == "qwen2"
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_path)
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("preset", ["small"])
def test_small_preset_shapes_suit_vllm_cpu(preset):
    text = PRESETS[preset].text
    assert text.head_dim == 64  # vLLM's CPU attention rejects head_dim 16
    assert sum(text.mrope_section) == text.head_dim // 2


def test_checkpoint_cache_is_reused(checkpoint_cache):
    first = get_checkpoint("qwen2", "tiny", cache_dir=checkpoint_cache)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert get_checkpoint("qwen2", "tiny", cache_dir=checkpoint_cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_build_checkpoint_cli_takes_a_family(tmp_path, family):
    """`rollplex-trl build-checkpoint --family F` writes that family's checkpoint (model type, processor), the same
    one `get_checkpoint` builds (identical weights); an unknown family is refused by argparse."""
    from safetensors.torch import load_file

    from rollplex_trl.cli import main
    from rollplex_trl.models.families import family_named

    out = tmp_path / family
    assert main(["build-checkpoint", "--family", family, "--output-dir", str(out)]) == 0
    expected = family_named(family)
    assert AutoConfig.from_pretrained(out).model_type == expected.model_type
    assert type(AutoProcessor.from_pretrained(out).video_processor).__name__ == expected.video_processor_class
    cached = get_checkpoint(expected.model_type, "tiny", cache_dir=tmp_path / "cache")
    ours, theirs = load_file(out / "model.safetensors"), load_file(cached / "model.safetensors")
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    with pytest.raises(SystemExit):
        main(["build-checkpoint", "--family", "llava", "--output-dir", str(tmp_path / "x")])
