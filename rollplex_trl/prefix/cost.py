"""The modelled cost of the scoring passes, serial vs shared prefix: what `rollplex_share_prefix="auto"` decides from.

Sharing the prefix removes G-1 of every G copies of the prompt from the linear layers (and G-1 of G vision-tower
runs), but the completions' attention over the prompt stays, and how much of it is computed depends on the suffix
attention path:

- serial (TRL's full forward, G rows of P + C tokens): every token through the linear layers, the vision tower once
  per row, causal attention over P + C (counted as the causal half: the cheapest the fused kernels do; a padded
  batch computes the full square, so this is the serial path at its best);
- shared, "cascade" suffix: the prompt once (P tokens, causal), each row's 1 + C tokens through the linear layers,
  their attention over the prompt (C x P per row) and causally over their own tokens (half of C x C);
- shared, "concat" suffix: the same linear work, but the rows' attention gets an explicit mask, so the full
  C x (P + C) is computed per row (the masked upper half included). This is what makes the shared path slower than
  serial at a low prompt share: ~0.81-0.88x at ~10% share with G = 8 or 16 on the `small` preset, which this model
  predicts (0.85x; `benchmarks/bench_shared_prefix.py --low-share`).

Costs are forward FLOPs of the matmuls (the backward scales both paths alike). Elementwise work, the K/V copy of the
concat path and kernel-launch overhead are left out; at a high share they favour sharing further, at a low share
the model was measured to overstate the shared path's advantage by up to ~5% (cascade at ~10% share: modelled
1.10x, measured 1.01-1.07x), hence `SHARE_MARGIN`.

The decision is taken once, from the first rollout's prompts (mean prompt length and visual tokens, reduced over
every process so all ranks decide alike) and the configured completion bound `max_completion_length` (completions
are at most that long; a shorter completion only raises the prompt share, where sharing pays more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollplex_trl.memory.model_dims import ModelDims

# Sharing is chosen when the serial cost is at least this multiple of the shared one (see the module docstring)
SHARE_MARGIN = 1.05


@dataclass(frozen=True)
class ScoringShape:
    """The shape of one group's scoring: mean prompt tokens P (visual tokens included), of which `visual_tokens`
    are the vision tower's merged outputs, completion tokens C, and G completions per prompt."""

    prompt_tokens: float
    completion_tokens: float
    group_size: int
    visual_tokens: float = 0.0

    @property
    def prompt_share(self) -> float:
        return self.prompt_tokens / max(1.0, self.prompt_tokens + self.completion_tokens)


def linear_flops_per_token(dims: ModelDims) -> float:
    """Forward FLOPs of one token through every decoder layer's projections and MLP (2 per weight)."""
    h, d = dims.hidden, dims.head_dim
    per_layer = h * dims.heads * d + 2 * h * dims.kv_heads * d + dims.heads * d * h + 3 * h * dims.intermediate
    return 2.0 * per_layer * dims.layers


def attention_flops_per_pair(dims: ModelDims) -> float:
    """Forward FLOPs of one (query, key) pair over all layers: q.k and p.v for every query head."""
    return 4.0 * dims.heads * dims.head_dim * dims.layers


def vision_flops_per_visual_token(dims: ModelDims, frame: tuple[int, int] | None = None) -> float:
    """Forward FLOPs of the vision tower per merged visual token (merge**2 patches): its blocks' projections and
    MLPs, the patch embedding (a convolution: 2 per weight per patch), the merger and any DeepStack mergers, and,
    given `frame` (one temporal slice's height and width in patches), the attention products (`vision_attention_
    keys_per_patch`). Without `frame` the attention is left out: the share decision compares G tower runs with one,
    and the attention scales alike (leaving it out understates sharing's gain)."""
    if dims.vision is None:
        return 0.0
    v = dims.vision
    mlp_matrices = 3 if v.gated_mlp else 2
    blocks = v.depth * (4 * v.hidden * v.hidden + mlp_matrices * v.hidden * v.intermediate)
    embed = v.in_channels * v.temporal_patch * v.patch * v.patch * v.hidden
    merged = v.hidden * v.merge**2  # a merger's MLP runs per merged token: (merged -> merged -> out) / merge**2
    mergers = (1 + v.deepstack_levels) * (merged * merged + merged * v.out_hidden) / v.merge**2
    attention = 2 * v.hidden * vision_attention_keys_per_patch(dims, frame) if frame else 0.0
    return 2.0 * (blocks + embed + mergers + attention) * v.merge**2


