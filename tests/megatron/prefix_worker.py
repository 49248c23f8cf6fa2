"""The shared prefix on the Megatron backend (backends/megatron/prefix.py) against MegatronPolicy.token_logps on the
full rows: the batch, the per-process checks, and the 2-process entry point (test_megatron_prefix.py asserts on the
records ``{case, rank, check, ok, value, detail}`` written to ``<out>/rank<k>.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import megatron_worker as mw
import numpy as np
import torch
import torch.distributed as dist

LOGP_TOL = 1e-5  # fp32, max abs (log-probs and entropies)
GRAD_RTOL = 1e-4  # max|g - g_ref| / max|g_ref| per parameter
BF16_TOL = 2e-2  # bf16 autocast, shared vs full (both under autocast), max abs
BF16_GRAD_RTOL = 0.25  # bf16 autocast grads, shared vs full, per parameter relative (the full bf16 pass vs fp32
# differs by as much: bf16 rounding of the K/V gradient sums)
# Rows of two prompts interleaved: prompt 0 has G = 3 rows, prompt 1 has G = 2 (4 in the slow variant).
ORDER = (0, 1, 0, 0, 1)


def prepared_prompts(path) -> list:
    """The two video prompts of megatron_worker.video_batch (4 frames 56x84, 8 frames 56x56) as PreparedPrompts."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    from rollplex_trl.data.prompt import PreparedPrompt

    processor = AutoProcessor.from_pretrained(path)
    rng = np.random.default_rng(0)
    prompts = []
    for i, (frames, width, question) in enumerate(((4, 84, "How many red balls move left?"), (8, 56, "Why?"))):
        video = torch.from_numpy(rng.integers(0, 255, (frames, 3, 56, width), dtype=np.uint8))
        meta = VideoMetadata(total_num_frames=frames, fps=2.0, frames_indices=list(range(frames)))
        chat = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}], tokenize=False,
            add_generation_prompt=True)
        out = processor(text=[chat], videos=[video], return_tensors="pt",
                        videos_kwargs=dict(video_metadata=[meta], do_sample_frames=False))
        prompts.append(PreparedPrompt(
            sample_id=str(i), prompt_ids=out["input_ids"][0].tolist(),
            mm_token_type_ids=out["mm_token_type_ids"][0].tolist(), pixel_values_videos=out["pixel_values_videos"],
            video_grid_thw=out["video_grid_thw"],
            second_per_grid_ts=torch.as_tensor(out["second_per_grid_ts"], dtype=torch.float32)))
    return prompts


def group_batch(path, order=ORDER, completion_len: int = 6, seed: int = 0) -> dict:
    """TRL's layout for rows ``order`` (prompt index per row): prompts left-padded to one width (they differ in
    length), completions right-padded to different lengths (row r keeps C - r % 3 tokens)."""
    from rollplex_trl.data.prompt import token_type_ids, vision_inputs

    prompts = prepared_prompts(path)
    rows = [prompts[i] for i in order]
    P, C = max(p.num_prompt_tokens for p in prompts), completion_len
    gen = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for r, row in enumerate(rows):
        n = row.num_prompt_tokens
        completion_mask = (torch.arange(C) < C - r % 3).long()
        completion = torch.randint(10, 700, (C,), generator=gen).masked_fill(completion_mask == 0, 0)
        ids.append(torch.cat([torch.zeros(P - n, dtype=torch.long), torch.tensor(row.prompt_ids), completion]))
        mask.append(torch.cat([torch.zeros(P - n, dtype=torch.long), torch.ones(n, dtype=torch.long),
                               completion_mask]))
    input_ids, attention_mask = torch.stack(ids), torch.stack(mask)
    full_vision = vision_inputs(rows)  # the full-sequence pass: one copy of the vision inputs per row
    full_vision["mm_token_type_ids"] = token_type_ids(rows, P, P + C)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "rows": rows, "K": C,
            "completion_mask": attention_mask[:, -C:], "vision": full_vision, "num_prompts": len(set(order))}


def full_logps(policy, batch, temperature=mw.TEMPERATURE):
    return policy.token_logps(batch["input_ids"], batch["attention_mask"], batch["K"], temperature=temperature,
                              compute_entropy=True, **batch["vision"])


def shared_logps(policy, batch, prompts_per_chunk: int, temperature=mw.TEMPERATURE):
    from rollplex_trl.backends.megatron.prefix import megatron_shared_prefix_logps

    return megatron_shared_prefix_logps(policy, batch["input_ids"], batch["attention_mask"], batch["K"],
                                        batch["rows"], temperature=temperature, compute_entropy=True,
                                        prompts_per_chunk=prompts_per_chunk)


def grads_of(policy) -> dict[str, torch.Tensor]:
    out = {f"gpt.{n}": p.grad.detach().clone() for n, p in policy.gpt.named_parameters() if p.grad is not None}
    out.update({f"visual.{n}": p.grad.detach().clone() for n, p in policy.visual.named_parameters()
                if p.grad is not None} if policy.visual is not None else {})
    return out


