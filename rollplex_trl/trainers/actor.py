"""The actor's shared prefix inside RollplexGRPOTrainer: once per prompt per gradient-accumulation window.

The policy's weights change only at the optimizer step, so within a window one prefix forward per prompt (vision
tower included) serves all of its completions, whichever micro-batch TRL put them in. Suffix backwards accumulate
into leaf copies of the prefix K/V (`detach_prefix`); at the window's end one backward sends the sum through the
prefix graph (`backward_prefix`), before gradient clipping and the optimizer step. Under multi-process DDP these
passes bypass DDP's forward, so the window's gradients are averaged here, as DDP would have.
"""

from __future__ import annotations

import torch

from rollplex_trl.data.prepared import PREPARED_KEY
from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix import backward_prefix, detach_prefix
from rollplex_trl.prefix.batch import ActorPrefix, group_by_prompt, rows_to_prompts, run_prefix
from rollplex_trl.rollout.layout import group_into_buckets


class ActorPrefixMixin:
    """Mixed into RollplexGRPOTrainer (before GRPOTrainer); the window bookkeeping lives in its training_step."""

    def _actor_prefix_for(self, model, inputs: dict, rows: list[PreparedPrompt] | None):
        """The window's prefix for this micro-batch's rows, building it for every micro-batch of the window that
        the current generation buffer serves (TRL scatters a prompt's G completions over them).

        Why this shape: the policy's weights change only at the optimizer step, so within a window one prefix
        forward per prompt serves all its completions, whichever micro-batch TRL put them in. Suffix backwards
        accumulate into leaf copies of the prefix K/V (`detach_prefix`); `_finish_actor_prefix` sends the sum
        through the prefix graph once, before gradient clipping and the optimizer step. TRL's loss normalisation
        per micro-batch is untouched, so every loss_type keeps its semantics.
        """
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        for actor in self._actor_prefix:
            try:
                return actor, rows_to_prompts(actor, prompt_ids, prompt_mask, rows)
            except KeyError:
                continue
        actor = self._build_actor_prefix(model)
        self._actor_prefix.append(actor)
        if self.memory_ledger is not None:
            self.memory_ledger.sample()  # the boundary state is largest right after it is built
        return actor, rows_to_prompts(actor, prompt_ids, prompt_mask, rows)

    def _build_actor_prefix(self, model) -> ActorPrefix:
        pre = self._take_precomputed("actor")  # built in the decode window at the same weights (trainers/overlap.py)
        if pre is not None:
            leaf_state, outputs = detach_prefix(pre.state)
            return ActorPrefix(window=self.state.global_step, key_to_prompt={k: i for i, k in enumerate(pre.keys)},
                               leaf_state=leaf_state, outputs=outputs)
        spg = self.args.steps_per_generation
        generate_every = spg * self.num_iterations
        # micro-batches of this window still to come that the current buffer serves (a later generation may start
        # inside a long window; its prompts get their own prefix when they arrive)
        count = min(self._window_steps_left, generate_every - self._step % generate_every)
        batches = [self._buffered_inputs[(self._step + i) % spg] for i in range(count)]
        prompt_ids = torch.cat([_pad_left(b["prompt_ids"], max(x["prompt_ids"].size(1) for x in batches),
                                          self._tokenizer.pad_token_id) for b in batches])
        prompt_mask = torch.cat([_pad_left(b["prompt_mask"], prompt_ids.size(1), 0) for b in batches])
        rows = None
        if batches[0].get(PREPARED_KEY) is not None:
            rows = [r for b in batches for r in b[PREPARED_KEY]]
        groups = group_by_prompt(prompt_ids, prompt_mask, rows)
        first = groups.first_row
        with self.accelerator.autocast():
            state = run_prefix(self.accelerator.unwrap_model(model), prompt_ids[first], prompt_mask[first],
                               [rows[r] for r in first] if rows is not None else None, keep_graph=True)
        leaf_state, outputs = detach_prefix(state)
        return ActorPrefix(window=self.state.global_step, key_to_prompt={k: i for i, k in enumerate(groups.keys)},
                           leaf_state=leaf_state, outputs=outputs)

    def _finish_actor_prefix(self) -> None:
        for actor in self._actor_prefix:
            backward_prefix(actor.outputs, actor.leaf_state)
        self._actor_prefix = []

    def _average_gradients_across_processes(self) -> None:
        """Average every trainable parameter's gradient over the processes, as DDP's reducer would have.

        The shared actor pass runs on the unwrapped model, so DDP's gradient hooks never fire (its reducer only acts
        after a forward through the wrapper). Averaging is linear, so gradients DDP did reduce within the window (a
        micro-batch that took TRL's own path) stay correct: they are equal on every process already. Missing
        gradients count as zeros on every process, so all processes reduce the same tensors in the same order.
        """
        params = [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]
        world = self.accelerator.num_processes
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
