"""Shared pieces of the Megatron backend tests: the video batch, the HF reference, and the per-process checks.

``main`` runs in each of 2 spawned processes (gloo): the MegatronPolicy at t = 2 against the HF model's own full
forward in the same process, then (after tearing megatron's grid down) t = 1 with 2 data-parallel ranks. Results
go to ``<out>/rank<k>.json`` as records ``{case, check, ok, value, detail}``; test_megatron_model.py asserts on them.

``python megatron_worker.py probes`` prints, as JSON, what each CPU shim's probe does without the shims and then
with them (test_megatron_compat.py runs it in a fresh process, so that nothing is applied yet).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

TEMPERATURE = 0.7
LOGP_TOL = 1e-5  # fp32, max abs
GRAD_RTOL = 1e-4  # max|g - g_ref| / max|g_ref|, per parameter
BF16_TOL = 2e-2  # bf16 autocast vs the fp32 HF reference, max abs (measured: log-probs 3.3e-3, entropies 4e-5)
VISION_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


# ----------------------------------------------------------------------------------------------- model and batch
def load_hf(path, dtype=torch.float32):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.train()  # dropout is 0 in these configs; train mode as in GRPO


def video_batch(path, completion_len: int = 5, seed: int = 0) -> dict:
    """TRL's layout: two real video prompts (4 frames 56x84, 8 frames 56x56) left-padded to one width, then
    right-padded completions of different lengths; mm_token_type_ids zero on the completions."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    processor = AutoProcessor.from_pretrained(path)
    rng = np.random.default_rng(seed)
    processed = []
    for frames, width, question in ((4, 84, "How many red balls move left?"), (8, 56, "Why?")):
        video = torch.from_numpy(rng.integers(0, 255, (frames, 3, 56, width), dtype=np.uint8))
        meta = VideoMetadata(total_num_frames=frames, fps=2.0, frames_indices=list(range(frames)))
        chat = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}], tokenize=False,
            add_generation_prompt=True)
        processed.append(processor(text=[chat], videos=[video], return_tensors="pt",
                                   videos_kwargs=dict(video_metadata=[meta], do_sample_frames=False)))
    P, C = max(p["input_ids"].shape[1] for p in processed), completion_len
    gen = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "mm_token_type_ids": []}
    for i, p in enumerate(processed):
        n = p["input_ids"].shape[1]
        left = torch.zeros(P - n, dtype=torch.long)
        completion_mask = (torch.arange(C) < C - 2 * i).long()
        completion = torch.randint(10, 700, (C,), generator=gen).masked_fill(completion_mask == 0, 0)
        rows["input_ids"].append(torch.cat([left, p["input_ids"][0], completion]))
        rows["attention_mask"].append(torch.cat([left, torch.ones(n, dtype=torch.long), completion_mask]))
        rows["mm_token_type_ids"].append(torch.cat([left, p["mm_token_type_ids"][0], torch.zeros(C, dtype=torch.long)]))
    batch = {k: torch.stack(v) for k, v in rows.items()}
    batch.update({k: torch.cat([p[k] for p in processed]) for k in VISION_KEYS})
    batch["completion_mask"] = batch["attention_mask"][:, -C:]
    batch["K"] = C
    return batch


def model_inputs(batch: dict) -> dict:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids", *VISION_KEYS)}


def hf_logps(model, batch: dict, temperature: float = TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: HF's full forward, log_softmax(logits / T) at positions [-K-1:-1] (TRL's convention)."""
    K = batch["K"]
    logits = model(**model_inputs(batch), use_cache=False).logits[:, -K - 1:-1]
    logprobs = torch.log_softmax(logits.float() / temperature, -1)
    logps = logprobs.gather(-1, batch["input_ids"][:, -K:, None]).squeeze(-1)
    return logps, -(logprobs.exp() * logprobs).sum(-1)


def policy_logps(policy, batch: dict, temperature: float = TEMPERATURE):
    inputs = model_inputs(batch)
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    return policy.token_logps(ids, mask, batch["K"], temperature=temperature, compute_entropy=True, **inputs)


def loss_of(logps, entropy, batch: dict) -> torch.Tensor:
    """A GRPO-like scalar touching log-probs and entropies, masked like TRL's loss."""
    mask = batch["completion_mask"].float()
    weights = torch.linspace(-1.0, 1.5, logps.numel()).view_as(logps)
    return (logps * weights * mask).sum() + 0.1 * (entropy * mask).sum()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def vision_grad_errors(visual, hf_grads: dict) -> tuple[float, list[str]]:
    """The vision tower's gradients against the HF model's (``model.visual.*``): the worst relative error and the
    tensors beyond GRAD_RTOL (a missing gradient counts as infinitely wrong)."""
    worst, bad = 0.0, []
    for name, p in visual.named_parameters():
        err = rel_err(p.grad, hf_grads[f"model.visual.{name}"]) if p.grad is not None else float("inf")
        worst = max(worst, err)
        if err > GRAD_RTOL:
            bad.append(f"{name}: {err:.2e}")
    return worst, bad


