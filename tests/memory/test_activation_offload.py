"""Issue 14's rollout-only and activation memory: rollplex_offload_activations (the actor's saved activations parked
in a host arena until their backward), the rollout's KV cache released before training.

- `SavedTensorOffload` with a `HostArena` (CPU): gradients bit-identical to no offload, the saved bytes really leave
  the process (they are in the arena's file, not in a tensor), every slot dropped after its last read, `release`
  empties the file;
- in training (video, beta > 0, gradient accumulation 2, shared actor prefix over the window): memory + offload on
  vs memory off, same seed: loss, reward, KL, grad norm and final weights equal (fp32; and under TRL's defaults:
  bf16 autocast, gradient checkpointing, beta 0, dapo), bytes were parked, the arena is empty after each step;
- "auto" decides from the plan against the device's capacity (logged), "on" without rollplex_memory is refused;
- rollout-only memory: no KV cache of the transformers engine is alive when the loss pass starts; vLLM's sleep
  mode is turned on with rollplex_memory="on" where vLLM supports it (CUDA).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_phase_memory import KEYS, _logs, _trainer

from rollplex_trl.memory import SavedTensorOffload
from rollplex_trl.memory.storage import HostArena


def _grads(model, x, offload):
    model.zero_grad(set_to_none=True)
    if offload is None:
        loss = model(x).square().sum()
    else:
        with offload.hooks():
            loss = model(x).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_arena_offload_is_exact_and_moves_the_bytes_out(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 8))
    x = torch.randn(512, 64)
    expected = _grads(model, x, None)
    arena = HostArena(tmp_path)
    offload = SavedTensorOffload(min_bytes=0, arena=arena)
    with offload.hooks():
        loss = model(x).square().sum()
    assert offload.num_parked >= 4 and arena.nbytes() == offload.nbytes() > 512 * 256 * 4
    assert all(h.host is None and h.device_copy is None for h in offload._parked)  # no in-process copy
    assert os.fstat(arena.fd).st_size >= arena.nbytes()
    model.zero_grad(set_to_none=True)
    loss.backward()
    got = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert arena.nbytes() == 0  # every slot dropped after its last unpack
    assert offload.parked_bytes_total > 0
    offload.release()
    assert offload.parked_bytes_total == 0 and os.fstat(arena.fd).st_size == 0
    arena.close()


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_training_with_offloaded_activations_equals_memory_off(tiny_vl_path, tmp_path, video_dataset, defaults,
                                                              monkeypatch):
    import rollplex_trl.trainers.memory as memory_module

    monkeypatch.setattr(memory_module, "OFFLOAD_MIN_BYTES", 0)  # the tiny model's activations are all small
    extra = dict(bf16=True, gradient_checkpointing=True, beta=0.0, loss_type="dapo") if defaults else {}
    on = _trainer(tiny_vl_path, video_dataset, tmp_path, "on", max_steps=3, rollplex_offload_activations="on",
                  output_dir=str(tmp_path / "on"), **extra)
    parked_after_step = []
    release = on.phase_memory.activations_done

    def checked(record):
        release(record)
        parked_after_step.append(on.phase_memory.activation_offload.arena.nbytes())

    on.phase_memory.activations_done = checked
    on.train()
    off = _trainer(tiny_vl_path, video_dataset, tmp_path, "off", max_steps=3, output_dir=str(tmp_path / "off"),
                   **extra)
    off.train()
    a, b = _logs(on), _logs(off)
    assert len(a) == len(b) == 3
    assert all("rollplex/prefix_rows_per_prompt" in r for r in a), "the shared prefix was not used"
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x["rollplex/mem_activations_offloaded_bytes"] > 0, step
        for key in (k for k in KEYS if k in y):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), f"{key} differs at step {step}"
    assert any(r["grad_norm"] > 0 for r in b)
    for p, q in zip(on.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert parked_after_step and all(n == 0 for n in parked_after_step)


def test_auto_follows_the_plan_and_on_needs_memory(tiny_vl_path, tmp_path, video_dataset, notices, monkeypatch):
    import rollplex_trl.trainers.memory as memory_module

    with pytest.raises(ValueError, match="rollplex_offload_activations='on'.*rollplex_memory"):
        _trainer(tiny_vl_path, video_dataset, tmp_path, "off", rollplex_offload_activations="on")
    monkeypatch.setattr(memory_module, "OFFLOAD_MIN_BYTES", 0)
    trainer = _trainer(tiny_vl_path, video_dataset, tmp_path, "on", max_steps=1, output_dir=str(tmp_path / "a"))
    trainer.train()
    assert trainer.phase_memory.activation_offload is None  # a tiny model fits the RAM
    assert any("rollplex_offload_activations='auto': off" in m for m in notices), notices
    notices.clear()
    monkeypatch.setattr(memory_module, "_device_capacity", lambda device: 1 << 20)  # a 1 MiB device
    trainer = _trainer(tiny_vl_path, video_dataset, tmp_path, "on", max_steps=1, output_dir=str(tmp_path / "b"))
    trainer.train()
    assert trainer.phase_memory.activation_offload is not None
    assert any("rollplex_offload_activations='auto': on" in m for m in notices), notices
    assert _logs(trainer)[0]["rollplex/mem_activations_offloaded_bytes"] > 0


@pytest.mark.parametrize("with_arena", [True, False])
def test_unpacked_tensors_keep_their_memory_order(tmp_path, with_arena):
    """A transposed or permuted saved tensor comes back with its own strides (bf16 backward kernels given another
    memory order summed differently: grad norm 1.6e-5 apart); a tensor with gaps comes back dense, same values."""
    arena = HostArena(tmp_path) if with_arena else None
    offload = SavedTensorOffload(min_bytes=0, arena=arena)
    base = torch.randn(6, 5, 4)
    for t in (base.transpose(0, 2), base.permute(1, 2, 0), base[:, ::2]):
        back = offload._unpack(offload._pack(t))
        assert torch.equal(back, t)
        if t.is_contiguous() or t.data_ptr() == base.data_ptr() and t.numel() == base.numel():
            assert back.stride() == t.stride()
    if arena is not None:
        arena.close()


def test_rollout_memory_vllm_sleep_is_turned_on_with_memory_on():
    """The colocated vLLM engine's KV cache (and unshared weights) released between rollouts: TRL's sleep mode, set
    before TRL builds the engine, on CUDA only (vLLM's CPU platform refuses sleep); nothing for server mode."""
    from types import SimpleNamespace

    from rollplex_trl.trainers.memory import vllm_sleep_for_memory

    def args(**kw):
        return SimpleNamespace(**{"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False, **kw})

    on = args()
    assert "vllm_enable_sleep_mode=True" in vllm_sleep_for_memory(on, {"rollplex_memory": "on"}, cuda=True)
    assert on.vllm_enable_sleep_mode is True
    cpu = args()
    assert "not supported on CPU" in vllm_sleep_for_memory(cpu, {"rollplex_memory": "on"}, cuda=False)
    assert cpu.vllm_enable_sleep_mode is False
    memory_on = {"rollplex_memory": "on"}
    for untouched, options in ((args(), {"rollplex_memory": "off"}), (args(vllm_mode="server"), memory_on),
                               (args(use_vllm=False), memory_on)):
        assert vllm_sleep_for_memory(untouched, options, cuda=True) is None
        assert untouched.vllm_enable_sleep_mode is False


def test_transformers_rollout_kv_cache_is_gone_before_training(tiny_vl_path, tmp_path, video_dataset, monkeypatch):
    """The transformers engine's KV caches (the expanded one and the shared-prefix one) live only inside generate:
    none is alive when the loss pass starts."""
    import gc
    import weakref

    from transformers.cache_utils import Cache

    import rollplex_trl.trainers.grpo as grpo

    caches, alive_at_loss = [], []
    init = Cache.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    monkeypatch.setattr(Cache, "__init__", tracked)
    loss = grpo.RollplexGRPOTrainer._loss_in_actor_window

    def rollout_cache(cache) -> bool:
        # The actor prefix's capture cache (prefix/forward.py) is not the rollout's: its checkpointed layers keep it
        # in their recompute closures until the backward, and it holds the boundary K/V themselves (no copy)
        return cache is not None and not all(type(layer).__name__ == "_CaptureLayer" for layer in cache.layers)

    def checked(self, *args, **kwargs):
        gc.collect()
        alive_at_loss.append(sum(rollout_cache(ref()) for ref in caches))
        return loss(self, *args, **kwargs)

    monkeypatch.setattr(grpo.RollplexGRPOTrainer, "_loss_in_actor_window", checked)
    trainer = _trainer(tiny_vl_path, video_dataset, tmp_path, "on", max_steps=2, num_generations=2,
                       rollplex_shared_decode="on", output_dir=str(tmp_path / "kv"))
    trainer.train()
    assert caches and alive_at_loss and all(n == 0 for n in alive_at_loss), (len(caches), alive_at_loss)
