"""Residency transitions follow the lifetime plan; the ledger's figures equal the registered tensors' sizes."""

import json

import pytest
import torch
from torch import nn

from rollplex_trl.memory import (
    LifetimeClass,
    MemoryLedger,
    MemoryRegistry,
    Phase,
    Placement,
    ResidencyManager,
    StreamedOptimizer,
    register_streamed_optimizer,
    window,
    wrap_in_phase,
)

from helpers import assert_is_a_drawn_chart, require

D, H, F = Placement.DEVICE, Placement.HOST, Placement.FREED
CYCLE = [Phase.ROLLOUT, Phase.SCORE, Phase.TRAIN, Phase.OPTIMIZER, Phase.SYNC, Phase.IDLE]

# Where each object must be after entering each phase (hand-written from the lifetime rules).
EXPECTED = {
    #                  rollout score train optimizer sync idle
    "master":         (H, H, H, D, H, H),  # permanent, window [optimizer]
    "snapshot":       (D, D, D, F, F, F),  # regenerable with regenerate(), window [rollout, train]
    "ref_weights":    (D, D, H, H, H, H),  # regenerable without regenerate(): parked on the host
    "prefix_kv":      (D, D, D, F, F, F),  # boundary [rollout, train]
    "prefix_acts":    (H, H, D, F, F, F),  # boundary, waits on the host during rollout and score
    "kv_cache":       (D, F, F, F, F, F),  # phase-local [rollout]
    "rollout_layout": (D, F, F, F, D, D),  # regenerable with regenerate(), window wraps: [sync, rollout]
}


def _t(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value)


def build():
    """A registry with one object per lifetime rule; returns (registry, manager, ledger, tensors, regenerated)."""
    reg = MemoryRegistry()
    master = nn.Parameter(torch.arange(64, dtype=torch.float32))
    # The snapshot is rebuilt from a source that is always readable (a host copy of the master); a regenerate
    # function must not read another managed object that may be offloaded at that moment.
    source = master.detach().clone()
    snapshot = source.to(torch.bfloat16)
    regenerated = []

    def regenerate_snapshot():
        regenerated.append("snapshot")
        snapshot.copy_(source)

    tensors = {
        "master": [master],
        "snapshot": [snapshot],
        "ref_weights": [_t(32, 2.0), _t(16, 3.0)],
        "prefix_kv": [_t(48, 4.0)],
        "prefix_acts": [_t(40, 5.0)],
        "kv_cache": [torch.zeros(100)],
        "rollout_layout": [_t(8, 7.0)],
    }
    reg.register_tensors("master", tensors["master"], LifetimeClass.PERMANENT, "optimizer", "optimizer")
    reg.register_tensors("snapshot", tensors["snapshot"], "regenerable", "rollout", "train",
                         regenerate=regenerate_snapshot)
    reg.register_tensors("ref_weights", tensors["ref_weights"], "regenerable", "rollout", "score")
    reg.register_tensors("prefix_kv", tensors["prefix_kv"], "boundary", "rollout", "train")
    reg.register_tensors("prefix_acts", tensors["prefix_acts"], "boundary", "rollout", "train",
                         host_phases=["rollout", "score"])
    reg.register_tensors("kv_cache", tensors["kv_cache"], "phase_local", "rollout", "rollout")
    reg.register_tensors("rollout_layout", tensors["rollout_layout"], "regenerable", "sync", "rollout",
                         regenerate=lambda: tensors["rollout_layout"][0].fill_(7.0))
    ledger = MemoryLedger(reg)
    return reg, ResidencyManager(reg, ledger), ledger, tensors, regenerated


class _Rig(tuple):
    # pytest prints test arguments on failure; printing a tensor whose storage is offloaded reads freed memory
    def __repr__(self) -> str:
        return "<registry rig>"


