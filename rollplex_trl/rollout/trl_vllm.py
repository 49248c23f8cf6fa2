"""The vLLM rollout behind TRL's options: `RollplexVLLMGeneration` stands where TRL builds its `VLLMGeneration`
(same constructor, so every `vllm_*` option of GRPOConfig is honoured exactly as TRL reads it: mode, tensor parallel
size, sleep mode, memory utilization, max model length, server address), and `VLLMRollout` is the trainer's
component that generates through it:
- each prompt is sent once with n = G (TRL sends G copies with n = 1);
- the sampled tokens' log-probs come back per row for TRL's importance-sampling correction;
- weights are synced once per optimizer step, bucketed and exact, logged as rollplex/weight_sync_s and
  rollplex/weight_sync_bytes; the KV cache is released after the rollout when sleep mode is on;
- the prefix jobs of the overlap run while vLLM generates, in the decode window the caller passes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from rollplex_trl import trl_compat
from rollplex_trl.rollout.engine import SamplingSpec, flatten_rows
from rollplex_trl.rollout.requests import requests_for_rows
from rollplex_trl.rollout.vllm_engine import VLLMColocateEngine, VLLMEngineConfig, cpu_platform
from rollplex_trl.rollout.vllm_server import VLLMServerEngine
from rollplex_trl.trl_compat import VLLMGeneration, profiling_context

logger = logging.getLogger(__name__)



class RollplexVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` (same constructor and attributes, plus `vllm_dtype`) backed by our engines."""

    def __init__(self, *args: Any, vllm_dtype: str = "auto", **kwargs: Any) -> None:
        self.vllm_dtype = vllm_dtype  # read by _init_vllm, which TRL's constructor calls
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        acc = self.accelerator
        if trl_compat.vllm_generation_shards_parameters(self):
            raise NotImplementedError("the Rollplex vLLM engine reads the trainer's parameters in place; DeepSpeed "
                                      "ZeRO-3 and FSDP shard them. Use GRPOTrainer's own vLLM path for those.")
        if self.mode == "server":
            super()._init_vllm()  # TRL's client and NCCL communicator, on the main process
            self.engine = VLLMServerEngine(getattr(self, "vllm_client", None), is_main=acc.is_main_process,
                                           gather=_gather_object, broadcast=_broadcast_object)
            self.engine.process_index = acc.process_index
            return
        if self.mode != "colocate":
            raise ValueError(f"vllm_mode must be either 'server' or 'colocate', got '{self.mode}'.")
        tp = self.tensor_parallel_size
        if acc.num_processes % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide world size ({acc.num_processes}) evenly.")
        tp_group = None
        if tp > 1:  # TRL's TP groups: consecutive ranks
            tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(i * tp, (i + 1) * tp)) for i in range(acc.num_processes // tp)])
        self.tp_group = tp_group
        os.environ["RANK"] = str(acc.process_index)
        os.environ["LOCAL_RANK"] = str(acc.local_process_index)
        os.environ["WORLD_SIZE"] = str(acc.num_processes)
        trl_compat.ensure_master_addr_port()
        on_cpu = cpu_platform()
        self.engine = self._make_colocate_engine(VLLMEngineConfig(
            # "auto" is TRL's choice (vLLM picks); exact log-prob parity and aliasing need the trainer's dtype
            model=self.model.name_or_path, dtype=self.vllm_dtype,
            tensor_parallel_size=tp,
            gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs, enable_sleep_mode=self.enable_sleep_mode, model_impl=self.model_impl,
            seed=acc.process_index // tp, trust_remote_code=self.trust_remote_code,
            enforce_eager=on_cpu,  # CPU: torch.compile adds minutes of start-up for no benefit to this tier
        ), tp_group)
        self.llm = getattr(self.engine, "llm", None)  # TRL's tool loop reads llm.llm_engine.model_config.max_model_len
        trl_compat.mark_vllm_weights_awake(self)
        acc.wait_for_everyone()

    def _make_colocate_engine(self, config: VLLMEngineConfig, tp_group: Any):
        # a method so that tests without vLLM can put a stand-in engine behind the same trainer code
        return VLLMColocateEngine(config, tp_group=tp_group)

    # TRL's entry points, for code that calls them directly (rollout_func users, TRL's own _generate)

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        if version is None:  # TRL gated the call on its step counter already: always sync
            self._forced_version = getattr(self, "_forced_version", -(10**9)) - 1
            version = self._forced_version
        self.last_metrics = self.engine.sync_weights(self.model, version)
        return self.last_metrics

    def sampling_spec(self) -> SamplingSpec:
        return SamplingSpec(max_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                            top_k=self.top_k, min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty,
                            structured_outputs_regex=self.structured_outputs_regex,
                            extra=dict(self.generation_kwargs))

    def generate(self, prompts: list[list[int]], images: list | None, num_generations: int, profiler=None) -> tuple:
        requests, _ = requests_for_rows(prompts, images, None, num_generations)
        with profiler or contextlib.nullcontext():
            results = self.engine.generate(requests, self.sampling_spec())
        self.engine.sleep()
        completion_ids, logprobs = flatten_rows(results)
        row_prompts = [list(r.prompt_ids) for r in requests for _ in range(r.n)]
        nested = [[[lp] for lp in seq] for seq in logprobs] if logprobs is not None else None
        return row_prompts, completion_ids, nested, None


def _gather_object(obj: list) -> list:
    from accelerate.utils import gather_object

    return gather_object(obj)


def _broadcast_object(obj: Any) -> Any:
    from accelerate.utils import broadcast_object_list

    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]


class VLLMRollout:
    """The trainer's rollout through `RollplexVLLMGeneration`: sync once per optimizer step, one request per prompt,
    generation inside the caller's decode window, the KV cache released after."""

    def __init__(self, generation: RollplexVLLMGeneration, pad_token_id: int, device: torch.device) -> None:
        self.generation = generation
        self.pad_token_id = pad_token_id
        self.device = device

    def generate(self, prompt_ids: list[list[int]], images: list | None, rows: list | None, num_generations: int,
                 *, weights_step: int, synced_step: int | None, decode_window: Callable | None,
                 record: Callable[[str, float], None], trainer: Any = None) -> tuple[tuple, int]:
        """(completion ids, sampling log-probs) per row, and the step whose weights the engine now holds.

        `decode_window(ids, mask)`, if given, is the context the prefix jobs run in while vLLM decodes (prompts
        left-padded, as TRL pads the prompts it scores)."""
        generation = self.generation
        if weights_step != synced_step:
            with profiling_context(trainer, "sync_weights") if trainer is not None else contextlib.nullcontext():
                metrics = generation.sync_weights(version=weights_step)
            for key, value in metrics.items():
                record(key, value)
        requests, _ = requests_for_rows(prompt_ids, images, rows, num_generations)
        window = contextlib.nullcontext() if decode_window is None else decode_window(*self._left_padded(prompt_ids))
        with profiling_context(trainer, "vLLM.generate") if trainer is not None else contextlib.nullcontext(), window:
            results = generation.engine.generate(requests, generation.sampling_spec())
        generation.engine.sleep()
        record("rollplex/vllm_requests_per_row", len(requests) / max(1, len(prompt_ids)))
        return flatten_rows(results), weights_step

    def _left_padded(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.tensor(p, device=self.device)
            mask[i, width - len(p):] = 1
        return ids, mask
