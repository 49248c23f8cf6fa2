"""vLLM colocated in the trainer's process: generation with n = G, exact bucketed weight sync, sleep and wake.

The engine runs in-process (`distributed_executor_backend="external_launcher"`, like TRL's colocate mode): each
trainer rank holds one vLLM rank; with tensor parallelism the ranks of a TP group all-gather their prompts, generate
the same batch and keep their own slice (TRL's scheme). vLLM is imported lazily, so this module imports anywhere.

Weight residency during training (`sleep`), chosen from the sharing mode after the first sync:
- "kept": some trainer tensors alias vLLM's storage, so the weights must stay where they are; only the KV cache is
  released (vLLM `sleep(level=0)` + `release_kv_cache_memory()`).
- "offloaded": part of the model never changes (frozen base of a PEFT model, frozen towers): weights go to host
  memory (level 1) and come back on wake, and the sync after wake copies only what can have changed.
- "discarded": everything changes at every step: the weights are dropped (level 2) and fully re-pushed on wake.
Never stale (TRL issue 5312): discarding marks the weights invalid, and `generate` refuses to run on invalid weights,
re-syncing from the last trainer model first, whatever the step counter says.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rollplex_trl import vllm_compat
from rollplex_trl.rollout.engine import RolloutRequest, RolloutSample, SamplingSpec
from rollplex_trl.rollout.sources import iter_sources, weights_bound_to
from rollplex_trl.rollout.weight_sync import DEFAULT_BUCKET_BYTES, SyncStats, WeightSync

if TYPE_CHECKING:  # vLLM is imported lazily: this module imports without it
    from vllm import CompletionOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class VLLMEngineConfig:
    """Engine options; the trainer fills them from TRL's `vllm_*` fields."""

    model: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 4096
    enable_sleep_mode: bool = False
    model_impl: str = "vllm"
    seed: int = 0
    enforce_eager: bool = False
    trust_remote_code: bool = False
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    alias: bool = True
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


def sampling_params(spec: SamplingSpec, n: int, **overrides: Any) -> SamplingParams:
    """vLLM SamplingParams with TRL's colocate translation (logprobs=0: the sampled token's log-prob)."""
    from vllm import SamplingParams

    kwargs: dict[str, Any] = dict(n=n, repetition_penalty=spec.repetition_penalty, temperature=spec.temperature,
                                  top_p=spec.top_p, top_k=spec.top_k, min_p=spec.min_p or 0.0,
                                  max_tokens=spec.max_tokens, logprobs=0)
    kwargs.update(spec.extra)
    kwargs.update(overrides)
    if spec.structured_outputs_regex is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(regex=spec.structured_outputs_regex)
    elif isinstance(kwargs.get("structured_outputs"), dict):
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


def vllm_prompt(request: RolloutRequest) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
    if request.multi_modal_data:
        row["multi_modal_data"] = request.multi_modal_data
    if request.mm_processor_kwargs:
        row["mm_processor_kwargs"] = request.mm_processor_kwargs
    return row


def sample_logprobs(output: CompletionOutput) -> list[float] | None:
    """Log-prob of each sampled token (vLLM returns {token: Logprob} per position, the sampled token included)."""
    if output.logprobs is None:
        return None
    values = []
    for token, position in zip(output.token_ids, output.logprobs, strict=True):
        value = position[token].logprob
        values.append(float("-inf") if math.isnan(value) else float(value))
    return values


