"""One process of tests/test_ddp_trainer.py (run under torchrun, gloo): a short video GRPO run, its logs to a file."""

import json
import os
import sys
from pathlib import Path


def main(checkpoint: str, out: str, share: str) -> None:
    """share: "auto"/"off" (rollplex_share_prefix), or "auto-measure": overlap "auto" made to measure on CPU, with
    the ranks' measurements rigged to disagree (rank 0 would choose ON, rank 1 OFF)."""
    measure = share == "auto-measure"
    sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    from helpers import video_rows

    rank = int(os.environ["RANK"])
    rows = video_rows(Path(out) / f"media{rank}", lambda i: "Q" * i)

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"]) % 5) for c in completions]

    args = RollplexGRPOConfig(
        output_dir=f"{out}/run-{share}", max_steps=4 if measure else 2, per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=5, use_cpu=True,
        bf16=False, save_strategy="no", ddp_backend="gloo",
        rollplex_share_prefix="auto" if measure else share, rollplex_overlap="auto" if measure else "off",
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    if measure:
        from rollplex_trl.overlap import OverlapSchedule

        OverlapSchedule.auto_measures_on_cpu = True
    trainer = RollplexGRPOTrainer(model=checkpoint, reward_funcs=reward, args=args,
                                  train_dataset=Dataset.from_list(rows))
    if measure:
        schedule = trainer.overlap
        finish = schedule._finish_window

        def rigged(*a, **k):
            finish(*a, **k)
            if schedule.training_windows == 2 and not schedule.decided:  # after the serial measurement
                schedule._auto_serial_s = 1e9 if rank == 0 else 0.0

        schedule._finish_window = rigged
    local_sums = []
    decision = trainer.sharing.decision
    if decision is not None:  # "auto": record what this process contributes to the cost decision
        reduce_sums = decision.reduce_sums
        decision.reduce_sums = lambda values: (local_sums.append(values), reduce_sums(values))[1]
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    choice = decision.choice if decision is not None else None
    result = {"world": trainer.accelerator.num_processes, "share_actor": trainer.plan.share_actor,
              "logs": [r for r in trainer.state.log_history if "loss" in r],
              "checksum": float(sum(p.double().sum() for p in model.parameters())),
              "sharing": None if choice is None else {
                  "local": local_sums, "share": choice.share,
                  "shape": [choice.shape.prompt_tokens, choice.shape.visual_tokens]}}
    Path(out, f"{share}-rank{rank}.json").write_text(json.dumps(result))
    # a process group left to the interpreter's exit can abort the process ("terminate called without an active
    # exception"): the trainer's end() closes it, and lets go of it, while both ranks are still here
    trainer.end()


if __name__ == "__main__":
    main(*sys.argv[1:4])
