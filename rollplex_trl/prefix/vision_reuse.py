"""Vision features reused between the prefills of one step: T-GRPO's shuffled clip at temporal-patch granularity.

Qwen2.5-VL's vision tower encodes each temporal patch (2 frames) on its own (tests/temporal/test_shuffle.py checks
this against the tower's output), so a clip whose temporal patches are permuted has the ordered clip's features,
permuted in blocks of one temporal patch's tokens. `VideoFeatureStore` keeps, for one generation batch, the
per-video features the ordered rollout's prefill computed, and hands the shuffled copy's prefill those features
permuted instead of running the tower again.

The prefill asks for features through `VideoFeatures.resolve`, called by `prefix_forward` where the tower would run
(inside its grad mode and checkpointing): videos the store can derive are permuted copies of recorded features;
the others go through the model's own `get_video_features` (the call its forward makes on the same pixels), and
are recorded (detached) for copies made later in the step. The model then gets them as `mm_encoder_outputs` (a
public argument of transformers' Qwen2.5-VL forward) instead of `pixel_values_videos`. A model whose tower also
returns per-block features for the LLM's first layers (Qwen3-VL's DeepStack, `deepstack_features`) gets those
recorded and permuted the same way (its tower, too, encodes each temporal patch on its own).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from rollplex_trl.data.prompt import PreparedPrompt


def accepts_encoder_outputs(backbone: Any) -> bool:
    """Whether the model's forward takes `mm_encoder_outputs` (transformers' Qwen2.5-VL does from 5.2x; the vLLM
    tier's 5.19 may not): without it the features cannot be handed in, and the tower runs as usual."""
    return "mm_encoder_outputs" in inspect.signature(backbone.forward).parameters


@dataclass(frozen=True)
class DerivedVideo:
    """Video `video_index` of prompt `source_key`, its temporal patches permuted: patch i of the copy is patch
    `permutation[i]` of the source."""

    source_key: int
    video_index: int
    permutation: torch.Tensor


@dataclass(frozen=True)
class VideoEncoding:
    """One video's tower outputs: the merged features the LLM's video tokens get, and, where the model has them,
    one feature map per DeepStack level (the same tokens)."""

    pooled: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    def detach(self) -> VideoEncoding:
        return VideoEncoding(self.pooled.detach(), tuple(t.detach() for t in self.deepstack))

    def permuted(self, permutation: torch.Tensor, num_patches: int) -> VideoEncoding:
        """The encoding of the clip whose temporal patch i is this clip's patch `permutation[i]`."""
        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(num_patches, -1, t.size(-1))[permutation.to(t.device)].reshape(t.shape)

        return VideoEncoding(permute(self.pooled), tuple(permute(t) for t in self.deepstack))


@dataclass
class VideoFeatureStore:
    """One generation batch's recorded video features (by prompt key and video index) and the copies derived from
    them. Lives on the trainer's `BatchContext`; dropped with the batch."""

    features: dict[tuple[int, int], VideoEncoding] = field(default_factory=dict)
    derived: dict[tuple[int, int], DerivedVideo] = field(default_factory=dict)
    reused: int = 0  # videos whose features came from the store
    encoded: int = 0  # videos the tower encoded while the store was on
    output_type: type | None = None  # the class of the model's `get_video_features` output

    def derive(self, copy: PreparedPrompt, source: PreparedPrompt, permutations: Sequence[torch.Tensor]) -> None:
        """`copy`'s videos are `source`'s with their temporal patches permuted by `permutations` (one per video)."""
        for v, perm in enumerate(permutations):
            self.derived[(copy.prompt_key, v)] = DerivedVideo(source.prompt_key, v, perm)

    def lookup(self, row: PreparedPrompt, video_index: int, num_patches: int) -> VideoEncoding | None:
        """The encoding of the row's video, derived from a recorded one, or None (not derived, or not recorded)."""
        derived = self.derived.get((row.prompt_key, video_index))
        if derived is None:
            return None
        source = self.features.get((derived.source_key, derived.video_index))
        return None if source is None else source.permuted(derived.permutation, num_patches)

    def for_rows(self, rows: Sequence[PreparedPrompt]) -> VideoFeatures:
        return VideoFeatures(self, list(rows))


@dataclass
class VideoFeatures:
    """The features of the videos of `rows` (in row order, as `vision_inputs` concatenates their pixels)."""

    store: VideoFeatureStore
    rows: list[PreparedPrompt]

    def resolve(self, backbone: Any, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor
                ) -> dict[str, BaseModelOutputWithPooling]:
        """`mm_encoder_outputs["video"]` for the backbone's forward: per video, derived features where the store
        has them, the tower's own output on the video's pixels otherwise (one tower call for all of those)."""
        videos = [(row, v) for row in self.rows
                  for v in range(0 if row.video_grid_thw is None else row.video_grid_thw.size(0))]
        if len(videos) != video_grid_thw.size(0):
            raise ValueError(f"internal error: {len(videos)} videos in the rows, {video_grid_thw.size(0)} grids")
        grid = video_grid_thw.tolist()
        pixels = pixel_values_videos.split([t * h * w for t, h, w in grid])
        encodings: list[VideoEncoding | None] = [self.store.lookup(row, v, grid[i][0])
                                                 for i, (row, v) in enumerate(videos)]
        todo = [i for i, e in enumerate(encodings) if e is None]
        if todo:
            out = backbone.get_video_features(torch.cat([pixels[i] for i in todo]), video_grid_thw[todo],
                                              return_dict=True)
            self.store.output_type = type(out)
            levels = getattr(out, "deepstack_features", None) or []
            for j, i in enumerate(todo):
                encodings[i] = VideoEncoding(out.pooler_output[j], tuple(level[j] for level in levels))
                row, v = videos[i]
                if (row.prompt_key, v) not in self.store.derived:
                    self.store.features[(row.prompt_key, v)] = encodings[i].detach()
        self.store.reused += len(videos) - len(todo)
        self.store.encoded += len(todo)
        fields: dict[str, Any] = {"pooler_output": tuple(e.pooled for e in encodings)}
        if encodings and encodings[0].deepstack:
            fields["deepstack_features"] = [tuple(e.deepstack[k] for e in encodings)
                                            for k in range(len(encodings[0].deepstack))]
        return {"video": (self.store.output_type or BaseModelOutputWithPooling)(**fields)}
