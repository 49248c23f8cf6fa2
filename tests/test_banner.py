"""The start-up banner (callbacks/banner.py): printed once by the main process, saying what the run is and what
was decided, checked against the trainer's own components."""

from datasets import Dataset

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

from helpers import video_rows


def _trainer(model, dataset, tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=4, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                  rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    kwargs.update(overrides)
    return RollplexGRPOTrainer(model=str(model), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                               args=RollplexGRPOConfig(**kwargs), train_dataset=dataset)


def test_banner_is_printed_once_with_the_runs_decisions(tiny_vl_path, tmp_path, capsys):
    trainer = _trainer(tiny_vl_path, Dataset.from_list(video_rows(tmp_path)), tmp_path, rollplex_temporal=True,
                       rollplex_verify_every=50, rollplex_share_prefix="on", rollplex_suffix_attention="concat")
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rollplex]")]
    assert len(lines) == 2, lines
    first, second = lines
    assert first.startswith("[rollplex] 1 process: data parallel 1 x tensor parallel 1 · backend hf")
    assert "rollout transformers generate (shared prefill)" in first and "precision fp32" in first
    for part in ("shared prefix: on (scoring, actor)", "suffix attention concat", "audit every 50 steps (2 rows)",
                 "T-GRPO on", "length control off", "memory off"):
        assert part in second, part


def test_banner_says_what_is_off(tiny_qwen2_path, tmp_path, capsys):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(4)]})
    trainer = _trainer(tiny_qwen2_path, dataset, tmp_path, rollplex_share_prefix="off", rollplex_verify_every=0,
                       bf16=True)
    trainer.train()
    text = capsys.readouterr().out
    assert "shared prefix: off" in text and "audit off" in text and "precision bf16" in text
