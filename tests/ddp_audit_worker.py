"""One process of tests/test_verify.py's DDP test (torchrun, gloo): audited video GRPO steps; with mode "fault" the
decode window's prefixes are wrong on rank 1 only, with mode "grad" the actor suffix's gradient is scaled by 1.5 on
rank 1 only (its values unchanged). Writes the logged audit values and the warnings it printed."""

import json
import logging
import os
import sys
from pathlib import Path


def main(checkpoint: str, out: str, mode: str) -> None:
    sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
    from datasets import Dataset

    import rollplex_trl.prefix.batch as prefix_batch
    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    from helpers import broken_take_scoring, video_rows

    rank = int(os.environ["RANK"])
    if mode == "fault" and rank == 1:
        prefix_batch.StepPrefixes.take_scoring = broken_take_scoring()
    if mode == "grad" and rank == 1:
        import rollplex_trl.backends.hf as hf_backend

        suffix = hf_backend.suffix_logps

        def scaled_gradient(*args, **kwargs):  # the same log-probs, their gradient 1.5 times as large
            logps, entropies = suffix(*args, **kwargs)
            return logps * 1.5 - logps.detach() * 0.5, entropies

        hf_backend.suffix_logps = scaled_gradient
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("rollplex_trl.trainers.verify").addHandler(Collect(level=logging.WARNING))
    args = RollplexGRPOConfig(
        output_dir=f"{out}/run-{mode}", max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=5, use_cpu=True,
        bf16=False, save_strategy="no", ddp_backend="gloo", rollplex_verify_every=1,
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    trainer = RollplexGRPOTrainer(model=checkpoint, reward_funcs=lambda completions, **k: [
        float(len(c[0]["content"]) % 5) for c in completions], args=args,
        train_dataset=Dataset.from_list(video_rows(Path(out) / f"media{rank}", lambda i: "Q" * i)))
    trainer.train()
    logs = [{k: v for k, v in r.items() if k.startswith("rollplex/verify_")} for r in trainer.state.log_history
            if "loss" in r]
    from rollplex_trl.callbacks.banner import banner_lines

    Path(out, f"{mode}-rank{rank}.json").write_text(json.dumps({"logs": logs, "warnings": warnings,
                                                                "banner": banner_lines(trainer)}))
    trainer.end()


if __name__ == "__main__":
    main(*sys.argv[1:4])