def compare_grads(got: dict, want: dict, prefix: str) -> tuple[float, list[str]]:
    worst, bad = 0.0, []
    for name, g in want.items():
        if not name.startswith(prefix):
            continue
        err = mw.rel_err(got[name], g) if name in got else float("inf")
        worst = max(worst, err)
        if err > GRAD_RTOL:
            bad.append(f"{name}: {err:.2e}")
    return worst, bad


def equivalence_checks(path, t: int, record, *, bf16: bool = True, order=ORDER) -> None:
    """Shared prefix vs the full-sequence megatron pass at TP = t: values, gradients, vision tower calls, bf16."""
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

    groups = init_model_parallel(t)
    policy = MegatronPolicy(mw.load_hf(path), groups)
    batch = group_batch(path, order)
    mask = batch["completion_mask"].bool()

    ref_logps, ref_ent = full_logps(policy, batch)
    mw.loss_of(ref_logps, ref_ent, batch).backward()
    ref_grads = grads_of(policy)
    policy.zero_grad(set_to_none=True)

    videos = []
    handle = policy.visual.register_forward_hook(lambda m, args, kwargs, out: videos.append(
        int(kwargs["grid_thw"].shape[0])), with_kwargs=True)
    try:
        logps, ent, U = shared_logps(policy, batch, prompts_per_chunk=2)
    finally:
        handle.remove()
    record("unique prompts and vision tower once per prompt", U == batch["num_prompts"] and videos == [U],
           f"U={U}, vision calls over {videos} videos")
    diff = (logps - ref_logps)[mask].abs().max().item()
    record("logps fp32", diff <= LOGP_TOL, "", diff)
    diff = (ent - ref_ent)[mask].abs().max().item()
    record("entropy fp32", diff <= LOGP_TOL, "", diff)
    diff = max((logps - ref_logps).abs().max().item(), (ent - ref_ent).abs().max().item())
    record("padded completion positions too", diff <= LOGP_TOL, "", diff)
    mw.loss_of(logps, ent, batch).backward()
    got = grads_of(policy)
    worst, bad = compare_grads(got, ref_grads, "gpt.")
    record("GPTModel grads (this rank's layout)", not bad, "; ".join(bad[:4]), worst)
    worst, bad = compare_grads(got, ref_grads, "visual.")
    record("vision tower grads", not bad and any(n.startswith("visual.") for n in ref_grads),
           "; ".join(bad[:4]), worst)
    policy.zero_grad(set_to_none=True)

    # sensitivity: serving each row the other prompt's K/V must change the log-probs
    from rollplex_trl.backends.megatron.prefix import megatron_suffix_logps, run_megatron_prefix
    from rollplex_trl.prefix.batch import group_by_prompt

    P = batch["input_ids"].size(1) - batch["K"]
    pg = group_by_prompt(batch["input_ids"][:, :P], batch["attention_mask"][:, :P], batch["rows"])
    with torch.no_grad():
        state = run_megatron_prefix(policy, batch["input_ids"][pg.first_row, :P],
                                    batch["attention_mask"][pg.first_row, :P], [batch["rows"][r] for r in pg.first_row],
                                    keep_graph=False)
        swapped, _ = megatron_suffix_logps(policy, state, 1 - pg.row_to_prompt, batch["input_ids"][:, P:],
                                           batch["completion_mask"], temperature=mw.TEMPERATURE)
    diff = (swapped - ref_logps)[mask].abs().max().item()
    record("sensitivity: the other prompt's K/V change the log-probs", diff > 1e-3 and not state.has_graph, "", diff)

    with torch.no_grad():  # the old/ref passes: one prompt per chunk, no graph kept
        logps1, ent1, _ = shared_logps(policy, batch, prompts_per_chunk=1)
    diff = max((logps1 - ref_logps).abs().max().item(), (ent1 - ref_ent).abs().max().item())
    record("no_grad, one prompt per chunk", diff <= LOGP_TOL and not logps1.requires_grad, "", diff)

    if t > 1:
        rollout_prefill_checks(path, policy, record)

    if bf16:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full16, full_ent16 = full_logps(policy, batch)
        mw.loss_of(full16, full_ent16, batch).backward()
        full16_grads = grads_of(policy)
        policy.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sh16, sh_ent16, _ = shared_logps(policy, batch, prompts_per_chunk=2)
        mw.loss_of(sh16, sh_ent16, batch).backward()
        sh16_grads = grads_of(policy)
        policy.zero_grad(set_to_none=True)
        diff = (sh16 - full16)[mask].abs().max().item()
        record("bf16 autocast logps vs full bf16", diff <= BF16_TOL, "", diff)
        record("bf16 autocast logps vs fp32 (for scale)", True, f"full bf16 vs fp32: "
               f"{(full16 - ref_logps)[mask].abs().max().item():.2e}", (sh16 - ref_logps)[mask].abs().max().item())
        diff = (sh_ent16 - full_ent16)[mask].abs().max().item()
        record("bf16 autocast entropy vs full bf16", diff <= BF16_TOL, "", diff)
        finite = all(torch.isfinite(g).all() for g in sh16_grads.values()) and sh16_grads.keys() == \
            full16_grads.keys()
        worst = max(mw.rel_err(sh16_grads[n], g) for n, g in full16_grads.items())
        scale = max(mw.rel_err(g, ref_grads[n]) for n, g in full16_grads.items())
        record("bf16 autocast grads vs full bf16", finite and worst <= BF16_GRAD_RTOL,
               f"full bf16 vs fp32 grads: {scale:.2e}", worst)


