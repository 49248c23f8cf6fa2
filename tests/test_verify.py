"""The exactness audit (rollplex_verify_every, trainers/verify.py): within tolerance when every mechanism works,
caught when a prefix is wrong, and invisible to training."""

import logging

import pytest
import torch
from datasets import Dataset

import rollplex_trl.prefix.batch as prefix_batch
from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.trainers.verify import GRAD_TOLERANCE, SAMPLER_TOLERANCE, TOLERANCE, audit_spec

from helpers import broken_take_scoring

KEYS = ("loss", "reward", "kl", "grad_norm", "entropy")
PASSES = ("ref", "policy", "actor")


def varied_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _train(model, dataset, tmp_path, name, **overrides):
    kwargs = dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=11,
                  use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no",
                  rollplex_verify_every=1, rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84,
                  # the old pass runs too (two optimizer steps per generation batch)
                  steps_per_generation=2, gradient_accumulation_steps=1)
    kwargs.update(overrides)
    trainer = RollplexGRPOTrainer(model=str(model), reward_funcs=varied_reward,
                                  args=RollplexGRPOConfig(**kwargs), train_dataset=dataset)
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_audit_within_tolerance_on_video(tiny_vl_path, tmp_path, video_dataset, defaults, caplog):
    extra = dict(bf16=True, gradient_checkpointing=True) if defaults else {}
    with caplog.at_level(logging.INFO, logger="rollplex_trl.trainers.verify"):
        _, logs = _train(tiny_vl_path, video_dataset, tmp_path, "video", **extra)
    tolerance = TOLERANCE["bf16" if defaults else "fp32"]
    seen = {kind for r in logs for kind in PASSES if f"rollplex/verify_{kind}_logp_abs" in r}
    assert seen == set(PASSES), seen
    worst = max(r[key] for r in logs for key in (f"rollplex/verify_{k}_logp_abs" for k in PASSES) if key in r)
    print("largest audited |Δ log-prob|:", worst)  # pytest -s
    assert worst <= tolerance
    assert worst > 0 or not defaults, "bf16 paths that agree bitwise would mean the audit compared a pass to itself"
    grads = [(r["rollplex/verify_actor_grad_cos"], r["rollplex/verify_actor_grad_rel"]) for r in logs
             if "rollplex/verify_actor_grad_cos" in r]
    print("actor gradient (cosine, relative norm difference):", grads)
    min_cos, max_rel = GRAD_TOLERANCE["bf16" if defaults else "fp32"]
    assert grads and all(cos >= min_cos and rel <= max_rel for cos, rel in grads)
    assert "EXCEEDED" not in caplog.text and "rollplex audit step 0" in caplog.text


def test_each_audited_pass_computes_its_plain_reference_once(tiny_vl_path, tmp_path, video_dataset, monkeypatch):
    """The actor's plain pass serves both the log-prob check (its values) and the gradient check (its graph): one
    plain forward per audited pass, not one for each check."""
    import rollplex_trl.trainers.verify as verify

    calls: list[int] = []  # per plain_pass closure: how many times it ran
    make = verify.plain_pass

    def counting(*args, **kwargs):
        plain, index = make(*args, **kwargs), len(calls)
        calls.append(0)

        def counted(rows):
            calls[index] += 1
            return plain(rows)

        return counted

    monkeypatch.setattr(verify, "plain_pass", counting)
    _, logs = _train(tiny_vl_path, video_dataset, tmp_path, "once", max_steps=1)
    assert "rollplex/verify_actor_grad_cos" in logs[0]  # the gradient was audited too
    assert len(calls) >= 3 and calls == [1] * len(calls), calls  # ref, policy, actor (and the sampler's): once each


