"""The `TrainingBackend` contract checks (backends/base.py), run the same way on every backend.

`run_contract(backend_name, paths, record)` builds the backend (`BACKENDS`), then, for a VL model (video + image
prompts, `PreparedPrompt` rows) and a text model (Qwen2, rows grouped by tokens), checks against an independent
reference: a plain transformers forward of prompt + completion on a separately loaded fp32 model,
log_softmax(logits / T) gathered at the completion tokens, padded positions zeroed (never the code under test):

1. `logps_and_entropies` under no_grad: the reference model's (`reference=True`, a perturbed copy of the weights,
   so a backend scoring the wrong model fails) and the policy's (old log-probs), `share_prefix` True and False;
   None is accepted only where the backend declares TRL's own pass (`hf`: share_prefix=False, rows=None).
2. the actor's pass outside a window: `logps_and_entropies` with gradients (`share_prefix=True`), a policy-gradient
   + entropy loss, backward; the backend's global grad norm (`clip_grad_norm(None)`; transformers' norm over the
   trained model where the backend returns None) and every parameter's gradient in HF names against the reference
   model's gradients.
3. the actor's pass inside a window: the prefix from `build_actor_prefix()` with its graph,
   detached to leaves (`detach_prefix`, as prefix/actor.py does), `actor_suffix_logps`, backward, `backward_prefix`:
   log-probs, entropies, grad norm and gradients as in 2.

Plus sensitivity records (a check that could not fail is worthless): the backend's log-probs against the reference
at a wrong temperature, and the reference model's against the policy's reference, must differ by far more than
the tolerance. Between 2 and 3 the optimizer step boundary runs (the backend's optimizer at lr = 0, which leaves
the weights bit-identical): it resets the backend's once-per-step gradient reduction.

`main` runs `run_contract` in each of t spawned processes (gloo) for the tensor-parallel backends; each rank writes
its records to ``<out>/rank<k>.json``. Records: ``{backend, model, check, rank, ok, value, tol, detail}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

_PREFIX_TESTS = str(Path(__file__).resolve().parents[1] / "prefix")
if _PREFIX_TESTS not in sys.path:  # the batch builders of tests/prefix (also in spawned workers)
    sys.path.insert(0, _PREFIX_TESTS)
import test_prefix_exactness as exact  # noqa: E402

TEMPERATURE = 0.7
WRONG_TEMPERATURE = 1.0  # sensitivity: the reference at this temperature must be far from the backend's values
LOGP_TOL = 1e-5  # fp32, max abs over the real completion tokens (log-probs and entropies)
GRAD_RTOL = 1e-4  # per parameter: max|g - g_ref| / max|g_ref|
NORM_RTOL = 1e-4  # |norm - norm_ref| / norm_ref
SENSITIVITY = 1e-3  # what a wrong temperature / a wrong model must move the log-probs by, at least
PROMPTS_PER_CHUNK = 2  # three unique prompts: two chunks, so the chunk loop and the row reordering run
REF_NOISE = 0.05  # the reference model's weights: w * (1 + REF_NOISE * n), n ~ N(0, 1) fixed by the seed
MODELS = ("vl", "text")
PADDED_CHECK = "padded completion positions are 0 (TRL's fused head)"
PASSES = [(reference, share) for reference in (True, False) for share in (True, False)]


def pass_name(reference: bool, share: bool) -> str:
    return f"{'ref' if reference else 'old'} logps_and_entropies share_prefix={share}"


def check_names() -> list[str]:
    """Every check `run_contract` records, per model (what the test file parametrizes over)."""
    per_model = [pass_name(r, s) for r, s in PASSES]
    per_model += ["sensitivity: wrong temperature", "sensitivity: reference vs policy weights"]
    for where in ("actor logps_and_entropies", "actor_suffix_logps"):
        per_model += [f"{where}: logps", f"{where}: grad norm", f"{where}: grads"]
    return [f"{model}: {check}" for model in MODELS for check in per_model]


# ----------------------------------------------------------------------------------------------------------------
# The cases: TRL's batch layout (left-padded prompts, right-padded completions of different lengths, rows of
# one prompt interleaved with others)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    model: str  # "vl" | "text"
    path: str
    batch: exact.Batch  # unique prompts (U, P), completions per row, row_to_prompt
    prompts: list | None  # U PreparedPrompts (VL), None: text rows grouped by their tokens (TRL's batch, no rows)
    rows: list | None  # the PreparedPrompt of each row (what the trainer passes as `rows`)
    input_ids: torch.Tensor  # (R, P + C)
    attention_mask: torch.Tensor
    advantages: torch.Tensor  # (R, 1)

    @property
    def C(self) -> int:
        return self.batch.completion_ids.size(1)


ROW_ORDER = [0, 2, 4, 1, 5, 3]  # 3 prompts x G = 2, interleaved (vl_batch/text_batch group a prompt's rows)


def make_case(model: str, path: str) -> Case:
    from transformers import AutoProcessor, AutoTokenizer

    from rollplex_trl.data.prompt import PreparedPrompt

    if model == "vl":
        processor = AutoProcessor.from_pretrained(path)
        b = exact.vl_batch(processor, ["video_long", "image", "video"], G=2)
    else:
        b = exact.text_batch(AutoTokenizer.from_pretrained(path), G=2)
    b = b.select_rows(torch.tensor(ROW_ORDER))
    assert b.prompt_mask[:, 0].min() == 0, "prompts of different lengths (left padding)"
    assert (b.completion_mask == 0).any(), "completions of different lengths (right padding)"
    prompts = rows = None
    if model == "vl":
        prompts = []
        for u in range(b.prompt_ids.size(0)):
            real = b.prompt_mask[u].bool()
            vision = dict(b.per_prompt_vision[u])
            if "second_per_grid_ts" in vision:
                vision["second_per_grid_ts"] = torch.as_tensor(vision["second_per_grid_ts"], dtype=torch.float32)
            prompts.append(PreparedPrompt(sample_id=str(u), prompt_ids=b.prompt_ids[u][real].tolist(),
                                          mm_token_type_ids=b.mm_token_type_ids[u][real].tolist(), **vision))
        rows = [prompts[u] for u in b.row_to_prompt.tolist()]
    input_ids = torch.cat([b.prompt_ids[b.row_to_prompt], b.completion_ids], 1)
    attention_mask = torch.cat([b.prompt_mask[b.row_to_prompt], b.completion_mask], 1)
    return Case(model, str(path), b, prompts, rows, input_ids, attention_mask, exact.advantages(b))


def load(case: Case, *, perturbed: bool = False, fused: bool = False) -> torch.nn.Module:
    """A fresh fp32 copy of the checkpoint (eager attention, train mode); `perturbed`: the reference model's
    weights; `fused`: TRL's fused LM head added, as GRPOTrainer does to the policy and the reference."""
    model = (exact.load_vl if case.model == "vl" else exact.load_qwen2)(case.path)
    if perturbed:
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + REF_NOISE * torch.randn(p.shape, generator=gen))
    if fused:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model


