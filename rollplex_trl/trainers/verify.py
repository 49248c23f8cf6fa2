"""`ExactnessAudit`: every run checks its own speed-ups (rollplex_verify_every, docs/verify.md).

On an audit step, each log-prob pass the step runs through Rollplex's machinery (the reference and old passes with
the shared prefix, prefixes built in the decode window or kept from the rollout's prefill; the actor's suffix against
the window's prefix) is recomputed for its first `rollplex_verify_rows` rows the plain way: full sequences through the
same model, under no_grad, with none of those mechanisms (TRL's own pass for text rows, the unshared per-row pass for
prepared image and video rows). The largest differences are logged as `rollplex/verify_<pass>_logp_abs` (log-prob)
and `rollplex/verify_<pass>_prob_rel` (|exp(Δ) - 1|, the relative error of the token's probability), and compared
with a tolerance that depends on the precision: a difference above it is a warning naming the pass and the
mechanisms it used (an error with rollplex_verify_strict).

For the actor, the gradient of Σ log-probs of those rows with respect to the trainable parameters is compared too:
through a fresh shared-prefix pass and through the plain pass (`torch.autograd.grad`), as cosine similarity and
relative norm difference (`rollplex/verify_actor_grad_cos`, `_grad_rel`).

The audit reads the model and writes nothing: no RNG draw, no `.grad`, no module state, so a run with audits learns
exactly what it learns without them (tested). Passes that ran TRL's own code are not audited (nothing to compare).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

AUTO_EVERY = 200  # rollplex_verify_every=None: the first step and then every this many steps
# Largest |Δ log-prob| of the same tokens between the Rollplex pass and the plain pass. fp32: the same math in
# another summation order (measured 5e-7 on the test models; 1e-4 leaves room for longer sums and bigger models).
# bf16 autocast: each matmul rounds to bf16 (8 mantissa bits, 2^-8 relative) in a different order on the two paths
# (measured 1e-3 on the test models with checkpointing; a 7B model's logits are larger, so its ulps are too). A
# broken mechanism (a wrong prefix, stale weights, another group's cache) typically moves log-probs by O(0.1-1).
TOLERANCE = {"fp32": 1e-4, "bf16": 0.1, "fp16": 0.02}
# The actor's gradient of Σ log-probs over the audited rows, shared-prefix path against the plain path: the smallest
# cosine similarity and the largest relative norm difference accepted (measured on the test models: fp32 cosine
# 1 - 3e-14, norms 1e-8 apart; bf16 autocast with checkpointing 1 - 8e-6 and 1.4e-4 at lr 5e-3, but norms up to 5%
# apart at cosine 0.99993 once lr 0.1 has collapsed the policy: peaked attention makes each bf16 path's gradient
# ~5% from the fp32 truth, the cascade's no further than plain attention's (tests/prefix/test_cascade.py), and
# the two paths round differently). A gradient averaged or scaled wrongly is off by 25% or more.
# The rollout engine's sampling log-probs against the trainer's plain pass: another engine's kernels (and, where
# rollplex_vllm_dtype differs from the trainer's precision, another dtype). A wrongly mapped or stale weight moves
# log-probs by whole nats; kernel differences in bf16 reach tenths.
SAMPLER_TOLERANCE = {"fp32": 1e-3, "bf16": 1.0, "fp16": 0.5}
GRAD_TOLERANCE = {"fp32": (1 - 1e-6, 1e-4), "bf16": (0.999, 0.1), "fp16": (0.9999, 0.02)}


@dataclass(frozen=True)
class AuditSpec:
    every: int  # 0: off
    rows: int
    strict: bool

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


def audit_spec(options: dict[str, Any], *, num_generations: int, backend: str) -> AuditSpec:
    """The audit this run does. None (auto): the first step and every AUTO_EVERY, on either backend (the plain pass
    is the backend's own: the transformers model's, or the Megatron model's full rows, `plain_pass`)."""
    every = options["rollplex_verify_every"]
    if every is None:
        every = AUTO_EVERY
    # two rows of one prompt exercise a shared prefix; the plain pass pays the whole prompt (video) per row, so
    # more rows cost more than they check (a whole group of 8 made the audit 2.4% of training, amortised)
    rows = options["rollplex_verify_rows"] or min(2, num_generations)
    return AuditSpec(every=every, rows=rows, strict=bool(options["rollplex_verify_strict"]))


def precision_of(mixed_precision: str) -> str:
    return {"bf16": "bf16", "fp16": "fp16"}.get(mixed_precision, "fp32")


def compare(used: torch.Tensor, plain: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max |Δ log-prob|, max |exp(Δ) - 1|) over the completion tokens `mask` selects; 0 where it selects none."""
    delta = (used.detach().float() - plain.float())[mask.bool()]
    if delta.numel() == 0:
        return 0.0, 0.0
    return float(delta.abs().max()), float(torch.expm1(delta).abs().max())


@dataclass(frozen=True)
class Variant:
    """An audited pass recomputed with one mechanism taken out: `run(rows)` gives its log-probs (rows, C)."""

    mechanism: str
    switch: str  # the setting that turns the mechanism off for the run
    run: Callable[[int], torch.Tensor]


class ExactnessAudit:
    def __init__(self, spec: AuditSpec, precision: str, device: torch.device | None = None) -> None:
        self.spec = spec
        self.precision = precision
        self.device = device  # for the reduction over processes (the trainer's device: NCCL needs CUDA tensors)
        self.tolerance = TOLERANCE[precision]
        self._audited: set[tuple[int, str]] = set()  # (step, pass): the first call of each pass per step
        self._warned: set[str] = set()

    def wants(self, step: int, kind: str) -> bool:
        return self.spec.due(step) and (step, kind) not in self._audited

    def check(self, *, step: int, kind: str, used: torch.Tensor, mask: torch.Tensor,
              plain: Callable[[int], torch.Tensor], mechanisms: list[str], record: Callable[[str, float], None],
              variants: list[Variant] = (), tolerance: float | None = None, advice: str | None = None) -> None:
        """Compare the first rows of a pass's log-probs `used` (rows, C) with `plain(rows)`, the plain recomputation
        of those rows; `mask` (rows, C) marks completion tokens. `mechanisms`: what the pass used (for the report).
        `variants`: the same pass with one mechanism taken out each, tried in turn when the difference is too large,
        to name the mechanism at fault; `advice`: what the report says when no variant names it."""
        self._audited.add((step, kind))
        rows = min(self.spec.rows, used.size(0))
        with torch.no_grad():
            reference = plain(rows)
        abs_diff, rel_diff = compare(used[:rows], reference, mask[:rows])
        worst_abs, worst_rel = self._worst_over_processes([abs_diff, rel_diff])
        record(f"rollplex/verify_{kind}_logp_abs", worst_abs)
        record(f"rollplex/verify_{kind}_prob_rel", worst_rel)
        tolerance = self.tolerance if tolerance is None else tolerance
        ok = abs_diff <= tolerance
        logger.info("rollplex audit step %d, %s log-probs of %d rows: max |Δ| %.2e (tolerance %.0e, %s) %s", step,
                    kind, rows, abs_diff, tolerance, self.precision, "ok" if ok else "EXCEEDED")
        if not ok:
            culprit = self._diagnose(variants, reference, mask[:rows], rows) or advice
            self._report(f"rollplex exactness audit, step {step}: the {kind} log-probs differ from a plain full "
                         f"forward of the same rows by up to {abs_diff:.3g} (tolerance {tolerance:g} under "
                         f"{self.precision})", kind, mechanisms, culprit)
        record("rollplex/verify_within_tolerance", float(worst_abs <= tolerance))  # the step's mean: 1 = all held
        self._stop_if_strict(worst_abs > tolerance, f"the {kind} log-probs, step {step}")

    def _worst_over_processes(self, values: list[float]) -> list[float]:
        """Each value's maximum over the processes (every process audits its own rows at the same point of the
        step, so the collective is reached by all): the logged metric is the worst process's. Each process decides
        and reports on its own rows."""
        if self.device is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()
                                       and torch.distributed.get_world_size() > 1):
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor.tolist()

    def _diagnose(self, variants: list[Variant], reference: torch.Tensor, mask: torch.Tensor, rows: int
                  ) -> str | None:
        """The first variant (the pass with one mechanism taken out) that agrees with the plain pass names the
        mechanism at fault; None when none does (the shared prefix itself, or something no variant removes)."""
        for variant in variants:
            with torch.no_grad():
                diff, _ = compare(variant.run(rows), reference, mask)
            logger.info("rollplex audit: without %s, max |Δ| %.2e", variant.mechanism, diff)
            if diff <= self.tolerance:
                return (f"Re-run without {variant.mechanism}, the pass agrees with the plain one (max |Δ| "
                        f"{diff:.2g}): that is the mechanism at fault; {variant.switch} turns it off")
        return None

    def check_gradient(self, *, step: int, ours: list[torch.Tensor | None], plain: list[torch.Tensor | None],
                       mechanisms: list[str], record: Callable[[str, float], None],
                       variants: list[GradientVariant] = ()) -> None:
        """Compare the actor's parameter gradients of the same objective through the shared-prefix path (`ours`) and
        the plain path, as one flattened vector: cosine similarity and relative norm difference. `variants`: the
        shared-prefix gradient with one mechanism taken out each, tried in turn when they differ, to name it."""
        cos, rel = gradient_agreement(ours, plain)
        worst_cos, worst_rel = self._worst_over_processes([-cos, rel])  # every process reaches it
        record("rollplex/verify_actor_grad_cos", -worst_cos)
        record("rollplex/verify_actor_grad_rel", worst_rel)
        min_cos, max_rel = GRAD_TOLERANCE[self.precision]
        ok = cos >= min_cos and rel <= max_rel
        logger.info("rollplex audit step %d, actor gradient: cosine %.8f (>= %g), relative norm difference %.2e "
                    "(<= %g, %s) %s", step, cos, min_cos, rel, max_rel, self.precision, "ok" if ok else "EXCEEDED")
        if not ok:
            culprit = None
            for variant in variants:
                v_cos, v_rel = gradient_agreement(variant.run(), plain)
                logger.info("rollplex audit: actor gradient without %s: cosine %.8f, norms %.2e apart",
                            variant.mechanism, v_cos, v_rel)
                if v_cos >= min_cos and v_rel <= max_rel:
                    culprit = (f"Re-run without {variant.mechanism}, the gradient agrees with the plain one (cosine "
                               f"{v_cos:.6f}, norms {v_rel:.2g} apart): that is the mechanism at fault; "
                               f"{variant.switch} turns it off")
                    break
            self._report(f"rollplex exactness audit, step {step}: the actor's gradient through the shared prefix "
                         f"differs from the plain full forward's: cosine {cos:.6f} (at least {min_cos:g}), norms "
                         f"{rel:.3g} apart (at most {max_rel:g}, {self.precision})", "actor-gradient", mechanisms,
                         culprit)
        exceeded = -worst_cos < min_cos or worst_rel > max_rel
        record("rollplex/verify_within_tolerance", float(not exceeded))
        self._stop_if_strict(exceeded, f"the actor's gradient, step {step}")

    def _stop_if_strict(self, exceeded_somewhere: bool, what: str) -> None:
        """rollplex_verify_strict: stop every process together (the decision is on the values reduced over the
        processes), after each has reported its own finding."""
        if self.spec.strict and exceeded_somewhere:
            raise RuntimeError(f"rollplex exactness audit: {what} exceeded the tolerance on at least one process "
                               "(its warning says where and why); stopping (rollplex_verify_strict=True)")

    def _report(self, finding: str, kind: str, mechanisms: list[str], culprit: str | None = None) -> None:
        advice = culprit or ("Taking out the prefix built ahead of the pass or switching the suffix attention does "
                             "not explain it: the shared prefix itself (rollplex_share_prefix='off' turns it off)"
                             if kind != "actor-gradient" else
                             "Turn them off one at a time (rollplex_share_prefix='off', rollplex_overlap='off', "
                             "rollplex_suffix_attention='concat') to find the one at fault")
        message = (f"{finding}. The pass used: {', '.join(mechanisms) or 'no Rollplex mechanism'}. {advice}; please "
                   "report it (docs/verify.md).")
        if self.spec.strict or kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message)


@dataclass(frozen=True)
class GradientVariant:
    """The audited gradient recomputed with one mechanism taken out (see `Variant`)."""

    mechanism: str
    switch: str
    run: Callable[[], list[torch.Tensor | None]]


def gradient_agreement(ours: list[torch.Tensor | None], plain: list[torch.Tensor | None]) -> tuple[float, float]:
    """(cosine similarity, relative norm difference) of two parameter gradients as flattened vectors (fp64)."""
    dot = norm_ours = norm_plain = 0.0
    for a, b in zip(ours, plain, strict=True):
        a = torch.zeros(()) if a is None else a.detach().double()
        b = torch.zeros(()) if b is None else b.detach().double()
        dot += float((a * b).sum())
        norm_ours += float((a * a).sum())
        norm_plain += float((b * b).sum())
    if norm_plain == 0.0:  # no gradient (all completions masked): nothing to compare on this process
        return 1.0, 0.0
    cos = dot / max((norm_ours * norm_plain) ** 0.5, 1e-300)
    return cos, abs(norm_ours ** 0.5 - norm_plain ** 0.5) / norm_plain ** 0.5


def audit_pass(trainer: Any, model: Any, logps: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               logits_to_keep: int, vision_kwargs: dict, mechanisms: list[str]) -> None:
    """The trainer's side of an audit: which pass this is, and its plain recomputation (trainers/grpo.py calls it
    after each Rollplex log-prob pass; it returns at once when no audit is due)."""
    audit: ExactnessAudit | None = trainer.audit
    if audit is None or any(v is not None for v in vision_kwargs.values()):  # TRL's own vision inputs: its pass
        return
    actor = torch.is_grad_enabled() and trainer.model.training
    kind = "actor" if actor else ("ref" if model is trainer.ref_model else "policy")
    step = trainer.state.global_step
    if not audit.wants(step, kind):
        return
    plain_model = trainer._trained_model(model) if actor else trainer.accelerator.unwrap_model(model)
    plain = plain_pass(trainer, plain_model, trainer.batch.scored_rows, input_ids, attention_mask, logits_to_keep,
                       reference=kind == "ref")
    # (activation offload hooks the actor's graphs: its gradient is not audited)
    gradient = actor and trainer.phase_memory is None
    if gradient:  # one plain pass serves both checks: its values for the log-probs, its graph for the gradient
        with torch.enable_grad():
            reference = plain(min(audit.spec.rows, input_ids.size(0)))
        plain = lambda rows: reference[:rows].detach()  # noqa: E731
    audit.check(step=step, kind=kind, used=logps, mask=attention_mask[:, -logits_to_keep:], plain=plain,
                mechanisms=mechanisms, record=trainer._record,
                variants=variants(trainer, plain_model, input_ids, attention_mask, logits_to_keep,
                                  reference=model is trainer.ref_model))
    if gradient:
        audit_gradient(trainer, audit, plain_model, reference, input_ids, attention_mask, logits_to_keep, step,
                       mechanisms)


def plain_pass(trainer: Any, model: Any, rows: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               logits_to_keep: int, *, reference: bool = False) -> Callable[[int], torch.Tensor]:
    """The plain recomputation of the first n rows' log-probs: full sequences through `model` (TRL's own pass for
    text; the unshared per-row pass with each row's vision inputs for prepared rows), under the trainer's autocast.
    On the Megatron backend, through its own policy (or reference): the full rows, no shared prefix, no cascade, no
    prefix built ahead (its `logps_and_entropies` with `share_prefix=False`; a TP collective, run by every rank)."""
    from rollplex_trl import trl_compat
    from rollplex_trl.prefix.batch import prepared_rows_logps

    def plain(n: int) -> torch.Tensor:
        ids, mask = input_ids[:n], attention_mask[:n]
        if trainer.backend.name != "hf":
            return trainer.backend.logps_and_entropies(
                model, reference=reference, input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep,
                batch_size=None, temperature=trainer.temperature, compute_entropy=False, compute_aux_loss=False,
                rows=rows[:n] if rows is not None else None, vision_kwargs={}, autocast=trainer.accelerator.autocast,
                training=trainer.model.training, share_prefix=False, prompts_per_chunk=1, precomputed=None)[0]
        if rows is not None:
            return prepared_rows_logps(model, rows[:n], ids, mask, logits_to_keep, None, False, False,
                                       trainer.accelerator.autocast)[0]
        with trainer.accelerator.autocast():
            return trl_compat.trl_per_token_logps(trainer, model, ids, mask, logits_to_keep)

    return plain


def audit_sampler(trainer: Any, output: dict[str, Any], transformers_logps: torch.Tensor | None = None
                  ) -> dict[str, Any]:
    """On an audit step, the rollout engine's own log-probs of the tokens it sampled against a plain pass through
    the trainer's weights at θ_k. vLLM returns them (TRL's `sampling_per_token_logps`): catches an engine that
    samples from other weights than the trainer's (a skipped or wrongly mapped weight sync). The transformers
    rollout's are recorded for the audited rows (`transformers_logps`, rollout/sampled_logps.py): catches a decode
    that reads the wrong prompt's K/V (the shared prefill's cache, the shared-prefix decode). Logged as
    `rollplex/verify_sampler_logp_abs`; the tolerance is looser (`SAMPLER_TOLERANCE`): another engine's kernels, or
    the decode's cache in the model's dtype. Returns `output`."""
    from rollplex_trl.data.prepared import PREPARED_KEY

    audit: ExactnessAudit | None = trainer.audit
    sampled = output.get("sampling_per_token_logps")
    mechanisms, advice = ["the rollout engine's weights (weight sync)"], None
    if sampled is None and transformers_logps is not None:
        sampled = _completion_width(transformers_logps, output["completion_ids"].size(1))
        mechanisms = ["the rollout's shared prefill (each prompt's K/V computed once for its G samples)"]
        if trainer.rollplex["rollplex_shared_decode"] != "off":
            mechanisms.append("the shared-prefix decode (rollplex_shared_decode, where it applied)")
        advice = ("The sampled tokens came from another distribution than the policy's given their prompt: try "
                  "rollplex_shared_decode='off', then rollplex_share_prefix='off' (no shared prefill)")
    step = trainer.state.global_step
    if audit is None or sampled is None or not trainer.model.training or not audit.wants(step, "sampler"):
        return output
    if any(k in output for k in ("pixel_values", "pixel_values_videos")):  # TRL's own vision path: not rebuilt here
        return output
    input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    width = output["completion_ids"].size(1)
    plain = plain_pass(trainer, trainer.accelerator.unwrap_model(trainer.model), output.get(PREPARED_KEY),
                       input_ids, attention_mask, width)
    audit.check(step=step, kind="sampler", used=sampled, mask=output["completion_mask"], plain=plain,
                mechanisms=mechanisms, record=trainer._record, tolerance=SAMPLER_TOLERANCE[audit.precision],
                advice=advice)
    return output


def _completion_width(logps: torch.Tensor, width: int) -> torch.Tensor:
    """Recorded (rows, decode steps) log-probs cut or zero-padded to TRL's completion width (its longest row)."""
    if logps.size(1) >= width:
        return logps[:, :width]
    return torch.cat([logps, logps.new_zeros(logps.size(0), width - logps.size(1))], dim=1)


