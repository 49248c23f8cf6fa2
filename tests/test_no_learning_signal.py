"""NoLearningSignal (callbacks/signal.py): one warning when every group had zero reward spread for several logged
steps in a row, naming the likely causes read off the same logs."""

import logging
from types import SimpleNamespace

from datasets import Dataset

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.callbacks import NoLearningSignal

LOGGER = "rollplex_trl.callbacks.signal"
STATE = SimpleNamespace(is_world_process_zero=True)


def _log(callback, **logs):
    callback.on_log(None, STATE, None, logs=logs)


def test_warns_once_after_n_flat_steps_and_resets_on_spread(caplog):
    callback = NoLearningSignal(steps=3)
    flat = {"frac_reward_zero_std": 1.0, "rewards/accuracy/mean": 0.0, "rewards/format_reward/mean": 0.0,
            "completions/clipped_ratio": 1.0}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _log(callback, **flat)
        _log(callback, **flat)
        _log(callback, **{**flat, "frac_reward_zero_std": 0.5})  # a step with spread: the count starts again
        _log(callback, **flat)
        _log(callback, **flat)
        assert not caplog.records
        _log(callback, **flat)
        _log(callback, **flat)
        _log(callback, loss=0.1)  # logs without the metric (e.g. evaluation) change nothing
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "no learning signal for 3 logged steps" in message
    assert "accuracy, format_reward" in message and "100% of the completions were cut" in message
    assert "answer format" in message


def test_other_processes_stay_quiet(caplog):
    callback = NoLearningSignal(steps=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        callback.on_log(None, SimpleNamespace(is_world_process_zero=False), None, logs={"frac_reward_zero_std": 1.0})
    assert not caplog.records


def test_a_run_with_a_reward_that_never_fires_warns(tiny_qwen2_path, tmp_path, caplog):
    def never(completions, **kwargs):
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(4)]})
    args = RollplexGRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=2,
                              max_completion_length=4, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                              logging_steps=1)
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=never, args=args, train_dataset=dataset)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train()
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 1 and "reward functions that returned 0 for every completion: never" in messages[0]
