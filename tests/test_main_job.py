"""The README's main job (`rollplex-trl demo`) trains end to end and leaves a loadable checkpoint and logs."""

import json

from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from rollplex_trl.cli import main


def test_demo_trains_two_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ROLLPLEX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--steps", "2", "--num-samples", "4", "--threads", "2"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("[rollplex-trl] done. checkpoint: ")
    checkpoint = out / "checkpoints" / "checkpoint-2"
    assert str(checkpoint) in printed[-1] and str(out / "logs.jsonl") in printed[-1]

    records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert "reward" in r and "rewards/accuracy_reward/mean" in r and "rewards/format_reward/mean" in r
        assert "rollplex/skipped_samples" in r

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint)
    assert sum(p.numel() for p in model.model.visual.parameters()) > 0
    AutoProcessor.from_pretrained(out / "checkpoints" / "checkpoint-2")
