"""rollplex_backend="megatron" with use_vllm=True on vLLM's real CPU backend (colocate, one process, t = 1).

The chain of weights: AdamW updates the Megatron shards; the transformers model is bound to them (mapped through
shared memory, rollplex_weight_mapping="on") and brought to each step before the rollout; vLLM's engine syncs from
that model (its CPU backend repacks most weights into its own layout, so that hop is the copy path: measured in
rollplex/weight_sync_bytes). The references: TRL's importance-sampling metrics compare vLLM's sampling log-probs
with the Megatron model's own log-probs of the same tokens (they agree only if vLLM sampled from the trained
weights), and at the end vLLM scores sequences as the synced transformers model does, which equals the shards
gathered back (hf_state_dict). Learning equivalence against the hf backend with the same vLLM path runs in the main
suite (test_vllm_megatron_path.py, with a stand-in engine: two vLLM engines cannot share this process).
"""

import pytest
import torch

from helpers import require

pytestmark = pytest.mark.needs_vllm


def test_megatron_backend_trains_through_the_vllm_engine(small_qwen2_path, tmp_path):
    require("megatron.core")
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.backends.megatron.mapped_weights import MappedRolloutWeights

    from vllm_helpers import TOL, max_gap

    prompts = ["How many red balls are there?", "Which way does the blue box move?", "Count the green dots.",
               "What colour appears first?"]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])

    def reward(completions, **kwargs):
        return [float(sum(map(ord, c[0]["content"])) % 7) for c in completions]  # varies within a group

    args = RollplexGRPOConfig(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, beta=0.1, logging_steps=1, report_to=[], seed=3, use_cpu=True,
        bf16=False, save_strategy="no", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3, rollplex_vllm_dtype="float32", rollplex_backend="megatron",
        rollplex_weight_mapping="on")  # pinned, not an auto decision
    trainer = RollplexGRPOTrainer(model=small_qwen2_path, reward_funcs=reward, args=args, train_dataset=dataset)
    assert isinstance(trainer.backend.rollout, MappedRolloutWeights)
    trainer.train()

    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 3 and all(row["grad_norm"] > 0 for row in logs)  # every step moved the weights
    params = sum(p.numel() for p in trainer.model.parameters())
    for row in logs:
        # vLLM sampled from the weights the Megatron model scores with (its sampling log-probs vs the trainer's)
        assert row["sampling/sampling_logp_difference/max"] < TOL, row
        # every tensor copied into vLLM (none aliased: that would move the model's tensors off the shards)
        assert row["rollplex/weight_sync_bytes"] == 4 * params and row["rollplex/weight_sync_aliased_bytes"] == 0
    for row in logs[1:]:  # the shards -> transformers hop: only what the plan copies
        assert row["rollplex/sync_bytes_copied"] == trainer.backend.rollout.bytes_copied_per_sync

    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    trainer.backend.sync_rollout()  # the last optimizer step, into the transformers model
    trained = trainer.backend.policy.hf_state_dict()
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    engine = trainer.vllm_generation.engine
    assert max_gap(engine, model) > 1e-3  # not pushed to vLLM yet
    engine.sync_weights(model, version=trainer.state.global_step)
    assert max_gap(engine, model) < TOL
