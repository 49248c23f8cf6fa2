"""The prefix overlap inside the vLLM rollout's decode window, in the main environment (no vLLM needed).

The trainer runs its real vLLM code path (`RollplexVLLMGeneration`, `VLLMRollout.generate`) with
a stand-in engine that samples from its own copy of the model, synced like vLLM. With the overlap on, the
reference and old-policy prefixes are computed while the engine generates; the run must learn exactly what it learns
with the overlap off.
"""

import pytest
from datasets import Dataset

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.rollout.trl_vllm import RollplexVLLMGeneration

from vllm_helpers import StandInEngine


def _train(path, tmp_path, overlap, monkeypatch):
    monkeypatch.setattr(RollplexVLLMGeneration, "_make_colocate_engine",
                        lambda self, config, tp_group: StandInEngine(self.model))
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]}
                                 for t in ["How many red balls?", "Which way does it move?", "Count the dots.",
                                           "What appears first?"]])
    seen = []

    def reward(completions, **kwargs):
        seen.extend(c[0]["content"] for c in completions)
        return [float(len(c[0]["content"]) % 5) for c in completions]

    args = RollplexGRPOConfig(output_dir=str(tmp_path / overlap), max_steps=3, per_device_train_batch_size=4,
                              num_generations=2, max_completion_length=6, learning_rate=5e-3, beta=0.1,
                              logging_steps=1, report_to=[], seed=5, use_cpu=True, bf16=False, save_strategy="no",
                              use_vllm=True, vllm_mode="colocate", rollplex_overlap=overlap)
    trainer = RollplexGRPOTrainer(model=str(path), reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r], seen


def test_prefix_jobs_run_while_the_vllm_engine_generates(tiny_qwen2_path, tmp_path, monkeypatch):
    on, logs_on, samples_on = _train(tiny_qwen2_path, tmp_path, "on", monkeypatch)
    off, logs_off, samples_off = _train(tiny_qwen2_path, tmp_path, "off", monkeypatch)
    assert on.vllm_generation.engine.requests_seen[0] == [2, 2]  # each prompt once, n = G
    assert samples_on == samples_off
    for a, b in zip(logs_on, logs_off, strict=True):
        assert a["rollplex/overlap_active"] == 1.0 and a["rollplex/prefix_s"] > 0
        assert a["rollplex/vllm_requests_per_row"] == 0.5 and a["rollplex/weight_sync_bytes"] == 1.0
        # same samples, same jobs on the same inputs (only when they run differs): the same numbers
        for key in ("loss", "kl", "grad_norm", "reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    assert all(r["rollplex/overlap_active"] == 0.0 for r in logs_off)  # the serial schedule, logged every step