@pytest.fixture
def setup():
    return _Rig(build())


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_window_wraps_around_the_step():
    assert window("rollout", "train") == (Phase.ROLLOUT, Phase.SCORE, Phase.TRAIN)
    assert window("sync", "rollout") == (Phase.SYNC, Phase.IDLE, Phase.ROLLOUT)
    with pytest.raises(ValueError, match="unknown phase"):
        window("decode", "train")


def test_each_object_is_where_the_plan_says_after_each_phase(setup):
    reg, mgr, _, tensors, regenerated = setup
    originals = {name: [t.clone() for t in ts] for name, ts in tensors.items()}
    for step in range(2):  # the second step starts from the placements the first left behind
        if step:
            # boundary state is per-step data: this step's prefix produces new tensors, registered anew
            for name in ("prefix_kv", "prefix_acts"):
                tensors[name] = [t.clone() for t in originals[name]]
                old = reg[name]
                reg.register_tensors(name, tensors[name], old.lifetime, old.first_use, old.last_use,
                                     host_phases=old.host_phases)
        for i, phase in enumerate(CYCLE):
            mgr.enter(phase)
            expected = {name: cols[i] for name, cols in EXPECTED.items()}
            assert mgr.plan(phase) == expected, phase
            assert mgr.placements() == expected, phase
            for name, ts in tensors.items():
                if expected[name] is D:
                    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in ts)
                    if name != "kv_cache":  # scratch: contents after a free are undefined
                        for t, o in zip(ts, originals[name], strict=True):
                            same = torch.equal(t, o)  # (never let pytest print a tensor whose storage is freed)
                            assert same, f"{name} lost its contents by {phase} of step {step}"
                else:
                    on_device = [t.untyped_storage().nbytes() for t in ts]
                    assert not any(on_device), f"{name} still on the device in {phase} of step {step}"
    # the snapshot was dropped after train and rebuilt for the next rollout, never copied to the host
    assert regenerated == ["snapshot"]


def test_views_and_parameters_survive_offload(setup):
    reg, mgr, _, tensors, _ = setup
    master = tensors["master"][0]
    view = master[10:20]
    mgr.enter("rollout")
    assert master.untyped_storage().nbytes() == 0
    mgr.enter("optimizer")
    assert tensors["master"][0] is master and isinstance(master, nn.Parameter)
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32))
    with torch.no_grad():
        view.add_(1)  # a write through the old view lands in the reloaded storage
    assert master[10].item() == 11.0


def test_phase_context_manager_returns_to_previous_phase(setup):
    reg, mgr, _, _, _ = setup
    mgr.enter("train")
    with mgr.phase("rollout"):
        assert mgr.current is Phase.ROLLOUT
        assert reg["kv_cache"].placement is D
    assert mgr.current is Phase.TRAIN
    assert reg["kv_cache"].placement is F


def test_wrap_in_phase_hooks_a_method(setup):
    reg, mgr, _, _, _ = setup

    class Trainer:
        def _generate(self, prompts):
            return [reg["kv_cache"].placement, mgr.current, prompts]

    trainer = Trainer()
    mgr.enter("train")
    undo = wrap_in_phase(trainer, "_generate", mgr, "rollout")
    assert trainer._generate("p") == [D, Phase.ROLLOUT, "p"]
    assert mgr.current is Phase.TRAIN and reg["kv_cache"].placement is F
    undo()
    assert trainer._generate("p")[1] is Phase.TRAIN


def test_register_validates_windows():
    reg = MemoryRegistry()
    with pytest.raises(ValueError, match="outside its window"):
        reg.register_tensors("x", [torch.zeros(2)], "boundary", "rollout", "score", host_phases=["train"])
    with pytest.raises(ValueError, match="idle"):
        reg.register_tensors("x", [torch.zeros(2)], "boundary", "idle", "score")
    w = torch.zeros(8)
    reg.register_tensors("w", [w], "regenerable", "rollout", "sync")
    with pytest.raises(ValueError, match="shares a tensor storage with the registered object 'w'"):
        reg.register_tensors("view_of_w", [w[2:4]], "boundary", "rollout", "train")