# ------------------------------------------------------------------------------------------------ the checks
def equivalence_checks(path, t: int, record) -> None:
    """MegatronPolicy at TP = t vs the HF model: log-probs, entropies, gradients, weights, clipping, weight sync."""
    from rollplex_trl.backends.megatron import MegatronPolicy, clip_grad_norm_tensor_parallel, init_model_parallel
    from rollplex_trl.backends.megatron.weights import iter_hf_llm_state, megatron_state

    groups = init_model_parallel(t)
    record("groups", groups.tp_size == t and groups.tp_rank == dist.get_rank() % t and groups.dp_size * t
           == groups.world, f"tp {groups.tp_rank}/{groups.tp_size} dp {groups.dp_rank}/{groups.dp_size}")
    hf = load_hf(path)
    batch = video_batch(path)
    ref_logps, ref_ent = hf_logps(hf, batch)
    loss_of(ref_logps, ref_ent, batch).backward()
    hf_grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)

    policy = MegatronPolicy(hf, groups)
    sd = policy.hf_state_dict()
    hf_params = {n: p.detach() for n, p in hf.named_parameters()}
    record("hf_state_dict round trip is exact", sd.keys() == hf_params.keys() and all(
        torch.equal(sd[n], hf_params[n]) for n in sd), f"{len(sd)} tensors")
    params = {n: p.detach() for n, p in policy.gpt.named_parameters()}
    small = dict(iter_hf_llm_state(policy.spec, policy.options, params, groups.tp_group, policy._hf_shapes,
                                   bucket_bytes=1))  # one tensor per all-gather
    record("round trip in one-tensor buckets", small.keys() == {n for n in sd if not n.startswith("model.visual.")}
           and all(torch.equal(small[n], hf_params[n]) for n in small))

    logps, ent = policy_logps(policy, batch)
    record("logps fp32", (logps - ref_logps).abs().max().item() <= LOGP_TOL, "", (logps - ref_logps).abs().max().item())
    record("entropy fp32", (ent - ref_ent).abs().max().item() <= LOGP_TOL, "", (ent - ref_ent).abs().max().item())
    loss_of(logps, ent, batch).backward()

    want = megatron_state(policy.spec, policy.options, groups.tp_rank, hf_grads)
    worst, bad = 0.0, []
    for name, p in policy.gpt.named_parameters():
        err = rel_err(p.grad, want[name].view_as(p.grad)) if p.grad is not None else float("inf")
        worst = max(worst, err)
        if err > GRAD_RTOL:
            bad.append(f"{name}: {err:.2e}")
    record("megatron grads == HF grads in this rank's layout", not bad, "; ".join(bad[:4]), worst)
    worst, bad = vision_grad_errors(policy.visual, hf_grads)
    record("vision tower grads == HF grads", not bad, "; ".join(bad[:4]), worst)

    # clipping: the TP-aware norm equals torch's over the full HF gradients, and clips the same way
    ref_params = [torch.nn.Parameter(torch.empty_like(g)) for g in hf_grads.values()]
    for p, g in zip(ref_params, hf_grads.values()):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm=0.5)
    measured = clip_grad_norm_tensor_parallel(policy.parameters(), None, groups, policy.duplicate_rows)
    norm = clip_grad_norm_tensor_parallel(policy.parameters(), 0.5, groups, policy.duplicate_rows)
    record("grad norm == torch clip_grad_norm_ over HF grads", abs(norm.item() - ref_norm.item())
           <= 1e-5 * ref_norm.item() and abs(measured.item() - norm.item()) == 0.0,
           f"{norm.item():.6f} vs {ref_norm.item():.6f}", abs(norm.item() - ref_norm.item()) / ref_norm.item())
    # replicated gradients that came out different on this rank (a nondeterministic kernel): the group's first
    # rank's after share_replicated_gradients, the sharded ones untouched
    from rollplex_trl.backends.megatron import share_replicated_gradients

    replicated = [p for p in policy.parameters() if not getattr(p, "tensor_model_parallel", False)]
    sharded = {id(p): p.grad.clone() for p in policy.parameters() if getattr(p, "tensor_model_parallel", False)}
    kept = [p.grad.clone() for p in replicated]
    for p in replicated:
        p.grad.add_(1e-3 * groups.tp_rank)
    share_replicated_gradients(policy.parameters(), groups, bucket_bytes=4096)
    record("replicated grads: the first rank's on every rank",
           all(torch.equal(p.grad, k) for p, k in zip(replicated, kept))
           and all(torch.equal(p.grad, sharded[id(p)]) for p in policy.parameters() if id(p) in sharded))
    clipped = {n: p.grad for n, p in zip(hf_grads, ref_params)}
    want = megatron_state(policy.spec, policy.options, groups.tp_rank, clipped)
    worst = max(rel_err(p.grad, want[n].view_as(p.grad)) for n, p in policy.gpt.named_parameters())
    record("clipped grads == torch's clipped HF grads", worst <= GRAD_RTOL, "", worst)

    # bf16 autocast (TRL's bf16=True on CPU): forward and backward run, log-probs within a bf16 tolerance
    policy.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps16, ent16 = policy_logps(policy, batch)
    loss_of(logps16, ent16, batch).backward()
    diff = (logps16 - ref_logps).abs().max().item()
    grads_ok = all(p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all()
                   for p in policy.gpt.parameters())
    record("logps bf16 autocast", diff <= BF16_TOL and grads_ok, f"grads fp32 and finite: {grads_ok}", diff)
    record("entropy bf16 autocast", (ent16 - ref_ent).abs().max().item() <= BF16_TOL, "",
           (ent16 - ref_ent).abs().max().item())

    # one AdamW step on the megatron parameters, then the copy-path weight sync into a separate HF model
    policy.zero_grad(set_to_none=True)
    logps, ent = policy_logps(policy, batch)
    loss_of(logps, ent, batch).backward()
    torch.optim.AdamW(policy.parameters(), lr=1e-2).step()
    with torch.no_grad():
        after, after_ent = policy_logps(policy, batch)
    fresh = load_hf(path)
    nbytes = policy.copy_into_hf(fresh)
    with torch.no_grad():
        synced, synced_ent = hf_logps(fresh, batch)
    moved = (after - ref_logps).abs().max().item()
    record("copy_into_hf: HF forward == megatron forward after a step", moved > 1e-3 and
           (synced - after).abs().max().item() <= LOGP_TOL and (synced_ent - after_ent).abs().max().item() <= LOGP_TOL,
           f"step moved logps by {moved:.2e}; {nbytes} bytes", (synced - after).abs().max().item())
    total = sum(p.numel() * p.element_size() for p in fresh.parameters())
    shared = policy.copy_into_hf(hf)  # the HF model that owns the vision tower: only the LLM is copied
    vis = sum(p.numel() * p.element_size() for p in hf.model.visual.parameters())
    record("copy_into_hf bytes", nbytes == total and shared == total - vis, f"{nbytes}, {shared}, {total}, {vis}")

    if t > 1:  # the all-gather shim (mappings allocate on torch.cuda.current_device())
        from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region

        x = torch.full((2, 3), float(groups.tp_rank))
        got = all_gather_last_dim_from_tensor_parallel_region(x, group=groups.tp_group)
        record("megatron all-gather on CPU", torch.equal(got, torch.cat([torch.full((2, 3), float(k))
                                                                          for k in range(t)], -1)))