def loss_of(logps: torch.Tensor, entropies: torch.Tensor, case: Case) -> torch.Tensor:
    """GRPO-like: -(logp * A) averaged over the real tokens, plus an entropy term (its gradient is checked too)."""
    mask = case.batch.completion_mask.float()
    return -(logps * mask * case.advantages).sum() / mask.sum() + 0.1 * (entropies * mask).sum() / mask.sum()


@dataclass
class Reference:
    logps: torch.Tensor
    entropies: torch.Tensor
    wrong_t_logps: torch.Tensor  # the same forward at WRONG_TEMPERATURE
    ref_logps: torch.Tensor  # the reference (perturbed) model's
    ref_entropies: torch.Tensor
    grads: dict[str, torch.Tensor]  # of loss_of on the policy's full forward, HF names
    norm: float


def reference(case: Case) -> Reference:
    """The independent full forwards (exact.full_plain: a plain transformers forward, no rollplex code)."""
    policy, ref = load(case), load(case, perturbed=True)
    with torch.no_grad():
        wrong_t, _ = exact.full_plain(policy, case.batch, temperature=WRONG_TEMPERATURE)
        ref_logps, ref_entropies = exact.full_plain(ref, case.batch, temperature=TEMPERATURE)
    logps, entropies = exact.full_plain(policy, case.batch, temperature=TEMPERATURE)
    loss_of(logps, entropies, case).backward()
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in policy.named_parameters()}
    norm = torch.nn.utils.get_total_norm(list(grads.values())).item()
    return Reference(logps.detach(), entropies.detach(), wrong_t, ref_logps, ref_entropies, grads, norm)


