"""One process of tests/temporal/test_temporal_ddp.py (torchrun, gloo): T-GRPO with each group split over the two
processes. Writes its logs, the accuracy rewards it computed (ordered rows and, on the group's owner, shuffled rows),
how many shuffled groups it sampled, and a checksum of its weights."""

import json
import os
import sys
from pathlib import Path


def main(checkpoint: str, out: str, mode: str) -> None:
    sys.path[:0] = [os.path.join(os.path.dirname(__file__), ".."), os.path.join(os.path.dirname(__file__), "../..")]
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    from helpers import video_rows

    rank = int(os.environ["RANK"])
    calls: list[list[float]] = []

    def accuracy(completions, **kwargs):
        values = [1.0 if len(c[0]["content"]) % 3 else 0.0 for c in completions]
        calls.append(values)
        return values

    temporal = mode != "off"
    args = RollplexGRPOConfig(
        output_dir=f"{out}/run-{mode}", max_steps=3, per_device_train_batch_size=2, num_generations=4,
        max_completion_length=6, learning_rate=5e-3, logging_steps=1, report_to=[], seed=5, use_cpu=True,
        bf16=False, save_strategy="no", ddp_backend="gloo", rollplex_temporal=temporal,
        rollplex_temporal_shuffle="patch" if mode.startswith("patch") else "frame",
        rollplex_temporal_alpha=0.0 if mode == "alpha0" else 0.3,
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    trainer = RollplexGRPOTrainer(model=checkpoint, reward_funcs=[accuracy], args=args,
                                  train_dataset=Dataset.from_list(video_rows(Path(out) / f"media{rank}",
                                                                             lambda i: "Q" * i)))
    if mode == "patch-plain":  # the patch shuffle without the feature reuse: the vision tower encodes the copies
        trainer.temporal.before_rollout = lambda trainer: None
    sampled: list[int] = []
    if temporal:
        sample = trainer.temporal.sample

        def recording(rows, **kwargs):
            pending = sample(rows, **kwargs)
            sampled.append(len(pending.groups))
            return pending

        trainer.temporal.sample = recording
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    result = {"logs": [r for r in trainer.state.log_history if "loss" in r], "calls": calls, "sampled": sampled,
              "checksum": float(sum(p.double().sum() for p in model.parameters()))}
    Path(out, f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    trainer.end()


if __name__ == "__main__":
    main(*sys.argv[1:4])
