"""One process of tests/megatron/test_megatron_loss_types.py: for each loss type given, a short GRPO run of a tiny
Qwen2 text model on the `hf` backend and on the Megatron backend (t = 1, a 1-process world), same seed, data and
configuration; the logs of both to one JSON file. Run as its own process (the Megatron runs make a process group
and megatron-core's parallel state, kept out of pytest's)."""

import json
import sys
from pathlib import Path

KEYS = ("loss", "kl", "grad_norm", "reward", "entropy", "completions/mean_length", "completions/min_length",
        "completions/max_length")


def reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def run(checkpoint: str, out: str, loss_type: str, backend: str) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoTokenizer

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    # the tiny random model almost never samples EOS within 6 tokens, so every completion would be full length and
    # the loss types' normalisers (per sequence, per batch, constant, per token) would coincide: bias EOS up so
    # completions end at different lengths (the bias shapes the sampling only, both backends the same)
    eos = AutoTokenizer.from_pretrained(checkpoint).eos_token_id

    prompts = [[{"role": "user", "content": f"count to {i} " * (1 + i % 3)}] for i in range(8)]
    args = RollplexGRPOConfig(
        output_dir=f"{out}/{loss_type}-{backend}", max_steps=2, per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=2, steps_per_generation=2, max_completion_length=6, learning_rate=5e-3,
        beta=0.1, loss_type=loss_type, logging_steps=1, report_to=[], seed=11, use_cpu=True, bf16=False,
        save_strategy="no", rollplex_backend=backend, generation_kwargs={"sequence_bias": [[[eos], 4.0]]})
    trainer = RollplexGRPOTrainer(model=checkpoint, reward_funcs=reward, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    return [{k: r.get(k) for k in KEYS} for r in trainer.state.log_history if "loss" in r]


if __name__ == "__main__":
    checkpoint, out, *loss_types = sys.argv[1:]
    results = {lt: {b: run(checkpoint, out, lt, b) for b in ("hf", "megatron")} for lt in loss_types}
    Path(out, "loss_types.json").write_text(json.dumps(results))