def vision_attention_keys_per_patch(dims: ModelDims, frame: tuple[int, int]) -> float:
    """Keys one patch attends to, summed over the tower's blocks, for frames of `frame` = (height, width) patches:
    every block attends within one temporal slice (transformers' `cu_seqlens`); Qwen2.5-VL's window blocks within
    windows of `window` pixels (`get_window_index`: whole windows from the top left, the last row and column
    partial), its full-attention blocks over the slice. q.k and p.v cost 2 x hidden FLOPs per (query, key) each."""
    v = dims.vision
    height, width = frame
    full = float(height * width)
    if not v.window or v.full_attention_blocks >= v.depth:
        return v.depth * full
    side = max(1, v.window // v.merge // v.patch)  # the window's side in merged tokens

    def squares(patches: int) -> int:  # the sum of the windows' squared extents along one axis, in patches
        merged = patches // v.merge
        parts = [side] * (merged // side) + ([merged % side] if merged % side else [])
        return sum((n * v.merge) ** 2 for n in parts)

    windowed = squares(height) * squares(width) / full  # sum over windows of size^2, per patch
    return v.full_attention_blocks * full + (v.depth - v.full_attention_blocks) * windowed


def head_flops(dims: ModelDims, scored_tokens: float) -> float:
    """The LM head on the scored positions (the same in both paths: TRL keeps only the completion's logits)."""
    return 2.0 * dims.hidden * dims.vocab * scored_tokens


@dataclass(frozen=True)
class ScoringFlops:
    """Forward FLOPs of one group's scoring pass, by kind (tests compare each with a FLOP counter's)."""

    linear: float  # decoder projections and MLPs
    attention: float  # q.k and p.v products
    vision: float  # vision-tower blocks
    head: float  # LM head on the scored positions

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.vision + self.head


def serial_flops(dims: ModelDims, shape: ScoringShape) -> ScoringFlops:
    """One group's scoring as TRL's full forward: G rows of P + C tokens, each with its own vision-tower run, and
    causal attention counted as its lower half (the fused kernels' best case; a padded batch computes all of it)."""
    P, C, G = shape.prompt_tokens, shape.completion_tokens, shape.group_size
    L = P + C
    return ScoringFlops(linear=G * L * linear_flops_per_token(dims),
                        attention=G * L * L / 2 * attention_flops_per_pair(dims),
                        vision=G * shape.visual_tokens * vision_flops_per_visual_token(dims),
                        head=head_flops(dims, G * C))


def shared_flops(dims: ModelDims, shape: ScoringShape, attention: str) -> ScoringFlops:
    """One group's scoring with the shared prefix: the P - 1 prompt tokens once (the prefix state), then G suffix
    rows of the last prompt token and the C completion tokens against it."""
    if attention not in ("cascade", "concat"):
        raise ValueError(f"suffix attention must be 'cascade' or 'concat', got {attention!r}")
    P, C, G = shape.prompt_tokens, shape.completion_tokens, shape.group_size
    prefix_tokens = P - 1
    rows = 1 + C
    if attention == "concat":  # an explicit mask: every query against every key, the masked ones included
        row_pairs = rows * (prefix_tokens + rows)
    else:  # the prompt part in full (no masked keys), the row's own part causally
        row_pairs = rows * prefix_tokens + rows * rows / 2
    return ScoringFlops(linear=(prefix_tokens + G * rows) * linear_flops_per_token(dims),
                        attention=(prefix_tokens * prefix_tokens / 2 + G * row_pairs) * attention_flops_per_pair(dims),
                        vision=shape.visual_tokens * vision_flops_per_visual_token(dims),
                        head=head_flops(dims, G * C))


@dataclass(frozen=True)
class ShareChoice:
    """The decision and its reason (logged once)."""

    share: bool
    modelled_speedup: float  # serial FLOPs / shared FLOPs
    shape: ScoringShape

    def reason(self, attention: str) -> str:
        s = self.shape
        verdict = "on" if self.share else "off"
        return (f"rollplex_share_prefix=auto: {verdict} (modelled scoring cost serial/shared = "
                f"{self.modelled_speedup:.2f}x, {'>=' if self.share else '<'} {SHARE_MARGIN}; mean prompt "
                f"{s.prompt_tokens:.0f} tokens ({s.visual_tokens:.0f} visual), completions up to "
                f"{s.completion_tokens:.0f} (max_completion_length), G={s.group_size}, prompt share >= "
                f"{s.prompt_share:.0%}, {attention} suffix attention; prefix/cost.py)")


def choose_sharing(dims: ModelDims, shape: ScoringShape, attention: str) -> ShareChoice:
    """Share where the modelled serial cost is at least `SHARE_MARGIN` times the shared one (G >= 2)."""
    if shape.group_size < 2:
        return ShareChoice(False, 1.0, shape)
    speedup = serial_flops(dims, shape).total / shared_flops(dims, shape, attention).total
    return ShareChoice(speedup >= SHARE_MARGIN, speedup, shape)


class SharingDecision:
    """`rollplex_share_prefix="auto"`'s cost decision, taken once at the first rollout (or, for a custom rollout
    function, the first scoring pass) and kept for the run.

    `reduce_sums` sums a list of floats over every process (identity on one process), so all ranks decide from the
    same numbers. `warn` logs the reason (the main process's logger, a no-op elsewhere).
    """

    def __init__(self, dims: ModelDims, *, attention: str, group_size: int, completion_bound: int,
                 reduce_sums: Callable[[list[float]], list[float]], warn: Callable[[str], None]) -> None:
        self.dims, self.attention, self.group_size = dims, attention, group_size
        self.completion_bound = completion_bound
        self.reduce_sums, self.warn = reduce_sums, warn
        self.choice: ShareChoice | None = None

    @property
    def decided(self) -> bool:
        return self.choice is not None

    def decide(self, prompt_lengths: list[int], visual_counts: list[int]) -> ShareChoice:
        """Decide from this process's prompts (one entry per row; a prompt's G rows weigh it equally), once."""
        if self.choice is not None:
            return self.choice
        total_tokens, total_visual, rows = self.reduce_sums(
            [float(sum(prompt_lengths)), float(sum(visual_counts)), float(len(prompt_lengths))])
        rows = max(rows, 1.0)
        shape = ScoringShape(prompt_tokens=total_tokens / rows, completion_tokens=float(self.completion_bound),
                             group_size=self.group_size, visual_tokens=total_visual / rows)
        self.choice = choose_sharing(self.dims, shape, self.attention)
        self.warn(self.choice.reason(self.attention))
        return self.choice
