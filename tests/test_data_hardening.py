"""Skipping invalid samples without skewing the data, the skipped-fraction limit, and the messages around them.

The wrapper logic is exercised with a stand-in preparer (rows marked `bad` raise, the others pass), so the tests
need no model; the references are counted independently: which rows the preparer was asked for, and the uniform
distribution a stand-in must follow. Real media (missing files) are used where the message text matters.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from rollplex_trl.data.errors import RollplexDataError
from rollplex_trl.data.prepared import (
    PREPARED_KEY,
    MediaOptions,
    MediaPreparer,
    PreparedPromptDataset,
    StreamPreparer,
)
from rollplex_trl.data.video import VideoSamplingConfig


class FlagPreparer(MediaPreparer):
    """Prepares a row unless it is marked `bad`; records every row it was asked for."""

    def __init__(self, processor, options) -> None:
        super().__init__(processor, options)
        self.calls: list[int] = []

    def prepare_row(self, row: dict, sample_id: str) -> dict:
        self.calls.append(row["problem_id"])
        if row["bad"]:
            raise RollplexDataError(f"sample {sample_id}: marked bad")
        row[PREPARED_KEY] = object()
        return row


class FlagDataset(PreparedPromptDataset):
    preparer_cls = FlagPreparer


def _options(**overrides) -> MediaOptions:
    kwargs = dict(sampling=VideoSamplingConfig(), skip_invalid=True, cache_size=0)
    kwargs.update(overrides)
    return MediaOptions(**kwargs)


def _rows(n: int, bad: set[int]) -> list[dict]:
    return [{"problem_id": i, "bad": i in bad, "prompt": f"q{i}"} for i in range(n)]


def _served(dataset: PreparedPromptDataset, order) -> dict[int, int]:
    """Which row stands behind each index, reading the indices in `order`."""
    return {i: dataset[i]["problem_id"] for i in order}


BLOCK = set(range(10, 22))  # 12 invalid rows in a row, among 40


# ---------------------------------------------------------------------------------------------------------------------
# Map-style datasets
# ---------------------------------------------------------------------------------------------------------------------


def test_a_block_of_invalid_rows_is_spread_over_the_valid_rows():
    dataset = FlagDataset(_rows(40, BLOCK), None, _options(max_skipped_fraction=1.0))
    served = _served(dataset, range(40))

    assert all(served[i] == i for i in range(40) if i not in BLOCK)  # valid rows stand for themselves
    stand_ins = [served[i] for i in sorted(BLOCK)]
    assert not set(stand_ins) & BLOCK  # never an invalid row
    uses = Counter(served.values())
    # Before: row 22 (the next valid one) trained 13 times an epoch. With 12 independent uniform draws among 28
    # rows, some row is drawn 4 or more times (5 uses) with probability ~2%.
    assert max(uses.values()) <= 4, uses
    assert len(set(stand_ins)) >= 6  # spread out (about 10 distinct expected; before: 1)
    assert min(stand_ins) < 10 and max(stand_ins) > 22  # from both sides of the block, not its neighbour
    assert dataset.num_skipped == 12 and dataset.skipped_fraction == pytest.approx(12 / 40)


def test_stand_ins_are_uniform_over_the_valid_rows():
    # 200 invalid rows (a block) and 200 valid ones: the stand-ins must follow the uniform distribution over
    # rows 200..399 (quartiles of 50 rows each: 50 stand-ins expected per quartile, standard deviation ~6).
    dataset = FlagDataset(_rows(400, set(range(200))), None, _options(max_skipped_fraction=1.0))
    stand_ins = [dataset[i]["problem_id"] for i in range(200)]
    assert all(200 <= s < 400 for s in stand_ins)
    quartiles = Counter((s - 200) // 50 for s in stand_ins)
    assert all(25 <= quartiles[q] <= 75 for q in range(4)), quartiles
    assert np.mean(stand_ins) == pytest.approx(299.5, abs=10)


def test_stand_ins_are_reproducible_whatever_the_read_order_and_leave_global_rngs_alone():
    rows = _rows(40, BLOCK)
    random.seed(123)
    torch.manual_seed(123)
    np.random.seed(123)
    states = (random.getstate(), torch.random.get_rng_state(), np.random.get_state()[1].copy())

    forward = _served(FlagDataset(rows, None, _options(max_skipped_fraction=1.0)), range(40))
    backward = _served(FlagDataset(rows, None, _options(max_skipped_fraction=1.0)), reversed(range(40)))
    shuffled_order = list(range(40))
    random.Random(7).shuffle(shuffled_order)
    shuffled = _served(FlagDataset(rows, None, _options(max_skipped_fraction=1.0)), shuffled_order)
    assert forward == backward == shuffled

    assert random.getstate() == states[0]
    assert torch.equal(torch.random.get_rng_state(), states[1])
    assert np.array_equal(np.random.get_state()[1], states[2])


def test_a_row_keeps_its_stand_in_after_leaving_the_cache():
    dataset = FlagDataset(_rows(40, BLOCK), None, _options(max_skipped_fraction=1.0, cache_size=2))
    first = _served(dataset, range(40))
    assert _served(dataset, range(40)) == first  # cache of 2: every row read again


def test_skipped_fraction_limit_stops_only_when_the_dataset_is_certainly_over_it():
    # 100 rows, limit 0.04: the 5th invalid row found proves more than 4% of the dataset is invalid, wherever the
    # reads are; 4 invalid rows (exactly 4%) never stop it, even when they are the first rows read.
    four_bad = FlagDataset(_rows(100, {0, 1, 2, 3}), None, _options(max_skipped_fraction=0.04))
    assert [four_bad[i]["problem_id"] for i in range(100)][4:] == list(range(4, 100))
    dataset = FlagDataset(_rows(100, {0, 1, 2, 3, 50}), None, _options(max_skipped_fraction=0.04))
    with pytest.raises(RollplexDataError) as caught:
        for i in range(100):
            dataset[i]
            assert i < 50, "the fifth invalid row (row 50) must stop it"
    message = str(caught.value)
    assert "5 of the 100 samples of the dataset are invalid (at least 5%)" in message
    assert "rollplex_max_skipped_fraction=0.04" in message and "1.0 never stops" in message
    assert "sample problem_id=0 (row 0): marked bad" in message  # the skipped samples and their reasons
    assert "rollplex_skip_invalid_samples=True" not in message  # skipping is on already


def test_skipped_fraction_limit_lists_the_first_skipped_samples():
    dataset = FlagDataset(_rows(40, BLOCK), None, _options(max_skipped_fraction=0.1))  # the 5th invalid row stops
    with pytest.raises(RollplexDataError, match="rollplex_max_skipped_fraction=0.1") as caught:
        for i in range(40):
            dataset[i]
    message = str(caught.value)
    listed = [f"sample problem_id={i} (row {i}): marked bad" for i in range(10, 15)]
    assert all(line in message for line in listed)
    assert "problem_id=15 (row 15)" not in message  # the first five only


def test_a_small_dataset_is_judged_once_every_row_was_read():
    dataset = FlagDataset(_rows(10, {3}), None, _options(max_skipped_fraction=0.05))
    with pytest.raises(RollplexDataError, match="1 of the 10 samples of the dataset"):
        for i in range(10):
            dataset[i]
            assert len(set(dataset.preparer.calls)) < 10
    assert FlagDataset(_rows(10, {3}), None, _options(max_skipped_fraction=0.1))[3]  # exactly 10% is allowed


def test_limit_one_never_stops():
    dataset = FlagDataset(_rows(40, set(range(39))), None, _options(max_skipped_fraction=1.0))
    assert [dataset[i]["problem_id"] for i in range(40)] == [39] * 40
    assert dataset.skipped_fraction == pytest.approx(39 / 40)


def test_skipped_fraction_counts_distinct_rows_read():
    dataset = FlagDataset(_rows(40, BLOCK), None, _options(max_skipped_fraction=1.0))
    assert dataset.skipped_fraction == 0.0
    for i in range(5):
        dataset[i]
    assert dataset.skipped_fraction == 0.0
    for _ in range(3):  # reading again adds no distinct row
        dataset[10]
    read = set(dataset.preparer.calls)
    assert dataset.skipped_fraction == pytest.approx(len(read & BLOCK) / len(read))


# ---------------------------------------------------------------------------------------------------------------------
# Messages (real media: missing files)
# ---------------------------------------------------------------------------------------------------------------------


def _video_rows(tmp_path, n: int) -> list[dict]:
    return [{"problem_id": 100 + i, "video": str(tmp_path / f"missing{i}.mp4"), "prompt": "How many?"}
            for i in range(n)]


def test_sample_labels_read_naturally(tmp_path):
    dataset = PreparedPromptDataset(_video_rows(tmp_path, 2), None, _options(skip_invalid=False))
    with pytest.raises(RollplexDataError) as caught:
        dataset[0]
    message = str(caught.value)
    assert message.startswith(f"sample problem_id=100 (row 0), video '{tmp_path / 'missing0.mp4'}': file not found")
    assert "'100 (row 0)'" not in message

    stream = StreamPreparer(MediaPreparer(None, _options(skip_invalid=False)), _options(skip_invalid=False))
    with pytest.raises(RollplexDataError, match=r"^sample problem_id=100 \(streamed\), video"):
        stream.prepare_batch(_video_rows(tmp_path, 1))
    no_id = [{"video": str(tmp_path / "missing.mp4"), "prompt": "How many?"}]
    with pytest.raises(RollplexDataError, match=r"^sample row 0, video"):
        PreparedPromptDataset(no_id, None, _options(skip_invalid=False))[0]


def test_every_sample_invalid_says_the_right_thing_with_and_without_skipping(tmp_path):
    rows = _video_rows(tmp_path, 3)
    with pytest.raises(RollplexDataError) as caught:
        PreparedPromptDataset(rows, None, _options(skip_invalid=False))[0]
    assert "rollplex_skip_invalid_samples=True" in str(caught.value)  # off: enabling it is the advice

    with pytest.raises(RollplexDataError) as caught:
        PreparedPromptDataset(rows, None, _options(max_skipped_fraction=1.0))[0]
    message = str(caught.value)
    assert message.startswith("all 3 samples are invalid, so rollplex_skip_invalid_samples has no valid sample")
    assert "missing0.mp4': file not found; check the path / data root" in message
    assert "=True" not in message and "skip such samples" not in message  # on already: no advice to turn it on
    assert "Check the data root and the media paths" in message

    stream = StreamPreparer(MediaPreparer(None, _options()), _options())
    with pytest.raises(RollplexDataError) as caught:
        stream.prepare_batch([row for row in rows for _ in range(2)])
    message = str(caught.value)
    assert message.startswith("all prompts of this generation batch are invalid")
    assert "=True" not in message and "missing2.mp4" in message


# ---------------------------------------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------------------------------------


def _batch(prompts: list[dict], generations: int = 2) -> list[dict]:
    """TRL's layout: the G copies of each prompt next to each other, as separate dicts."""
    return [dict(p) for p in prompts for _ in range(generations)]


