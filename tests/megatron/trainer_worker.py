"""One process of tests/megatron/test_megatron_trainer.py: a short video GRPO run on either backend, its logs and
final weights (the transformers model's: on the Megatron backend, the rollout weights synced from the shards) to
files. Run in-process (one process) or under torchrun (gloo)."""

import json
import os
import sys
from pathlib import Path


def run(checkpoint: str, out: str, backend: str, tp: int, tag: str, mode: str = "") -> dict:
    """mode: "" (fp32), "bf16" (TRL's defaults: bf16 autocast + gradient checkpointing), "save" (checkpoint at
    step 2, output_dir run-<tag>), "resume:<tag>" (resume from a copy of run-<tag>'s checkpoint-2), "overlap"
    (fp32, rollplex_overlap="on": the prefix jobs run in a worker thread while the rollout decodes), "views" (fp32,
    rollplex_weight_mapping="off": views of local shards, the rest all-gathered), "vllm" (fp32, use_vllm=True in
    colocate mode through the trainer's real vLLM path, with the main suite's stand-in engine: a sampler holding its
    own copy of the weights, synced from the transformers model), "gloo" (rollplex_shm_all_reduce="off": the TP
    all-reduces over gloo), "allranks" (rollplex_pooled_rollout="off": every TP rank decodes), "copyrows"
    (rollplex_row_parallel_views="off": the row-parallel weights copied after each step, not read in place),
    "replicated" (rollplex_split_vision="off": every TP rank runs the vision tower on every video), "audit" (the
    exactness audit on every step; its values and warnings in the result), "prefixfault" (the decode window's
    prefix values off by 1e-3 on rank 1, with "overlap" for the window).
    Several join with "+" (e.g. "bf16+views"). The Megatron runs pin rollplex_weight_mapping ("on", or "off" with
    "views"), rollplex_row_parallel_views ("on", or "off" with "copyrows", "views" or "vllm") and, at t > 1,
    rollplex_shm_all_reduce ("on", or "off" with "gloo"), rollplex_pooled_rollout ("on", or "off" with
    "allranks", "overlap" or "vllm", where it cannot run) and rollplex_split_vision ("on", or "off" with
    "replicated"): never an auto decision."""
    sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..")]
    import torch
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    from helpers import video_rows

    rank = int(os.environ.get("RANK", 0))
    flags = set(mode.split("+")) if mode else set()
    wide = "g4" in flags  # issue 31's configuration: 4 prompts of 8-frame clips per step, G = 4
    rows = video_rows(Path(out) / f"media-{tag}-{rank}", lambda i: "Q" * i, frames=8 if wide else None)

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"]) % 5) for c in completions]

    vllm = "vllm" in flags
    processor = None
    if vllm:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm_cpu"))
        from transformers import AutoProcessor

        from rollplex_trl.rollout.trl_vllm import RollplexVLLMGeneration

        from vllm_helpers import StandInEngine

        processor = AutoProcessor.from_pretrained(checkpoint)
        tok = processor.tokenizer
        RollplexVLLMGeneration._make_colocate_engine = lambda self, config, tp_group: StandInEngine(
            self.model, processor=processor, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    bf16 = "bf16" in flags
    warnings: list[str] = []
    if "audit" in flags:
        import logging

        class Collect(logging.Handler):
            def emit(self, record):
                warnings.append(record.getMessage())

        logging.getLogger("rollplex_trl.trainers.verify").addHandler(Collect(level=logging.WARNING))
    if "prefixfault" in flags and rank == 1:
        import rollplex_trl.prefix.batch as prefix_batch

        from helpers import broken_take_scoring

        prefix_batch.StepPrefixes.take_scoring = broken_take_scoring()
    output_dir = f"{out}/run-{tag}"
    resume = None
    if mode.startswith("resume:"):
        import shutil

        if rank == 0:
            shutil.copytree(f"{out}/run-{mode.split(':', 1)[1]}", output_dir)
        resume = f"{output_dir}/checkpoint-2"
    args = RollplexGRPOConfig(
        output_dir=output_dir, max_steps=3, per_device_train_batch_size=8 if wide else 2,
        num_generations=4 if wide else 2, gradient_accumulation_steps=2, max_completion_length=6,
        learning_rate=1e-3 if wide else 5e-3, beta=0.04 if wide else 0.1, logging_steps=1,
        report_to=[], seed=5, use_cpu=True, bf16=bf16, gradient_checkpointing=bf16 or "gc" in flags,
        save_strategy="steps" if "save" in flags else "no", save_steps=2,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None, rollplex_backend=backend,
        rollplex_tensor_parallel_size=tp, rollplex_overlap="on" if "overlap" in flags else "auto",
        rollplex_weight_mapping="off" if "views" in flags else ("on" if backend == "megatron" else "auto"),
        rollplex_row_parallel_views="off" if flags & {"copyrows", "views", "vllm"} or backend != "megatron" else "on",
        rollplex_shm_all_reduce="off" if "gloo" in flags or tp == 1 else "on",
        rollplex_pooled_rollout="off" if flags & {"allranks", "overlap", "vllm"} or tp == 1 else "on",
        rollplex_split_vision="off" if "replicated" in flags or tp == 1 or backend != "megatron" else "on",
        use_vllm=vllm, vllm_mode="colocate", rollplex_verify_every=1 if "audit" in flags else None,
        # the hf backend's suffix with the prompt's K/V concatenated, as the Megatron backend's core attention does:
        # under bf16 the two backends then round the same sums alike (cascade's kernels round differently: bf16 step
        # 2 loss 2% apart instead of 5e-3; cascade itself is tested against the full forward in tests/prefix/)
        rollplex_suffix_attention="concat",
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84,
        rollplex_video_min_frames=8 if wide else 4, rollplex_video_max_frames=8 if wide else 16)
    trainer = RollplexGRPOTrainer(model=checkpoint, reward_funcs=reward, args=args,
                                  train_dataset=Dataset.from_list(rows * 2), processing_class=processor)
    if backend == "hf":  # the reference runs: the weights before training (the tests compare updates)
        initial = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
        torch.save(initial, Path(out) / f"{tag}-rank{rank}-initial.pt")
    casts = _count_rollout_weight_casts(trainer) if bf16 and backend == "megatron" else None
    prefills = _count_prefix_passes() if backend == "megatron" else None
    tower_items: list[int] = []  # items (grid rows) per call of the trained vision tower (rollplex_split_vision)
    if backend == "megatron" and trainer.backend.policy.visual is not None:
        trainer.backend.policy.visual.register_forward_pre_hook(
            lambda _m, args, kwargs: tower_items.append(len(kwargs["grid_thw"])), with_kwargs=True)
    grads = _record_gradients(trainer) if "grads" in flags else None
    if resume:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # rank 0 copied the checkpoint
    trainer.train(resume_from_checkpoint=resume)
    if trainer.backend.name == "megatron":
        trainer.backend.sync_rollout()
    if "save" in flags:
        trainer.save_model(f"{out}/final-{tag}")
    from rollplex_trl.backends.megatron.split_k import logical_parameters

    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = {n: p.detach().float().clone() for n, p in logical_parameters(model).items()}  # (out, in) shapes
    torch.save(weights, Path(out) / f"{tag}-rank{rank}-weights.pt")
    if grads is not None:
        torch.save(grads, Path(out) / f"{tag}-rank{rank}-grads.pt")
    keys = ("loss", "kl", "grad_norm", "reward", "entropy")
    result = {"world": trainer.accelerator.num_processes,
              "logs": [{k: r.get(k) for k in keys} | {m: v for m, v in r.items() if m.startswith(
                  ("rollplex/sync", "rollplex/overlap_active", "rollplex/prefix_s", "sampling/sampling_logp",
                   "rollplex/verify_"))}
                       for r in trainer.state.log_history if "loss" in r],
              "steps": [r["step"] for r in trainer.state.log_history if "loss" in r], "warnings": warnings}
    if trainer.backend.name == "megatron":
        result["rollout"] = _rollout_binding(trainer.backend, model)
        all_reduce = trainer.backend.all_reduce
        result["shm_all_reduce_calls"] = all_reduce.calls if all_reduce is not None else 0
        pool = trainer.backend.rollout_pool
        result["pooled_threads"] = pool.pooled_threads if pool is not None else 0
        # LLM layers whose activations are recomputed in the backward (gradient_checkpointing)
        result["recompute_layers"] = sum(bool(vars(layer).get("rollplex_recompute"))
                                         for layer in trainer.backend.policy.gpt.decoder.layers)
        if casts is not None:
            result["rollout_weight_casts"] = casts
        result["prefix_passes"] = prefills
        result["split_vision"] = trainer.backend.vision_split is not None
        result["tower_items"] = tower_items
        result["rollout_frozen"] = not any(p.requires_grad for p in model.parameters())
    Path(out, f"{tag}-rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # under torchrun (in-process runs keep pytest's world)
        trainer.end()  # every rank done, the groups released before the interpreter's exit (RollplexGRPOTrainer.end)
    return result


def _record_gradients(trainer) -> list[dict]:
    """Per optimizer step, the gradients the clip sees (reduced over the ranks, not yet clipped), in HF names and
    shapes: on the hf backend the transformers model's, on the Megatron backend the shards' all-gathered over TP
    (a collective: every rank records) and the vision tower's."""
    import torch

    from rollplex_trl.backends.megatron import weights

    steps: list[dict] = []
    clip = trainer._clip_grad_norm

    def recording(model):
        if trainer.backend.name != "megatron":
            grads = {n: p.grad.detach().float().clone() for n, p in trainer.accelerator.unwrap_model(
                model).named_parameters() if p.grad is not None}
        else:
            backend = trainer.backend
            backend.grad_norm(None)  # the reductions (once per step), no clipping yet
            policy = backend.policy
            zeros = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in policy.gpt.named_parameters()}
            grads = {n: g.float().clone() for n, g in weights.iter_hf_llm_state(
                policy.spec, policy.options, zeros, policy.groups.tp_group, policy._hf_shapes)}
            if policy.visual is not None:
                grads |= {f"model.visual.{n}": p.grad.detach().float().clone()
                          for n, p in policy.visual.named_parameters() if p.grad is not None}
        steps.append(grads)
        return clip(model)

    trainer._clip_grad_norm = recording
    return steps


def _count_prefix_passes() -> dict:
    """Prompt forwards by kind: the transformers rollout model's prefill (`run_prefix` through prefix/generation.py)
    and the Megatron policy's prefix passes with and without their autograd graph (every Megatron prefix pass:
    the decode window's jobs, the rollout's prefill where it runs there, the actor window's own)."""
    import importlib

    megatron_prefix = importlib.import_module("rollplex_trl.backends.megatron.prefix")
    generation = importlib.import_module("rollplex_trl.prefix.generation")

    counts = {"transformers": 0, "megatron_graph": 0, "megatron_no_grad": 0}
    run_prefix, megatron = generation.run_prefix, megatron_prefix.megatron_prefix

    def transformers(*args, **kwargs):
        counts["transformers"] += 1
        return run_prefix(*args, **kwargs)

    def policy(*args, keep_graph, **kwargs):
        counts["megatron_graph" if keep_graph else "megatron_no_grad"] += 1
        return megatron(*args, keep_graph=keep_graph, **kwargs)

    generation.run_prefix, megatron_prefix.megatron_prefix = transformers, policy  # this process is this run's
    return counts


def _count_rollout_weight_casts(trainer) -> dict:
    """Under autocast: per `generate` call of the rollout model, its decode steps (text-decoder forwards) and the
    casts made of its weights (`_to_copy` of a float tensor on one of their storages), counted at the dispatcher on
    the decoding thread. Kept across the steps, each weight is cast at most once per call; not kept, once per
    step (backends/megatron/rollout_weights.py `autocast_caches_weights`)."""
    import transformers

    from helpers import WeightCasts

    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = [p for p in model.parameters() if p.is_floating_point()]
    counts = {"calls": [], "weights": len(weights)}

    decoder = model.base_model.language_model
    steps = [0]
    decoder.register_forward_pre_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    generate = transformers.GenerationMixin.generate

    def counting(self, *args, **kwargs):
        steps[0] = 0
        with WeightCasts(weights) as casts:
            output = generate(self, *args, **kwargs)
        counts["calls"].append({"steps": steps[0], "casts": casts.count})
        return output

    transformers.GenerationMixin.generate = counting
    return counts


def _rollout_binding(backend, model) -> dict:
    """How the rollout model holds its weights after the last sync: equal to the trained shards (gathered over TP
    here, a collective), and, where they are mapped (rollplex_weight_mapping), which shared-memory file backs each
    tensor's pages, by the binding's class, read from /proc/self/maps."""
    import torch

    from rollplex_trl.backends.megatron.mapped_weights import MappedRolloutWeights, backing_files
    from rollplex_trl.backends.megatron.split_k import logical_parameters

    trained = backend.policy.hf_state_dict()
    params, logical = dict(model.named_parameters()), logical_parameters(model)
    unequal = [n for n, value in trained.items() if not torch.equal(logical[n].detach(), value)]
    out = {"unequal_to_trained": unequal, "mapped": isinstance(backend.rollout, MappedRolloutWeights)}
    if out["mapped"]:
        files = {}
        for name, mode in backend.rollout.classes().items():
            # a file name is rollplex-<session>-<train|buffer>-<device>: keep its role and device
            files[name] = [mode, sorted("-".join(f.split("-")[-2:]) if f else "private"
                                        for f in backing_files(params[name].data))]
        out |= {"files": files, "plan_copy_bytes": backend.rollout.bytes_copied_per_sync,
                "aliased_bytes": backend.rollout.bytes_aliased}
    return out


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], *sys.argv[6:7])
