"""Checkpoints: the model's own key conversion, the data order of later epochs, and crash safety.

transformers 5.x saves some models under their legacy parameter names (`save_pretrained` reverses the model's
checkpoint conversion mapping: Qwen2.5-VL writes `model.layers.*` and `visual.*` for what it holds as
`model.language_model.layers.*` and `model.visual.*`), but `Trainer._load_from_checkpoint` reads those files with a
plain, non-strict `load_state_dict`. For such models nothing is loaded and training silently restarts from the
initial weights (seen with transformers 5.24 and TRL 1.16's own GRPOTrainer, which is affected the same way: the
resumed run's KL dropped to a tenth of the uninterrupted run's). `load_model_weights` loads them through
`from_pretrained`, which applies the conversion, and copies them with a strict `load_state_dict`, so a mismatch
raises instead of passing silently. It is used only when the file's names differ from the model's; when they match,
the Trainer's own loading runs unchanged.

Data order: TRL's `RepeatSampler` draws one permutation per epoch from a generator seeded once, and has no
`set_epoch`, so a run resumed in epoch e starts the generator afresh and replays epoch 0's order instead of epoch
e's. `ResumableRepeatSampler` adds `set_epoch` (which the Trainer calls at every epoch): it reseeds and draws the e
earlier permutations, so every epoch's order is the uninterrupted run's, resumed or not.

Crash safety (checkpoints written atomically, resume=True taking the newest complete one, an incomplete one named
with its file and problem): see "Crash-safe checkpoints" below.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from rollplex_trl.notices import notice
from rollplex_trl.trl_compat import RepeatSampler

logger = logging.getLogger(__name__)

_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"


def saved_parameter_names(checkpoint_dir: str) -> set[str] | None:
    """Tensor names in the checkpoint's safetensors weights, or None if it has none (PEFT adapters, FSDP, .bin)."""
    index = os.path.join(checkpoint_dir, _SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(checkpoint_dir, _SAFE_WEIGHTS)
    if os.path.isfile(single):
        if problem := safetensors_problem(single):  # safetensors' own error names no file
            raise CheckpointError(f"Cannot load the weights of {checkpoint_dir}: {problem}")
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def needs_converted_load(model: torch.nn.Module, checkpoint_dir: str) -> bool:
    """Whether the checkpoint's weight names differ from `model`'s (then the Trainer's plain load would miss them)."""
    saved = saved_parameter_names(checkpoint_dir)
    if saved is None or not hasattr(model, "config") or hasattr(model, "peft_config"):
        return False
    return saved != set(model.state_dict())


def load_model_weights(model: torch.nn.Module, checkpoint_dir: str) -> None:
    """Load `checkpoint_dir`'s weights into `model` through `from_pretrained` (key conversion), strictly."""
    dtype = next(model.parameters()).dtype
    fresh = type(model).from_pretrained(checkpoint_dir, dtype=dtype, device_map="cpu")
    result = model.load_state_dict(fresh.state_dict(), strict=True)
    del fresh
    missing = "" if not result.missing_keys else f"; missing: {result.missing_keys[:5]}"
    notice(f"resumed the model weights from {checkpoint_dir} through from_pretrained (the file uses the model's "
           f"legacy parameter names, which Trainer's own loading would skip){missing}")


class ResumableRepeatSampler(RepeatSampler):
    """TRL's RepeatSampler whose epoch-e order does not depend on whether epochs 0..e-1 ran in this process."""

    @classmethod
    def from_sampler(cls, sampler: RepeatSampler) -> ResumableRepeatSampler:
        resumable = cls.__new__(cls)
        resumable.__dict__.update(vars(sampler))  # same data, sizes, seed and generator: TRL builds, we extend
        return resumable

    def set_epoch(self, epoch: int) -> None:
        if not self.shuffle or self.seed is None:  # sequential, or unseeded (not reproducible anyway)
            return
        self.generator.manual_seed(self.seed)
        for _ in range(epoch):  # the permutations the earlier epochs drew, one per epoch (RepeatSampler.__iter__)
            torch.randperm(self.num_samples, generator=self.generator)


# ---- Crash-safe checkpoints ----
#
# transformers 5.24 writes `checkpoint-N` in place, file after file, and `train(resume_from_checkpoint=True)` takes the
# highest-numbered `checkpoint-*` folder whatever it holds. A job killed while saving (preemption, OOM killer) leaves a
# folder with only `config.json`, and an auto-restarting job then fails on it at every restart; a truncated weights file
# fails with a safetensors header error that names no file; a checkpoint without `optimizer.pt` resumes silently with a
# fresh optimizer. Here:
# - `CheckpointStaging.staged` (around `Trainer._save_checkpoint`) makes `_get_output_dir` point into `tmp-checkpoint-N`
#   while the Trainer writes, so its own code (and TRL's) writes `tmp-checkpoint-N/checkpoint-N`; once everything is
#   written (and fsynced) the main process renames it to `checkpoint-N`, the other ranks waiting at barriers. Rotation
#   (`save_total_limit`), the best checkpoint's path and hub pushes then run on the final folder.
# - `resolve_resume` (at the start of `train`) turns `resume_from_checkpoint=True` into the newest COMPLETE checkpoint,
#   warning for each newer one it skips, and checks an explicitly named one, raising with the file and the problem.

STAGING_PREFIX = "tmp-checkpoint"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_STAGING_RE = re.compile(rf"^{STAGING_PREFIX}-(\d+)$")
_OPTIMIZER, _OPTIMIZER_BIN, _SCHEDULER, _STATE = "optimizer.pt", "optimizer.bin", "scheduler.pt", "trainer_state.json"
_WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (names the folder, the file and the problem)."""


def safetensors_problem(path: str) -> str | None:
    """What is wrong with a safetensors file (unreadable or truncated header, missing tensor data), or None."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: truncated safetensors file ({size} bytes, no header)"
            n = struct.unpack("<Q", head)[0]
            if 8 + n > size:
                return f"{path}: truncated safetensors header ({size} bytes, the header alone needs {8 + n})"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"{path}: unreadable safetensors header ({e})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and "data_offsets" in v]
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        return f"{path}: truncated safetensors file ({size} bytes, its header describes {expected})"
    return None


def torch_file_problem(path: str) -> str | None:
    """What is wrong with a `torch.save` file (zip format: a truncated one has no central directory), or None."""
    try:
        with zipfile.ZipFile(path):
            return None
    except (OSError, zipfile.BadZipFile) as e:
        return f"{path}: unreadable or truncated torch file ({e})"


def _file_problem(path: str) -> str | None:
    return safetensors_problem(path) if path.endswith(".safetensors") else torch_file_problem(path)


def checkpoint_problems(checkpoint_dir: str, *, require_optimizer: bool = True) -> list[str]:
    """Why `checkpoint_dir` cannot be resumed from (each problem names its file); empty when it is complete.

    Complete: weights that parse (safetensors header readable and the data it describes present, an index's shards
    all present and sound, torch files readable), `trainer_state.json`, and with `require_optimizer` (not
    `save_only_model`) `optimizer.pt` and `scheduler.pt`. DeepSpeed (`global_step*`) and FSDP (`pytorch_model_fsdp*`,
    `optimizer*`) folders count as present, unparsed.
    """
    if not os.path.isdir(checkpoint_dir):
        return [f"{checkpoint_dir}: no such folder"]
    problems = []
    entries = os.listdir(checkpoint_dir)
    sharded_dirs = [e for e in entries if os.path.isdir(os.path.join(checkpoint_dir, e))]
    weights = [os.path.join(checkpoint_dir, e) for e in _WEIGHT_FILES if e in entries]
    for index_name in (e for e in _INDEX_FILES if e in entries):
        index = os.path.join(checkpoint_dir, index_name)
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{index}: unreadable weights index ({e})")
            continue
        weights.append(index)
        for shard in shards:
            path = os.path.join(checkpoint_dir, shard)
            if not os.path.isfile(path):
                problems.append(f"{path}: missing (listed in {index_name})")
            elif problem := _file_problem(path):
                problems.append(problem)
    for path in weights:
        if not path.endswith(".json") and (problem := _file_problem(path)):
            problems.append(problem)
    if not weights and not any(d.startswith(("global_step", "pytorch_model_fsdp")) for d in sharded_dirs):
        problems.append(f"{checkpoint_dir}: no model weights (model.safetensors, adapter_model.safetensors, "
                        f"a sharded index, ...); found only {sorted(entries)}")
    state = os.path.join(checkpoint_dir, _STATE)
    try:
        with open(state) as f:
            json.load(f)
    except FileNotFoundError:
        problems.append(f"{state}: missing")
    except (OSError, ValueError) as e:
        problems.append(f"{state}: unreadable ({e})")
    if require_optimizer:
        problems += optimizer_problems(checkpoint_dir, entries, sharded_dirs)
    return problems


def optimizer_problems(checkpoint_dir: str, entries: list[str] | None = None,
                       sharded_dirs: list[str] | None = None) -> list[str]:
    """Missing or unreadable optimizer/scheduler state (what `Trainer._load_optimizer_and_scheduler` silently skips)."""
    entries = os.listdir(checkpoint_dir) if entries is None else entries
    sharded_dirs = sharded_dirs if sharded_dirs is not None else [
        e for e in entries if os.path.isdir(os.path.join(checkpoint_dir, e))]
    if any(d.startswith("global_step") for d in sharded_dirs):  # DeepSpeed keeps its optimizer there
        return []
    problems = []
    present = [e for e in (_OPTIMIZER, _OPTIMIZER_BIN) if e in entries]
    if not present and not any("optimizer" in d for d in sharded_dirs):  # FSDP: optimizer_0/
        problems.append(f"{os.path.join(checkpoint_dir, _OPTIMIZER)}: missing (the optimizer state)")
    for name in present + ([_SCHEDULER] if _SCHEDULER in entries else []):
        if problem := torch_file_problem(os.path.join(checkpoint_dir, name)):
            problems.append(problem)
    if _SCHEDULER not in entries:
        problems.append(f"{os.path.join(checkpoint_dir, _SCHEDULER)}: missing (the learning-rate scheduler state)")
    return problems


def _step(name: str, pattern: re.Pattern) -> int | None:
    match = pattern.match(name)
    return int(match.group(1)) if match else None


def _listing(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        return []


def remove_staging_leftovers(output_dir: str) -> None:
    """Delete `tmp-checkpoint-N` folders, what a save that was killed leaves behind (never resumed from)."""
    for name in _listing(output_dir):
        path = os.path.join(output_dir, name)
        if _step(name, _STAGING_RE) is not None and os.path.isdir(path):
            logger.warning("rollplex: removing %s, the leftover of a checkpoint save that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)


def newest_complete_checkpoint(output_dir: str, *, require_optimizer: bool = True) -> str:
    """The highest-numbered complete `checkpoint-N` in `output_dir`; warns for each newer incomplete one it skips,
    raises `CheckpointError` listing what it found if there is none."""
    names = _listing(output_dir)
    checkpoints = sorted(((_step(n, _CHECKPOINT_RE), n) for n in names
                          if _step(n, _CHECKPOINT_RE) is not None and os.path.isdir(os.path.join(output_dir, n))),
                         reverse=True)
    skipped = []
    for _, name in checkpoints:
        path = os.path.join(output_dir, name)
        problems = checkpoint_problems(path, require_optimizer=require_optimizer)
        if not problems:
            return path
        skipped.append(f"{name}: " + "; ".join(problems))
        logger.warning("rollplex: resume_from_checkpoint=True skips %s, which is incomplete: %s", path,
                       "; ".join(problems))
    leftovers = [n for n in names if _step(n, _STAGING_RE) is not None]
    found = "\n  ".join(skipped + [f"{n}: an interrupted save (ignored)" for n in leftovers]) or "nothing"
    raise CheckpointError(
        f"resume_from_checkpoint=True: no complete checkpoint in {output_dir}. Found:\n  {found}\n"
        "Start without resume_from_checkpoint, or pass the path of a checkpoint that has its weights, "
        f"{_STATE}{'' if not require_optimizer else f', {_OPTIMIZER} and {_SCHEDULER}'}.")


def _resume_needs_optimizer(trainer) -> bool:
    return not trainer.args.save_only_model


def resolve_resume(trainer, resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """`True` (or "latest"/"true", as the command line passes it): the newest complete checkpoint of `args.output_dir`
    (leftover staging folders removed). A path: checked,
    `CheckpointError` naming the file and the problem if incomplete. With `save_only_model` (no optimizer state by
    design) a missing optimizer is a warning."""
    if isinstance(resume_from_checkpoint, str) and not os.path.exists(resume_from_checkpoint):
        # the command line's `--resume_from_checkpoint latest` (or true/false) arrives as a string
        word = resume_from_checkpoint.strip().lower()
        resume_from_checkpoint = {"latest": True, "true": True, "false": None, "none": None, "": None}.get(
            word, resume_from_checkpoint)
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return resume_from_checkpoint
    output_dir = trainer.args.output_dir
    require_optimizer = _resume_needs_optimizer(trainer)
    if resume_from_checkpoint is True:
        if trainer.args.should_save:
            remove_staging_leftovers(output_dir)
        path = newest_complete_checkpoint(output_dir, require_optimizer=require_optimizer)
    else:
        path = os.fspath(resume_from_checkpoint)
        problems = checkpoint_problems(path, require_optimizer=require_optimizer)
        if problems:
            parent = os.path.dirname(os.path.abspath(path))
            older = [n for n in _listing(parent) if _step(n, _CHECKPOINT_RE) is not None and os.path.join(parent, n)
                     != os.path.abspath(path) and not checkpoint_problems(os.path.join(parent, n),
                                                                         require_optimizer=require_optimizer)]
            older.sort(key=lambda n: _step(n, _CHECKPOINT_RE))
            hint = f"complete ones there: {', '.join(older)}" if older else "none of its siblings is complete"
            missing_optimizer = any(p.endswith("(the optimizer state)") for p in problems)
            raise CheckpointError(
                f"Cannot resume from {path}: " + "; ".join(problems) + ". Pick another checkpoint (" + hint
                + "), or pass resume_from_checkpoint=True (`--resume_from_checkpoint latest` on the command line) "
                + "to take the newest complete one in the output directory"
                + (". To continue deliberately with a fresh optimizer, load the weights without resuming (or resume "
                   "with save_only_model=True)" if missing_optimizer else "") + ".")
    if not require_optimizer and optimizer_problems(path):
        logger.warning("rollplex: resuming %s without optimizer/scheduler state (save_only_model=True saves the "
                       "weights only): the optimizer and the learning-rate schedule start afresh", path)
    return path


def resolve_resume_argument(trainer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`resolve_resume` applied to `train(*args, **kwargs)`'s `resume_from_checkpoint`, wherever it was passed."""
    if args:
        return (resolve_resume(trainer, args[0]), *args[1:]), kwargs
    if "resume_from_checkpoint" in kwargs:
        kwargs = {**kwargs, "resume_from_checkpoint": resolve_resume(trainer, kwargs["resume_from_checkpoint"])}
    return args, kwargs


def _fsync(path: str, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:  # platforms that cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """Flush every file of `folder`, then the folders themselves (their entries)."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root, directory=True)


def _finalize(staging_root: str, staged: str, final: str) -> None:
    """Rename the complete `staged` folder to `final` (moving aside a stale `final` of an earlier run first)."""
    fsync_tree(staged)
    stale = None
    if os.path.exists(final):  # e.g. an incomplete checkpoint-N that a resume skipped, now written again
        stale = f"{staging_root}-stale"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
    os.rename(staged, final)
    shutil.rmtree(staging_root, ignore_errors=True)
    _fsync(os.path.dirname(final), directory=True)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


@dataclass
class CheckpointStaging:
    """The checkpoint being written (crash safety): while `staged` runs, the Trainer's writes go to the staging
    folder (`output_dir`), and a hub push waits for the final name (`push`). Owned by the trainer."""

    staging_root: str | None = None
    deferred_push: Callable[[str], None] | None = None

    def output_dir(self, run_dir: str) -> str:
        """What `_get_output_dir` returns: the staging folder while a checkpoint is being written, else `run_dir`."""
        return self.staging_root or run_dir

    def push(self, checkpoint_folder: str, push: Callable[[str], None]) -> None:
        """`_push_from_checkpoint`: a staged checkpoint is pushed (an async upload) once it has its final name."""
        if self.staging_root is not None:
            self.deferred_push = push
        else:
            push(checkpoint_folder)

    @contextlib.contextmanager
    def staged(self, trainer, trial) -> Iterator[None]:
        """Around `Trainer._save_checkpoint`: its writes go to `tmp-checkpoint-N/checkpoint-N` (through
        `_get_output_dir`), which becomes `checkpoint-N` only once complete; then rotation, best checkpoint, push."""
        args, state = trainer.args, trainer.state
        run_dir = trainer._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}-{state.global_step}")
        staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if args.should_save and os.path.exists(staging_root):
            shutil.rmtree(staging_root)  # an earlier save of this step that was killed
        trainer.accelerator.wait_for_everyone()
        self.staging_root, self.deferred_push = staging_root, None
        try:
            yield  # the Trainer's own save (its rotation sees only the staging folder: a no-op)
        finally:
            self.staging_root = None
        # the best checkpoint as the Trainer would have recorded it under its final name (it saw the staging folder)
        best_step = state.best_global_step
        if best_step and args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if (best_step == state.global_step or os.path.isdir(best)) and state.best_model_checkpoint != best:
                state.best_model_checkpoint = best
                if args.should_save:
                    state.save_to_json(os.path.join(staged, _STATE))
        trainer.accelerator.wait_for_everyone()  # every rank has written its part
        if args.should_save:
            _finalize(staging_root, staged, final)
        trainer.accelerator.wait_for_everyone()  # nobody goes on before checkpoint-N exists
        if self.deferred_push is not None:
            push, self.deferred_push = self.deferred_push, None
            push(final)
        if args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                               best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