def test_audit_on_text_prompts(tiny_qwen2_path, tmp_path):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(8)]})
    _, logs = _train(tiny_qwen2_path, dataset, tmp_path, "text")
    values = [r[f"rollplex/verify_{k}_logp_abs"] for r in logs for k in PASSES if f"rollplex/verify_{k}_logp_abs" in r]
    assert values and max(values) <= TOLERANCE["fp32"]


def test_audit_does_not_change_training(tiny_vl_path, tmp_path, video_dataset):
    audited, a = _train(tiny_vl_path, video_dataset, tmp_path, "audited")
    plain, b = _train(tiny_vl_path, video_dataset, tmp_path, "plain", rollplex_verify_every=0)
    assert not any("rollplex/verify_actor_logp_abs" in r for r in b)
    for x, y in zip(a, b, strict=True):
        for key in (k for k in KEYS if k in y):  # reward and KL at generation steps only
            assert x[key] == y[key], key
    for p, q in zip(audited.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q)


def _perturbed_prefix(monkeypatch, scale=1e-3):
    """A broken mechanism: every shared prefix's values are off by `scale` (what a wrong K/V layout would do)."""
    forward = prefix_batch.prefix_forward

    def broken(*args, **kwargs):
        state = forward(*args, **kwargs)
        state.values = [v + scale for v in state.values]
        return state

    monkeypatch.setattr(prefix_batch, "prefix_forward", broken)


def test_audit_catches_a_perturbed_prefix(tiny_vl_path, tmp_path, video_dataset, monkeypatch, caplog):
    _perturbed_prefix(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="rollplex_trl.trainers.verify"):
        _, logs = _train(tiny_vl_path, video_dataset, tmp_path, "broken", max_steps=1)
    assert logs[0]["rollplex/verify_ref_logp_abs"] > TOLERANCE["fp32"]
    assert "the ref log-probs differ" in caplog.text and "shared prefix" in caplog.text
    assert "the shared prefix itself (rollplex_share_prefix='off'" in caplog.text  # every prefix is wrong here
    min_cos, max_rel = GRAD_TOLERANCE["fp32"]
    assert logs[0]["rollplex/verify_actor_grad_cos"] < min_cos or logs[0]["rollplex/verify_actor_grad_rel"] > max_rel
    assert "the actor's gradient through the shared prefix differs" in caplog.text


def test_strict_audit_raises(tiny_vl_path, tmp_path, video_dataset, monkeypatch):
    _perturbed_prefix(monkeypatch)
    with pytest.raises(RuntimeError, match="rollplex_verify_strict"):
        _train(tiny_vl_path, video_dataset, tmp_path, "strict", max_steps=1, rollplex_verify_strict=True)


def test_audit_spec_defaults_and_refusals():
    options = dict(rollplex_verify_every=None, rollplex_verify_rows=None, rollplex_verify_strict=False)
    spec = audit_spec(options, num_generations=8, backend="hf")
    assert (spec.every, spec.rows) == (200, 2) and spec.due(0) and spec.due(400) and not spec.due(1)
    assert audit_spec({**options, "rollplex_verify_rows": 8}, num_generations=8, backend="hf").rows == 8
    assert audit_spec(options, num_generations=8, backend="megatron").every == 200  # auto: on, both backends
    assert audit_spec({**options, "rollplex_verify_every": 5}, num_generations=8, backend="megatron").every == 5
    assert audit_spec({**options, "rollplex_verify_every": 0}, num_generations=8, backend="hf").every == 0


def test_audit_names_a_broken_decode_window_prefix(tiny_vl_path, tmp_path, video_dataset, monkeypatch, caplog):
    """Only the prefixes built ahead of the scoring passes (the decode window's jobs) are wrong: re-run without them
    the pass agrees, and the report names them and the switch."""
    monkeypatch.setattr(prefix_batch.StepPrefixes, "take_scoring", broken_take_scoring())
    with caplog.at_level(logging.WARNING, logger="rollplex_trl.trainers.verify"):
        _, logs = _train(tiny_vl_path, video_dataset, tmp_path, "window", max_steps=1)
    assert logs[0]["rollplex/verify_ref_logp_abs"] > TOLERANCE["fp32"]
    assert "Re-run without the prefix built ahead of this pass" in caplog.text
    assert "rollplex_overlap='off' turns it off" in caplog.text
    assert "the actor log-probs differ" not in caplog.text  # the actor's pass (its own prefix) is fine


