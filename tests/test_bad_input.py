"""Bad input gets a clear error naming the sample and the file, or (opt-in) is skipped and counted."""

import math

import pytest
import torch
from datasets import Dataset

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.errors import RollplexDataError

from helpers import record_generations, write_mp4


def reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 3) for c in completions]


def _config(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=4, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                  gradient_checkpointing=False, logging_steps=1, seed=0, shuffle_dataset=False,
                  rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 56)
    kwargs.update(overrides)
    return RollplexGRPOConfig(**kwargs)


def _row(pid, path):
    return {"problem_id": pid, "video": str(path),
            "prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "How many?"}]}]}


def _trainer(path, rows, config, func=reward):
    return RollplexGRPOTrainer(model=str(path), reward_funcs=func, args=config, train_dataset=Dataset.from_list(rows))


def test_missing_video_names_sample_and_file(tiny_vl_path, tmp_path):
    good = write_mp4(tmp_path / "good.mp4", 8, 56, 56)
    missing = tmp_path / "nowhere" / "gone.mp4"
    trainer = _trainer(tiny_vl_path, [_row(501, missing), _row(502, good)], _config(tmp_path,
                       rollplex_check_rows=0))  # the lazy path: found at the first read
    with pytest.raises(RollplexDataError) as info:
        trainer.train()
    assert "501" in str(info.value) and str(missing) in str(info.value)


def test_undecodable_video_names_sample_and_file(tiny_vl_path, tmp_path):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x01 this is not a video " * 100)
    good = write_mp4(tmp_path / "good.mp4", 8, 56, 56)
    trainer = _trainer(tiny_vl_path, [_row(601, corrupt), _row(602, good)], _config(tmp_path,
                       rollplex_check_rows=0))  # the lazy path: found at the first read
    with pytest.raises(RollplexDataError) as info:
        trainer.train()
    assert "601" in str(info.value) and "corrupt.mp4" in str(info.value)


def test_invalid_samples_can_be_skipped_and_are_counted(tiny_vl_path, tmp_path):
    good_a = write_mp4(tmp_path / "a.mp4", 8, 56, 56, seed=1)
    good_b = write_mp4(tmp_path / "b.mp4", 8, 56, 56, seed=2)
    rows = [_row(701, tmp_path / "missing.mp4"), _row(702, good_a), _row(703, good_b)]
    trainer = _trainer(tiny_vl_path, rows, _config(tmp_path, rollplex_skip_invalid_samples=True, max_steps=2,
                                                   rollplex_max_skipped_fraction=0.5))
    trainer.train()
    assert trainer.train_dataset.num_skipped == 1
    assert 0 in trainer.train_dataset.skipped and "missing.mp4" in trainer.train_dataset.skipped[0]
    logged = [r["rollplex/skipped_samples"] for r in trainer.state.log_history if "rollplex/skipped_samples" in r]
    assert logged and max(logged) == 1.0
    fractions = [r["rollplex/skipped_fraction"] for r in trainer.state.log_history if "rollplex/skipped_fraction" in r]
    assert fractions and max(fractions) > 0 and max(fractions) == pytest.approx(trainer.train_dataset.skipped_fraction)
    # the stand-in for the invalid row is a valid prompt, never the invalid one
    assert trainer.train_dataset[0]["problem_id"] in (702, 703)


def _truncated_faststart_mp4(path, num_frames=40):
    """A faststart MP4 (index before the data) cut near half its bytes: it opens and declares every frame, but only
    the first ones decode (an interrupted download or copy)."""
    import av
    import numpy as np

    whole = path.with_name("whole-" + path.name)
    with av.open(str(whole), mode="w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264" if "libx264" in av.codec.codecs_available else "mpeg4", rate=5)
        stream.height, stream.width, stream.pix_fmt = 56, 56, "yuv420p"
        for i in range(num_frames):
            frame = np.full((56, 56, 3), 5 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    data = whole.read_bytes()
    with av.open(str(whole)) as container:  # cut between packets, so that no decoder error gives it away
        ends = [p.pos + p.size for p in container.demux(video=0) if p.size and p.pos is not None]
    path.write_bytes(data[: min(ends, key=lambda end: abs(end - len(data) / 2))])
    return path


def test_truncated_video_is_an_error_naming_sample_and_file(tiny_vl_path, tmp_path):
    cut = _truncated_faststart_mp4(tmp_path / "cut.mp4")
    good = write_mp4(tmp_path / "good.mp4", 8, 56, 56)
    trainer = _trainer(tiny_vl_path, [_row(1001, cut), _row(1002, good)], _config(tmp_path,
                       rollplex_check_rows=0))  # the lazy path: found at the first read
    with pytest.raises(RollplexDataError) as info:
        trainer.train_dataset[0]
    message = str(info.value)
    assert "problem_id=1001 (row 0)" in message and str(cut) in message and "truncated or corrupt" in message


def test_truncated_video_is_skipped_and_the_skipped_fraction_is_limited(tiny_vl_path, tmp_path):
    cut = _truncated_faststart_mp4(tmp_path / "cut.mp4")
    good = write_mp4(tmp_path / "good.mp4", 8, 56, 56)
    rows = [_row(1101, cut), _row(1102, good)]
    # half the rows invalid, above the default limit of 5%: training stops, naming the option to raise
    trainer = _trainer(tiny_vl_path, rows, _config(tmp_path, rollplex_skip_invalid_samples=True))
    with pytest.raises(RollplexDataError) as info:
        trainer.train()
    message = str(info.value)
    assert "1 of the 2 samples of the dataset are invalid" in message
    assert "rollplex_max_skipped_fraction=0.05" in message
    assert "problem_id=1101 (row 0)" in message and "truncated or corrupt" in message

    trainer = _trainer(tiny_vl_path, rows, _config(tmp_path, rollplex_skip_invalid_samples=True,
                                                   rollplex_max_skipped_fraction=1.0))
    trainer.train()
    assert trainer.train_dataset.num_skipped == 1 and "truncated" in trainer.train_dataset.skipped[0]
    assert trainer.train_dataset.skipped_fraction == 0.5


def test_over_budget_prompt_is_an_error_not_a_truncation(tiny_vl_path, tmp_path, monkeypatch):
    clip = write_mp4(tmp_path / "a.mp4", 8, 56, 56)
    rows = [_row(800, clip), _row(801, clip)]
    rows[1]["prompt"][0]["content"][1]["text"] = "How many? " * 10  # only the second prompt is over budget
    # at start-up, before the model loads (rollplex_check_rows): the processor runs on the first rows
    from transformers import PreTrainedModel

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the check")

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedModel, "from_pretrained", classmethod(no_model))
        with pytest.raises(RollplexDataError) as info:
            _trainer(tiny_vl_path, rows, _config(tmp_path, rollplex_max_prompt_length=60))
    message = str(info.value)
    assert "problem_id=801 (row 1)" in message and "rollplex_max_prompt_length=60" in message
    assert "visual" in message and "found at start-up" in message and "rollplex_check_rows" in message
    # without the check (or past the first rows): the same error when training reads the row
    trainer = _trainer(tiny_vl_path, rows, _config(tmp_path, rollplex_max_prompt_length=60, rollplex_check_rows=1))
    trainer.train_dataset[0]
    with pytest.raises(RollplexDataError) as info:
        trainer.train_dataset[1]
    message = str(info.value)
    assert "801" in message and "rollplex_max_prompt_length=60" in message and "visual" in message


def test_empty_dataset_is_a_clear_error(tiny_vl_path, tmp_path):
    empty = Dataset.from_dict({"problem_id": [], "video": [], "prompt": []})
    with pytest.raises((RollplexDataError, ValueError)) as info:
        RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=reward, args=_config(tmp_path),
                            train_dataset=empty)
    assert "empty" in str(info.value).lower() or "no " in str(info.value).lower()


