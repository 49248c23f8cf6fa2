"""The transformers rollout behind the same interface as vLLM: `model.generate` with n samples per prompt.

The trainer's transformers path stays TRL's own generate call (with the shared prefill of prefix/generation.py);
this engine serves code that wants one interface for both backends (benchmarks, evaluation scripts, tests). The
engine *is* the trainer's model, so weight sync is a no-op and there is nothing to sleep.
"""

from __future__ import annotations

import torch

from rollplex_trl.rollout.engine import RolloutRequest, RolloutSample, SamplingSpec


class TransformersEngine:
    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int]):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)

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
        if any(r.multi_modal_data for r in requests):
            raise NotImplementedError("the transformers engine takes text prompts; the trainer's transformers path "
                                      "handles images and videos")
        results: list[list[RolloutSample]] = [[] for _ in requests]
        for n in sorted({r.n for r in requests}):  # num_return_sequences is per call
            idx = [i for i, r in enumerate(requests) if r.n == n]
            for i, samples in zip(idx, self._generate_same_n([requests[i] for i in idx], n, sampling), strict=True):
                results[i] = samples
        return results

    def _generate_same_n(self, requests: list[RolloutRequest], n: int,
                         sampling: SamplingSpec) -> list[list[RolloutSample]]:
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
            output_scores=True, return_dict_in_generate=True, **sampling.extra)
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