def test_audit_names_a_broken_cascade_attention(tiny_vl_path, tmp_path, video_dataset, monkeypatch, caplog):
    import rollplex_trl.prefix.suffix_attention as suffix_attention

    cascade = suffix_attention.causal_cascade_attention
    monkeypatch.setattr(suffix_attention, "causal_cascade_attention",
                        lambda *a, **k: cascade(*a, **k) * 1.01)
    with caplog.at_level(logging.WARNING, logger="rollplex_trl.trainers.verify"):
        _train(tiny_vl_path, video_dataset, tmp_path, "cascade", max_steps=1, rollplex_suffix_attention="cascade")
    assert "Re-run without the cascade suffix attention" in caplog.text
    assert "rollplex_suffix_attention='concat' turns it off" in caplog.text


def test_audit_names_the_cascade_for_a_gradient_only_fault(tiny_vl_path, tmp_path, video_dataset, monkeypatch,
                                                           caplog):
    """The cascade attention's gradient scaled by 1.5, its values unchanged: the log-prob checks pass, the gradient
    check fails, and re-running the gradient with the concat suffix attention names the cascade."""
    import rollplex_trl.prefix.suffix_attention as suffix_attention

    cascade = suffix_attention.causal_cascade_attention

    def scaled_gradient(*args, **kwargs):
        out = cascade(*args, **kwargs)
        return out * 1.5 - out.detach() * 0.5

    monkeypatch.setattr(suffix_attention, "causal_cascade_attention", scaled_gradient)
    with caplog.at_level(logging.WARNING, logger="rollplex_trl.trainers.verify"):
        _, logs = _train(tiny_vl_path, video_dataset, tmp_path, "cascade-grad", max_steps=1,
                         rollplex_suffix_attention="cascade")
    assert all(logs[0][f"rollplex/verify_{kind}_logp_abs"] <= TOLERANCE["fp32"] for kind in PASSES)
    assert logs[0]["rollplex/verify_actor_grad_rel"] > GRAD_TOLERANCE["fp32"][1]
    assert "the actor's gradient through the shared prefix differs" in caplog.text
    assert "Re-run without the cascade suffix attention, the gradient agrees" in caplog.text
    assert "rollplex_suffix_attention='concat' turns it off" in caplog.text


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
@pytest.mark.parametrize("shared_decode", ["on", "off"])
def test_transformers_sampler_log_probs_within_tolerance(tiny_vl_path, tmp_path, video_dataset, defaults,
                                                         shared_decode):
    """The transformers rollout's own log-probs of the sampled tokens (recorded for the audited rows,
    rollout/sampled_logps.py) agree with a plain pass at θ_k, at a temperature other than 1 (TRL divides the
    logits by it), with the prompt's K/V shared in the decode or copied to every row."""
    extra = dict(bf16=True, gradient_checkpointing=True) if defaults else {}
    _, logs = _train(tiny_vl_path, video_dataset, tmp_path, "sampler", max_steps=4, temperature=0.7,
                     rollplex_shared_decode=shared_decode, **extra)
    values = [r["rollplex/verify_sampler_logp_abs"] for r in logs if "rollplex/verify_sampler_logp_abs" in r]
    print("sampler |Δ log-prob| per audited step:", values)  # pytest -s
    assert len(values) == 2, "the sampler is audited at every rollout of an audited step (one per two steps)"
    assert max(values) <= (0.1 if defaults else 1e-4)
    assert all(r["rollplex/verify_within_tolerance"] == 1.0 for r in logs)


