"""rollplex_memory: the memory plan acting at every phase boundary (rollplex_trl/trainers/memory.py).

- fidelity: memory on vs off, same seed, video, beta > 0, gradient accumulation 2: the same loss, reward, KL and
  grad norm (only bytes move), with the reference weights and the optimizer state really off the compute side;
- the reference weights' offload/restore is bit-exact and lowers the process's RSS by their bytes;
- the StreamedOptimizer with a host arena equals torch AdamW (fused, foreach) and checkpoints interchange with it;
- save/resume of a trainer with memory on.

The trainer hooks are applied by `HookedTrainer` below, with exactly the lines proposed for RollplexGRPOTrainer; once
they are in the trainer, `HookedTrainer = RollplexGRPOTrainer` keeps every test here working.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from datasets import Dataset
from torch import nn

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.memory import StreamedOptimizer
from rollplex_trl.memory.ledger import process_rss
from rollplex_trl.memory.lifetime import Placement
from rollplex_trl.memory.storage import HostArena, TensorGroup, release_free_memory
from rollplex_trl.trainers.memory import PhaseMemory, _adopt_resizable

from helpers import video_rows

HookedTrainer = RollplexGRPOTrainer  # the trainer carries the phase-memory hooks itself (trainers/grpo.py)


KEYS = ("loss", "reward", "kl", "grad_norm", "entropy")


def varied_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _config(tmp_path, memory, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / memory), max_steps=4, per_device_train_batch_size=2, num_generations=2,
        gradient_accumulation_steps=2, max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1,
        report_to=[], seed=11, use_cpu=True, bf16=False, save_strategy="no", rollplex_memory=memory,
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return RollplexGRPOConfig(**kwargs)


def _trainer(model, dataset, tmp_path, memory, **overrides):
    return HookedTrainer(model=str(model), reward_funcs=varied_reward, args=_config(tmp_path, memory, **overrides),
                         train_dataset=dataset)


def _logs(trainer):
    return [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("overlap", ["auto", "on"])  # CPU: serial schedule / prefix jobs on a worker thread
def test_memory_on_equals_off_and_moves(tiny_vl_path, tmp_path, video_dataset, overlap):
    on = _trainer(tiny_vl_path, video_dataset, tmp_path, "on", max_steps=5, rollplex_overlap=overlap)
    on.train()
    off = _trainer(tiny_vl_path, video_dataset, tmp_path, "off", max_steps=5, rollplex_overlap=overlap)
    off.train()
    a, b = _logs(on), _logs(off)
    assert len(a) == len(b) == 5
    assert all(r["rollplex/prefix_rows_per_prompt"] > 1 for r in a), "the shared prefix was not used"
    if overlap == "on":
        assert any(r["rollplex/overlap_active"] == 1 for r in a)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in (k for k in KEYS if k in y):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), f"{key} differs at step {step}"
    assert any(r["kl"] > 0 for r in b[1:]) and any(r["grad_norm"] > 0 for r in b)
    for p, q in zip(on.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(p, q)

    memory = on.phase_memory
    assert off.phase_memory is None
    # the streamed optimizer is the trainer's, its state parked in the arena (placeholders hold no bytes)
    assert isinstance(on.optimizer.optimizer, StreamedOptimizer)
    state = [v for s in memory.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert state and all(v.untyped_storage().nbytes() == 0 for v in state)
    assert memory.arena.nbytes() >= memory.optimizer.state_bytes() > 0
    # the reference weights are off the compute side between passes, and were resident in each pass
    ref = memory.ref_object
    assert ref.placement is Placement.HOST
    assert all(p.untyped_storage().nbytes() == 0 for p in on.ref_model.parameters())
    phases = [phase.value for phase, placement in ref.history if placement is Placement.DEVICE]
    assert phases and set(phases) == {"score"}
    # the ledger: a score phase with the reference's bytes, the optimizer phase with chunks, gradients dropped
    peaks = memory.registered_peaks()
    policy = sum(p.numel() * p.element_size() for p in on.model.parameters())
    ref_bytes = sum(p.numel() * p.element_size() for p in on.ref_model.parameters())
    assert peaks["score"] >= policy + ref_bytes
    assert peaks["train"] >= 2 * policy  # weights + gradients
    # the overlap schedule's reference prefix job (in the rollout phase) held the reference weights while it ran
    assert on.overlap is not None and peaks["rollout"] >= policy + ref_bytes
    assert peaks["idle"] == policy
    logged = a[-1]
    for key in ("rollplex/mem_resident_bytes", "rollplex/mem_peak_score_bytes", "rollplex/mem_rss_peak_train_bytes"):
        assert key in logged, key
    # the planner's prediction for the same objects
    plan = memory.planned(on, prompt_len=100, completion_len=6)
    assert plan["num_params"]["planner"] == pytest.approx(plan["num_params"]["model"], rel=0.02)
    assert plan["rollplex"]["score"] == pytest.approx(peaks["score"], rel=0.02)


def test_checkpoint_resume_with_memory_on_and_optimizer_interchange(tiny_vl_path, tmp_path):
    dataset = Dataset.from_list(video_rows(tmp_path, lambda i: "Q" * i))
    kwargs = dict(save_strategy="steps", save_steps=2, rollplex_overlap="off", gradient_accumulation_steps=1,
                  per_device_train_batch_size=4, seed=5)
    full = _trainer(tiny_vl_path, dataset, tmp_path / "full", "on", **kwargs)
    full.train()
    checkpoint = tmp_path / "full" / "on" / "checkpoint-2"
    resumed = _trainer(tiny_vl_path, dataset, tmp_path / "resumed", "on", **kwargs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = _logs(resumed)[2:], _logs(full)[2:]
    assert [r["step"] for r in a] == [3, 4]
    for x, y in zip(a, b, strict=True):
        for key in KEYS:
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), key
    for p, q in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(p, q)
    # optimizer.pt written by the streamed optimizer is plain AdamW state: it loads into torch.optim.AdamW, and a
    # plain trainer's optimizer.pt loads into the streamed one (what resuming a memory-off run with memory on does)
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    params = list(resumed.model.parameters())
    plain = torch.optim.AdamW([{"params": params[: len(params) // 2]}, {"params": params[len(params) // 2:]}])
    with pytest.raises(ValueError):  # group sizes differ: proves the groups really come from the file
        plain.load_state_dict(saved)
    memory = resumed.phase_memory
    groups = [[p for p in g["params"]] for g in memory.optimizer.param_groups]
    plain = torch.optim.AdamW([{"params": g} for g in groups])
    plain.load_state_dict(saved)
    assert all(torch.is_tensor(s["exp_avg"]) and s["exp_avg"].untyped_storage().nbytes() > 0
               for s in plain.state.values())
    memory.optimizer.load_state_dict(plain.state_dict())
    back = memory.optimizer.state_dict()
    for key, s in saved["state"].items():
        for name, v in s.items():
            assert torch.equal(back["state"][key][name], v), (key, name)


# --- unit tests: the moves themselves -----------------------------------------------------------------------------


def _non_resizable_module(tmp_path, mib: int) -> nn.Module:
    """A module whose weights come from safetensors, as a loaded checkpoint's do (storages not resizable)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    rows = mib * 2**20 // (4 * 1024)
    module = nn.Sequential(nn.Linear(1024, rows // 2), nn.Linear(rows // 2, 1024, bias=False))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(tmp_path / "w.safetensors"))
    del module
    module = nn.Sequential(nn.Linear(1024, rows // 2), nn.Linear(rows // 2, 1024, bias=False))
    module.load_state_dict(load_file(str(tmp_path / "w.safetensors")), assign=True)
    return module


def test_reference_offload_restore_is_bit_exact_and_lowers_rss(tmp_path):
    module = _non_resizable_module(tmp_path, 96)
    params = list(module.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    digest = [p.detach().double().sum().item() for p in params]
    probe = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module(probe)
    _adopt_resizable(params)
    assert all(p.untyped_storage().resizable() for p in params)
    ids = [id(p) for p in module.parameters()]
    arena = HostArena(tmp_path)
    group = TensorGroup(params, arena=arena, immutable=True)
    gc.collect()
    release_free_memory()
    for round_trip in range(2):  # the second offload only releases (immutable: the arena copy stays valid)
        before = process_rss()
        group.to_host()
        after = process_rss()
        assert before - after >= 0.9 * nbytes, f"RSS dropped by {(before - after) / 2**20:.1f} MiB of " \
                                               f"{nbytes / 2**20:.1f} MiB (round trip {round_trip})"
        assert all(p.untyped_storage().nbytes() == 0 for p in params)
        assert arena.nbytes() == nbytes
        group.to_device()
        assert process_rss() - after >= 0.9 * nbytes
        assert [id(p) for p in module.parameters()] == ids  # nn.Parameter identity survives
        with torch.no_grad():
            assert torch.equal(module(probe), expected)
        assert [p.detach().double().sum().item() for p in params] == digest
    arena.close()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 5, bias=False))


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(7, 12, generator=g)).pow(2).mean() * 50
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()


def _state(opt: torch.optim.Optimizer) -> list[dict]:
    sd = opt.state_dict()["state"]
    return [sd[i] for i in sorted(sd)]


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
def test_streamed_optimizer_in_the_arena_equals_adamw(tmp_path, kind):
    kw = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-6, fused=kind == "fused", foreach=kind == "foreach" or None)
    if kind == "fused":
        kw.pop("foreach")
    ref_model, model = _model(), _model()
    ref = torch.optim.AdamW(_groups(ref_model), **kw)
    arena = HostArena(tmp_path)
    streamed = StreamedOptimizer(_groups(model), torch.optim.AdamW, chunk_bytes=3000, host_arena=arena, **kw)
    _train(ref_model, ref, steps=5)
    _train(model, streamed, steps=5)
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(streamed.last_step_chunks) > 2
    # between steps: placeholders without bytes, the state in the arena, no slots held
    assert all(v.untyped_storage().nbytes() == 0 for s in streamed.state.values() for k, v in s.items()
               if k != "step")
    assert arena.nbytes() == streamed.state_bytes() and not streamed._slots
    for a, b in zip(_state(ref), _state(streamed), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_arena_optimizer_checkpoints_interchange_with_adamw(tmp_path):
    kw = dict(lr=2e-2, weight_decay=0.05)
    ref_model = _model()
    ref = torch.optim.AdamW(_groups(ref_model), **kw)
    _train(ref_model, ref, steps=3)
    torch.save(ref.state_dict(), tmp_path / "optimizer.pt")
    weights = {k: v.clone() for k, v in ref_model.state_dict().items()}
    _train(ref_model, ref, steps=2, seed=9)

    model = _model()
    model.load_state_dict(weights)
    streamed = StreamedOptimizer(_groups(model), torch.optim.AdamW, chunk_bytes=1024, host_arena=HostArena(tmp_path),
                                 **kw)
    streamed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert all(v.untyped_storage().nbytes() == 0 for s in streamed.state.values() for k, v in s.items()
               if k != "step")
    _train(model, streamed, steps=2, seed=9)
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)

    # its own checkpoint, through a file, into a plain AdamW: the same next steps
    torch.save(streamed.state_dict(), tmp_path / "streamed.pt")
    model2 = copy.deepcopy(model)
    plain = torch.optim.AdamW(_groups(model2), **kw)
    plain.load_state_dict(torch.load(tmp_path / "streamed.pt", weights_only=True))
    plain.param_groups[0]["lr"] = streamed.param_groups[0]["lr"]
    plain.param_groups[1]["lr"] = streamed.param_groups[1]["lr"]
    for opt, m in ((streamed, model), (plain, model2)):
        g = torch.Generator().manual_seed(11)
        for _ in range(2):
            m(torch.randn(7, 12, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_auto_and_unsupported_decisions(tiny_vl_path, tmp_path, video_dataset, notices):
    trainer = _trainer(tiny_vl_path, video_dataset, tmp_path, "auto")
    assert trainer.phase_memory is None  # a tiny model takes nothing like half the RAM
    assert any("rollplex_memory='auto': off" in m for m in notices), notices
    pays, why = PhaseMemory.pays(trainer)
    assert not pays and "GiB" in why
    assert PhaseMemory.unsupported(trainer) is None


def test_an_object_in_use_is_not_moved_by_a_phase_boundary():
    from rollplex_trl.memory import MemoryLedger, MemoryRegistry, ResidencyManager

    registry = MemoryRegistry()
    manager = ResidencyManager(registry, MemoryLedger(registry))
    weights = torch.arange(1024, dtype=torch.float32)
    expected = weights.clone()
    registry.register("ref", TensorGroup([weights]), "regenerable", "score", "score")
    manager.enter("rollout")
    obj = registry["ref"]
    assert obj.placement is Placement.HOST and weights.untyped_storage().nbytes() == 0
    with manager.using("ref"):  # the reference prefix job inside the decode window
        assert obj.placement is Placement.DEVICE and torch.equal(weights, expected)
        manager.enter("train")  # a boundary while the job runs (concurrent schedule): the object stays
        assert obj.placement is Placement.DEVICE and torch.equal(weights, expected)
    assert obj.placement is Placement.HOST  # placed for the current phase once released
    manager.enter("score")
    assert torch.equal(weights, expected)


# --- under TRL's defaults, and forced settings ---------------------------------------------------------------------

MEASURED_ONLY = ("rollplex/mem_resident_bytes", "rollplex/mem_host_bytes", "rollplex/mem_permanent_bytes",
                 "rollplex/mem_regenerable_bytes")


def _text_trainer(model_path, tmp_path, memory, trainer_kwargs=None, **overrides):
    """A text GRPO run that leaves TRL's defaults alone (bf16, gradient checkpointing, beta 0, dapo,
    optim adamw_torch_fused) unless `overrides` say otherwise."""
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count {i} " * (i + 1)}] for i in range(4)]})
    kwargs = dict(output_dir=str(tmp_path / memory), max_steps=3, per_device_train_batch_size=2, num_generations=2,
                  max_completion_length=6, learning_rate=5e-3, logging_steps=1, report_to=[], seed=11, use_cpu=True,
                  save_strategy="no", disable_tqdm=True, rollplex_memory=memory)
    kwargs.update(overrides)
    trainer_kwargs = {"model": str(model_path), **(trainer_kwargs or {})}
    return HookedTrainer(reward_funcs=varied_reward, args=RollplexGRPOConfig(**kwargs), train_dataset=dataset,
                         **trainer_kwargs)


def test_memory_on_under_trl_defaults_streams_the_fused_optimizer(tiny_qwen2_path, tmp_path, monkeypatch):
    import rollplex_trl.trainers.memory as memory_module

    monkeypatch.setattr(memory_module, "CPU_CHUNK_BYTES", 128 << 10)  # several chunks of the tiny model's state
    on = _text_trainer(tiny_qwen2_path, tmp_path, "on")
    args = on.args
    assert (args.optim, args.bf16, args.gradient_checkpointing, args.beta, args.loss_type) == (
        "adamw_torch_fused", True, True, 0.0, "dapo")
    on.train()
    off = _text_trainer(tiny_qwen2_path, tmp_path, "off")
    off.train()
    a, b = _logs(on), _logs(off)
    assert len(a) == len(b) == 3 and any(r["grad_norm"] > 0 for r in b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in ("loss", "grad_norm", "reward"):
            assert x[key] == y[key], f"{key} differs at step {step}"
    for p, q in zip(on.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(p, q)
    # what moves under TRL's defaults on CPU: the fused AdamW's state, streamed from the arena; no reference (beta 0)
    memory = on.phase_memory
    streamed = on.optimizer.optimizer
    assert isinstance(streamed, StreamedOptimizer) and streamed is memory.optimizer
    assert all(g["fused"] for g in streamed.inner.param_groups) and len(streamed.last_step_chunks) > 2
    state = [v for s in streamed.state.values() for k, v in s.items() if k != "step"]
    assert state and all(v.untyped_storage().nbytes() == 0 for v in state)
    assert memory.arena.nbytes() == streamed.state_bytes() > 0
    assert memory.ref_object is None and on.ref_model is None
    # the ledger: measured figures are logged with their real values, unmeasured ones not at all (never a 0)
    policy = sum(p.numel() * p.element_size() for p in on.model.parameters())
    for r in a:
        assert r["rollplex/mem_regenerable_bytes"] == policy
        assert r["rollplex/mem_resident_bytes"] == policy  # between steps only the weights are resident
        assert r["rollplex/mem_host_bytes"] == streamed.state_bytes()
        assert 0 < r["rollplex/mem_permanent_bytes"] < streamed.state_bytes()  # chunks in flight, never all of it
    for r in b:
        assert not any(k in r for k in MEASURED_ONLY), sorted(k for k in r if k.startswith("rollplex/mem_"))
        for phase in ("rollout", "score", "optimizer", "sync", "idle"):  # nothing registered lives there
            assert f"rollplex/mem_peak_{phase}_bytes" not in r


def test_forced_on_refuses_what_it_cannot_move(tiny_qwen2_path, tmp_path):
    with pytest.raises(ValueError, match=r"rollplex_memory='on' cannot move the optimizer state: optim='adafactor' "
                       r"builds Adafactor.*optim='adamw_torch_fused'.*rollplex_memory='auto'"):
        _text_trainer(tiny_qwen2_path, tmp_path, "on", optim="adafactor")
    with pytest.raises(ValueError, match=r"rollplex_memory='on' cannot move the reference model: sync_ref_model=True"
                       r".*Set sync_ref_model=False"):
        _config(tmp_path, "on", sync_ref_model=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_path))
    with pytest.raises(ValueError, match=r"cannot move the optimizer state: the optimizer was passed in built"):
        _text_trainer(tiny_qwen2_path, tmp_path, "on", trainer_kwargs=dict(
            model=model, optimizers=(torch.optim.AdamW(model.parameters()), None)))


def _force_auto(monkeypatch):
    import rollplex_trl.trainers.memory as memory_module

    monkeypatch.setattr(memory_module, "AUTO_PRESSURE", 0.0)  # a tiny model is always "under pressure"


def test_auto_counts_and_moves_only_what_can_move(tiny_qwen2_path, tmp_path, notices, monkeypatch):
    _force_auto(monkeypatch)
    # nothing can move (no reference at beta 0, Adafactor's state does not stream): auto stays off
    trainer = _text_trainer(tiny_qwen2_path, tmp_path, "auto", optim="adafactor")
    assert PhaseMemory.moved_bytes(trainer) == {"reference_weights": 0, "optimizer_state": 0}
    assert trainer.phase_memory is None
    assert any("rollplex_memory='auto': off" in m and "optimizer state stays resident" in m for m in notices)
    # a synced reference stays resident, the optimizer state streams
    notices.clear()
    trainer = _text_trainer(tiny_qwen2_path, tmp_path, "auto", beta=0.1, sync_ref_model=True)
    moved, sizes = PhaseMemory.moved_bytes(trainer), PhaseMemory.movable_bytes(trainer)
    assert sizes["reference_weights"] > 0 and moved["reference_weights"] == 0
    assert moved["optimizer_state"] == sizes["optimizer_state"] == 2 * sizes["gradients"] > 0
    memory = trainer.phase_memory
    assert memory is not None and memory.ref_object is None
    assert all(p.untyped_storage().nbytes() > 0 for p in trainer.ref_model.parameters())
    notes = [m for m in notices if "rollplex_memory='auto'" in m]
    assert len(notes) == 1 and "reference model stays resident (sync_ref_model=True" in notes[0]
