"""The start-up banner: what this run is and what Rollplex decided for it, printed once by the main process.

    [rollplex] 2 processes: data parallel 2 x tensor parallel 1 · backend hf · rollout transformers generate (shared
    prefill) · precision bf16
    [rollplex] shared prefix: auto, decided at the first rollout (scoring, actor) · suffix attention cascade · overlap
    auto · shared decode auto · memory off · audit every 200 steps (2 rows) · T-GRPO off · length control off

`auto` choices that depend on the data are decided at the first rollout and logged then, once.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


def banner_lines(trainer: Any) -> list[str]:
    """The banner's lines for `trainer` (a RollplexGRPOTrainer after construction)."""
    options, support = trainer.rollplex, trainer.plan
    processes = trainer.accelerator.num_processes
    tp = options["rollplex_tensor_parallel_size"] if trainer.backend.name == "megatron" else 1
    if trainer.use_vllm:
        rollout = f"vLLM ({trainer.args.vllm_mode})"
    elif support.shared_prefill:
        rollout = "transformers generate (shared prefill)"
    else:
        rollout = "transformers generate (TRL's path)"
    precision = {"no": "fp32"}.get(trainer.accelerator.mixed_precision, trainer.accelerator.mixed_precision)
    world = (f"{processes} process{'es' if processes > 1 else ''}: data parallel {processes // tp} x tensor parallel "
             f"{tp}")
    shared = [name for name, on in (("scoring", support.share_scoring), ("actor", support.share_actor)) if on]
    if not shared:
        prefix = "off"
    elif trainer.sharing.decision is not None:
        prefix = f"auto, decided at the first rollout ({', '.join(shared)})"
    else:
        prefix = f"on ({', '.join(shared)})"
    audit = trainer.audit
    audited = f"every {audit.spec.every} steps ({audit.spec.rows} rows)" if audit is not None else "off"
    temporal = trainer.temporal
    decisions = [f"shared prefix: {prefix}", f"suffix attention {trainer.sharing.suffix_attention}",
                 f"overlap {options['rollplex_overlap'] if support.overlap_window else 'off'}",
                 f"shared decode {options['rollplex_shared_decode'] if support.shared_prefill else 'off'}",
                 f"memory {'on' if trainer.phase_memory is not None else 'off'}", f"audit {audited}",
                 f"T-GRPO {'on' if temporal is not None and temporal.temporal else 'off'}",
                 f"length control {'on' if temporal is not None and temporal.len_control else 'off'}"]
    return [f"[rollplex] {world} · backend {trainer.backend.name} · rollout {rollout} · precision {precision}",
            "[rollplex] " + " · ".join(decisions)]


class StartupBanner(TrainerCallback):
    """Prints `banner_lines` once, on the main process, when training begins."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.printed = False

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.printed and state.is_world_process_zero:
            print("\n".join(banner_lines(self.trainer)), flush=True)
        self.printed = True
