"""T-GRPO under DDP (2 CPU processes, gloo, torchrun) with every group split over the two processes: the process
holding a group's first row samples its shuffled copy, the others none; the bonus every process applies is Video-R1's
rule on the gathered ordered accuracies and the owner's shuffled ones; with α = 0 the run learns exactly as with the
recipe off."""

from pathlib import Path

import pytest
from test_temporal_trainer import video_r1_bonus

from helpers import run_two_processes

G, S = 4, 2


def _run(checkpoint, out: Path, mode: str, port: int) -> list[dict]:
    return run_two_processes(Path(__file__).with_name("ddp_temporal_worker.py"), [str(checkpoint), str(out), mode],
                             out, f"{mode}-rank*.json", port)


def test_temporal_with_groups_split_over_processes(tiny_vl_path, tmp_path):
    runs = {mode: _run(tiny_vl_path, tmp_path, mode, port)
            for mode, port in (("off", 29591), ("alpha0", 29592), ("on", 29593))}
    keys = ("loss", "grad_norm", "reward")
    for results in runs.values():  # the processes hold the same weights and log the same numbers
        assert results[0]["checksum"] == results[1]["checksum"]
        assert [[r[k] for k in keys] for r in results[0]["logs"]] == [[r[k] for k in keys] for r in results[1]["logs"]]
    for mode in ("alpha0", "on"):  # rank 0 holds each group's first row: it samples the copy, rank 1 none
        assert runs[mode][0]["sampled"] == [1, 1, 1] and runs[mode][1]["sampled"] == [0, 0, 0]
    for x, y in zip(runs["alpha0"][0]["logs"], runs["off"][0]["logs"], strict=True):
        for key in keys:
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), key
    rank0, rank1 = runs["on"]
    fired = 0
    for step, log in enumerate(rank0["logs"]):
        # rank 0 scored its two ordered rows, then the group's shuffled rows; rank 1 its two ordered rows
        ordered = rank0["calls"][2 * step] + rank1["calls"][step]
        shuffled = rank0["calls"][2 * step + 1]
        assert len(ordered) == G and len(shuffled) == S
        bonus = video_r1_bonus(ordered, shuffled, alpha=0.3, mu=0.8)
        fired += any(bonus)
        assert log["rewards/temporal_bonus/mean"] == pytest.approx(sum(bonus) / G, abs=1e-6), step
        assert log["reward"] == pytest.approx(sum(a + b for a, b in zip(ordered, bonus, strict=True)) / G, abs=1e-6)
    assert len(rank1["calls"]) == 3
    assert fired, "the bonus never fired: the test would not see a wrong reduction"


def test_patch_shuffle_reuse_under_ddp(tiny_vl_path, tmp_path):
    """The patch shuffle's feature reuse on the process that owns the group (rank 0 here): the same shuffled
    completions, rewards and updates as the same run without the reuse, on both processes."""
    reuse = _run(tiny_vl_path, tmp_path, "patch", 29594)
    plain = _run(tiny_vl_path, tmp_path, "patch-plain", 29595)
    for a, b in zip(reuse, plain, strict=True):
        assert a["calls"] == b["calls"] and a["checksum"] == pytest.approx(b["checksum"], rel=1e-9)
    assert all(r["rollplex/temporal_vision_reused"] == 1.0 for r in reuse[0]["logs"])
    assert not any("rollplex/temporal_vision_reused" in r for r in plain[0]["logs"])
