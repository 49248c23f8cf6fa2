"""The prefix overlap while the real vLLM engine generates (vLLM's CPU backend, the small Qwen2 checkpoint).

1. The shared-prefix math in this environment's transformers (< 5.20, whose decoders take the cache as
   `past_key_values`): prefix + suffix log-probs and gradients equal the full-sequence forward's.
2. GRPO with `use_vllm=True` and `rollplex_overlap="on"`: the reference, old-policy and actor prefixes are computed
   by the overlap worker while vLLM decodes. Every generation batch's reference and old log-probs (computed from
   those prefixes) are compared with a full-sequence forward of the same rows at the same weights, and the whole run
   (samples, losses, KL, gradient norms) with the same run with the overlap off.
"""

import pytest
import torch

pytestmark = pytest.mark.needs_vllm


def test_prefix_suffix_is_exact_in_this_transformers(small_qwen2_path):
    from transformers import AutoModelForCausalLM

    from rollplex_trl.prefix import prefix_forward, suffix_logps

    model = AutoModelForCausalLM.from_pretrained(small_qwen2_path, dtype=torch.float32)
    torch.manual_seed(0)
    P, C, G = 9, 6, 3
    prompt = torch.randint(3, 500, (2, P))
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :2] = 0  # left padding in the second prompt
    completion = torch.randint(3, 500, (2 * G, C))
    completion_mask = torch.ones_like(completion)
    completion_mask[1, 4:] = 0
    rows = torch.arange(2).repeat_interleave(G)

    state = prefix_forward(model, prompt, prompt_mask, keep_graph=True)
    got, _ = suffix_logps(model, state, rows, completion, completion_mask)
    got.sum().backward()
    got_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    # the reference: the full sequence of every row, as TRL scores it (one forward, default positions)
    ids = torch.cat([prompt[rows], completion], 1)
    mask = torch.cat([prompt_mask[rows], completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, P - 1:-1].float()
    want = logits.log_softmax(-1).gather(-1, completion[..., None])[..., 0] * completion_mask
    want.sum().backward()

    assert state.has_graph and state.num_layers == model.config.num_hidden_layers
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=2e-5)
    for g, w in zip(got_grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5)


PROMPTS = ["How many red balls are there?", "Which way does the blue box move?", "Count the green dots.",
           "What colour appears first?"]


def _train(path, tmp_path, overlap, checks):
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    samples = []

    def reward(completions, **kwargs):
        samples.extend(c[0]["content"] for c in completions)
        return [float(len(c[0]["content"]) % 7) for c in completions]

    args = RollplexGRPOConfig(
        output_dir=str(tmp_path / overlap), max_steps=3, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, beta=0.1, logging_steps=1, report_to=[], seed=3, use_cpu=True,
        bf16=False, save_strategy="no", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3, rollplex_share_prefix="on", rollplex_overlap=overlap,
        rollplex_overlap_threads=1,
        rollplex_vllm_dtype="float32")  # the trainer's dtype: vLLM samples what fp32 scores
    trainer = RollplexGRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=dataset)
    if checks:
        _check_scores_against_full_forward(trainer)
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r], samples


def _check_scores_against_full_forward(trainer):
    """After each generation batch, recompute its reference and old log-probs with full forwards (no prefix, no
    overlap) at the same weights; the batch's values came from the overlap worker's prefixes."""
    from rollplex_trl.prefix.batch import StepPrefixes

    original = trainer._generate_and_score_completions
    trainer.compared = []

    def checked(inputs):
        taken = []
        take = StepPrefixes.take_scoring

        def recording(self, *, reference):
            state = take(self, reference=reference)
            if state is not None:  # a state the decode window's worker built
                taken.append("ref" if reference else "old")
            return state

        StepPrefixes.take_scoring = recording
        try:
            out = original(inputs)
        finally:
            StepPrefixes.take_scoring = take
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        C = out["completion_ids"].size(1)
        for key, model in (("ref_per_token_logps", trainer.ref_model), ("old_per_token_logps", trainer.model)):
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1:-1]
            want = logits.float().div(trainer.temperature).log_softmax(-1).gather(
                -1, out["completion_ids"][..., None])[..., 0]
            got = out[key]
            m = out["completion_mask"].bool()
            gap = (got - want)[m].abs().max().item()
            assert gap < 1e-4, f"{key}: overlap prefix log-probs differ from the full forward by {gap}"
        trainer.compared.append(sorted(k for k in taken))
        return out

    trainer._generate_and_score_completions = checked


def test_overlap_while_vllm_generates(small_qwen2_path, tmp_path):
    on, logs_on, samples_on = _train(small_qwen2_path, tmp_path, "on", checks=True)
    # every generation batch took the ref and old prefixes from the worker (the actor's comes in compute_loss)
    assert on.compared and all(kinds == ["old", "ref"] for kinds in on.compared), on.compared
    for row in logs_on:
        assert row["rollplex/overlap_active"] == 1.0 and row["rollplex/prefix_s"] > 0
        assert row["rollplex/decode_s"] > 0 and row["rollplex/vllm_requests_per_row"] == 0.5

    off, logs_off, samples_off = _train(small_qwen2_path, tmp_path, "off", checks=False)
    assert samples_on == samples_off  # vLLM sampled the same completions: the worker leaked nothing into it
    assert len(logs_on) == len(logs_off) == 3
    for a, b in zip(logs_on, logs_off, strict=True):
        for key in ("loss", "kl", "grad_norm", "reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