def test_ledger_figures_match_tensor_sizes(setup):
    reg, mgr, ledger, tensors, _ = setup
    size = {name: _nbytes(ts) for name, ts in tensors.items()}
    cls = {obj.name: obj.lifetime for obj in reg}
    for i, phase in enumerate(CYCLE):
        mgr.enter(phase)
        by_class = reg.bytes_by_class(Placement.DEVICE)
        for c in LifetimeClass:
            want = sum(size[n] for n, cols in EXPECTED.items() if cols[i] is D and cls[n] is c)
            assert by_class[c] == want, (phase, c)
        host = sum(size[n] for n, cols in EXPECTED.items() if cols[i] is H)
        assert sum(reg.bytes_by_class(Placement.HOST).values()) == host, phase
    mgr.enter("rollout")
    m = ledger.metrics()
    # rollout holds snapshot + ref + prefix_kv + kv_cache + rollout_layout (on the device)
    rollout = sum(size[n] for n in ("snapshot", "ref_weights", "prefix_kv", "kv_cache", "rollout_layout"))
    assert m["rollplex/mem_peak_rollout_bytes"] == rollout
    assert m["rollplex/mem_peak_optimizer_bytes"] == size["master"]  # everything else is freed or on the host
    assert m["rollplex/mem_peak_train_bytes"] == size["snapshot"] + size["prefix_kv"] + size["prefix_acts"]
    assert m["rollplex/mem_boundary_bytes"] == size["prefix_kv"] + size["prefix_acts"]
    assert m["rollplex/mem_permanent_bytes"] == size["master"]
    assert m["rollplex/mem_regenerable_bytes"] == size["snapshot"] + size["ref_weights"] + size["rollout_layout"]
    assert m["rollplex/mem_phase_local_bytes"] == size["kv_cache"]
    assert m["rollplex/mem_resident_bytes"] == rollout
    # prefix_acts was freed after its last use: a freed object has nothing to park on the host (the next step's
    # prefix registers new tensors)
    assert m["rollplex/mem_host_bytes"] == size["master"]
    assert reg["prefix_acts"].placement is F
    ledger.reset_window()
    assert ledger.metrics()["rollplex/mem_boundary_bytes"] == 0
    events = ledger.trace_events()
    json.dumps(events)
    assert {e["name"] for e in events if e["ph"] == "X"} >= {p.value for p in CYCLE}


def test_streamed_optimizer_chunks_enter_the_ledger():
    reg = MemoryRegistry()
    ledger = MemoryLedger(reg)
    mgr = ResidencyManager(reg, ledger)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    opt = StreamedOptimizer(model.parameters(), torch.optim.AdamW, chunk_bytes=1200, lr=1e-3)
    register_streamed_optimizer(reg, opt, ledger)
    model(torch.randn(2, 16)).sum().backward()
    with mgr.phase("optimizer"):
        opt.step()  # first step creates the state (no chunk was loaded yet)
        opt.step()  # second step streams it
    assert reg["optimizer_state"].placement is H
    assert reg.bytes_by_class(H)[LifetimeClass.PERMANENT] == opt.state_bytes() == 2 * 4 * (2 * 16 * 16 + 2 * 16)
    peak_chunk = max(c.resident_bytes for c in opt.last_step_chunks)
    assert 0 < peak_chunk < opt.state_bytes()
    m = ledger.metrics()
    assert m["rollplex/mem_permanent_bytes"] == peak_chunk
    assert m["rollplex/mem_peak_optimizer_bytes"] == peak_chunk


def test_plot_ledger(setup, tmp_path):
    require("matplotlib")
    from rollplex_trl.memory.plot import plot_ledger

    _, mgr, ledger, _, _ = setup
    for phase in CYCLE:
        mgr.enter(phase)
    out = plot_ledger(ledger, tmp_path / "timeline.png")
    assert_is_a_drawn_chart(out)
