"""`RollplexGRPOConfig`: TRL's `GRPOConfig` plus the `rollplex_*` fields.

Every field has a `help` text and a default that is safe: exact, and never slower than TRL when it cannot help.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from trl import GRPOConfig

# vLLM's dtype names (ModelConfig.dtype)
_VLLM_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# A sampled frame is at least one 28x28 patch (ViT patch 14 x spatial merge 2); Qwen2.5-VL merges 2 frames per
# temporal patch, so a video needs at least 2 sampled frames.
_MIN_FRAME_PIXELS = 28 * 28
_FRAME_FACTOR = 2

_TRUE_WORDS, _FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class _Rule:
    """How one rollplex_* value is read and checked: its kind, and the allowed range in words and as a test."""

    kind: str  # "mode" (auto/on/off), "choice", "bool", "int", "float", "optional_int", "text"
    allowed: str
    ok: Callable[[Any], bool] = lambda value: True
    choices: tuple[str, ...] = ()


_MODES = ("auto", "on", "off")

_DECLARED: list[tuple[Any, _Rule]] = []  # (dataclass field, its rule), in declaration order


def _option(*, rule: _Rule, **field_kwargs: Any) -> Any:
    """A rollplex_* field: `dataclasses.field(**field_kwargs)` (its help text in metadata, as TRL's fields) with the
    validation rule declared beside it. The rule stays out of the metadata: argparse (TrlParser) reads every key
    there."""
    declared = field(**field_kwargs)
    _DECLARED.append((declared, rule))
    return declared


@dataclass
class RollplexGRPOConfig(GRPOConfig):
    r"""Configuration for [`RollplexGRPOTrainer`]: everything of [`trl.GRPOConfig`] plus the `rollplex_*` fields.

    Each field is declared once, below: its default, its `help` text (what `rollplex-trl grpo --help` and
    docs/configuration.md show) and its validation rule side by side. Every default is safe: exact, and never
    slower than TRL where it cannot help. `"auto"` decides once per run (the same on every process) and logs its
    reason once; a forced `"on"` that cannot hold raises at construction, naming the field and what would work.
    """

    rollplex_share_prefix: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "Compute each prompt's prefix (vision tower + prompt) once per group of G completions in the "
            "reference, old and actor log-prob passes. 'auto': on where supported and where the modelled cost of both "
            "paths says it pays (decided once at the first rollout from the prompts, max_completion_length and G; "
            "reason logged once); 'on': always (error where unsupported); 'off': TRL's full forward for every "
            "completion.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_prefix_chunk_prompts: int = _option(
        rule=_Rule("int", "an integer >= 1", lambda v: v >= 1),
        default=8,
        metadata={"help": "Unique prompts per prefix forward in the no-grad (reference/old) log-prob passes."},
    )
    rollplex_suffix_attention: Literal["auto", "cascade", "concat"] = _option(
        rule=_Rule("choice", "'auto', 'cascade' or 'concat'", choices=("auto", "cascade", "concat")),
        default="auto",
        metadata={
            "help": "How completions attend to their prompt's K/V in the shared-prefix scoring passes. 'cascade': "
            "the prompt part once per prompt for its G rows and the completion part causally, merged exactly; "
            "'concat': the prompt's K/V copied to every row. 'auto': cascade where it applies (CPU, sdpa/eager), "
            "else concat with the reason logged once.",
            "choices": ["auto", "cascade", "concat"],
        },
    )
    rollplex_overlap: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "Run the prefix work of a step (reference, old-policy and actor prefixes) inside the rollout's "
            "decode window, at the same weights. 'auto': measure the first steps and keep it only where it shortens "
            "the step (decision logged); 'on': always; 'off': prefixes computed when scored. Needs the shared prefix; "
            "works with transformers' generate and with the vLLM engine (use_vllm=True).",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_vllm_dtype: str = _option(
        rule=_Rule("choice", f"one of {_VLLM_DTYPES}", choices=_VLLM_DTYPES),
        default="auto",
        metadata={"help": "dtype of the colocated vLLM engine (use_vllm=True, vllm_mode='colocate'). 'auto' is TRL's "
                  "choice (vLLM picks: the checkpoint's dtype, bf16 for fp32 checkpoints on CPU). Set the trainer's "
                  "dtype (e.g. 'float32', 'bfloat16') for sampling log-probs that match the trainer's exactly and "
                  "for weight aliasing, which needs equal dtypes."},
    )
    rollplex_overlap_threads: int = _option(
        rule=_Rule("int", "an integer >= 0 (0: the trainer's own count)", lambda v: v >= 0),
        default=0,
        metadata={"help": "CPU only: intra-op threads of the prefix worker while the rollout decodes. 0: the "
                  "trainer's own count (exact: the serial schedule's numbers; the cores are oversubscribed during the "
                  "window). n > 0: the worker takes n and decoding the rest; faster on CPU, but a different thread "
                  "count can round reductions differently, so results may differ from the serial schedule."},
    )
    rollplex_shared_decode: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "Transformers rollout: decode the G completions of a prompt against one copy of its K/V "
            "(cascade attention, exact merge) instead of G copies. 'auto': on from num_generations >= 8 (where it "
            "was measured to pay) wherever it applies (sdpa/eager attention, no beam search), else off with the "
            "reason logged once; 'on': error where it cannot apply; 'off': the prompt's K/V copied to every row.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_compile_decode: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "Transformers rollout with shared-prefix decoding: run each decode step's text-decoder forward "
            "through torch.compile (dynamic shapes: one graph for every step; same operations, inductor may round "
            "the last bit differently). 'auto': off (measured on CPU: minutes of compile per process, paid back "
            "only by long runs; never run on CUDA); 'on': compile (error where shared-prefix decoding does not "
            "run); 'off': the model's own forward.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_overlap_timeout_s: float = _option(
        rule=_Rule("float", "a finite number of seconds > 0", lambda v: v > 0),
        default=600.0,
        metadata={"help": "Longest wait for a concurrent prefix job (the overlapped schedule) after decoding ends "
                  "before the step fails with its name. The serial schedule (rollplex_overlap 'off', and 'auto' on "
                  "CPU) runs its jobs inline on the trainer's thread, where no timeout applies: a hung job there "
                  "hangs the step as any other forward would."},
    )
    rollplex_timeline: bool = _option(
        rule=_Rule("bool", "true or false"),
        default=False,
        metadata={"help": "Write the phase timeline of the run (Chrome-trace JSON and a Gantt PNG) to output_dir."},
    )
    rollplex_console: Literal["compact", "trl"] = _option(
        rule=_Rule("choice", "'compact' or 'trl'", choices=("compact", "trl")),
        default="compact",
        metadata={
            "help": "What the console shows per logged step. 'compact': one line (step, reward per function, loss, "
            "KL, seconds, the audit's verdict on audited steps) in place of transformers' progress bar and "
            "dictionary printer; 'trl': TRL's own console. The full logs go to the log history and the trackers "
            "either way.",
            "choices": ["compact", "trl"],
        },
    )
    rollplex_memory: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="off",
        metadata={
            "help": "Act on the memory plan at every phase boundary: the reference model resident only for the "
            "reference pass, the optimizer state off the compute device and streamed in chunks during the optimizer "
            "step, phase-local buffers freed (docs/memory.md). Exact (bytes are moved, never recomputed). 'auto': on "
            "where weights, reference, gradients and optimizer state would take over half of the device (CPU: RAM) "
            "and something can move, decision logged once; what cannot move stays resident, logged. 'on': always; "
            "an error at construction where it cannot act (Megatron, DeepSpeed/FSDP) or cannot move something (an "
            "optimizer other than torch's AdamW, Adam, SGD, Adagrad, RMSprop, fused or not; a reference with "
            "sync_ref_model). 'off': nothing moves.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_offload_activations: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "With rollplex_memory acting: park the actor's saved activations (its loss forward and the "
            "window's prefix graph) off the compute device until their backward reads them (a host arena file on "
            "CPU, pinned host memory on CUDA). Exact (byte copies). 'auto': where the memory plan's train phase "
            "would not fit the device, decided at the first actor micro-batch and logged once; 'on': always (needs "
            "rollplex_memory); 'off': never.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_memory_ledger: bool = _option(
        rule=_Rule("bool", "true or false"),
        default=True,
        metadata={
            "help": "Keep a memory ledger by lifetime class and phase (rollout, train, optimizer, ...) and log it as "
            "rollplex/mem_*. Observation only: it moves nothing."
        },
    )
    rollplex_backend: Literal["hf", "megatron"] = _option(
        rule=_Rule("choice", "'hf' or 'megatron'", choices=("hf", "megatron")),
        default="hf",
        metadata={
            "help": "Training engine of the policy's LLM. 'hf': transformers + accelerate (TRL's own). 'megatron': "
            "Megatron-Core's GPTModel, tensor-parallel over rollplex_tensor_parallel_size ranks, with the vision "
            "tower replicated and data parallelism over the remaining ranks (needs the 'megatron' extra; see "
            "docs/megatron.md for what runs and what is verified).",
            "choices": ["hf", "megatron"],
        },
    )
    rollplex_tensor_parallel_size: int = _option(
        rule=_Rule("int", "an integer >= 1", lambda v: v >= 1),
        default=1,
        metadata={"help": "With rollplex_backend='megatron': tensor-parallel degree t of the LLM. The world size "
                  "(processes from accelerate launch / torchrun) must be a multiple of t; the rest is data "
                  "parallelism. It must divide the attention heads and KV groups."},
    )
    rollplex_weight_mapping: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "With rollplex_backend='megatron': how the rollout model reads the trained weights. 'on': every "
            "TP rank's shards live in a shared-memory file, each rank maps its peers' files, and every rollout "
            "tensor whose bytes line up on pages is a view of them (a peer's included): only the rest (e.g. "
            "row-parallel weights at t > 1) is copied after each optimizer step. 'off': views of this rank's own "
            "shards only, the rest rebuilt from an all-gather. 'auto': 'on' where it can run (CPU, one host per TP "
            "group, room in /dev/shm, one dtype), else 'off' with the reason logged. Same weights either way.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_row_parallel_views: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "With rollplex_backend='megatron', the weight mapping and t > 1: a row-parallel weight (o_proj, "
            "down_proj) is split over the TP ranks along its input features, so in the transformers layout every "
            "row holds a piece of every rank's shard and no page stitching makes it one tensor. 'on': the rollout "
            "model reads it in place, as one strided (out, t, in / t) view of the mapped shards, through a split-K "
            "Linear (the same sum grouped by shard: nothing copied after a step, no second copy held; checkpoints "
            "still write the (out, in) weight). 'off': a copy rebuilt after each optimizer step. 'auto': 'on' "
            "where the mapping runs and the rollout is the transformers model (with vLLM the engine copies every "
            "weight anyway).",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_shm_all_reduce: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "With rollplex_backend='megatron' and t > 1 on CPU: the all-reduces of every decoder layer (the "
            "row-parallel outputs forward, the column-parallel input gradients backward) through one shared-memory "
            "file instead of gloo's loopback TCP (6-25x less time per all-reduce on CPU). Every rank sums in the "
            "same rank order, so the results are identical on every rank (at t = 2 gloo's sums bit for bit). "
            "'auto': where it can run (an x86 CPU, t > 1, the TP group on one host, room in /dev/shm), else gloo "
            "with the reason logged; 'on': refuse to start otherwise; 'off': gloo.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_pooled_rollout: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "With rollplex_backend='megatron' and t > 1 on CPU: the transformers rollout (prefill and "
            "decode) once per TP group, on its first rank with the intra-op threads of all t ranks, while the "
            "peers wait without taking a core, instead of every rank decoding the same batch with its own threads "
            "(the group trains on the first rank's completions either way). 'auto': where it can run (CPU, the TP "
            "group on one host, the transformers rollout, rollplex_overlap not 'on'), else every rank decodes, "
            "with the reason logged; 'on': refuse to start otherwise; 'off': every rank decodes.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_split_vision: Literal["auto", "on", "off"] = _option(
        rule=_Rule("mode", "'auto', 'on' or 'off'", choices=_MODES),
        default="auto",
        metadata={
            "help": "With rollplex_backend='megatron' and t > 1: TP rank r runs the vision tower on items r, r + t, "
            "... of the batch's images and videos, the features of all items are gathered over the TP group and "
            "the tower's gradients summed over it once per optimizer step, instead of every rank running the "
            "tower on every item (the replicated tower is most of a rank's prompt work for video at large t: "
            "docs/megatron.md). The same numbers up to the order of the items' gradient sums. 'auto': at t > 1 "
            "with a vision tower; 'on': refuse to start otherwise; 'off': the tower replicated.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_video_sampling: Literal["config", "processor"] = _option(
        rule=_Rule("choice", "'config' or 'processor'", choices=("config", "processor")),
        default="config",
        metadata={
            "help": "Where the frame sampling comes from. 'config': the rollplex_video_* fields (Video-R1's "
            "settings by default). 'processor': the model's video processor's own settings (its fps, 2 where it "
            "has none; min/max frames; pixel bounds per frame for Qwen2.5-VL, over frames x height x width of the "
            "whole clip for Qwen3-VL), as the family samples by itself; a rollplex_video_* field set away from its "
            "default is then refused, not ignored.",
            "choices": ["config", "processor"],
        },
    )
    rollplex_video_fps: float = _option(
        rule=_Rule("float", "a finite number > 0", lambda v: v > 0),
        default=2.0, metadata={"help": "Frames sampled per second of video, as qwen-vl-utils does (FPS)."}
    )
    rollplex_video_min_frames: int = _option(
        rule=_Rule("int", "an integer >= 1", lambda v: v >= 1),
        default=4, metadata={"help": "Fewest frames sampled from one video."})
    rollplex_video_max_frames: int = _option(
        rule=_Rule("int", f"an integer >= {_FRAME_FACTOR} (Qwen2.5-VL merges {_FRAME_FACTOR} frames per temporal "
                   "patch)", lambda v: v >= _FRAME_FACTOR),
        default=16, metadata={"help": "Most frames sampled from one video (Video-R1 trains with 16)."}
    )
    rollplex_video_min_pixels: int = _option(
        rule=_Rule("int", "an integer >= 1", lambda v: v >= 1),
        default=16 * 28 * 28, metadata={"help": "Lower bound on the pixels of one sampled video frame."}
    )
    rollplex_video_max_pixels: int = _option(
        rule=_Rule("int", f"an integer >= {_MIN_FRAME_PIXELS} (one 28x28 patch: ViT patch 14 x spatial merge 2)",
                   lambda v: v >= _MIN_FRAME_PIXELS),
        default=128 * 28 * 28,
        metadata={"help": "Upper bound on the pixels of one sampled video frame (Video-R1: 128*28*28)."},
    )
    rollplex_max_prompt_length: int | None = _option(
        rule=_Rule("optional_int", "None or an integer >= 1", lambda v: v is None or v >= 1),
        default=None,
        metadata={
            "help": "Budget for prompt tokens, visual tokens included. Longer prompts raise an error naming the "
            "sample (or are skipped with rollplex_skip_invalid_samples); they are never truncated, because cutting "
            "a prompt would cut visual tokens. None means no budget."
        },
    )
    rollplex_skip_invalid_samples: bool = _option(
        rule=_Rule("bool", "true or false"),
        default=False,
        metadata={
            "help": "Skip samples with a missing or undecodable video/image or an over-budget prompt instead of "
            "raising. Each skipped sample is replaced by a valid sample drawn uniformly (seeded, reproducible) and "
            "counted in rollplex/skipped_samples and rollplex/skipped_fraction."
        },
    )
    rollplex_max_skipped_fraction: float = _option(
        rule=_Rule("float", "a number in [0, 1]", lambda v: 0 <= v <= 1),
        default=0.05,
        metadata={
            "help": "With rollplex_skip_invalid_samples: the largest fraction of the rows read that may be invalid. "
            "Above it training stops with an error listing the first skipped samples (a dataset that bad is more "
            "likely a wrong path or format than a few broken files). 1.0 never stops."
        },
    )
    rollplex_check_rows: int = _option(
        rule=_Rule("int", "an integer >= 0", lambda v: v >= 0),
        default=4,
        metadata={"help": "Before the models load, open the video and image files of the first this many rows of "
                  "each dataset and run those rows through the training's preparation (frames sampled, chat "
                  "template, processor, rollplex_max_prompt_length), so a missing or corrupt file or a prompt over "
                  "budget is reported at start-up (naming the sample and the file) instead of at the first step. "
                  "0: off. Skipped with rollplex_skip_invalid_samples. `rollplex-trl check-data` checks a whole "
                  "file."},
    )
    rollplex_media_cache_size: int = _option(
        rule=_Rule("int", "an integer >= 0", lambda v: v >= 0),
        default=64,
        metadata={
            "help": "How many prepared prompts (decoded frames + processor output) to keep in memory, so the G "
            "copies of a prompt and repeated generation batches decode each video once."
        },
    )
    # ---- Video-R1's recipe (arXiv 2503.21776): T-GRPO and length control. They change what is learned: off by default.
    rollplex_temporal: bool = _option(
        rule=_Rule("bool", "true or false"),
        default=False,
        metadata={
            "help": "T-GRPO (Video-R1's --temporal true): for each video prompt also sample "
            "rollplex_temporal_generations completions on a copy with its frames shuffled (scored, never trained on); "
            "where the ordered completions' mean accuracy p >= rollplex_temporal_mu * the shuffled ones' p~, add "
            "rollplex_temporal_alpha to each correct (accuracy > 0.1) ordered completion's accuracy reward. Per "
            "prompt group; image and text prompts are unaffected. See docs/temporal.md."
        },
    )
    rollplex_temporal_generations: int | None = _option(
        rule=_Rule("optional_int", "an integer >= 1 or None", lambda v: v is None or v >= 1),
        default=None,
        metadata={"help": "Completions sampled on each shuffled clip. None: num_generations // 2 (Video-R1's)."},
    )
    rollplex_temporal_alpha: float = _option(
        rule=_Rule("float", "a number >= 0", lambda v: v >= 0),
        default=0.3,
        metadata={"help": "T-GRPO's bonus α added to the accuracy reward of correct ordered completions "
                          "(Video-R1: 0.3)."},
    )
    rollplex_temporal_mu: float = _option(
        rule=_Rule("float", "a number >= 0", lambda v: v >= 0),
        default=0.8,
        metadata={"help": "T-GRPO's margin μ: the bonus applies where p >= μ * p~ (Video-R1: 0.8)."},
    )
    rollplex_temporal_shuffle: Literal["frame", "patch"] = _option(
        rule=_Rule("choice", "'frame' or 'patch'", choices=("frame", "patch")),
        default="frame",
        metadata={
            "help": "What T-GRPO shuffles. 'frame': the sampled frames (Video-R1's behaviour). 'patch': whole temporal "
            "patches (2 frames on Qwen2.5-VL), whose vision features are then an exact permutation of the ordered "
            "clip's: the transformers rollout permutes those instead of running the vision tower again "
            "(docs/temporal.md).",
            "choices": ["frame", "patch"],
        },
    )
    rollplex_temporal_reward: str = _option(
        rule=_Rule("text", "a reward function's name, or '' for the first one"),
        default="",
        metadata={
            "help": "The accuracy reward T-GRPO and length control read and T-GRPO's bonus is added to: a reward "
            "function's name (its __name__, as TRL logs it), or '' for the first reward function (Video-R1's)."
        },
    )
    rollplex_len_control: bool = _option(
        rule=_Rule("bool", "true or false"),
        default=False,
        metadata={
            "help": "Video-R1's length control (--len_control true): where more than one completion of a group is "
            "correct (accuracy > 0.1), add rollplex_len_control_bonus to each correct one whose length in tokens lies "
            "in [rollplex_len_control_min, rollplex_len_control_max]."
        },
    )
    rollplex_len_control_min: int = _option(
        rule=_Rule("int", "an integer >= 0", lambda v: v >= 0),
        default=320,
        metadata={"help": "Length control's lower bound in completion tokens, inclusive (Video-R1: 320)."},
    )
    rollplex_len_control_max: int = _option(
        rule=_Rule("int", "an integer >= 0", lambda v: v >= 0),
        default=512,
        metadata={"help": "Length control's upper bound in completion tokens, inclusive (Video-R1: 512)."},
    )
    rollplex_len_control_bonus: float = _option(
        rule=_Rule("float", "a number", lambda v: True),
        default=0.2,
        metadata={"help": "Length control's bonus added to the reward (Video-R1: 0.2)."},
    )
    rollplex_verify_every: int | None = _option(
        rule=_Rule("optional_int", "an integer >= 0 or None", lambda v: v is None or v >= 0),
        default=None,
        metadata={"help": "Exactness audit (docs/verify.md): every this many steps (and at step 0), recompute the "
                  "first rollplex_verify_rows rows of each log-prob pass Rollplex ran (reference, old, actor) with a "
                  "plain full forward (on the Megatron backend its own full rows), and the rollout's own log-probs "
                  "of the sampled tokens and the actor's gradient; log the largest differences as rollplex/verify_*; "
                  "warn above a tolerance set by the precision. 0: off. None: every 200 steps."},
    )
    rollplex_verify_rows: int | None = _option(
        rule=_Rule("optional_int", "an integer >= 1 or None", lambda v: v is None or v >= 1),
        default=None,
        metadata={"help": "Rows each audited pass recomputes (the first rows of the batch: completions of one "
                  "prompt). None: 2, the fewest that exercise sharing one prefix; the plain recomputation pays the "
                  "prompt (video) once per row, so a whole group costs G/2 times as much."},
    )
    rollplex_verify_strict: bool = _option(
        rule=_Rule("bool", "true or false"),
        default=False,
        metadata={"help": "Raise instead of warning when the exactness audit finds a difference above tolerance."},
    )

    def __post_init__(self) -> None:
        _validate(self)  # first: a bad rollplex_* value is reported as such, whatever else is wrong
        # TRL's GRPOConfig defaults the deprecated `gradient_checkpointing` to True, so transformers (>= 5.x, which
        # renamed it `activation_checkpointing`) warned "deprecated" on every config nobody wrote it in. Carrying
        # TRL's default over to the new name first is transformers' own resolution (the new name takes the old
        # value), without the warning; a user's explicit False still goes through (and warns) as before.
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is True:
            self.activation_checkpointing = True
        super().__post_init__()


# every rollplex_* field's rule, by name (the dataclass gave each declared field its name)
_RULES: dict[str, _Rule] = {declared.name: rule for declared, rule in _DECLARED}


def rollplex_field_names() -> list[str]:
    """Names of the fields RollplexGRPOConfig adds to GRPOConfig."""
    base = {f.name for f in fields(GRPOConfig)}
    return [f.name for f in fields(RollplexGRPOConfig) if f.name not in base]


def rollplex_options(args: Any) -> dict[str, Any]:
    """The rollplex_* values of ``args``; a plain GRPOConfig gets the (safe) defaults."""
    defaults = {f.name: f.default for f in fields(RollplexGRPOConfig)}
    return {name: getattr(args, name, defaults[name]) for name in rollplex_field_names()}




def _read(name: str, value: Any, rule: _Rule) -> Any:
    """`value` as the field's type (YAML and command lines give strings, YAML 1.1 reads on/off as booleans), or a
    ValueError naming the field and what it allows. Never a silent reinterpretation: "false" is False, not truthy."""
    def bad() -> ValueError:
        return ValueError(f"{name} must be {rule.allowed}, got {value!r} ({type(value).__name__})")

    text = value.strip().lower() if isinstance(value, str) else None
    if rule.kind == "mode":
        if isinstance(value, bool):  # `rollplex_overlap: off` in a YAML file arrives as False
            return "on" if value else "off"
        if text in rule.choices:
            return text
        raise bad()
    if rule.kind == "choice":
        if text in rule.choices:
            return text
        raise bad()
    if rule.kind == "text":
        if isinstance(value, str):
            return value.strip()
        raise bad()
    if rule.kind == "bool":
        if isinstance(value, bool):
            return value
        if text in _TRUE_WORDS or (isinstance(value, int) and value == 1):
            return True
        if text in _FALSE_WORDS or (isinstance(value, int) and value == 0):
            return False
        raise bad()
    if rule.kind == "optional_int" and (value is None or text in ("none", "null")):
        return None
    if isinstance(value, bool):  # True is an int to Python, never a count here
        raise bad()
    try:
        if rule.kind == "float":
            number = float(value)
            if not math.isfinite(number):
                raise bad()
            return number
        if isinstance(value, float) and not value.is_integer():
            raise bad()
        return int(text) if text is not None else int(value)
    except (TypeError, ValueError) as err:
        if isinstance(err, ValueError) and str(err).startswith(name):
            raise
        raise bad() from None


# the fields rollplex_video_sampling="processor" replaces by the video processor's own settings
_PROCESSOR_SAMPLED = ("rollplex_video_fps", "rollplex_video_min_frames", "rollplex_video_max_frames",
                      "rollplex_video_min_pixels", "rollplex_video_max_pixels")


def _validate(cfg: RollplexGRPOConfig) -> None:
    """Read every rollplex_* value as its type and check its range, naming the field; then the cross-field rules."""
    for name, rule in _RULES.items():
        value = _read(name, getattr(cfg, name), rule)
        if not rule.ok(value):
            raise ValueError(f"{name} must be {rule.allowed}, got {getattr(cfg, name)!r}")
        setattr(cfg, name, value)
    if cfg.rollplex_video_min_frames > cfg.rollplex_video_max_frames:
        raise ValueError(
            "need rollplex_video_min_frames <= rollplex_video_max_frames, got "
            f"{cfg.rollplex_video_min_frames} and {cfg.rollplex_video_max_frames}"
        )
    if cfg.rollplex_backend != "megatron" and cfg.rollplex_tensor_parallel_size != 1:
        raise ValueError(f"rollplex_tensor_parallel_size={cfg.rollplex_tensor_parallel_size} needs "
                         "rollplex_backend='megatron' (the 'hf' backend is data-parallel only)")
    if cfg.rollplex_backend != "megatron" and cfg.rollplex_weight_mapping == "on":
        raise ValueError("rollplex_weight_mapping='on' needs rollplex_backend='megatron' (the 'hf' backend trains "
                         "the rollout model itself: there is nothing to map)")
    if cfg.rollplex_row_parallel_views == "on" and (cfg.rollplex_backend != "megatron"
                                                     or cfg.rollplex_weight_mapping == "off"):
        raise ValueError("rollplex_row_parallel_views='on' needs rollplex_backend='megatron' with "
                         "rollplex_weight_mapping 'auto' or 'on' (the views read the mapped training shards)")
    if cfg.rollplex_backend != "megatron" and cfg.rollplex_shm_all_reduce == "on":
        raise ValueError("rollplex_shm_all_reduce='on' needs rollplex_backend='megatron' (the 'hf' backend has no "
                         "tensor-parallel all-reduce)")
    if cfg.rollplex_split_vision == "on" and (cfg.rollplex_backend != "megatron"
                                              or cfg.rollplex_tensor_parallel_size == 1):
        raise ValueError("rollplex_split_vision='on' needs rollplex_backend='megatron' with "
                         "rollplex_tensor_parallel_size > 1 (it spreads the vision tower's items over the TP ranks)")
    if cfg.rollplex_backend != "megatron" and cfg.rollplex_pooled_rollout == "on":
        raise ValueError("rollplex_pooled_rollout='on' needs rollplex_backend='megatron' (the 'hf' backend's "
                         "processes each decode their own prompts)")
    if cfg.rollplex_memory == "on" and cfg.beta != 0.0 and cfg.sync_ref_model:
        raise ValueError("rollplex_memory='on' cannot move the reference model: sync_ref_model=True writes the policy "
                         "into it every ref_model_sync_steps steps. Set sync_ref_model=False, or "
                         "rollplex_memory='auto' to keep it resident")
    if cfg.rollplex_len_control_min > cfg.rollplex_len_control_max:
        raise ValueError("need rollplex_len_control_min <= rollplex_len_control_max, got "
                         f"{cfg.rollplex_len_control_min} and {cfg.rollplex_len_control_max}")
    if cfg.rollplex_video_sampling == "processor":
        import dataclasses

        defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name in _PROCESSOR_SAMPLED}
        changed = sorted(name for name, default in defaults.items() if getattr(cfg, name) != default)
        if changed:
            raise ValueError(f"rollplex_video_sampling='processor' takes the frame sampling from the video processor, "
                             f"but {', '.join(changed)} {'is' if len(changed) == 1 else 'are'} set: leave "
                             f"{'it' if len(changed) == 1 else 'them'} at the default, or use "
                             "rollplex_video_sampling='config'")
    if cfg.rollplex_video_min_pixels > cfg.rollplex_video_max_pixels:
        raise ValueError(
            "need rollplex_video_min_pixels <= rollplex_video_max_pixels, got "
            f"{cfg.rollplex_video_min_pixels} and {cfg.rollplex_video_max_pixels}"
        )