# ----------------------------------------------------------------------------------------------------------------
# The backends: how each is built, and where its gradients are in HF names (the only backend-specific pieces)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Built:
    backend: object  # a TrainingBackend
    policy: torch.nn.Module  # the transformers policy the trainer holds (what it passes as `model`)
    ref: torch.nn.Module  # the transformers reference model
    hf_grads: Callable[[], dict[str, torch.Tensor]]  # the trained model's gradients, full tensors in HF names
    trl_own_pass: bool  # whether `logps_and_entropies` returns None (TRL's own pass) for share_prefix=False, rows=None
    close: Callable[[], None]


def _hf(case: Case, mode: str) -> Built:
    from rollplex_trl.backends import HfBackend

    policy, ref = load(case, fused=True), load(case, perturbed=True, fused=True).eval()
    backend = HfBackend(unwrap=lambda m: m)
    why_not = backend.cascade_unsupported(policy, torch.device("cpu"))  # the run plan's fact
    assert why_not is None, why_not  # fp32 eager on CPU: the cascade applies
    backend.suffix_attention_mode = "cascade" if mode == "auto" else mode  # what the plan decides for `mode`

    def hf_grads():
        return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in policy.named_parameters()}

    return Built(backend, policy, ref, hf_grads, trl_own_pass=True, close=backend.close)


def _megatron(case: Case, t: int) -> Built:
    from rollplex_trl.backends.megatron import weights
    from rollplex_trl.backends.megatron.backend import MegatronBackend

    policy, ref = load(case, fused=True), load(case, perturbed=True, fused=True).eval()
    backend = MegatronBackend(rollout_model=policy, ref_model=ref, tensor_parallel_size=t, seed=0,
                              record=lambda key, value: None,
                              is_main_process=not dist.is_initialized() or dist.get_rank() == 0)
    assert backend.groups.tp_size == t

    def hf_grads():  # the LLM's gradient shards all-gathered into HF names and shapes, plus the vision copy's
        mp = backend.policy
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in mp.gpt.named_parameters()}
        out = dict(weights.iter_hf_llm_state(mp.spec, mp.options, grads, mp.groups.tp_group, mp._hf_shapes))
        if mp.visual is not None:
            out.update({f"model.visual.{n}": p.grad if p.grad is not None else torch.zeros_like(p)
                        for n, p in mp.visual.named_parameters()})
        return out

    return Built(backend, policy, ref, hf_grads, trl_own_pass=False, close=backend.close)


@dataclass(frozen=True)
class BackendSpec:
    build: Callable[[Case], Built]
    processes: int = 1  # > 1: run in that many spawned processes (gloo), as `main`
    requires: str | None = None  # the optional package it needs (skipped without it, unless the extras are required)


# A new backend is one more entry here: tests/backends/test_contract.py runs every check on every entry.
BACKENDS: dict[str, BackendSpec] = {
    "hf": BackendSpec(lambda case: _hf(case, "auto")),  # the trainer's default: cascade suffix attention on CPU
    "hf-concat": BackendSpec(lambda case: _hf(case, "concat")),
    "megatron-t1": BackendSpec(lambda case: _megatron(case, 1), requires="megatron.core"),
    "megatron-t2": BackendSpec(lambda case: _megatron(case, 2), processes=2, requires="megatron.core"),
}


