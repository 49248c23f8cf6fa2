"""The transformers rollout behind the same interface as vLLM: `model.generate` with n samples per prompt.

A test helper: nothing in the package builds it. The trainer's transformers rollout engine is
rollout/transformers_rollout.py `TransformersRollout` (TRL's regular generation with the shared prefill); the tests
use this engine as the sampler of their stand-in vLLM engine (tests/vllm_cpu/vllm_helpers.py) and to check
vLLM-style media requests against transformers. The engine *is* the model it was given, so weight sync is a no-op
and there is nothing to sleep.

Given the model's processor, it also takes vLLM-style image and video requests (rollout/requests.py,
data/framed.py): the prompt ids with their placeholders already expanded, plus the frames and images. It processes
the media as vLLM does (one processor call per request, the frames' sampling metadata, `do_sample_frames=False`,
the request's `mm_processor_kwargs`) and checks that the processed media fill exactly the prompt's placeholder runs.
"""

from __future__ import annotations

from typing import Any

import torch

from rollplex_trl.rollout.engine import RolloutRequest, RolloutSample, SamplingSpec


class TransformersEngine:
    """`RolloutEngine` over `model.generate` (a test helper, see the module docstring)."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int], processor: Any = None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.processor = processor  # needed for image/video requests only

    def sync_weights(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        if model is not self.model:
            raise ValueError("the transformers engine generates with the trainer's own model")
        return {"rollplex/weight_sync_s": 0.0, "rollplex/weight_sync_bytes": 0.0}

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, requests: list[RolloutRequest], sampling: SamplingSpec) -> list[list[RolloutSample]]:
        results: list[list[RolloutSample]] = [[] for _ in requests]
        for i, request in enumerate(requests):  # media requests one by one: each has its own vision inputs
            if request.multi_modal_data:
                results[i] = self._generate_same_n([request], request.n, sampling, self._media_inputs(request))[0]
        requests_left = [i for i, r in enumerate(requests) if not r.multi_modal_data]
        for n in sorted({requests[i].n for i in requests_left}):  # num_return_sequences is per call
            idx = [i for i in requests_left if requests[i].n == n]
            for i, samples in zip(idx, self._generate_same_n([requests[i] for i in idx], n, sampling), strict=True):
                results[i] = samples
        return results

    def _media_inputs(self, request: RolloutRequest) -> dict[str, torch.Tensor]:
        """The vision inputs of one image/video request, processed from its frames as vLLM processes them."""
        if self.processor is None:
            raise ValueError("image/video requests need the model's processor: TransformersEngine(..., processor=...)")
        from transformers.video_utils import VideoMetadata

        data = request.multi_modal_data
        images = data.get("image")
        images = None if images is None else (images if isinstance(images, list) else [images])
        videos = data.get("video") or []
        frames = [f for f, _ in videos]
        metadata = [VideoMetadata(**{k: v for k, v in m.items() if k != "do_sample_frames"}) for _, m in videos]
        # one placeholder per item in the text; the processor expands it, as vLLM's HF-processor call does
        text = "".join(f"<|vision_start|>{self.processor.image_token}<|vision_end|>" for _ in images or []) + "".join(
            f"<|vision_start|>{self.processor.video_token}<|vision_end|>" for _ in videos)
        # the request's mm_processor_kwargs as vLLM passes them (flat, or per modality), plus the frames' metadata
        kwargs: dict[str, Any] = dict(request.mm_processor_kwargs or {})
        if videos:
            kwargs["videos_kwargs"] = {**(kwargs.get("videos_kwargs") or {}), "video_metadata": metadata,
                                       "do_sample_frames": False}
        out = self.processor(text=[text], images=images, videos=frames or None, return_tensors="pt", **kwargs)
        expanded = out["input_ids"][0].tolist()
        for token in (self.processor.image_token_id, self.processor.video_token_id):
            want, got = expanded.count(token), request.prompt_ids.count(token)
            if want != got:
                raise ValueError(f"the request's media fill {want} placeholder tokens ({token}) but its prompt has "
                                 f"{got}: the prompt ids were built from other frames or image sizes")
        vision = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        types = torch.zeros(1, len(request.prompt_ids), dtype=torch.long)
        ids = torch.tensor(request.prompt_ids)
        types[0, ids == self.processor.image_token_id] = 1
        types[0, ids == self.processor.video_token_id] = 2
        vision["mm_token_type_ids"] = types
        return vision

    def _generate_same_n(self, requests: list[RolloutRequest], n: int, sampling: SamplingSpec,
                         vision: dict[str, torch.Tensor] | None = None) -> list[list[RolloutSample]]:
        device = next(self.model.parameters()).device
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(requests):  # left padding: every prompt ends where generation starts
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, device=device)
            mask[i, width - len(r.prompt_ids):] = 1
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=sampling.max_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
            min_p=sampling.min_p or None, repetition_penalty=sampling.repetition_penalty,
            num_return_sequences=n, pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_ids,
            output_scores=True, return_dict_in_generate=True,
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (vision or {}).items()},
            **sampling.extra)
        tokens = out.sequences[:, width:]
        # scores are the processed logits the tokens were sampled from (temperature, top-k/p applied)
        logps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        logps = logps.gather(-1, tokens[:, : logps.size(1)].unsqueeze(-1)).squeeze(-1)
        samples = []
        for row in range(tokens.size(0)):
            ids_row = tokens[row].tolist()
            end = next((k + 1 for k, t in enumerate(ids_row) if t in self.eos_token_ids), len(ids_row))
            samples.append(RolloutSample(ids_row[:end], logps[row, :end].tolist()))
        return [samples[i * n:(i + 1) * n] for i in range(len(requests))]
