"""The tiny checkpoints' ingredients every builder shares, a leaf module (no other rollplex_trl import): the test
presets (sizes), a byte-level BPE tokenizer with Qwen's special tokens and Qwen2.5-VL's chat template, and the
language model's config fields. The family builders (rollplex_trl/models/) and testing/checkpoints.py use it.

Presets:
- ``tiny``: unit tests; a few hundred thousand parameters, loads in well under 2 s.
- ``demo``: the main job; the tiny vision tower under a wider language model (hidden 128, 8 heads), the smallest
  shape that learned the left_right task behind Video-R1's prompt template (benchmarks/probe_left_right.md).
- ``small``: benchmarks; head_dim 64 (vLLM's CPU attention rejects 16) and tens of millions of parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Qwen's special tokens. Their order fixes their ids (they come first in the vocabulary).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen2.5-VL's chat template (as shipped with Qwen/Qwen2.5-VL-*-Instruct): a default system prompt, one
# <|vision_start|><|image_pad|><|vision_end|> block per image and <|video_pad|> per video.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TextPreset:
    """Shape of the language model (shared by Qwen2 and the LLM inside Qwen2.5-VL)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class VisionPreset:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    fullatt_block_indexes: tuple[int, ...]
    window_size: int = 112
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 2


@dataclass(frozen=True)
class Preset:
    text: TextPreset
    vision: VisionPreset
    # Per-frame / per-image pixel bounds of the processors (multiples of 28*28).
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 256 * 28 * 28
    dtype: str = "float32"  # weights as saved (tests compare in fp32; the 3b preset is saved in bf16)
    extra: dict = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        text=TextPreset(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3)),
        vision=VisionPreset(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=(1,)),
    ),
    "demo": Preset(
        text=TextPreset(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, mrope_section=(2, 3, 3)),
        vision=VisionPreset(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=(1,)),
    ),
    "small": Preset(
        text=TextPreset(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                        num_attention_heads=8, num_key_value_heads=2, mrope_section=(8, 12, 12)),
        vision=VisionPreset(depth=4, hidden_size=256, intermediate_size=512, num_heads=4,
                            fullatt_block_indexes=(1, 3)),
    ),
    # Qwen2.5-VL-3B's shapes (LLM and vision tower; our small tokenizer instead of the 151k vocabulary), for the GPU
    # benchmark script. ~3.5 B parameters: build it on the machine that runs it (benchmarks/gpu_h200.sh).
    "3b": Preset(
        text=TextPreset(vocab_size=4096, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                        num_attention_heads=16, num_key_value_heads=2, mrope_section=(16, 24, 24)),
        vision=VisionPreset(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                            fullatt_block_indexes=(7, 15, 23, 31)),
        max_pixels=768 * 28 * 28,
        dtype="bfloat16",
    ),
}


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------

def _training_corpus() -> list[str]:
    """A small deterministic corpus covering what our tasks and prompts say, so BPE learns useful merges."""
    colours = ["red", "green", "blue", "yellow", "white", "black", "purple", "orange", "cyan", "magenta"]
    shapes = ["circle", "square", "object", "ball", "box", "dot"]
    directions = ["left", "right", "up", "down"]
    lines = [
        "Please think about this question as if you were a human pondering deeply. Engage in an internal dialogue "
        "using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', 'let's break it down', etc, or other "
        "natural language thought expressions It's encouraged to include self-reflection or verification in the "
        "reasoning process. Provide your detailed reasoning between the <think> </think> tags, and then give your "
        "final answer between the <answer> </answer> tags.",
        "Please provide only the single option letter (e.g., A, B, C, D, etc.) within the <answer> </answer> tags.",
        "Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
        "Please transcribe text from the image/video clearly and provide your text answer within the <answer> "
        "</answer> tags.",
        "Please provide your text answer within the <answer> </answer> tags.",
        "You are a helpful assistant.",
        "system user assistant Options: A. B. C. D. E.",
    ]
    for c in colours:
        for s in shapes:
            lines.append(f"How many {c} {s}s appear in the video? <think>I count the {c} {s}s.</think> "
                         f"<answer>{len(c) % 7}</answer>")
        for d in directions:
            lines.append(f"In which direction does the {c} object move? It moves {d}. <answer>{d}</answer>")
        lines.append(f"Which object appeared first in the video? The {c} one appeared first.")
    lines += [" ".join(str(i) for i in range(0, 101)), "0.5 1.25 3.14 42 100 1,000"]
    return lines * 4


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE tokenizer (like Qwen's) with Qwen's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        padding_side="left",  # TRL and the Qwen processors expect left padding for prompts
        truncation_side="left",
        model_max_length=32768,
    )
    hf_tok.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    return hf_tok


def _padded_vocab_size(n_tokens: int, multiple: int = 64) -> int:
    # Like real checkpoints, the embedding is padded beyond the tokenizer's size (vLLM/Megatron pad too).
    return ((n_tokens + multiple - 1) // multiple) * multiple




def special_token_ids(tokenizer) -> dict[str, int]:
    """The ids of Qwen's special tokens in `tokenizer`."""
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def text_config_kwargs(p: TextPreset, tokenizer, with_mrope: bool) -> dict:
    """The language model's config fields for a preset (also the text config inside each VL family's builder)."""
    ids = special_token_ids(tokenizer)
    kwargs = dict(
        vocab_size=_padded_vocab_size(len(tokenizer)),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )
    if with_mrope:
        kwargs["rope_scaling"] = {"type": "default", "rope_type": "default", "mrope_section": list(p.mrope_section)}
    return kwargs


def save_model(model, tokenizer, out_dir) -> None:
    """Save a built model with Qwen's generation config (end of turn or text ends a completion; the pad token is
    end of text)."""
    from transformers import GenerationConfig

    ids = special_token_ids(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT],
    )
    model.save_pretrained(out_dir)