def _first_row(batch: dict) -> dict:
    """The batch's first row alone: one video item (its pixel rows and grid row)."""
    grid = batch["video_grid_thw"][:1]
    out = {k: (v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == 2 else v)
           for k, v in batch.items()}
    out["video_grid_thw"] = grid
    out["pixel_values_videos"] = batch["pixel_values_videos"][:int(grid.prod())]
    return out


def vision_split_checks(path, t: int, record) -> None:
    """rollplex_split_vision at TP = t: each rank runs the vision tower on its items only (counted), the features
    are gathered over TP, and after sum_vision_gradients the tower's gradients (and the LLM's) equal the HF model's
    full backward; also with fewer items than ranks (one video: the last rank runs no tower at all)."""
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel, sum_vision_gradients
    from rollplex_trl.backends.megatron.vision_split import VisionSplit
    from rollplex_trl.backends.megatron.weights import megatron_state

    groups = init_model_parallel(t)

    def all_reduce(x):
        dist.all_reduce(x, group=groups.tp_group)
        return x

    for label, select in (("two items", lambda b: b), ("one item", _first_row)):
        hf = load_hf(path)
        batch = select(video_batch(path))
        ref_logps, ref_ent = hf_logps(hf, batch)
        loss_of(ref_logps, ref_ent, batch).backward()
        hf_grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
        hf.zero_grad(set_to_none=True)
        policy = MegatronPolicy(hf, groups)
        policy.vision_split = VisionSplit(tp_rank=groups.tp_rank, tp_size=t, all_reduce=all_reduce)
        seen: list = []
        hook = policy.visual.register_forward_pre_hook(
            lambda _m, args, kwargs, seen=seen: seen.append(kwargs["grid_thw"].tolist()), with_kwargs=True)
        logps, ent = policy_logps(policy, batch)
        hook.remove()
        loss_of(logps, ent, batch).backward()
        items = batch["video_grid_thw"].tolist()
        mine = items[groups.tp_rank::t]
        record(f"split vision ({label}): the tower ran on this rank's items only",
               seen == ([mine] if mine else []), f"ran {seen}, items {items}")
        had_grads = any(p.grad is not None for p in policy.visual.parameters())
        sum_vision_gradients(policy.visual.parameters(), groups, all_reduce)
        diff = (logps - ref_logps).abs().max().item()
        record(f"split vision ({label}): logps", diff <= LOGP_TOL, "", diff)
        worst, bad = vision_grad_errors(policy.visual, hf_grads)
        record(f"split vision ({label}): vision tower grads == HF grads after the TP sum",
               not bad and had_grads == bool(mine), f"had grads before the sum: {had_grads}; " + "; ".join(bad[:4]),
               worst)
        want = megatron_state(policy.spec, policy.options, groups.tp_rank, hf_grads)
        worst = max(rel_err(p.grad, want[n].view_as(p.grad)) for n, p in policy.gpt.named_parameters())
        record(f"split vision ({label}): LLM grads == HF grads", worst <= GRAD_RTOL, "", worst)


