"""TRL's warning for a row whose every reward returned None prints the row's columns: the prepared prompt Rollplex
carries in the batch (`rollplex_prompt`) shows as one short line, not every token id and a pixel tensor."""

import logging

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer


def none_reward(completions, **kwargs):
    return [None] * len(completions)


def test_the_prepared_prompt_prints_short_in_trls_none_reward_warning(tiny_vl_path, tmp_path, video_dataset, caplog):
    args = RollplexGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                              num_generations=2, max_completion_length=4, report_to=[], use_cpu=True,
                              save_strategy="no", rollplex_verify_every=0)
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=[none_reward], args=args,
                                  train_dataset=video_dataset)
    with caplog.at_level(logging.WARNING, logger="trl"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert warnings, [r.getMessage()[:200] for r in caplog.records]
    message = warnings[0]
    assert "'rollplex_prompt': PreparedPrompt(sample " in message and " tokens, " in message
    assert len(message) < 1500, len(message)  # the default dataclass repr printed ~3 KB of ids and tensor values
    assert "tensor(" not in message