def cpu_platform() -> bool:
    """Whether vLLM runs on its CPU backend (without vLLM: whether there is no GPU)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return not torch.cuda.is_available()
    return current_platform.is_cpu()


class VLLMColocateEngine:
    """One vLLM rank in this process. `sync_weights` after each optimizer step, `generate` for the rollout."""

    def __init__(self, config: VLLMEngineConfig, *, tp_group: Any = None, llm: Any = None):
        self.config = config
        self.tp_group = tp_group
        self.weight_sync: WeightSync | None = None
        self.residency: str | None = None  # "kept" | "offloaded" | "discarded", decided at the first sync
        self._synced_version: int | None = None
        self._weights_valid = False  # vLLM's weights equal the trainer's at `_synced_version`
        self._source_model: torch.nn.Module | None = None
        self._weights_asleep = False  # offloaded or discarded by vLLM's sleep
        self._kv_asleep = False  # KV cache released (and scheduling paused for level 0)
        self._discarded_once = False
        self._plan_model: torch.nn.Module | None = None
        self.sleep_enabled = config.enable_sleep_mode
        # `llm` lets tests drive the state machine with a stand-in; normally the engine starts its own
        self.llm = llm if llm is not None else self._build()

    # ------------------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------------------

    def _build(self):
        LLM = vllm_compat.llm_class()  # noqa: N806  vLLM's class, after the version check

        c = self.config
        if self.sleep_enabled and cpu_platform():
            logger.warning("vllm_enable_sleep_mode: vLLM's CPU backend has no sleep mode; the KV cache stays "
                           "allocated (VLLM_CPU_KVCACHE_SPACE bounds it)")
            self.sleep_enabled = False
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model must live in this process
        start = time.perf_counter()
        llm = LLM(model=c.model, dtype=c.dtype, tensor_parallel_size=c.tensor_parallel_size,
                  gpu_memory_utilization=c.gpu_memory_utilization, max_model_len=c.max_model_len,
                  max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                  enable_sleep_mode=self.sleep_enabled, model_impl=c.model_impl,
                  distributed_executor_backend="external_launcher", seed=c.seed, enforce_eager=c.enforce_eager,
                  logprobs_mode="processed_logprobs",  # IS correction needs the distribution actually sampled
                  trust_remote_code=c.trust_remote_code, **c.llm_kwargs)
        logger.info("vLLM engine started in %.1f s", time.perf_counter() - start)
        if self.sleep_enabled:
            llm.sleep(level=2)  # nothing to keep until the first sync (TRL does the same)
            self._weights_asleep = self._kv_asleep = self._discarded_once = True
        return llm

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's in-process model (this rank's shard)."""
        return vllm_compat.inprocess_model(self.llm)

    @property
    def max_model_len(self) -> int:
        return vllm_compat.max_model_len(self.llm)

    # ------------------------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------------------------

    def _make_weight_sync(self, model: torch.nn.Module) -> WeightSync:
        from rollplex_trl.rollout.vllm_targets import VLLMTargets

        blocker = None
        if self.config.tensor_parallel_size > 1:
            blocker = "vLLM holds only this rank's shard (tensor parallelism)"
        bound = weights_bound_to(model)
        if bound:  # aliasing would move the model's tensors into vLLM's storage, ending their binding
            blocker = f"the trainer model's tensors are bound to {bound}"
        targets = VLLMTargets(self.model, iter_sources(model))
        if targets.skipped:
            logger.warning("weight sync: %d trainer tensors have no vLLM parameter and are not synced: %s",
                           len(targets.skipped), targets.skipped[:5])
        return WeightSync(targets, lambda: iter_sources(model), bucket_bytes=self.config.bucket_bytes,
                          alias=self.config.alias, alias_blocker=blocker)

    def _decide_residency(self, model: torch.nn.Module) -> str:
        assert self.weight_sync is not None
        if self.weight_sync.aliased_names:
            return "kept"
        if any(not s.trainable for s in iter_sources(model)):
            return "offloaded"
        return "discarded"

    def sync_weights(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Make vLLM hold `model`'s weights at `version` (the trainer's optimizer step). Idempotent per version."""
        if self._weights_valid and version == self._synced_version and model is self._source_model:
            return {}
        self._source_model = model
        self._wake_weights()
        if self.weight_sync is None or self._plan_model is not model:
            # the plan holds views of this model's tensors (and may alias them): one plan per trainer model
            self.weight_sync = self._make_weight_sync(model)
            self._plan_model = model
            self._weights_valid = False
            self.residency = None
        # a partial sync is only valid on top of weights that were kept (or offloaded and restored) since the last
        full = not self._weights_valid or self.residency in (None, "discarded")
        stats = self.weight_sync.sync(full=full)
        if self.residency is None:
            self.residency = self._decide_residency(model)
            logger.info("vLLM weights during training: %s", self.residency)
        self.llm.reset_prefix_cache()  # cached K/V were computed with the old weights
        self._synced_version = version
        self._weights_valid = True
        return self._log(stats)

    def _log(self, stats: SyncStats) -> dict[str, float]:
        logger.debug("weight sync: %s", stats)
        return stats.metrics()

    def invalidate_weights(self) -> None:
        """Mark vLLM's weights as not the trainer's (after a discard): the next rollout re-syncs first."""
        self._weights_valid = False
        self._discarded_once = True

    # ------------------------------------------------------------------------------------------------------------
    # Sleep / wake
    # ------------------------------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release memory for training: the KV cache always, the weights per `residency` (module docstring)."""
        if not self.sleep_enabled or self._kv_asleep:
            return
        if self.residency == "kept":
            self.llm.sleep(level=0)
            self.llm.release_kv_cache_memory()
        elif self.residency == "offloaded":
            self.llm.sleep(level=1)
            self._weights_asleep = True
        else:
            self.llm.sleep(level=2)
            self._weights_asleep = True
            self.invalidate_weights()
        self._kv_asleep = True

    def _wake_weights(self) -> None:
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def wake(self) -> None:
        """Back to generating: weights mapped (and re-synced if they were discarded), then the KV cache."""
        self._wake_weights()
        self._require_fresh_weights()
        if self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache", "scheduling"] if self.residency == "kept" else ["kv_cache"])
            self._kv_asleep = False

    # ------------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------------

    def _require_fresh_weights(self) -> None:
        if self._weights_valid:
            return
        if self._source_model is None:
            if self._synced_version is None and not self._discarded_once:
                return  # never synced, never discarded: vLLM holds the checkpoint it loaded
            raise RuntimeError("vLLM's weights were discarded and no trainer model is known to re-sync from")
        logger.info("vLLM weights were discarded since the last sync: re-syncing before generating")
        self.sync_weights(self._source_model, self._synced_version if self._synced_version is not None else -1)

    def generate(self, requests: list[RolloutRequest], sampling: SamplingSpec) -> list[list[RolloutSample]]:
        self.wake()  # a no-op when awake; re-syncs discarded weights before anything is sampled
        local = len(requests)
        everything = self._gather_tp(requests)
        prompts = [vllm_prompt(r) for r in everything]
        ns = {r.n for r in everything}
        # one SamplingParams for the batch when every request asks for the same n (the GRPO case)
        params = sampling_params(sampling, ns.pop()) if len(ns) == 1 else [sampling_params(sampling, r.n)
                                                                             for r in everything]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        results = [[RolloutSample(list(o.token_ids), sample_logprobs(o)) for o in out.outputs] for out in outputs]
        return self._my_slice(results, local)

    def _gather_tp(self, requests: list[RolloutRequest]) -> list[RolloutRequest]:
        if self.tp_group is None or self.config.tensor_parallel_size == 1:
            return requests
        gathered: list[Any] = [None] * self.config.tensor_parallel_size
        torch.distributed.all_gather_object(gathered, requests, group=self.tp_group)
        self._tp_sizes = [len(g) for g in gathered]
        return [r for g in gathered for r in g]

    def _my_slice(self, results: list, local: int) -> list:
        if self.tp_group is None or self.config.tensor_parallel_size == 1:
            return results
        rank = torch.distributed.get_rank(group=self.tp_group)
        start = sum(self._tp_sizes[:rank])
        return results[start:start + local]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """vLLM's log-prob of every token after the first of each fixed sequence (for tests and benchmarks)."""
        from vllm import SamplingParams

        self._require_fresh_weights()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [[pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
                for out, seq in zip(outputs, sequences, strict=True)]