def _stream(**overrides) -> StreamPreparer:
    options = _options(cache_size=64, **overrides)
    return StreamPreparer(FlagPreparer(None, options), options)


def test_stream_stand_ins_keep_groups_and_are_uniform_over_the_batch():
    # 400 batches of one invalid prompt (listed first) and four valid ones: the stand-in's position among the valid
    # prompts must be uniform (100 expected each, standard deviation ~9); before, it was always the first.
    stream = _stream(max_skipped_fraction=1.0)
    positions = Counter()
    for b in range(400):
        prompts = [{"problem_id": 5 * b + k, "bad": k == 0, "prompt": f"q{b}-{k}"} for k in range(5)]
        out = stream.prepare_batch(_batch(prompts))
        assert [r["problem_id"] for r in out[2:]] == [p for p in range(5 * b + 1, 5 * b + 5) for _ in range(2)]
        assert out[0]["problem_id"] == out[1]["problem_id"] != 5 * b  # both copies: the same valid prompt
        assert out[0][PREPARED_KEY] is out[1][PREPARED_KEY]
        positions[out[0]["problem_id"] - 5 * b - 1] += 1
    assert all(60 <= positions[k] <= 140 for k in range(4)), positions
    assert stream.num_skipped == 400 and stream.skipped_fraction == pytest.approx(400 / 2000)


