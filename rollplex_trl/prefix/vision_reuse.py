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
public argument of transformers' Qwen2.5-VL forward) instead of `pixel_values_videos`.
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


@dataclass
class VideoFeatureStore:
    """One generation batch's recorded video features (by prompt key and video index) and the copies derived from
    them. Lives on the trainer's `BatchContext`; dropped with the batch."""

    features: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    derived: dict[tuple[int, int], DerivedVideo] = field(default_factory=dict)
    reused: int = 0  # videos whose features came from the store
    encoded: int = 0  # videos the tower encoded while the store was on

    def derive(self, copy: PreparedPrompt, source: PreparedPrompt, permutations: Sequence[torch.Tensor]) -> None:
        """`copy`'s videos are `source`'s with their temporal patches permuted by `permutations` (one per video)."""
        for v, perm in enumerate(permutations):
            self.derived[(copy.prompt_key, v)] = DerivedVideo(source.prompt_key, v, perm)

    def lookup(self, row: PreparedPrompt, video_index: int, num_patches: int) -> torch.Tensor | None:
        """The features of the row's video, derived from recorded ones, or None (not derived, or not recorded)."""
        derived = self.derived.get((row.prompt_key, video_index))
        if derived is None:
            return None
        source = self.features.get((derived.source_key, derived.video_index))
        if source is None:
            return None
        blocks = source.reshape(num_patches, -1, source.size(-1))
        return blocks[derived.permutation.to(source.device)].reshape(source.shape)

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
        features: list[torch.Tensor | None] = [self.store.lookup(row, v, grid[i][0])
                                               for i, (row, v) in enumerate(videos)]
        todo = [i for i, f in enumerate(features) if f is None]
        if todo:
            encoded = backbone.get_video_features(torch.cat([pixels[i] for i in todo]), video_grid_thw[todo],
                                                  return_dict=True).pooler_output
            for i, f in zip(todo, encoded, strict=True):
                features[i] = f
                row, v = videos[i]
                if (row.prompt_key, v) not in self.store.derived:
                    self.store.features[(row.prompt_key, v)] = f.detach()
        self.store.reused += len(videos) - len(todo)
        self.store.encoded += len(todo)
        return {"video": BaseModelOutputWithPooling(pooler_output=tuple(features))}