def test_audit_catches_a_shared_decode_cache_pointing_at_the_wrong_group(tiny_vl_path, tmp_path, video_dataset,
                                                                        monkeypatch, caplog):
    """The shared-prefix decode's cache maps each row to the next group's prompt: the completions are sampled from
    another prompt's distribution. The trainer's log-prob passes are all consistent with each other (they score the
    right prompt), so only the sampler's own log-probs show it, and the report names the decode."""
    import rollplex_trl.prefix.shared_decode as shared_decode

    build = shared_decode.build_cache

    def wrong_group(keys, values, prompt_mask, row_to_prompt, **kwargs):
        return build(keys, values, prompt_mask, (row_to_prompt + 1) % prompt_mask.size(0), **kwargs)

    monkeypatch.setattr(shared_decode, "build_cache", wrong_group)
    with caplog.at_level(logging.WARNING, logger="rollplex_trl.trainers.verify"):
        _, logs = _train(tiny_vl_path, video_dataset, tmp_path, "wrong-group", max_steps=1,
                         rollplex_shared_decode="on")
    # (the random test model's next-token distribution depends little on its prompt: 0.07 here, fp32 clean 1e-6)
    assert logs[0]["rollplex/verify_sampler_logp_abs"] > 10 * SAMPLER_TOLERANCE["fp32"]
    assert all(logs[0][f"rollplex/verify_{kind}_logp_abs"] <= TOLERANCE["fp32"] for kind in PASSES)
    assert "the sampler log-probs differ" in caplog.text
    assert "rollplex_shared_decode='off'" in caplog.text


def test_audit_under_ddp_reports_the_worst_process(tiny_vl_path, tmp_path):
    """Two processes (gloo): each audits its own rows; the logged values are the worst process's, so a fault on
    rank 1 only (a wrong prefix, a scaled gradient) shows in rank 0's logs too, while only rank 1 warns."""
    from pathlib import Path

    from helpers import run_two_processes

    worker = Path(__file__).with_name("ddp_audit_worker.py")
    clean = run_two_processes(worker, [str(tiny_vl_path), str(tmp_path), "clean"], tmp_path, "clean-rank*.json",
                              29611)
    fault = run_two_processes(worker, [str(tiny_vl_path), str(tmp_path), "fault"], tmp_path, "fault-rank*.json",
                              29612)
    for results in (clean, fault):
        assert results[0]["logs"] == results[1]["logs"]  # reduced: the same numbers on both processes
    assert all(v <= TOLERANCE["fp32"] for row in clean[0]["logs"] for k, v in row.items() if k.endswith("logp_abs"))
    assert not clean[0]["warnings"] and not clean[1]["warnings"]
    assert fault[0]["logs"][0]["rollplex/verify_ref_logp_abs"] > TOLERANCE["fp32"]
    assert not fault[0]["warnings"]
    assert any("Re-run without the prefix built ahead of this pass" in w for w in fault[1]["warnings"])
    # a gradient scaled on rank 1 only (log-probs unchanged): the gradient check catches it, reduced to every rank
    grad = run_two_processes(worker, [str(tiny_vl_path), str(tmp_path), "grad"], tmp_path, "grad-rank*.json", 29613)
    assert grad[0]["logs"] == grad[1]["logs"]
    assert all(row["rollplex/verify_actor_grad_rel"] == pytest.approx(0.5, rel=1e-3) for row in grad[0]["logs"])
    assert all(v <= TOLERANCE["fp32"] for row in grad[0]["logs"] for k, v in row.items() if k.endswith("logp_abs"))
    assert not grad[0]["warnings"]
    assert any("the actor's gradient through the shared prefix differs" in w for w in grad[1]["warnings"])
    # the start-up banner says how many processes there are (callbacks/banner.py)
    assert clean[0]["banner"][0].startswith("[rollplex] 2 processes: data parallel 2 x tensor parallel 1")