def _fresh_shared_pass(trainer: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       logits_to_keep: int, rows: int, *, reference: bool, training: bool,
                       suffix: str | None) -> torch.Tensor:
    """The first `rows` rows' log-probs through a shared-prefix pass built now (no prefix computed ahead of it),
    with `suffix` attention instead of the backend's own for this one call when given."""
    backend = trainer.backend
    scored = trainer.batch.scored_rows
    previous = getattr(backend, "suffix_attention_mode", None)
    if suffix is not None:
        backend.suffix_attention_mode = suffix
    try:
        return backend.logps_and_entropies(
            model, reference=reference, input_ids=input_ids[:rows], attention_mask=attention_mask[:rows],
            logits_to_keep=logits_to_keep, batch_size=None, temperature=trainer.temperature,
            compute_entropy=False, compute_aux_loss=False, rows=scored[:rows] if scored is not None else None,
            vision_kwargs={}, autocast=trainer.accelerator.autocast, training=training, share_prefix=True,
            prompts_per_chunk=trainer.rollplex["rollplex_prefix_chunk_prompts"], precomputed=None)[0]
    finally:
        if suffix is not None:
            backend.suffix_attention_mode = previous


def variants(trainer: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
             *, reference: bool) -> list[Variant]:
    """The audited pass with one mechanism taken out each: a fresh shared-prefix pass instead of the prefix built
    ahead of it (in the decode window, or the rollout's prefill kept for the actor window), then the same with the
    other suffix attention (cascade <-> concat)."""
    backend = trainer.backend

    def fresh(rows: int, suffix: str | None = None) -> torch.Tensor:
        return _fresh_shared_pass(trainer, model, input_ids, attention_mask, logits_to_keep, rows,
                                  reference=reference, training=trainer.model.training, suffix=suffix)
    out = [Variant("the prefix built ahead of this pass (decode window / kept prefill)", "rollplex_overlap='off'",
                   fresh)]
    mode = getattr(backend, "suffix_attention_mode", None)
    if mode in ("cascade", "concat"):
        other = "concat" if mode == "cascade" else "cascade"
        out.append(Variant(f"the {mode} suffix attention", f"rollplex_suffix_attention='{other}'",
                           lambda rows: fresh(rows, suffix=other)))
    return out