def kv_replication_checks(path, t: int, record) -> None:
    """One KV head at t = 2: Megatron replicates the KV group on both ranks (its all-gather path runs, and the clip
    norm must count the replicated k/v rows once)."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from rollplex_trl.backends.megatron import MegatronPolicy, clip_grad_norm_tensor_parallel, init_model_parallel
    from rollplex_trl.backends.megatron.weights import megatron_state

    config = AutoConfig.from_pretrained(path)
    config.get_text_config().num_key_value_heads = 1
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(config).train()
    batch = video_batch(path)
    ref_logps, ref_ent = hf_logps(hf, batch)
    loss_of(ref_logps, ref_ent, batch).backward()
    hf_grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)
    groups = init_model_parallel(t)
    policy = MegatronPolicy(hf, groups)
    logps, ent = policy_logps(policy, batch)
    loss_of(logps, ent, batch).backward()
    diff = max((logps - ref_logps).abs().max().item(), (ent - ref_ent).abs().max().item())
    record("kv replicated: logps and entropies", diff <= LOGP_TOL, "", diff)
    want = megatron_state(policy.spec, policy.options, groups.tp_rank, hf_grads)
    worst = max(rel_err(p.grad, want[n].view_as(p.grad)) for n, p in policy.gpt.named_parameters())
    record("kv replicated: grads", worst <= GRAD_RTOL, "", worst)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in hf_grads.values()]))
    norm = clip_grad_norm_tensor_parallel(policy.parameters(), None, groups, policy.duplicate_rows)
    err = abs(norm.item() - ref_norm.item()) / ref_norm.item()
    record("kv replicated: grad norm counts k/v rows once", err <= 1e-5, f"{norm.item()} vs {ref_norm.item()}", err)
    sd = policy.hf_state_dict()
    record("kv replicated: round trip", all(torch.equal(sd[n], p) for n, p in hf.named_parameters()))


def data_parallel_checks(record) -> None:
    """t = 1 over 2 processes: DP groups, gradient averaging, and norm with replicated (unsharded) parameters."""
    from rollplex_trl.backends.megatron import average_data_parallel_gradients, init_model_parallel

    groups = init_model_parallel(1)
    record("dp groups", groups.dp_size == groups.world and groups.tp_size == 1, str(groups))
    rank = dist.get_rank()
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7)),
              torch.nn.Parameter(torch.zeros(2))]
    for i, p in enumerate(params[:2]):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).view_as(p) * (rank + 1) + i
    average_data_parallel_gradients(params, groups, bucket_bytes=32)  # several buckets
    mean = (1 + groups.world) / 2
    ok = all(torch.allclose(p.grad, torch.arange(p.numel(), dtype=torch.float32).view_as(p) * mean + i)
             for i, p in enumerate(params[:2])) and params[2].grad is None
    record("dp average == mean", ok)
    try:
        init_model_parallel(2)
        record("changing t is refused", False)
    except ValueError as e:
        record("changing t is refused", "rollplex_tensor_parallel_size" in str(e), str(e))


def main(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    records: list[dict] = []
    case = ""

    def record(check, ok=True, detail="", value=None):
        records.append({"case": case, "rank": rank, "check": check, "ok": bool(ok), "detail": detail,
                        "value": value})

    try:
        case = "t2"
        equivalence_checks(path, world, record)
        vision_split_checks(path, world, record)
        kv_replication_checks(path, world, record)
        parallel_state.destroy_model_parallel()  # tests only: one grid per process otherwise
        case = "dp2"
        data_parallel_checks(record)
    except Exception:
        record("no exception", False, traceback.format_exc())
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
        from rollplex_trl.backends.megatron import release_model_parallel

        release_model_parallel()  # parallel_state would keep gloo's threads alive into the interpreter's exit
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- shim probes
def _probes() -> dict:
    """One probe per CPU shim: the megatron-core code path the shim exists for."""
    from megatron.core import utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.tensor_parallel import random as mrandom

    def rope():
        MultimodalRotaryEmbedding(kv_channels=8, rotary_percent=1.0)

    def memory_buffer():
        utils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")

    def all_gather():
        class Pair:  # a 2-rank group; the collective itself is stubbed, the allocation before it is the probe
            def size(self):
                return 2

        stub = mappings.dist_all_gather_func
        mappings.dist_all_gather_func = lambda out, x, group=None: out.copy_(torch.cat([x, x]))
        try:
            got = mappings._gather_along_last_dim(torch.ones(2, 3), Pair())
        finally:
            mappings.dist_all_gather_func = stub
        assert got.shape == (2, 6)

    def rng_fork():
        with mrandom.get_cuda_rng_tracker().fork():
            pass

    def causal_mask():
        softmax = fused_softmax.FusedScaleMaskSoftmax(
            input_in_fp16=False, input_in_bf16=False, attn_mask_type=fused_softmax.AttnMaskType.causal,
            scaled_masked_softmax_fusion=False, mask_func=lambda x, m: x.masked_fill(m, -10000.0),
            softmax_in_fp32=True, scale=None)
        probs = softmax(torch.randn(1, 1, 4, 4), None)
        assert probs[0, 0, 0, 1:].abs().max() == 0

    def autocast():
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(5, 4, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layers.LinearWithGradAccumulationAndAsyncCommunication.apply(x, w, None, False, False, False, None,
                                                                             0, None)
        y.float().sum().backward()
        assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32

    def frozen_autocast():
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(5, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layers.LinearWithFrozenWeight.apply(x, w, None, False, None)
        y.float().sum().backward()
        assert x.grad.dtype == torch.float32

    return {"current_device:rope": rope, "current_device:memory_buffer": memory_buffer,
            "current_device:all_gather": all_gather, "rng_tracker": rng_fork, "causal_mask": causal_mask,
            "autocast:linear": autocast, "autocast:frozen_linear": frozen_autocast}


def run_probes() -> dict:
    import rollplex_trl.megatron_compat as compat

    out = {"cuda": torch.cuda.is_available()}
    for phase in ("without", "with"):
        if phase == "with":
            out["applied"] = compat.apply_cpu_shims()
            out["applied_again"] = compat.apply_cpu_shims()
        for name, probe in _probes().items():
            try:
                with contextlib.redirect_stderr(open(os.devnull, "w")):
                    probe()
                out[f"{phase}:{name}"] = "ok"
            except Exception as e:  # what the shim is for: record the failure
                out[f"{phase}:{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


if __name__ == "__main__" and sys.argv[1:] == ["probes"]:
    print("PROBES " + json.dumps(run_probes()))
