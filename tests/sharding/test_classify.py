"""Runs, stitching, strided views and placement on small hand-checkable layouts."""

import itertools

import numpy as np
import pytest

from rollplex_trl.sharding.classify import (
    ALIGNED,
    COPY,
    VIEW,
    Runs,
    affine_factor,
    classify,
    compress_runs,
    decompose,
)
from rollplex_trl.sharding.placement import max_weight_assignment


def _split(ids, n, k):
    return np.array_split(ids, n)[k]


def test_affine_factor():
    assert affine_factor(np.arange(6) * 3) == [(6, 3)]
    assert affine_factor(np.array([0, 1, 2, 10, 11, 12])) == [(2, 10), (3, 1)]
    assert affine_factor(np.array([0, 1, 5, 6, 100, 101, 105, 106])) == [(2, 100), (2, 5), (2, 1)]
    assert affine_factor(np.array([0, 1, 2, 10, 11])) is None
    assert affine_factor(np.array([7])) == []


def test_column_split_8_to_4_is_two_runs_and_aligned():
    rows, cols = np.arange(64), np.arange(16)
    shards = [(_split(rows, 8, k), cols) for k in (2, 3)]  # rollout rank 1 draws from training ranks 2, 3
    runs = decompose((_split(rows, 4, 1), cols), shards)
    assert runs.holder.tolist() == [0, 1] and runs.length.tolist() == [128, 128]
    res = classify(runs, (16, 16), [128, 128], page=512, esize=4)
    assert res.cls == ALIGNED and res.constraints == {0: 0, 1: 0}


def test_row_split_8_to_4_is_a_split_k_view():
    rows, cols = np.arange(8), np.arange(64)
    shards = [(rows, _split(cols, 8, k)) for k in (0, 1)]
    runs = decompose((rows, _split(cols, 4, 0)), shards)
    assert len(runs) == 16  # two runs per row
    res = classify(runs, (8, 16), [64, 64], page=256, esize=4)
    assert res.cls == VIEW
    assert res.view.sizes == (8, 2, 8) and res.view.strides == (8, 64, 1) and not res.view.plain


def test_interleaved_blocks_stitch_only_when_pieces_are_whole_pages():
    # [a0 b0 | a1 b1] in training, [a0 a1 b0 b1] in rollout: four runs of 4 rows x 8 columns x 4 bytes = 128 B.
    rows, cols = np.arange(16), np.arange(8)
    t0, t1 = np.r_[0:4, 8:12], np.r_[4:8, 12:16]
    runs = decompose((rows, cols), [(t0, cols), (t1, cols)])
    assert len(runs) == 4
    assert classify(runs, (16, 8), [64, 64], page=128, esize=4).cls == ALIGNED
    big = classify(runs, (16, 8), [64, 64], page=256, esize=4)
    assert big.cls == VIEW and big.view.sizes == (2, 2, 4, 8)  # [gate; up] x [rank 0, rank 1] blocks
    assert classify(runs, (16, 8), [64, 64], page=256, esize=4, allow_view=False).cls == COPY


def test_rows_nobody_holds_force_a_copy():
    runs = decompose((np.arange(10), np.arange(4)), [(np.arange(8), np.arange(4))])
    assert (runs.holder < 0).any()
    assert classify(runs, (10, 4), [32], page=64, esize=4).cls == COPY


def test_compress_runs_groups_strided_copies():
    runs = Runs(dst=np.array([0, 8, 16, 24]), holder=np.array([0, 1, 0, 1]), src=np.array([0, 0, 8, 8]),
                length=np.array([8, 8, 8, 8]))
    assert compress_runs(runs) == [(0, 2, 8, 0, 16, 0, 8), (1, 2, 8, 8, 16, 0, 8)]


@pytest.mark.parametrize("seed", range(5))
def test_assignment_is_optimal(seed):
    w = np.random.default_rng(seed).integers(0, 10, (6, 6)).astype(float)
    best = max(sum(w[i, p[i]] for i in range(6)) for p in itertools.permutations(range(6)))
    got = max_weight_assignment(w)
    assert sorted(got) == list(range(6))
    assert sum(w[i, got[i]] for i in range(6)) == best
