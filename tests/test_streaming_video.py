"""Video datasets streamed as `datasets.IterableDataset`: TRL reorders the stream itself (G repeats of each prompt,
repeated generation batches), so the rows are prepared per generation batch. The reference is the same data as a
map-style dataset (itself tested against full forwards): with the same seed and no shuffling, the two runs sample
the same completions and log the same losses."""

import pytest
import torch
from datasets import Dataset

import rollplex_trl.data.prepared as dataset_module
from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.errors import RollplexDataError

from helpers import RecordingReward, video_rows


def _train(model, dataset, tmp_path, name, **overrides):
    kwargs = dict(output_dir=str(tmp_path / name), max_steps=4, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=5,
                  use_cpu=True, bf16=False, save_strategy="no", shuffle_dataset=False, rollplex_overlap="off",
                  rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84,
                  rollplex_check_rows=0)  # the tests count training's decodes; the start-up check would add 4
    kwargs.update(overrides)
    reward = RecordingReward()
    trainer = RollplexGRPOTrainer(model=str(model), reward_funcs=reward, args=RollplexGRPOConfig(**kwargs),
                                  train_dataset=dataset)
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r], reward.seen


@pytest.mark.parametrize("extra", [{}, {"num_iterations": 2}])
def test_streamed_video_learns_what_the_map_style_dataset_learns(tiny_vl_path, tmp_path, monkeypatch, extra):
    rows = video_rows(tmp_path, lambda i: "Q" * i)
    decoded = []
    load_video = dataset_module.load_video
    monkeypatch.setattr(dataset_module, "load_video", lambda *a, **k: decoded.append(a[0]) or load_video(*a, **k))

    mapped, logs_map, seen_map = _train(tiny_vl_path, Dataset.from_list(rows), tmp_path, "map", **extra)
    decoded_map = list(decoded)
    decoded.clear()
    streamed, logs_stream, seen_stream = _train(tiny_vl_path, Dataset.from_list(rows).to_iterable_dataset(),
                                                tmp_path, "stream", **extra)

    assert streamed.media.stream_preparer is not None and mapped.media.stream_preparer is None
    assert seen_stream == seen_map and len(seen_map) == 16 // extra.get("num_iterations", 1)
    assert len(logs_stream) == len(logs_map) == 4
    for a, b in zip(logs_stream, logs_map, strict=True):
        assert set(a) == set(b)
        for key in ("loss", "kl", "grad_norm", "reward", "rollplex/prefix_rows_per_prompt"):
            if key in b:  # steps that reuse a generation (num_iterations > 1) log no reward
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    # one decode per clip and prompt, as with the map-style wrapper (its G copies and repeats are served from cache)
    assert sorted(decoded) == sorted(decoded_map) and len(set(decoded)) == len(decoded)


def test_streamed_invalid_samples_are_named_or_skipped(tiny_vl_path, tmp_path):
    rows = video_rows(tmp_path, lambda i: "Q" * i)
    rows[1]["video"] = str(tmp_path / "missing.mp4")
    with pytest.raises(RollplexDataError, match=r"1 \(streamed\)"):
        _train(tiny_vl_path, Dataset.from_list(rows).to_iterable_dataset(), tmp_path, "strict", max_steps=1)

    trainer, logs, seen = _train(tiny_vl_path, Dataset.from_list(rows).to_iterable_dataset(), tmp_path, "skip",
                                 max_steps=2, rollplex_skip_invalid_samples=True)
    assert trainer.media.stream_preparer.num_skipped == 1
    assert all(pid != 1 for pid, _ in seen)  # the invalid prompt's rows were replaced by a valid prompt's
    assert logs[-1]["rollplex/skipped_samples"] == 1.0 and all(torch.isfinite(torch.tensor(r["loss"])) for r in logs)


def test_a_plain_torch_iterable_is_refused(tiny_vl_path, tmp_path):
    rows = video_rows(tmp_path, lambda i: "Q" * i)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(rows)

    with pytest.raises((TypeError, RollplexDataError), match="IterableDataset"):  # TRL refuses it first
        _train(tiny_vl_path, Stream(), tmp_path, "torch", max_steps=1)