def rollout_prefill(policy, groups=None, all_reduce=None):
    """The trainer's Megatron rollout prefill (`MegatronBackend.rollout_prefill`) for this policy (no pooled
    rollout: every rank decodes)."""
    from types import SimpleNamespace

    from rollplex_trl.backends.megatron.backend import MegatronBackend

    backend = SimpleNamespace(policy=policy, groups=groups or policy.groups, rollout_pool=None, all_reduce=all_reduce)
    return MegatronBackend.rollout_prefill(backend, training=True)


def video_generate_inputs(path, G: int):
    from trl.trainer.utils import pad

    from rollplex_trl.data.prompt import generation_fields

    prompts = prepared_prompts(path)  # two video prompts of different lengths: left padding in the batch
    rows = [p for p in prompts for _ in range(G)]
    fields = generation_fields(rows)
    inputs = dict(
        input_ids=pad([torch.tensor(r.prompt_ids) for r in rows], padding_value=0, padding_side="left"),
        attention_mask=pad([torch.ones(r.num_prompt_tokens, dtype=torch.long) for r in rows], padding_value=0,
                           padding_side="left"),
        mm_token_type_ids=pad([torch.tensor(x) for x in fields.pop("mm_token_type_ids")], padding_value=0,
                              padding_side="left"), **fields)
    return rows, inputs


def rollout_prefill_checks(path, policy, record) -> None:
    """The transformers rollout decoding from the TP policy's prefill (`MegatronBackend.rollout_prefill` at t > 1:
    a collective, then the ranks' KV heads gathered) on every rank: K/V equal HF's own prefill (1e-5) and the same
    greedy tokens as HF's `generate` (the rollout model is this rank's full transformers copy)."""
    from transformers import GenerationConfig

    from rollplex_trl.prefix.generation import generate_with_shared_prefill

    hf = mw.load_hf(path).eval()
    rows, inputs = video_generate_inputs(path, 2)
    _, unique = video_generate_inputs(path, 1)
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=[])
    with torch.no_grad():
        wanted = hf.model(**{k: v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                             for k, v in unique.items()}, use_cache=True).past_key_values
        plain = hf.generate(**inputs, generation_config=config)
    from rollplex_trl.backends.megatron.shm_all_reduce import SharedMemoryAllReduce

    shm = SharedMemoryAllReduce(policy.groups.tp_group)
    errors, equal, states = [], [], []
    for all_reduce in (None, shm):  # gathered by dist.all_gather, or through the shared-memory all-reduce
        prefill = rollout_prefill(policy, all_reduce=all_reduce)
        decoded = []
        original = prefill.for_decode

        def recording(state, original=original, decoded=decoded):
            decoded.append(original(state))
            return decoded[-1]

        prefill = dataclasses.replace(prefill, for_decode=recording)
        with torch.no_grad():
            ours = generate_with_shared_prefill(hf, **inputs, rows=rows, prefill=prefill, generation_config=config)
        (state,) = decoded
        width = state.keys[0].size(2)
        errors.append(max(max((k - layer.keys[:, :, -width:]).abs().max().item(),
                              (v - layer.values[:, :, -width:]).abs().max().item())
                          for k, v, layer in zip(state.keys, state.values, wanted.layers, strict=True)))
        equal.append(torch.equal(ours, plain))
        states.append(state)
    shm.close()
    same = all(torch.equal(a, b) for a, b in zip(states[0].keys + states[0].values, states[1].keys + states[1].values,
                                                 strict=True))
    record("rollout prefill, KV heads gathered: K/V equal HF's", max(errors) <= LOGP_TOL and same,
           f"all_gather / shm all-reduce equal: {same}", max(errors))
    record("rollout prefill, KV heads gathered: HF's greedy tokens", all(equal), str(equal))


def main(rank: int, world: int, port: int, path: str, out_dir: str, bf16: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    records: list[dict] = []

    def record(check, ok=True, detail="", value=None):
        records.append({"case": f"t{world}", "rank": rank, "check": check, "ok": bool(ok), "detail": detail,
                        "value": value})

    try:
        equivalence_checks(path, world, record, bf16=bf16)
    except Exception:
        record("no exception", False, traceback.format_exc())
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
        from rollplex_trl.backends.megatron import release_model_parallel

        release_model_parallel()  # parallel_state would keep gloo's threads alive into the interpreter's exit
        dist.destroy_process_group()