def test_stream_stand_ins_are_reproducible():
    prompts = [{"problem_id": k, "bad": k in (0, 3, 6), "prompt": f"q{k}"} for k in range(8)]
    first = [r["problem_id"] for r in _stream(max_skipped_fraction=1.0).prepare_batch(_batch(prompts))]
    again = [r["problem_id"] for r in _stream(max_skipped_fraction=1.0).prepare_batch(_batch(prompts))]
    assert first == again and not {0, 3, 6} & set(first)


def test_stream_batch_without_valid_prompt_uses_recent_valid_prompts():
    stream = _stream(max_skipped_fraction=1.0)
    earlier = [{"problem_id": k, "bad": False, "prompt": f"q{k}"} for k in range(3)]
    stream.prepare_batch(_batch(earlier))
    broken = [{"problem_id": 10 + k, "bad": True, "prompt": f"b{k}"} for k in range(2)]
    out = stream.prepare_batch(_batch(broken))
    assert {r["problem_id"] for r in out} <= {0, 1, 2}
    assert out[0]["problem_id"] == out[1]["problem_id"] and out[2]["problem_id"] == out[3]["problem_id"]


def test_stream_skipped_fraction_limit():
    stream = _stream(max_skipped_fraction=0.1)
    # 3 of the first 10 rows are invalid (30%), but a stream is judged only from 20 distinct rows on
    prompts = [{"problem_id": k, "bad": k in (1, 4, 7), "prompt": f"q{k}"} for k in range(10)]
    stream.prepare_batch(_batch(prompts))
    assert stream.skipped_fraction == pytest.approx(0.3)
    more = [{"problem_id": k, "bad": False, "prompt": f"q{k}"} for k in range(10, 20)]
    with pytest.raises(RollplexDataError, match=r"3 of the 20 samples read so far are invalid \(15%\)"):
        stream.prepare_batch(_batch(more))


def test_video_column_probe_lets_a_datasets_own_error_surface():
    """`has_video_column` peeks at the first row of a dataset without column names. An empty dataset is no video
    dataset (TRL reports the emptiness); an error reading the row is the dataset's and is raised, not turned into
    "no video column" (which would route video rows down the image/text path)."""
    from rollplex_trl.data.prepared import has_video_column

    class Unreadable:
        def __getitem__(self, index):
            raise OSError("shard 3 of the annotations cannot be read")

    assert has_video_column([]) is False
    assert has_video_column(iter([])) is False
    assert has_video_column([{"prompt": "p", "video": "a.mp4"}]) is True
    assert has_video_column(iter([{"prompt": "p"}])) is False
    with pytest.raises(OSError, match="shard 3"):
        has_video_column(Unreadable())