def audit_gradient(trainer: Any, audit: ExactnessAudit, model: Any, plain: torch.Tensor, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, logits_to_keep: int, step: int, mechanisms: list[str]) -> None:
    """The gradient of Σ log-probs of the audited rows with respect to the trainable parameters, through a fresh
    shared-prefix pass (prefix with its graph, suffix against it; the same functions the actor window runs) and
    through the plain pass (`plain`: its log-probs of those rows, with their graph); `torch.autograd.grad`, so no
    `.grad` is touched."""
    rows = min(audit.spec.rows, input_ids.size(0))
    params = [p for p in model.parameters() if p.requires_grad]
    mask = attention_mask[:rows, -logits_to_keep:].to(torch.float32)
    backend = trainer.backend

    def shared(suffix: str | None = None) -> list[torch.Tensor | None]:
        """The gradient through a fresh shared-prefix pass (`suffix`: with that suffix attention instead)."""
        with torch.enable_grad():
            logps = _fresh_shared_pass(trainer, model, input_ids, attention_mask, logits_to_keep, rows,
                                       reference=False, training=True, suffix=suffix)
            return list(torch.autograd.grad((logps.float() * mask).sum(), params, allow_unused=True))

    ours = shared()
    with torch.enable_grad():
        reference = torch.autograd.grad((plain[:rows].float() * mask).sum(), params, allow_unused=True)
    variants = []
    mode = getattr(backend, "suffix_attention_mode", None)
    if mode in ("cascade", "concat"):
        other = "concat" if mode == "cascade" else "cascade"
        variants.append(GradientVariant(f"the {mode} suffix attention", f"rollplex_suffix_attention='{other}'",
                                        lambda: shared(other)))
    audit.check_gradient(step=step, ours=ours, plain=list(reference), mechanisms=mechanisms,
                         record=trainer._record, variants=variants)


def build_audit(trainer: Any) -> ExactnessAudit | None:
    """The trainer's audit, or None when rollplex_verify_every resolves to off."""
    spec = trainer.plan.audit  # audit_spec, decided in the run plan (trainers/plan.py)
    return ExactnessAudit(spec, precision_of(trainer.accelerator.mixed_precision),
                          device=trainer.accelerator.device) if spec.every else None
