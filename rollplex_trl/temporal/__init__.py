"""Video-R1's T-GRPO and length control (arXiv 2503.21776): the temporal bonus for completions that answer better
with the frames in order than shuffled, the length bonus for correct completions of a moderate length, and the
frame shuffle that makes the shuffled copy of a video prompt."""

from rollplex_trl.temporal.bonus import LengthControl, TemporalBonus, length_bonus, temporal_bonus
from rollplex_trl.temporal.shuffle import ShuffledVideo, shuffle_permutation, shuffle_video_pixels, shuffled_prompt

__all__ = ["LengthControl", "ShuffledVideo", "TemporalBonus", "length_bonus", "shuffle_permutation",
           "shuffle_video_pixels", "shuffled_prompt", "temporal_bonus"]
