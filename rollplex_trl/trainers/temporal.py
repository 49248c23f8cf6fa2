"""`TemporalRecipe`: Video-R1's T-GRPO and length control (rollplex_temporal, rollplex_len_control) in the trainer.

What happens in a training step with the recipe on (docs/temporal.md):

1. Rollout. After the ordered completions are sampled, each video prompt with two or more temporal patches gets a
   shuffled copy (temporal/shuffle.py), and `rollplex_temporal_generations` completions are sampled on it through
   the same rollout engine (shared prefill, shared-prefix decode), under a forked RNG so that the ordered rollout and
   everything after it sample exactly as with the recipe off. A group split across processes is handled by the
   process that holds its first row (its "owner").
2. Rewards. The accuracy reward (`rollplex_temporal_reward`) is computed for the shuffled completions; the bonuses
   (temporal/bonus.py) go into two reward columns of their own, `temporal_bonus` and `length_bonus` (weight 1, logged
   by TRL as `rewards/temporal_bonus/mean` ...), so the reward TRL sums is Video-R1's: accuracy + α·[bonus] + the other
   rewards + the length bonus. Shuffled completions get no log-probs and no loss.

Evaluation (`num_generations_eval`) runs without the recipe, as Video-R1's does.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix.forward import unwrap_model
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore, accepts_encoder_outputs
from rollplex_trl.temporal import LengthControl, ShuffledVideo, TemporalBonus, length_bonus, shuffled_prompt
from rollplex_trl.temporal import temporal_bonus as compute_temporal_bonus

logger = logging.getLogger(__name__)

TEMPORAL_COLUMN, LENGTH_COLUMN = "temporal_bonus", "length_bonus"


def _rng_seed(seed: int, step: int, process_index: int) -> int:
    """The seed of one step's shuffled sampling on one process: reproducible (resume), distinct per step/process."""
    digest = hashlib.sha256(f"rollplex-temporal-sampling:{seed}:{step}:{process_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _placeholder(name: str) -> Callable[..., list[None]]:
    """A reward source TRL calls like any other; it returns None (no value) and the recipe fills the column after
    TRL has gathered the rewards of every process."""
    def column(completions: list, **kwargs: Any) -> list[None]:
        return [None] * len(completions)

    column.__name__ = name
    return column


@dataclass(frozen=True)
class ShuffledGroup:
    """One group's shuffled copy, on the process that owns the group."""

    group: int  # the group's index in the gathered generation batch (row // num_generations)
    first_row: int  # the local row of the group's first completion (its inputs give the reward's keyword arguments)
    row: PreparedPrompt  # the shuffled copy
    how: ShuffledVideo


@dataclass
class ShuffledRollout:
    """The shuffled completions of this process's owned groups, waiting for the rewards."""

    groups: list[ShuffledGroup]
    completion_ids: list[list[int]]  # len(groups) * generations rows, group-major
    generations: int


class TemporalRecipe:
    def __init__(self, options: dict[str, Any], *, temporal: bool, len_control: bool, accuracy_index: int,
                 reward_func_names: list[str], num_generations: int, seed: int, temporal_patch_size: int = 2) -> None:
        self.temporal = temporal  # the run plan's decisions (trainers/plan.py: the refusals are there)
        self.len_control = len_control
        self.bonus = TemporalBonus(alpha=options["rollplex_temporal_alpha"], mu=options["rollplex_temporal_mu"])
        self.length = LengthControl(low=options["rollplex_len_control_min"], high=options["rollplex_len_control_max"],
                                    bonus=options["rollplex_len_control_bonus"])
        self.granularity = options["rollplex_temporal_shuffle"]
        self.generations = options["rollplex_temporal_generations"] or max(1, num_generations // 2)
        self.num_generations = num_generations
        self.seed = seed
        self.temporal_patch_size = temporal_patch_size
        self.accuracy_index = accuracy_index
        self.accuracy_name = reward_func_names[self.accuracy_index]

    @property
    def columns(self) -> list[str]:
        return [name for name, on in ((TEMPORAL_COLUMN, self.temporal), (LENGTH_COLUMN, self.len_control)) if on]

    def placeholders(self) -> list[Callable[..., list[None]]]:
        """The reward sources the trainer appends to TRL's (trl_compat.add_reward_source), one per column."""
        return [_placeholder(name) for name in self.columns]

    # ---- rollout ----------------------------------------------------------------------------------------------------

    def shuffled_groups(self, rows: list[PreparedPrompt], *, process_offset: int, step: int) -> list[ShuffledGroup]:
        """The shuffled copies this process makes: one per group it owns (it holds the group's first row) whose
        prompt has a video of two or more temporal patches. `process_offset`: the index of this process's first
        row in the gathered batch."""
        if not self.temporal:
            return []
        out = []
        for i, row in enumerate(rows):
            global_row = process_offset + i
            if global_row % self.num_generations:
                continue
            made = shuffled_prompt(row, seed=self.seed, step=step, granularity=self.granularity,
                                   temporal_patch_size=self.temporal_patch_size)
            if made is not None:
                out.append(ShuffledGroup(group=global_row // self.num_generations, first_row=i, row=made[0],
                                         how=made[1]))
        return out

    def sample(self, rows: list[PreparedPrompt], *, process_index: int, step: int,
               generate: Callable[[list[list[int]], list[PreparedPrompt], int], list[list[int]]],
               video_store: VideoFeatureStore | None = None) -> ShuffledRollout:
        """Sample the shuffled completions of the groups this process owns. `rows`: this process's generation
        batch (its prepared prompts, in TRL's order); `generate(prompt ids, rows, per_prompt)`: the trainer's rollout
        engine without a decode window, returning completion ids per row. `video_store`: told which copy comes from
        which ordered prompt (temporal-patch granularity), so the copies' prefill can reuse the ordered features."""
        groups = self.shuffled_groups(rows, process_offset=process_index * len(rows), step=step)
        if video_store is not None and self.granularity == "patch":
            for g in groups:
                video_store.derive(g.row, g.how.ordered, g.how.permutations)
        S = self.generations
        shuffled_rows = [g.row for g in groups for _ in range(S)]
        completion_ids: list[list[int]] = []
        if shuffled_rows:
            with self.isolated_rng(_rng_seed(self.seed, step, process_index)):
                completion_ids = generate([list(r.prompt_ids) for r in shuffled_rows], shuffled_rows, S)
            if len(completion_ids) != len(shuffled_rows):
                raise RuntimeError(f"internal error: {len(completion_ids)} shuffled completions for "
                                   f"{len(shuffled_rows)} rows")
        return ShuffledRollout(groups=groups, completion_ids=[list(c) for c in completion_ids], generations=S)

    def before_rollout(self, trainer: Any) -> None:
        """Before the ordered rollout of a training generation batch: at temporal-patch granularity, a store for
        the video features its prefill computes (prefix/vision_reuse.py), which the shuffled copies' prefill
        permutes instead of running the vision tower again. Only the transformers engine's own prefill fills it (vLLM
        encodes inside its engine; a backend's prefill and TRL's generate do not record), and a video it has no
        features for is encoded as usual: the store changes what runs, never the result."""
        if (self.temporal and self.granularity == "patch" and trainer.model.training
                and trainer.vllm_rollout is None and trainer.batch.generation_rows is not None
                and accepts_encoder_outputs(unwrap_model(trainer.accelerator.unwrap_model(trainer.model)).base_model)):
            trainer.batch.video_store = VideoFeatureStore()

    def after_rollout(self, trainer: Any, trl_generate: Callable) -> None:
        """After the ordered rollout of a training generation batch: sample the shuffled copies at the same weights
        through the trainer's rollout engine (`TrainerRollout.extra_samples`) into `trainer.batch.shuffled`."""
        rows = trainer.batch.generation_rows
        if not (self.temporal and trainer.model.training and rows is not None):
            return
        store = trainer.batch.video_store
        started = time.perf_counter()
        try:
            trainer.batch.shuffled = self.sample(
                rows, process_index=trainer.accelerator.process_index, step=trainer.state.global_step,
                generate=lambda ids, shuffled_rows, per_prompt: trainer.rollout.extra_samples(
                    ids, shuffled_rows, per_prompt, trl_generate), video_store=store)
        finally:
            trainer.batch.video_store = None  # the ordered clips' features are not needed after this
        trainer._record("rollplex/temporal_rollout_s", time.perf_counter() - started)
        if store is not None:
            videos = sum(len(g.how.permutations) for g in trainer.batch.shuffled.groups)
            if videos:  # of the shuffled copies' videos, the share whose tower pass was a permutation of features
                trainer._record("rollplex/temporal_vision_reused", store.reused / videos)

    @staticmethod
    @contextlib.contextmanager
    def isolated_rng(seed: int) -> Iterator[None]:
        """Sampling of the shuffled completions draws from its own seeded RNG; the global RNG state (CPU and the
        current CUDA device) is restored afterwards, so the ordered rollouts of this and later steps sample exactly
        as with the recipe off."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    # ---- rewards ----------------------------------------------------------------------------------------------------

    def shuffled_accuracy(self, pending: ShuffledRollout, accuracy_func: Callable, inputs: list[dict], prompts: list,
                          completions: list, trainer_state: Any) -> list[float]:
        """The accuracy reward of the shuffled completions (decoded into `completions`, group-major), with each
        group's keyword arguments taken from its ordered first row (the same answer, problem type, ...)."""
        G = pending.generations
        keys = [k for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")] if inputs else []
        kwargs: dict[str, Any] = {k: [inputs[g.first_row][k] for g in pending.groups for _ in range(G)] for k in keys}
        values = accuracy_func(
            prompts=[prompts[g.first_row] for g in pending.groups for _ in range(G)], completions=completions,
            completion_ids=pending.completion_ids, trainer_state=trainer_state,
            log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None, **kwargs)
        if len(values) != len(completions):
            raise ValueError(f"reward function '{self.accuracy_name}' returned {len(values)} rewards for "
                             f"{len(completions)} shuffled completions")
        return [float("nan") if v is None else float(v) for v in values]

    def fill_columns(self, rewards_per_func: torch.Tensor, lengths: torch.Tensor, shuffled: torch.Tensor,
                     has_shuffled: torch.Tensor, first_column: int) -> dict[str, float]:
        """Write the bonus columns of the gathered `rewards_per_func` (N, F) in place from the accuracy column,
        the gathered completion `lengths` (N,) and the groups' shuffled accuracies (N/G, S) with `has_shuffled`
        (N/G,). `first_column`: the index of the recipe's first column. Returns metrics."""
        G = self.num_generations
        accuracy = rewards_per_func[:, self.accuracy_index].view(-1, G)
        column = first_column
        metrics: dict[str, float] = {}
        if self.temporal:
            bonus, fired = compute_temporal_bonus(accuracy, shuffled, has_shuffled, self.bonus)
            rewards_per_func[:, column] = bonus.reshape(-1)
            groups = int(has_shuffled.sum())
            metrics["rollplex/temporal_groups"] = float(groups)
            metrics["rollplex/temporal_unshuffled_groups"] = float(has_shuffled.numel() - groups)
            # Video-R1's condition p >= mu * p~ held / a completion of the group was paid the bonus (needs one correct)
            paid = (bonus > 0).any(dim=1) & has_shuffled
            metrics["rollplex/temporal_condition_rate"] = float(fired.sum()) / groups if groups else 0.0
            metrics["rollplex/temporal_bonus_rate"] = float(paid.sum()) / groups if groups else 0.0
            metrics["rollplex/temporal_shuffled_completions"] = float(groups * shuffled.size(1))
            if groups:
                metrics["rollplex/temporal_shuffled_accuracy"] = float(torch.nanmean(shuffled[has_shuffled]))
                metrics["rollplex/temporal_ordered_accuracy"] = float(torch.nanmean(accuracy[has_shuffled]))
            column += 1
        if self.len_control:
            paid = length_bonus(accuracy, lengths.view(-1, G).to(accuracy.device), self.length).reshape(-1)
            rewards_per_func[:, column] = paid
            metrics["rollplex/len_control_rate"] = float((paid > 0).float().mean()) if paid.numel() else 0.0
        return metrics

    def rewards(self, trainer: Any, inputs: list[dict], prompts: list, completion_ids_list: list[list[int]],
                rewards_per_func: torch.Tensor) -> dict[str, float]:
        """Fill the recipe's columns of TRL's gathered `rewards_per_func` (in place) for this generation batch;
        every process calls it (the shuffled accuracies and the lengths are reduced over processes). Returns
        metrics."""
        from rollplex_trl import trl_compat

        accelerator = trainer.accelerator
        device = rewards_per_func.device
        G, S = self.num_generations, self.generations
        groups = rewards_per_func.size(0) // G
        shuffled = torch.zeros(groups, S, device=device)
        has = torch.zeros(groups, device=device)
        pending: ShuffledRollout | None = trainer.batch.shuffled
        if pending is not None and pending.groups:
            ordered_prompts = [prompts[g.first_row] for g in pending.groups for _ in range(S)]
            completions = trl_compat.decode_completions(
                trainer, ordered_prompts, [list(g.row.prompt_ids) for g in pending.groups for _ in range(S)],
                pending.completion_ids)
            values = self.shuffled_accuracy(pending, trainer.reward_funcs[self.accuracy_index], inputs, prompts,
                                            completions, trainer.state)
            for k, g in enumerate(pending.groups):
                shuffled[g.group] = torch.tensor(values[k * S:(k + 1) * S], device=device)
                has[g.group] = 1.0
        if accelerator.num_processes > 1:
            shuffled, has = accelerator.reduce(shuffled, "sum"), accelerator.reduce(has, "sum")
        lengths = torch.tensor([len(ids) for ids in completion_ids_list], device=device)
        lengths = accelerator.gather(lengths) if accelerator.num_processes > 1 else lengths
        first_column = len(trainer.reward_func_names) - len(self.columns)
        metrics = self.fill_columns(rewards_per_func, lengths, shuffled, has > 0, first_column)
        # a row every user reward left unscored (None) stays unscorable for TRL: no bonus turns it into a 0 reward
        unscored = torch.isnan(rewards_per_func[:, :first_column]).all(dim=1)
        rewards_per_func[unscored, first_column:] = float("nan")
        return metrics

    @classmethod
    def build(cls, trainer: Any) -> TemporalRecipe | None:
        """The recipe for this trainer, its reward columns added to TRL's; None when both switches are off."""
        from rollplex_trl import trl_compat

        plan = trainer.plan
        if not (plan.temporal or plan.len_control):
            return None
        vision = getattr(trainer.accelerator.unwrap_model(trainer.model).config, "vision_config", None)
        recipe = cls(trainer.rollplex, temporal=plan.temporal, len_control=plan.len_control,
                     accuracy_index=plan.temporal_reward_index, reward_func_names=list(trainer.reward_func_names),
                     num_generations=trainer.num_generations, seed=trainer.args.seed,
                     temporal_patch_size=int(getattr(vision, "temporal_patch_size", 2) or 2))
        for column in recipe.placeholders():
            trl_compat.add_reward_source(trainer, column, column.__name__)
        return recipe
