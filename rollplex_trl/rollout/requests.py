"""Rollout requests: one per prompt with n = its number of samples, built from TRL's rows or our prepared prompts.

vLLM takes frames and images (it runs the model's processor itself), so a prepared video prompt travels as the
`FramedPrompt` our loader made (data/framed.py): its token ids with placeholders already expanded, its sampled frames
and their metadata.
"""

from __future__ import annotations

from typing import Any

from rollplex_trl.data.framed import FramedPrompt, video_item
from rollplex_trl.data.prompt import PreparedPrompt, prompt_identity
from rollplex_trl.rollout.engine import RolloutRequest


def request_for(prompt: PreparedPrompt, n: int) -> RolloutRequest:
    """A vLLM request for one prepared prompt: its token ids (placeholders already expanded by our processor run)
    and, for a `FramedPrompt`, its frames and images."""
    if not isinstance(prompt, FramedPrompt):
        if prompt.pixel_values is not None or prompt.pixel_values_videos is not None:
            raise ValueError(f"{prompt.describe()}: the prompt has images or videos but no frames for vLLM; "
                             "prepare it with FramedPromptDataset")
        return RolloutRequest(list(prompt.prompt_ids), n)
    data: dict[str, Any] = {}
    if prompt.images:
        data["image"] = list(prompt.images)
    if prompt.videos:
        data["video"] = [video_item(v) for v in prompt.videos]
    kwargs = None
    if prompt.videos and prompt.pixel_bounds is not None:
        # the frames are already at their final size: bounds around it make vLLM's resize a no-op. Scoped to the
        # video processor (vLLM's Qwen-VL processing keeps `images_kwargs`/`videos_kwargs` apart): flat `size` would
        # also resize the prompt's images, which the trainer processed with the image processor's own bounds
        bounds = {"shortest_edge": prompt.pixel_bounds[0], "longest_edge": prompt.pixel_bounds[1]}
        kwargs = {"videos_kwargs": {"size": bounds}}
    return RolloutRequest(list(prompt.prompt_ids), n, multi_modal_data=data or None, mm_processor_kwargs=kwargs)


def requests_for_rows(prompt_ids: list[list[int]], images: list | None, rows: list | None,
                      num_generations: int) -> tuple[list[RolloutRequest], list[int]]:
    """One request per run of identical consecutive rows (n = run length), and each row's request index.

    TRL's sampler puts a prompt's G copies next to each other; a rank may hold part of a group when its batch is not
    a multiple of G, so runs are found, not assumed. With num_generations == 1 (tool turns) every row is its own.
    """
    requests: list[RolloutRequest] = []
    owner: list[int] = []
    previous = None
    for i, ids in enumerate(prompt_ids):
        row = rows[i] if rows is not None else None
        row_images = images[i] if images is not None else None
        key = prompt_identity(ids, row, row_images) if num_generations > 1 else None
        if key is not None and key == previous:
            requests[-1].n += 1
        else:
            if row is not None:
                request = request_for(row, 1)
            else:
                data = {"image": row_images if len(row_images) > 1 else row_images[0]} if row_images else None
                request = RolloutRequest(list(ids), 1, multi_modal_data=data)
            requests.append(request)
            previous = key
        owner.append(len(requests) - 1)
    return requests, owner
