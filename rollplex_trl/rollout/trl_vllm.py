"""RollplexGRPOTrainer with use_vllm=True: TRL's options, our rollout engine (rollplex_trl/rollout/).

`VLLMEngineMixin` makes GRPOTrainer build `RollplexVLLMGeneration` where it would build TRL's `VLLMGeneration`
(same constructor, so every `vllm_*` option of GRPOConfig is honoured exactly as TRL reads it: mode, tensor parallel
size, sleep mode, memory utilization, max model length, server address), and routes the rollout through the engine:
- each prompt is sent once with n = G (TRL sends G copies with n = 1);
- the sampled tokens' log-probs come back per row for TRL's importance-sampling correction;
- weights are synced once per optimizer step, bucketed and exact, logged as rollplex/weight_sync_s and
  rollplex/weight_sync_bytes; the KV cache is released after the rollout when sleep mode is on;
- the prefix jobs of the overlap (trainers/overlap.py) run while vLLM generates, in the same decode window the
  transformers rollout uses.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from trl.extras.profiling import profiling_context
from trl.generation.vllm_generation import VLLMGeneration

from rollplex_trl.config import rollplex_options
from rollplex_trl.rollout.engine import SamplingSpec, flatten_rows
from rollplex_trl.rollout.requests import requests_for_rows
from rollplex_trl.rollout.vllm_engine import VLLMColocateEngine, VLLMEngineConfig, cpu_platform
from rollplex_trl.rollout.vllm_server import VLLMServerEngine

logger = logging.getLogger(__name__)

_SWAP_LOCK = threading.Lock()


class RollplexVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` (same constructor and attributes, plus `vllm_dtype`) backed by our engines."""

    def __init__(self, *args: Any, vllm_dtype: str = "auto", **kwargs: Any) -> None:
        self.vllm_dtype = vllm_dtype  # read by _init_vllm, which TRL's constructor calls
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        acc = self.accelerator
        if self._dist.is_zero3 or self._dist.is_fsdp:
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
        from trl.trainer.utils import ensure_master_addr_port

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
        ensure_master_addr_port()
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
        self._llm_weights_sleeping = False
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


def trainer_init_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """GRPOTrainer.__init__'s arguments by name (model, reward_funcs, args, train_dataset, ...), before it runs."""
    from trl import GRPOTrainer

    return inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments


@contextlib.contextmanager
def _trl_builds(factory: Callable[..., VLLMGeneration]) -> Iterator[None]:
    """Inside the block, GRPOTrainer.__init__ calls `factory` where it constructs TRL's VLLMGeneration."""
    import trl.trainer.grpo_trainer as grpo_module

    with _SWAP_LOCK:
        original = grpo_module.VLLMGeneration
        grpo_module.VLLMGeneration = factory
        try:
            yield
        finally:
            grpo_module.VLLMGeneration = original


class VLLMEngineMixin:
    """Mixed into RollplexGRPOTrainer before OverlapMixin and GRPOTrainer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = trainer_init_arguments(*args, **kwargs).get("args")
        dtype = rollplex_options(config)["rollplex_vllm_dtype"] if config is not None else "auto"
        with _trl_builds(functools.partial(RollplexVLLMGeneration, vllm_dtype=dtype)):
            super().__init__(*args, **kwargs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self.use_vllm or not isinstance(getattr(self, "vllm_generation", None), RollplexVLLMGeneration):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        generation: RollplexVLLMGeneration = self.vllm_generation
        mode = "train" if self.model.training else "eval"
        if self.state.global_step != self._last_loaded_step:
            with profiling_context(self, "sync_weights"):
                metrics = generation.sync_weights(version=self.state.global_step)
            for key, value in metrics.items():
                self._metrics[mode][key].append(value)
            self._last_loaded_step = self.state.global_step
        rows = getattr(self, "_rows_to_tokenize", None)
        requests, _ = requests_for_rows(prompt_ids, images, rows, num_generations)
        window = self._vllm_decode_window(prompt_ids, rows)
        with profiling_context(self, "vLLM.generate"), window:
            results = generation.engine.generate(requests, generation.sampling_spec())
        generation.engine.sleep()
        self._metrics[mode]["rollplex/vllm_requests_per_row"].append(len(requests) / max(1, len(prompt_ids)))
        return flatten_rows(results)

    def _vllm_decode_window(self, prompt_ids: list[list[int]], rows):
        factory = self._decode_window_factory(rows) if getattr(self, "overlap_executor", None) is not None else None
        if factory is None:
            return contextlib.nullcontext()
        device = self.accelerator.device
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self._tokenizer.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):  # left-padded, as TRL pads the prompts it scores
            ids[i, width - len(p):] = torch.tensor(p, device=device)
            mask[i, width - len(p):] = 1
        return factory(ids, mask)
