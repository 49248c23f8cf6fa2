"""RollplexGRPOTrainer with use_vllm=True on vLLM's CPU backend: TRL's colocate options, n = G requests, sampling
log-probs for the importance-sampling correction, the weight sync metrics, and vLLM exactly in sync with the
trained model at the end.

The shared prefix and its overlap are off here, so this is the plain path (TRL's full-sequence scoring behind our
engine); test_vllm_overlap_cpu.py runs them with this engine."""

import pytest

pytestmark = pytest.mark.needs_vllm


def test_grpo_steps_with_the_vllm_engine(small_qwen2_path, tmp_path):
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.rollout.trl_vllm import RollplexVLLMGeneration

    from vllm_helpers import TOL, max_gap

    prompts = ["How many red balls are there?", "Which way does the blue box move?", "Count the green dots.",
               "What colour appears first?"]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"]) % 7) for c in completions]

    args = RollplexGRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, beta=0.1, logging_steps=1, report_to=[], seed=3, use_cpu=True,
        bf16=False, save_strategy="no", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3, rollplex_share_prefix="off", rollplex_overlap="off",
        rollplex_vllm_dtype="float32")  # the trainer's dtype (TRL's default fp32): exact parity
    trainer = RollplexGRPOTrainer(model=small_qwen2_path, reward_funcs=reward, args=args, train_dataset=dataset)
    assert isinstance(trainer.vllm_generation, RollplexVLLMGeneration)
    trainer.train()

    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 2
    for row in logs:
        assert row["rollplex/weight_sync_s"] > 0
        # fp32 everywhere; the norms and q/k/v biases (what vLLM's CPU backend does not repack) are aliased
        params = sum(p.numel() for p in trainer.model.parameters())
        assert row["rollplex/weight_sync_bytes"] + row["rollplex/weight_sync_aliased_bytes"] == 4 * params
        assert row["rollplex/vllm_requests_per_row"] == 0.5  # one request per prompt, n = G = 2
        assert any("importance_sampling" in k for k in row), "TRL's IS correction did not get sampling log-probs"

    engine = trainer.vllm_generation.engine
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    assert max_gap(engine, model) > 1e-3  # the last optimizer step is not pushed yet
    engine.sync_weights(model, version=trainer.state.global_step)
    assert max_gap(engine, model) < TOL
