"""The actor's shared prefix: once per prompt per gradient-accumulation window, its gradient sent back once.

The policy's weights change only at the optimizer step, so within a window one prefix forward per prompt (vision
tower included) serves all of its completions, whichever micro-batch TRL put them in. Suffix backwards accumulate
into leaf copies of the prefix K/V (`detach_prefix`); at the window's end one backward sends the sum through the
prefix graph (`backward_prefix`), before gradient clipping and the optimizer step. TRL's loss normalisation per
micro-batch is untouched, so every loss_type keeps its semantics. Under multi-process DDP these passes bypass DDP's
forward (its reducer never fires), so the window's gradients are averaged here, as DDP would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.memory.storage import group_into_buckets
from rollplex_trl.prefix.batch import ActorPrefix, Precomputed, group_by_prompt, rows_to_prompts, run_prefix
from rollplex_trl.prefix.forward import backward_prefix, detach_prefix

# Batches of the window that the current generation buffer serves: (prompt_ids, prompt_mask, prepared rows or None)
WindowPrompts = list[tuple[torch.Tensor, torch.Tensor, Sequence[PreparedPrompt] | None]]


class ActorWindow:
    """The policy's prefixes of the current gradient-accumulation window and the window's bookkeeping.

    `autocast` is the trainer's mixed-precision context (the prefix runs outside the model's wrapped forward);
    `average_across_processes` is set under multi-process DDP; `on_built` is called after a prefix is built (the
    memory ledger samples then: the boundary state is largest right after it is built).
    """

    def __init__(self, autocast: Callable[[], AbstractContextManager], pad_token_id: int, *,
                 average_across_processes: bool = False, on_built: Callable[[], None] | None = None,
                 build_prefix: Callable[..., object] = run_prefix) -> None:
        self.autocast = autocast
        self.build_prefix = build_prefix  # run_prefix (transformers), or the Megatron backend's run_megatron_prefix
        self.pad_token_id = pad_token_id
        self.average_across_processes = average_across_processes
        self.on_built = on_built
        self.prefixes: list[ActorPrefix] = []
        self.steps_left = 0  # micro-steps of the open window still to run (0: no window open)

    def open(self, accumulation_steps: int) -> None:
        """Called at each micro-step's start: opens a window at the first micro-step of an accumulation window."""
        if self.steps_left == 0:
            self.steps_left = accumulation_steps

    @property
    def is_open(self) -> bool:
        return self.steps_left > 0

    def prefix_for(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   rows: Sequence[PreparedPrompt] | None, *, window_index: int,
                   window_prompts: Callable[[], WindowPrompts],
                   precomputed: Callable[[], Precomputed | None]) -> tuple[ActorPrefix, torch.Tensor]:
        """The window's prefix for this micro-batch's rows and each row's prompt index, building it for every
        micro-batch of the window that the current generation buffer serves (TRL scatters a prompt's G
        completions over them). `precomputed` gives the state built in the rollout's decode window (same weights),
        if any; otherwise `window_prompts` lists the prompts to build it from."""
        for actor in self.prefixes:
            try:
                return actor, rows_to_prompts(actor, prompt_ids, prompt_mask, rows)
            except KeyError:
                continue
        pre = precomputed()
        batches = window_prompts()
        actor = self._from_precomputed(pre, window_index) if pre is not None else self._build(
            model, batches, window_index)
        actor.rows = sum(ids.size(0) for ids, _, _ in batches)
        self.prefixes.append(actor)
        if self.on_built is not None:
            self.on_built()
        return actor, rows_to_prompts(actor, prompt_ids, prompt_mask, rows)

    def step_done(self, model: torch.nn.Module) -> None:
        """Called after each micro-step: at the window's end, one backward per prefix, then (DDP) the averaging."""
        if self.steps_left == 0:
            return
        self.steps_left -= 1
        if self.steps_left:
            return
        for actor in self.prefixes:
            backward_prefix(actor.outputs, actor.leaf_state)
        self.prefixes = []
        if self.average_across_processes:
            average_gradients(model)

    def boundary_tensors(self) -> list[torch.Tensor]:
        """The tensors the window keeps alive (for the memory ledger)."""
        return [t for a in self.prefixes for t in (*a.leaf_state.kv_tensors(), *a.outputs)]

    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def _from_precomputed(pre: Precomputed, window_index: int) -> ActorPrefix:
        leaf_state, outputs = detach_prefix(pre.state)
        return ActorPrefix(window=window_index, key_to_prompt={k: i for i, k in enumerate(pre.keys)},
                           leaf_state=leaf_state, outputs=outputs)

    def _build(self, model: torch.nn.Module, batches: WindowPrompts, window_index: int) -> ActorPrefix:
        width = max(ids.size(1) for ids, _, _ in batches)
        prompt_ids = torch.cat([_pad_left(ids, width, self.pad_token_id) for ids, _, _ in batches])
        prompt_mask = torch.cat([_pad_left(mask, width, 0) for _, mask, _ in batches])
        rows = [r for _, _, batch_rows in batches for r in batch_rows] if batches[0][2] is not None else None
        groups = group_by_prompt(prompt_ids, prompt_mask, rows)
        first = groups.first_row
        with self.autocast():
            state = self.build_prefix(model, prompt_ids[first], prompt_mask[first],
                                      [rows[r] for r in first] if rows is not None else None, keep_graph=True)
        leaf_state, outputs = detach_prefix(state)
        return ActorPrefix(window=window_index, key_to_prompt={k: i for i, k in enumerate(groups.keys)},
                           leaf_state=leaf_state, outputs=outputs)


def average_gradients(model: torch.nn.Module) -> None:
    """Average every trainable parameter's gradient over the processes, as DDP's reducer would have.

    The shared actor pass runs on the unwrapped model, so DDP's gradient hooks never fire (its reducer only acts
    after a forward through the wrapper). Averaging is linear, so gradients DDP did reduce within the window (a
    micro-batch that took TRL's own path) stay correct: they are equal on every process already. Missing gradients
    count as zeros on every process, so all processes reduce the same tensors in the same order.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    world = torch.distributed.get_world_size()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:  # one flat buffer per dtype and device: the same grouping on every process
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        sizes = [(i, g.numel() * g.element_size()) for i, g in enumerate(grads)]
        for bucket in group_into_buckets(sizes, 64 * 2**20):
            flat = torch.cat([grads[i].reshape(-1) for i in bucket])
            torch.distributed.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for i in bucket:
                grads[i].copy_(flat[offset:offset + grads[i].numel()].view_as(grads[i]))
                offset += grads[i].numel()


def _pad_left(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """Left-pad (rows, w) to (rows, width): micro-batches of one buffer can have different prompt widths."""
    if x.size(1) == width:
        return x
    return torch.cat([x.new_full((x.size(0), width - x.size(1)), value), x], dim=1)
