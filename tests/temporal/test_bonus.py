"""T-GRPO's temporal bonus and length control against an independent re-implementation of Video-R1's formula.

The reference below is written the way Video-R1's trainer computes it (one device batch = one prompt: the ordered
completions' accuracy column, the shuffled completions' accuracy column, a Python loop over the correct indices),
applied to each group separately, then compared with the vectorised per-group code."""

import math

import pytest
import torch

from rollplex_trl.temporal import LengthControl, TemporalBonus, length_bonus, temporal_bonus


def video_r1_rewards(accuracy, shuffled, lengths, *, temporal=True, len_control=True, alpha=0.3, mu=0.8,
                     low=320, high=512, bonus=0.2):
    """One group: the total reward per ordered completion as Video-R1 computes it, with a single reward function
    (accuracy), so rewards_per_func[:, 0] is the accuracy."""
    acc = list(accuracy)
    rewards = list(acc)
    if temporal and shuffled is not None:
        acc_mean = sum(acc) / len(acc)
        shuffled_mean = sum(shuffled) / len(shuffled)
        if acc_mean >= mu * shuffled_mean:
            rewards = [r + alpha if a > 0.1 else r for r, a in zip(rewards, acc)]
    if len_control:
        selected = [i for i, a in enumerate(acc) if a > 0.1]
        if len(selected) > 1:
            for i in selected:
                if low <= lengths[i] <= high:
                    rewards[i] += bonus
    return rewards


def ours(accuracy, shuffled, lengths, has_shuffled, *, temporal=True, len_control=True):
    acc = torch.tensor(accuracy, dtype=torch.float32)
    shuf = torch.tensor(shuffled, dtype=torch.float32)
    total = acc.clone()
    if temporal:
        extra, _ = temporal_bonus(acc, shuf, torch.tensor(has_shuffled))
        total += extra
    if len_control:
        total += length_bonus(acc, torch.tensor(lengths))
    return total


CASES = {
    # name: (ordered accuracy, shuffled accuracy, lengths)
    "p_tilde_zero": ([1.0, 0.0, 1.0, 0.0], [0.0, 0.0], [400, 400, 100, 600]),
    "p_zero": ([0.0, 0.0, 0.0, 0.0], [1.0, 0.0], [400, 400, 400, 400]),
    "both_zero": ([0.0, 0.0, 0.0, 0.0], [0.0, 0.0], [400, 400, 400, 400]),
    "all_correct": ([1.0, 1.0, 1.0, 1.0], [1.0, 1.0], [320, 512, 319, 513]),
    "none_correct": ([0.05, 0.1, 0.0, 0.0], [0.0, 0.0], [400, 400, 400, 400]),
    "one_correct": ([1.0, 0.0, 0.0, 0.0], [0.0, 0.0], [400, 400, 400, 400]),
    "shuffled_better": ([1.0, 0.0, 0.0, 0.0], [1.0, 1.0], [400, 400, 400, 400]),
    "at_the_margin": ([1.0, 1.0, 0.0, 0.0], [0.625, 0.625], [400, 400, 400, 400]),  # 0.5 >= 0.8*0.625 exactly
    "just_below": ([1.0, 1.0, 0.0, 0.0], [0.75, 0.75], [400, 400, 400, 400]),  # 0.5 < 0.8*0.75
    "partial_credit": ([0.5, 0.2, 0.11, 0.09], [0.3, 0.1], [330, 500, 10, 400]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_group_matches_video_r1(name):
    accuracy, shuffled, lengths = CASES[name]
    expected = video_r1_rewards(accuracy, shuffled, lengths)
    got = ours([accuracy], [shuffled], [lengths], [True])[0]
    assert got.tolist() == pytest.approx(expected, abs=1e-6)


def test_batches_of_groups_match_video_r1_per_group():
    """Random groups, several per batch, some without a shuffled copy (image/text prompts, single-patch clips)."""
    gen = torch.Generator().manual_seed(0)
    B, G, S = 64, 8, 4
    # values exact in float32 (0.1-like values would compare differently in float32, as Video-R1's tensors do,
    # and in this reference's Python floats)
    levels = torch.tensor([0.0, 0.0, 0.0, 0.25, 0.5, 1.0])
    accuracy = levels[torch.randint(0, len(levels), (B, G), generator=gen)]
    shuffled = (torch.rand(B, S, generator=gen) < 0.4).float()
    lengths = torch.randint(250, 600, (B, G), generator=gen)
    has = torch.rand(B, generator=gen) < 0.7
    got = ours(accuracy.tolist(), shuffled.tolist(), lengths.tolist(), has.tolist())
    for b in range(B):
        expected = video_r1_rewards(accuracy[b].tolist(), shuffled[b].tolist() if has[b] else None,
                                    lengths[b].tolist())
        assert got[b].tolist() == pytest.approx(expected, abs=1e-6), b


def test_fired_flags_and_constants():
    acc = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    shuf = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    extra, fired = temporal_bonus(acc, shuf, torch.tensor([True, True, False]), TemporalBonus(alpha=0.5, mu=0.4))
    # group 0: 0.5 >= 0.4*1.0 fires; group 1: 0 >= 0 fires but nothing is correct; group 2: no shuffled copy
    assert fired.tolist() == [True, True, False]
    assert extra.tolist() == [[0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]
    lengths = torch.tensor([[10, 20], [10, 20], [10, 20]])
    got = length_bonus(acc, lengths, LengthControl(low=10, high=15, bonus=0.7))
    assert got.tolist() == [[0.0, 0.0], [0.0, 0.0], [pytest.approx(0.7), 0.0]]


def test_nan_accuracy_is_not_correct_and_left_out_of_the_means():
    """TRL lets a reward function return None (NaN): such a completion is not correct and not in p or p̃."""
    acc = torch.tensor([[1.0, math.nan, 0.0, 1.0]])
    shuf = torch.tensor([[1.0, math.nan]])
    extra, fired = temporal_bonus(acc, shuf, torch.tensor([True]))
    assert not fired.item()  # p = 2/3 < 0.8 * 1.0
    assert extra.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert length_bonus(acc, torch.full((1, 4), 400)).tolist() == [pytest.approx([0.2, 0.0, 0.0, 0.2])]
