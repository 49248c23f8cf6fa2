"""Activation recompute on the Megatron backend (backends/megatron/recompute.py): TRL's gradient_checkpointing.

Reference: the same policy with recompute off. In fp32 the recompute repeats the same kernels on the same inputs,
so every gradient (GPTModel and vision tower) must be bit-identical, on the full rows, on the shared prefix with its
graph inline, and on the actor's two-stage backward (suffixes into leaf copies of the prompt's K/V, one backward
through the prefix afterwards: the recompute of the suffix layers then runs after the suffix pass ended, with the
K/V hook re-installed). Under bf16 autocast (TRL's default) likewise bit-identical to the same pass without
recompute. That it saves memory is measured, not timed: the tensors autograd keeps outside the checkpointed layers.
"""

from __future__ import annotations

import contextlib

import megatron_worker as mw
import prefix_worker as pw
import pytest
import torch

from helpers import require

require("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def policy(one_process, tiny_vl_path):
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

    p = MegatronPolicy(mw.load_hf(tiny_vl_path), init_model_parallel(1))
    p.train()
    yield p
    _recompute(p, False)


@pytest.fixture(scope="module")
def batch(tiny_vl_path):
    return pw.group_batch(tiny_vl_path)


def _recompute(policy, on: bool) -> None:
    from rollplex_trl.backends.megatron.recompute import disable_layer_recompute, enable_layer_recompute

    if on:
        assert enable_layer_recompute(policy.gpt) == policy.gpt.config.num_layers
    else:
        disable_layer_recompute(policy.gpt)


@contextlib.contextmanager
def _saved_bytes(counter: list[int]):
    """Bytes of the tensors autograd saves for the backward outside checkpointed regions (the checkpoint's own
    saved-tensor hooks take precedence inside them)."""
    def pack(t):
        counter[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _full(policy, batch):
    return pw.full_logps(policy, batch)


def _shared(policy, batch):
    logps, ent, _ = pw.shared_logps(policy, batch, prompts_per_chunk=2)
    return logps, ent


def _two_stage(policy, batch):
    """The actor window's path: prefix kept with its graph, suffix passes on leaf copies, then one backward."""
    from rollplex_trl.backends.megatron.prefix import megatron_suffix_logps, run_megatron_prefix
    from rollplex_trl.prefix.batch import group_by_prompt
    from rollplex_trl.prefix.forward import backward_prefix, detach_prefix

    P = batch["input_ids"].size(1) - batch["K"]
    pg = group_by_prompt(batch["input_ids"][:, :P], batch["attention_mask"][:, :P], batch["rows"])
    state = run_megatron_prefix(policy, batch["input_ids"][pg.first_row, :P],
                                batch["attention_mask"][pg.first_row, :P],
                                [batch["rows"][r] for r in pg.first_row], keep_graph=True)
    leaves, outputs = detach_prefix(state)
    logps, ent = megatron_suffix_logps(policy, leaves, pg.row_to_prompt, batch["input_ids"][:, P:],
                                       batch["completion_mask"], temperature=mw.TEMPERATURE, compute_entropy=True)
    mw.loss_of(logps, ent, batch).backward()
    backward_prefix(outputs, leaves)
    return logps.detach(), ent.detach()


def _run(policy, batch, path: str, recompute: bool, autocast: bool):
    _recompute(policy, recompute)
    policy.zero_grad(set_to_none=True)
    counter = [0]
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with amp:
            if path == "two-stage":
                with _saved_bytes(counter):
                    logps, ent = _two_stage(policy, batch)
            else:
                with _saved_bytes(counter):
                    logps, ent = (_full if path == "full" else _shared)(policy, batch)
                mw.loss_of(logps, ent, batch).backward()
        return logps.detach(), ent.detach(), pw.grads_of(policy), counter[0]
    finally:
        policy.zero_grad(set_to_none=True)
        _recompute(policy, False)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("path", ["full", "shared-prefix", "two-stage"])
def test_recompute_is_exact_and_keeps_less(policy, batch, path, autocast):
    logps, ent, grads, kept = _run(policy, batch, path, recompute=False, autocast=autocast)
    logps_rc, ent_rc, grads_rc, kept_rc = _run(policy, batch, path, recompute=True, autocast=autocast)
    assert torch.equal(logps, logps_rc) and torch.equal(ent, ent_rc)
    assert grads.keys() == grads_rc.keys() and any(n.startswith("visual.") for n in grads)
    assert any(n.startswith("gpt.decoder.") for n in grads)
    differ = [n for n, g in grads.items() if not torch.equal(g, grads_rc[n])]
    assert not differ, f"gradients differ with recompute on: {differ[:5]}"
    # the decoder layers' activations are no longer kept (what stays: embeddings, the vision tower's own, the head)
    print(f"{path}, autocast={autocast}: saved bytes with recompute / without = {kept_rc / kept:.3f}")  # pytest -s
    assert kept_rc < 0.6 * kept, (kept_rc, kept)


def test_no_recompute_outside_training(policy, batch):
    """Eval-mode and no_grad forwards (the reference and old-policy passes) are not checkpointed: same saved
    tensors with the wrapper installed as without it."""
    _recompute(policy, True)
    try:
        policy.eval()
        counter_on = [0]
        with _saved_bytes(counter_on):
            _full(policy, batch)
    finally:
        policy.train()
        _recompute(policy, False)
    policy.eval()
    try:
        counter_off = [0]
        with _saved_bytes(counter_off):
            _full(policy, batch)
    finally:
        policy.train()
    assert counter_on[0] == counter_off[0] > 0