def test_nan_reward_is_an_error_naming_the_function(tiny_vl_path, tmp_path):
    clip = write_mp4(tmp_path / "a.mp4", 8, 56, 56)

    def broken_reward(completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer = _trainer(tiny_vl_path, [_row(901, clip), _row(902, clip)], _config(tmp_path), func=broken_reward)
    with pytest.raises(RollplexDataError) as info:
        trainer.train()
    assert "broken_reward" in str(info.value) and "NaN" in str(info.value)


def test_none_reward_keeps_trl_semantics(tiny_vl_path, tmp_path):
    """A reward function may return None for rows it cannot score (TRL turns them into NaN). TRL 1.16's semantics:
    a row no function scored is unscorable: its advantage is 0 and it is left out of the logged reward; the other
    rows' advantages are normalised over their group's scorable rows. Checked on video rows against that definition
    computed here from the recorded rewards (test_trl_parity checks text rows against trl.GRPOTrainer itself)."""
    clip = write_mp4(tmp_path / "a.mp4", 8, 56, 56)
    scored = []

    def partial_reward(completions, **kwargs):
        values = [None if i % 2 else float(len(c[0]["content"]) % 3) + 1.0 for i, c in enumerate(completions)]
        scored.append(values)
        return values

    trainer = _trainer(tiny_vl_path, [_row(1, clip), _row(2, clip)],
                       _config(tmp_path, num_generations=4, max_completion_length=6), func=partial_reward)
    advantages = []
    record_generations(trainer, "advantages", advantages)
    trainer.train()
    (log,) = [r for r in trainer.state.log_history if "loss" in r]
    rewards = torch.tensor([v if v is not None else float("nan") for v in scored[0]])
    adv = advantages[0].view(-1)
    assert adv.numel() == rewards.numel() == 4  # one prompt, G = 4
    assert (adv[1::2] == 0).all()  # unscorable rows carry no signal
    groups = rewards.view(-1, 4)
    mean = torch.nanmean(groups, 1, keepdim=True)
    std = torch.sqrt(torch.nanmean((groups - mean) ** 2, 1, keepdim=True) * 2 / (2 - 1))  # unbiased over 2 rows
    expected = ((groups - mean) / (std + 1e-4)).nan_to_num(0.0).view(-1)
    assert torch.allclose(adv, expected, atol=1e-5), (adv, expected)
    assert log["reward"] == pytest.approx(torch.nanmean(rewards).item(), rel=1e-6)
    assert math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"])


@pytest.mark.parametrize("field,value", [("rollplex_video_fps", 0.0), ("rollplex_video_min_frames", 0),
                                         ("rollplex_max_prompt_length", -5), ("rollplex_video_max_pixels", 1),
                                         ("rollplex_vllm_dtype", "fp32")])
def test_bad_config_values_are_rejected(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        _config(tmp_path, **{field: value})


@pytest.mark.parametrize("streamed", [False, True])
def test_plain_string_prompt_with_media_is_refused_before_the_model_loads(tmp_path, streamed):
    """A plain-string prompt cannot carry a video: refused at construction, naming the row and the format, before
    any model loads (the model path here does not exist: reaching it would be a different error)."""
    clip = write_mp4(tmp_path / "a.mp4", num_frames=4, height=56, width=56)
    dataset = Dataset.from_list([{"problem_id": 7, "prompt": "What happens in the video?", "video": str(clip)}])
    if streamed:
        dataset = dataset.to_iterable_dataset()
    args = RollplexGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[],
                              per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(ValueError, match=r"problem_id=7 \(row 0\) has a 'video' but its prompt is a plain string"):
        RollplexGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=lambda completions, **k: [0.0],
                            args=args, train_dataset=dataset)


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_bad_media_in_the_first_rows_is_refused_before_the_model_loads(tmp_path, kind):
    """rollplex_check_rows (default 4) opens the first rows' files at construction, before any model loads (the
    model path does not exist: reaching it would be another error). A file truncated after an intact header is
    found when training decodes it (test_truncated_video_is_an_error_naming_sample_and_file)."""
    good = write_mp4(tmp_path / "good.mp4", 8, 56, 56)
    bad = tmp_path / "nowhere" / "gone.mp4" if kind == "missing" else tmp_path / "c.mp4"
    if kind == "corrupt":
        bad.write_bytes(b"\x00 not a video " * 100)
    rows = [_row(901, good), _row(902, bad)]
    with pytest.raises(RollplexDataError, match=r"problem_id=902 \(row 1\)") as info:
        _trainer(tmp_path / "no-such-model", rows, _config(tmp_path))
    assert str(bad) in str(info.value)
    # off, or the bad row past the first N: nothing is read at construction (the model path is then the error)
    for config in (_config(tmp_path, rollplex_check_rows=0), _config(tmp_path, rollplex_check_rows=1)):
        with pytest.raises(OSError):
            _trainer(tmp_path / "no-such-model", rows, config)
