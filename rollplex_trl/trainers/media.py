"""Which of the trainer's datasets take the prepared-prompt path, and how (map-style wrapper or streamed batches).

Video datasets always do: TRL 1.16 has no video path (it would silently drop the frames). Image datasets do when the
shared prefix is on (it needs each row's prompt identity and per-prompt pixels, which TRL's flat image tensor does
not carry); otherwise they take TRL's own path. With vLLM the rows also keep the frames our loader sampled
(`FramedPrompt`), because vLLM processes media itself and cannot take pixel patches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import datasets
import torch

from rollplex_trl.data.errors import RollplexDataError
from rollplex_trl.data.framed import FramedMediaPreparer, FramedPromptDataset
from rollplex_trl.data.prepared import (
    IMAGE_COLUMNS,
    MediaOptions,
    MediaPreparer,
    PreparedPromptDataset,
    StreamPreparer,
    has_column,
    has_video_column,
)
from rollplex_trl.data.video import VideoSamplingConfig
from rollplex_trl.models.families import frame_factor, processor_video_sampling


def media_options(options: dict[str, Any], chat_template: str | None, chat_template_kwargs: dict | None,
                  processor: Any = None) -> MediaOptions:
    """The `rollplex_*` media fields as the data module's options, frames at the processor's patch multiple. With
    `rollplex_video_sampling="processor"` the frame sampling is the processor's own (models/families.py
    `processor_video_sampling`); without a processor to read it from (a text model), the fields' defaults stand, and
    a video dataset is refused later anyway."""
    if options.get("rollplex_video_sampling", "config") == "processor" and processor is not None:
        sampling = VideoSamplingConfig(**processor_video_sampling(processor))
    else:
        sampling = VideoSamplingConfig(
            fps=options["rollplex_video_fps"], min_frames=options["rollplex_video_min_frames"],
            max_frames=options["rollplex_video_max_frames"], min_pixels=options["rollplex_video_min_pixels"],
            max_pixels=options["rollplex_video_max_pixels"],
        )
    factor = frame_factor(processor) if processor is not None else None
    if factor is not None:  # frames at the multiple the model patches (recorded in the checkpoint as such)
        sampling = replace(sampling, image_factor=factor)
    return MediaOptions(
        sampling=sampling,
        max_prompt_length=options["rollplex_max_prompt_length"],
        skip_invalid=options["rollplex_skip_invalid_samples"],
        max_skipped_fraction=options["rollplex_max_skipped_fraction"],
        cache_size=options["rollplex_media_cache_size"],
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )


@dataclass
class DatasetPreparation:
    """Wraps datasets for the prepared-prompt path; holds the stream preparer of a streamed video dataset."""

    processor: Any
    options: MediaOptions
    is_vlm: bool
    prepare_images: bool  # Support.prepare_images
    framed: bool  # use_vllm: rows keep their frames and images
    custom_rollout: bool  # tools, environments or a rollout_func
    stream_preparer: StreamPreparer | None = None

    def record_skips(self, train_dataset: Any, record: Callable[[str, float], None]) -> None:
        """`rollplex/skipped_samples` and `rollplex/skipped_fraction` of the training data (map-style or streamed)."""
        sources = [d for d in (train_dataset, self.stream_preparer) if hasattr(d, "num_skipped")]
        record("rollplex/skipped_samples", float(sum(d.num_skipped for d in sources)))
        record("rollplex/skipped_fraction", max([float(d.skipped_fraction) for d in sources], default=0.0))

    def wrap(self, dataset: Any, name: str) -> Any:
        """`dataset` as the trainer should read it (possibly unchanged); `name` labels errors ("train", "eval")."""
        if dataset is None or isinstance(dataset, PreparedPromptDataset):
            return dataset
        if not has_video_column(dataset):
            shareable_images = (self.prepare_images and hasattr(dataset, "__getitem__")
                                and not isinstance(dataset, torch.utils.data.IterableDataset)
                                and has_column(dataset, IMAGE_COLUMNS))
            return self._prepared(dataset) if shareable_images else dataset
        if not self.is_vlm:
            raise RollplexDataError(
                f"the {name} dataset has a video column but the processing class is a tokenizer, not a processor. "
                "Pass the model's processor (e.g. AutoProcessor.from_pretrained(...)) as processing_class."
            )
        streamed = isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__")
        if streamed and not isinstance(dataset, datasets.IterableDataset):
            raise RollplexDataError(
                f"the {name} dataset is iterable but not a datasets.IterableDataset; TRL groups the G completions "
                "of a prompt only in map-style datasets and datasets.IterableDataset streams. Wrap it with "
                "datasets.IterableDataset.from_generator(...)."
            )
        if self.custom_rollout:
            raise NotImplementedError("video prompts with tools, environments or a rollout_func are not supported.")
        if streamed:  # TRL reorders the stream itself: its rows are prepared per generation batch
            if self.stream_preparer is None:
                preparer_cls = FramedMediaPreparer if self.framed else MediaPreparer
                self.stream_preparer = StreamPreparer(preparer_cls(self.processor, self.options), self.options)
            return dataset
        return self._prepared(dataset)

    def has_video(self, *wrapped: Any) -> bool:
        """Whether any of the wrapped datasets (or the stream) carries video."""
        return self.stream_preparer is not None or any(
            isinstance(d, PreparedPromptDataset) and has_video_column(d.base) for d in wrapped)

    def _prepared(self, dataset: Any) -> PreparedPromptDataset:
        # vLLM processes media itself from frames and images (it cannot take pixel patches): its rows keep the
        # media our loader decoded, so nothing is decoded twice (data/framed.py)
        cls = FramedPromptDataset if self.framed else PreparedPromptDataset
        return cls(dataset, self.processor, self.options)


def setup_video_training(trainer: Any) -> None:
    """What a run on video datasets sets up once: the video placeholder suppressed in sampling, and the frame
    sampling recorded in the model's config (so every checkpoint and the final model carry it; `rollplex-trl ask`
    samples frames the way training did)."""
    suppress_video_token(trainer)
    record_video_sampling(trainer)


# the model config attribute holding the training's frame sampling (rollplex_trl.inference reads it)
SAMPLING_CONFIG_KEY = "rollplex_video_sampling"


def record_video_sampling(trainer: Any) -> None:
    import dataclasses

    config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    if config is not None:
        setattr(config, SAMPLING_CONFIG_KEY, dataclasses.asdict(trainer.media.options.sampling))


def suppress_video_token(trainer: Any) -> None:
    """TRL suppresses the image placeholder in sampling ("a sampled image token would mismatch the image
    features"); a sampled video placeholder would do the same to the video features. Only for video datasets:
    changing the sampling distribution otherwise would make image/text runs differ from TRL's."""
    from rollplex_trl import trl_compat

    video_token_id = getattr(trainer.model.config, "video_token_id", None)
    gen_config = getattr(trainer, "generation_config", None)
    if not trl_compat.is_vlm(trainer) or video_token_id is None or gen_config is None:
        return
    suppressed = list(gen_config.suppress_tokens or [])
    if video_token_id not in suppressed:
        gen_config.suppress_tokens = suppressed + [video_token_id]
        trainer.generation_kwargs["suppress_tokens"] = gen_config.suppress_tokens
