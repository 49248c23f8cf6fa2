"""The transformers rollout's own log-probs of the tokens it sampled, for the exactness audit.

vLLM returns them (TRL's `sampling_per_token_logps`), and the audit compares them with a plain pass through the
trainer's weights (trainers/verify.py `audit_sampler`). HF's `generate` returns them only with every step's logits
for every row kept (`output_logits`: rows x tokens x vocabulary). `SampledLogps` records them for the first `rows`
rows only: a forward hook on the decoding model reads each decode step's raw logits (before any logits processor:
the distribution TRL's log-probs describe, logits / temperature), keeps their log-softmax for one step, and picks
the sampled token's entry when the next step's input (that token) arrives; the last token's from the returned ids.

It reads and changes nothing the sampling uses: no random draws, no change to the logits. What it catches is a
rollout that samples from another distribution than the policy's: a shared-prefix decode cache pointing at the
wrong prompt, a prefill cache built from other inputs, a decode step that reads stale weights.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch


class SampledLogps:
    """Records the sampler's log-probs of the first `rows` rows of one `generate` call (see the module docstring)."""

    def __init__(self, rows: int, temperature: float) -> None:
        self.rows = rows
        self.temperature = temperature
        self._steps: list[torch.Tensor] = []  # (rows,) per decoded token, the sampled token's log-prob
        self._pending: torch.Tensor | None = None  # (rows, V): the latest step's log-softmax, token not yet known
        self._thread: int | None = None
        self.result: torch.Tensor | None = None  # what `finish` returned

    @contextlib.contextmanager
    def recording(self, causal_lm: torch.nn.Module) -> Iterator[None]:
        """Around `causal_lm.generate`: every call of the model on this thread is one decode step (the shared
        prefill calls the backbone, not the model, and the decode window's jobs run on other threads)."""
        self._thread = threading.get_ident()
        handle = causal_lm.register_forward_hook(self._hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", None)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if logits is None or ids is None:
            return
        with torch.no_grad():
            if self._pending is not None:  # this step's input is the token sampled from the previous step's logits
                self._steps.append(self._pending.gather(-1, ids[: self.rows, -1:].to(self._pending.device))[:, 0])
            self._pending = torch.log_softmax(logits[: self.rows, -1].float() / self.temperature, dim=-1)

    def finish(self, completion_ids: torch.Tensor) -> torch.Tensor | None:
        """(rows, tokens) log-probs of `completion_ids` (the call's completions, (R, tokens), before EOS masking),
        or None when no decode step was seen (a path that does not call the model)."""
        if self._pending is not None and len(self._steps) < completion_ids.size(1):
            last = completion_ids[: self.rows, len(self._steps)].to(self._pending.device)
            self._steps.append(self._pending.gather(-1, last[:, None])[:, 0])
        self._pending = None
        self.result = torch.stack(self._steps[: completion_ids.size(1)], dim=1) if self._steps else None
        return self.result
