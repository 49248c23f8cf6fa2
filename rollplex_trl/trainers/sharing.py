"""`PrefixSharing`: whether the shared prefix runs, decided once, in two stages.

1. From the configuration, at construction: the run plan (trainers/plan.py) says whether the shared prefix can run
   exactly here, and which suffix attention path it takes (`cascade` / `concat`).
2. From the data, once: under rollplex_share_prefix="auto", the first rollout's prompts decide whether sharing pays
   (prefix/cost.py `SharingDecision`: the modelled cost of both paths, summed over every process, logged once). A
   forced rollplex_overlap="on" needs the shared prefix, so it is then not left to the cost model. The trainer
   records the choice in the plan (`RunPlan.sharing_pays`).

`on` combines both; it is True until the data decision is made, which happens before any pass that shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollplex_trl.memory.model_dims import dims_from_config
from rollplex_trl.notices import notice
from rollplex_trl.prefix.cost import SharingDecision
from rollplex_trl.trainers.plan import RunPlan


class PrefixSharing:
    def __init__(self, plan: RunPlan, suffix_attention: str, decision: SharingDecision | None,
                 visual_token_ids: set[int]) -> None:
        self.share_scoring = plan.share_scoring
        self.suffix_attention = suffix_attention  # "cascade" or "concat"
        self.decision = decision  # None: nothing left to decide from data
        self.visual_token_ids = visual_token_ids

    @classmethod
    def build(cls, trainer: Any) -> PrefixSharing:
        plan, options, accelerator = trainer.plan, trainer.rollplex, trainer.accelerator
        warn: Callable[[str], None] = notice if accelerator.is_main_process else (lambda message: None)
        config = accelerator.unwrap_model(trainer.model).config
        attention = plan.suffix_attention
        visual = {i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
                  if i is not None}
        decision = None
        if options["rollplex_share_prefix"] == "auto" and plan.share_scoring:
            if options["rollplex_overlap"] == "on":  # forced on: it holds, so auto may not take its window away
                warn("rollplex_share_prefix=auto: on, not left to the cost model: rollplex_overlap='on' runs the "
                     "prefix work in the decode window, which needs the shared prefix")
            else:
                def reduce_sums(values: list[float]) -> list[float]:
                    if accelerator.num_processes == 1:
                        return values
                    sums = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
                    return accelerator.reduce(sums, "sum").tolist()

                decision = SharingDecision(
                    dims_from_config(config, getattr(config, "model_type", "model")), attention=attention,
                    group_size=trainer.num_generations, completion_bound=trainer.max_completion_length,
                    reduce_sums=reduce_sums, warn=warn)
        return cls(plan, attention, decision, visual)

    @property
    def on(self) -> bool:
        choice = self.decision.choice if self.decision is not None else None
        return self.share_scoring and (choice is None or choice.share)

    def decide(self, prompt_ids: list[list[int]]) -> bool | None:
        """Make the data decision from these prompts if it is still open: whether sharing pays, or None when there
        was nothing left to decide."""
        if self.decision is None or self.decision.decided:
            return None
        visual = self.visual_token_ids
        choice = self.decision.decide([len(ids) for ids in prompt_ids],
                                      [sum(1 for t in ids if t in visual) for ids in prompt_ids])
        return choice.share

    def decide_from_mask(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> bool | None:
        if self.decision is None or self.decision.decided:
            return None
        return self.decide([ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)])
