"""One process of tests/test_ddp_trainer.py (run under torchrun, gloo): a short video GRPO run, its logs to a file."""

import json
import os
import sys
from pathlib import Path


def main(checkpoint: str, out: str, share: str) -> None:
    sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    from helpers import video_rows

    rank = int(os.environ["RANK"])
    rows = video_rows(Path(out) / f"media{rank}", lambda i: "Q" * i)

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"]) % 5) for c in completions]

    args = RollplexGRPOConfig(
        output_dir=f"{out}/run-{share}", max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=5, use_cpu=True,
        bf16=False, save_strategy="no", ddp_backend="gloo", rollplex_share_prefix=share, rollplex_overlap="off",
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    trainer = RollplexGRPOTrainer(model=checkpoint, reward_funcs=reward, args=args,
                                  train_dataset=Dataset.from_list(rows))
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    result = {"world": trainer.accelerator.num_processes, "share_actor": trainer._share_actor,
              "logs": [r for r in trainer.state.log_history if "loss" in r],
              "checksum": float(sum(p.double().sum() for p in model.parameters()))}
    Path(out, f"{share}-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