# ----------------------------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------------------------


def _max_diff(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    return (got.detach() - want)[mask].abs().max().item()


def _padded_values(logps: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> float:
    return max(logps.detach()[~mask].abs().max().item(), entropies.detach()[~mask].abs().max().item())


def _grad_errors(got: dict, want: dict) -> tuple[float, str]:
    if got.keys() != want.keys():
        return float("inf"), f"names differ: missing {sorted(want.keys() - got.keys())[:3]}, extra " \
                             f"{sorted(got.keys() - want.keys())[:3]}"
    errors = {}
    for name, g_ref in want.items():
        scale = g_ref.abs().max().item()
        errors[name] = (got[name].float() - g_ref).abs().max().item() / (scale if scale > 0 else 1.0)
    worst = max(errors, key=errors.get)
    return errors[worst], f"worst {worst}; {len(want)} tensors"


def _grad_norm(built: Built) -> float:
    norm = built.backend.clip_grad_norm(None)
    if norm is None:  # "transformers does it": its norm over the trained model's gradients
        params = built.backend.trained_model(built.policy).parameters()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return float(norm)


def _step_boundary(built: Built) -> None:
    """The optimizer step that ends an accumulation window, at lr = 0 (the weights stay bit-identical): the
    backend's own optimizer where it builds one, else transformers' (gradients zeroed)."""
    args = SimpleNamespace(weight_decay=0.0, learning_rate=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           optim="adamw_torch")
    optimizer = built.backend.create_optimizer(args)
    if optimizer is None:
        built.backend.trained_model(built.policy).zero_grad(set_to_none=True)
        return
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _gradient_records(built: Built, ref: Reference, logps, entropies, case: Case, where: str, record) -> None:
    mask = case.batch.completion_mask.bool()
    diff = max(_max_diff(logps, ref.logps, mask), _max_diff(entropies, ref.entropies, mask))
    record(f"{where}: logps", diff <= LOGP_TOL and logps.requires_grad, diff, LOGP_TOL,
           f"requires_grad={logps.requires_grad}")
    norm = _grad_norm(built)
    err = abs(norm - ref.norm) / ref.norm
    record(f"{where}: grad norm", err <= NORM_RTOL, err, NORM_RTOL, f"{norm:.6f} vs reference {ref.norm:.6f}")
    worst, detail = _grad_errors(built.hf_grads(), ref.grads)
    record(f"{where}: grads", worst <= GRAD_RTOL, worst, GRAD_RTOL, detail)
    _step_boundary(built)


def contract_checks(built: Built, case: Case, ref: Reference, record) -> None:
    backend, mask = built.backend, case.batch.completion_mask.bool()
    padded: list[float] = []  # max |value| at padded completion positions, per pass
    common = dict(input_ids=case.input_ids, attention_mask=case.attention_mask, logits_to_keep=case.C,
                  batch_size=None, temperature=TEMPERATURE, compute_entropy=True, compute_aux_loss=False,
                  rows=case.rows, vision_kwargs={}, autocast=contextlib.nullcontext,
                  prompts_per_chunk=PROMPTS_PER_CHUNK, precomputed=None)

    # 1. reference and old log-probs (no graph)
    for reference, share in PASSES:
        name = pass_name(reference, share)
        with torch.no_grad():
            out = backend.logps_and_entropies(built.ref if reference else built.policy, reference=reference,
                                              training=True, share_prefix=share, **common)
        if not share and case.rows is None and built.trl_own_pass:
            record(name, out is None, 0.0, 0.0, "must return None: TRL's own pass (not compared)")
            continue
        if out is None:
            record(name, False, float("inf"), LOGP_TOL, "returned None (TRL's own pass) where it must not")
            continue
        logps, entropies, unique = out
        want_logps, want_entropies = (ref.ref_logps, ref.ref_entropies) if reference else (ref.logps, ref.entropies)
        diff = max(_max_diff(logps, want_logps, mask), _max_diff(entropies, want_entropies, mask))
        U = case.batch.prompt_ids.size(0)
        shape_ok = logps.shape == entropies.shape == case.batch.completion_ids.shape
        counted = unique == U if share else unique is None
        record(name, diff <= LOGP_TOL and shape_ok and counted and not logps.requires_grad, diff, LOGP_TOL,
               f"shape {tuple(logps.shape)}, unique prompts {unique} (U = {U})")
        padded.append(_padded_values(logps, entropies, mask))
        if not reference and share:  # sensitivity: the comparison would catch a wrong temperature
            wrong = _max_diff(logps, ref.wrong_t_logps, mask)
            record("sensitivity: wrong temperature", wrong > SENSITIVITY, wrong, SENSITIVITY,
                   f"vs the reference at T={WRONG_TEMPERATURE}")
        if reference and share:  # ... and the wrong model
            wrong = _max_diff(logps, ref.logps, mask)
            record("sensitivity: reference vs policy weights", wrong > SENSITIVITY, wrong, SENSITIVITY,
                   "the reference model's log-probs vs the policy's reference")

    # 2. the actor's pass outside an accumulation window: log-probs with their graph, loss, backward
    trained = backend.trained_model(built.policy)
    trained.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logps, entropies, _ = backend.logps_and_entropies(built.policy, reference=False, training=True,
                                                          share_prefix=True, **common)
        loss_of(logps, entropies, case).backward()
    padded.append(_padded_values(logps, entropies, mask))
    _gradient_records(built, ref, logps, entropies, case, "actor logps_and_entropies", record)

    # 3. the actor's pass inside a window: the window's prefix, suffix against its leaf copy, one prefix backward
    from rollplex_trl.prefix import backward_prefix, detach_prefix

    build = backend.build_actor_prefix()
    b = case.batch
    with torch.enable_grad():
        state = build(trained, b.prompt_ids, b.prompt_mask, case.prompts, keep_graph=True)
        leaf_state, outputs = detach_prefix(state)
        logps, entropies = backend.actor_suffix_logps(trained, leaf_state, b.row_to_prompt, b.completion_ids,
                                                      b.completion_mask, temperature=TEMPERATURE,
                                                      compute_entropy=True)
        loss_of(logps, entropies, case).backward()
        backward_prefix(outputs, leaf_state)
    padded.append(_padded_values(logps, entropies, mask))
    _gradient_records(built, ref, logps, entropies, case, "actor_suffix_logps", record)
    # TRL's fused head (and the reference) give 0 where the completion is padding; the loss masks them either way
    record(PADDED_CHECK, max(padded) == 0.0, max(padded), 0.0, f"max |logp|, |entropy| there over {len(padded)} passes")


def run_contract(backend_name: str, paths: dict[str, str], record: Callable[..., None]) -> None:
    """Every check on `backend_name`, for each model in MODELS; `record(model, check, ok, value, tol, detail)`."""
    for model in MODELS:
        case = make_case(model, paths[model])
        ref = reference(case)
        built = BACKENDS[backend_name].build(case)
        try:
            contract_checks(built, case, ref, lambda *args, model=model: record(model, *args))
        finally:
            built.close()


# ----------------------------------------------------------------------------------------------------------------
# One process of a multi-process backend (mp.spawn)
# ----------------------------------------------------------------------------------------------------------------


def main(rank: int, world: int, port: int, backend_name: str, paths: dict[str, str], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    records: list[dict] = []

    def record(model, check, ok, value=None, tol=None, detail=""):
        records.append({"backend": backend_name, "model": model, "check": f"{model}: {check}", "rank": rank,
                        "ok": bool(ok), "value": value, "tol": tol, "detail": detail})

    try:
        run_contract(backend_name, paths, record)
    except Exception:
        record("-", "no exception", False, detail=traceback.format_exc())
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
        if "megatron.core" in sys.modules:  # parallel_state would keep gloo's threads alive past the exit
            from rollplex_trl.backends.megatron import release_model_parallel

            release_model_parallel()
        dist.destroy_process_group()
