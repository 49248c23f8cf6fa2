"""vLLM in server mode through TRL's own client (`trl.generation.vllm_client.VLLMClient`).

Generation: the main process sends each unique prompt once with n = G (`/v1/completions` with token ids) and shares
the results with the other ranks. Weight sync: the trainer's tensors under HF names, streamed with the client's
packed NCCL broadcast (one flat buffer per bucket on the wire); LoRA layers go as base + delta computed out of place,
so the trainer's base weights are never merged and unmerged. Images go through the client's `image_features`;
videos are not supported by TRL's server protocol (a clear error says so).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rollplex_trl.rollout.engine import RolloutRequest, RolloutSample, SamplingSpec
from rollplex_trl.rollout.sources import iter_sources


def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) with LoRA deltas added out of place (the trainer's tensors are untouched)."""
    for src in iter_sources(model):
        tensor = src.tensor
        if src.delta is not None:
            tensor = tensor + src.delta().to(tensor.dtype)
        yield src.name, tensor


class VLLMServerEngine:
    """`client` is a TRL `VLLMClient` on the main process (None elsewhere); `gather`/`broadcast` are the
    accelerator's object collectives (identity in a single process)."""

    def __init__(self, client: Any, *, is_main: bool = True, gather: Callable[[list], list] | None = None,
                 broadcast: Callable[[Any], Any] | None = None):
        self.client = client
        self.is_main = is_main
        self._gather = gather or (lambda x: x)
        self._broadcast = broadcast or (lambda x: x)
        self._metadata: list[tuple[str, str, list[int]]] | None = None
        self._synced_version: int | None = None

    def sync_weights(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        if version == self._synced_version:
            return {}
        start = time.perf_counter()
        nbytes = 0
        if self._metadata is None:
            self._metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape))
                              for name, t in merged_tensors(model)]
        if self.is_main:
            def counted() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal nbytes
                for name, tensor in merged_tensors(model):
                    nbytes += tensor.numel() * tensor.element_size()
                    yield name, tensor

            self.client.update_named_params(self._metadata, counted())
            self.client.reset_prefix_cache()
        self._synced_version = version
        return {"rollplex/weight_sync_s": time.perf_counter() - start, "rollplex/weight_sync_bytes": float(nbytes)}

    def sleep(self) -> None:  # the server owns its memory
        pass

    def wake(self) -> None:
        pass

    def generate(self, requests: list[RolloutRequest], sampling: SamplingSpec) -> list[list[RolloutSample]]:
        if any(r.multi_modal_data and "video" in r.multi_modal_data for r in requests):
            raise NotImplementedError("video prompts with vllm_mode='server': TRL's server protocol carries images "
                                      "only; use vllm_mode='colocate'")
        local = len(requests)
        everything = self._gather(requests)
        payload = None
        if self.is_main:
            payload = self._generate_main(everything, sampling)
        results = self._broadcast(payload)
        offset = self._offset(local)
        return results[offset:offset + local]

    def _offset(self, local: int) -> int:
        # ranks hold equal numbers of prompts (TRL's sampler), so rank r's requests start at r * local
        return getattr(self, "process_index", 0) * local

    def _generate_main(self, requests: list[RolloutRequest], sampling: SamplingSpec) -> list[list[RolloutSample]]:
        results: list[list[RolloutSample]] = [[] for _ in requests]
        for n in sorted({r.n for r in requests}):
            idx = [i for i, r in enumerate(requests) if r.n == n]
            features = None
            images = [(requests[i].multi_modal_data or {}).get("image") for i in idx]
            if any(im is not None for im in images):
                features = self.client.image_features(images)
            out = self.client.generate(
                prompts=[requests[i].prompt_ids for i in idx], features=features, n=n,
                repetition_penalty=sampling.repetition_penalty, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, min_p=sampling.min_p or 0.0, max_tokens=sampling.max_tokens, logprobs=0,
                structured_outputs_regex=sampling.structured_outputs_regex, generation_kwargs=sampling.extra)
            logprobs = out.get("logprobs")
            for k, i in enumerate(idx):
                results[i] = [RolloutSample(list(out["completion_ids"][k * n + j]),
                                            [lp[0] for lp in logprobs[k * n + j]] if logprobs is not None else None)
                              for j in range(n)]
        return results
