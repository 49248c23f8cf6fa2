"""rollplex_weight_mapping: the Megatron backend's rollout model mapped onto the training shards' shared memory
(backends/megatron/mapped_weights.py), in a 1-process world (t = 1; t = 2 across processes runs in
test_megatron_trainer.py).

The reference for "aliased" is behavioural: after a real AdamW step and before any sync, an aliased rollout tensor
already holds the new weights (nothing copied them) and a copied one still holds the old; after the sync every
tensor equals the shards gathered back into HF layout (`hf_state_dict`). Which tensors must be copied follows from
the layouts: Megatron's `linear_qkv` interleaves [q_g; k_g; v_g] per KV group, so vLLM's fused `qkv_proj` (of which
HF's q/k/v are row slices) is stitched from one piece per group and projection, which maps only when each piece is
a whole number of pages (4096 bytes here): in fp32 the weights do and the biases do not; in bf16 k/v do not either.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import megatron_worker as mw
import pytest
import torch

from helpers import require

require("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore")

PAGE = 4096


def _backend(path, dtype=torch.float32, mapping="on", **kwargs):
    from rollplex_trl.backends.megatron.backend import MegatronBackend

    records: list[tuple[str, float]] = []
    rollout = mw.load_hf(path, dtype=dtype)
    backend = MegatronBackend(rollout_model=rollout, ref_model=None, tensor_parallel_size=1, seed=0,
                              record=lambda k, v: records.append((k, v)), is_main_process=False,
                              weight_mapping=mapping, **kwargs)
    return backend, rollout, records


def _must_copy(rollout) -> set[str]:
    """HF's q/k/v come from one rollout tensor (vLLM's fused `qkv_proj`, and its bias), built from one piece per KV
    group and projection: it maps only when every piece is a whole number of pages, else all three are copied."""
    text = rollout.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    rows = {"q_proj": head_dim * text.num_attention_heads // text.num_key_value_heads, "k_proj": head_dim,
            "v_proj": head_dim}
    fused: dict[str, list[tuple[str, bool]]] = {}  # (layer, weight|bias) -> [(name, piece on pages)]
    for name, p in rollout.named_parameters():
        *layer, proj, what = name.split(".")
        if ".language_model." in name and proj in rows:
            row_bytes = p.element_size() * (p.shape[1] if p.dim() == 2 else 1)
            fused.setdefault(f"{'.'.join(layer)}.{what}", []).append((name, rows[proj] * row_bytes % PAGE == 0))
    return {name for pieces in fused.values() if not all(ok for _, ok in pieces) for name, _ in pieces}


def _adamw_step(backend):
    optimizer = backend.create_optimizer(SimpleNamespace(weight_decay=0.0, learning_rate=1e-2, adam_beta1=0.9,
                                                         adam_beta2=0.999, adam_epsilon=1e-8,
                                                         optim="adamw_torch_fused"))
    loss = sum(p.float().sum() for _, p in backend.trainable())  # every weight moves by about lr (Adam)
    loss.backward()
    optimizer.step()  # its post-hook counts the weight version


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_is_visible_without_copy_and_sync_rebuilds_the_rest(one_process, tiny_vl_path, dtype):
    from rollplex_trl.backends.megatron.mapped_weights import MappedRolloutWeights, backing_files
    from rollplex_trl.backends.megatron.rollout_weights import StaleRolloutWeights

    backend, rollout, records = _backend(tiny_vl_path, dtype)
    assert isinstance(backend.rollout, MappedRolloutWeights)
    classes = backend.rollout.classes()
    params = dict(rollout.named_parameters())
    assert set(classes) == set(params)
    copied = {n for n, mode in classes.items() if mode == "buffer"}
    assert copied == _must_copy(rollout)
    for name, mode in classes.items():  # which file's pages hold each tensor (/proc/self/maps)
        files = {f.rsplit("-", 2)[-2] + "-" + f.rsplit("-", 1)[-1] for f in backing_files(params[name].data)}
        assert files == ({"buffer-0"} if mode == "buffer" else {"train-0"}), (name, files)

    before = {n: p.detach().clone() for n, p in params.items()}
    _adamw_step(backend)
    trained = backend.policy.hf_state_dict()
    with pytest.raises(StaleRolloutWeights, match="optimizer step 0, but 1 steps"):
        backend.rollout.check_fresh()
    for name, p in params.items():
        assert not torch.equal(trained[name], before[name]), name  # every weight moved
        # aliased: already the new weights, no sync ran; copied: still the old ones
        assert torch.equal(p, trained[name] if name not in copied else before[name]), name

    backend.sync_rollout()
    assert all(torch.equal(p, trained[n]) for n, p in params.items())
    sync = dict(records)
    expect_copied = sum(params[n].numel() * params[n].element_size() for n in copied)
    assert sync["rollplex/sync_bytes_copied"] == expect_copied == backend.rollout.bytes_copied_per_sync
    assert sync["rollplex/sync_bytes_aliased"] == sum(p.numel() * p.element_size() for p in params.values()) \
        - expect_copied


def _file_ranges(tensor: torch.Tensor) -> list[tuple[str, int, int]]:
    """(file, first byte, end) of the file pages holding ``tensor``'s bytes in this process, read from
    /proc/self/maps here (not through the code under test); private memory is file ''."""
    span = (1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))) * tensor.element_size()
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + span
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start < hi and lo < end:
                a, b = max(lo, start), min(hi, end)
                path = fields[5] if len(fields) > 5 else ""
                offset = int(fields[2], 16) if path else start  # anonymous memory: its own addresses
                out.append((path, offset + a - start, offset + b - start))
    assert sum(b - a for _, a, b in out) == span, "a tensor outside this process's mappings"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_live_bytes_measured_independently_equal_the_plan(one_process, tiny_vl_path, dtype):
    """The binding's byte counts against measurements that do not read the plan: (1) storage identity: the
    rollout tensors' bytes whose file pages lie inside the trainer's shard storages (the training parameters'
    own file ranges, however many virtual ranges map them) are the aliased bytes, the rest the copied ones;
    (2) the bytes a sync actually writes: after an AdamW step that moves every weight, the rollout tensors'
    bytes whose contents the sync changed (the training shards untouched by it)."""
    backend, rollout, records = _backend(tiny_vl_path, dtype)
    params = dict(rollout.named_parameters())
    train = [r for _, p in backend.trainable() for r in _file_ranges(p.data)]
    assert all(path for path, _, _ in train)  # adopted into the shared-memory arena

    def inside(path, a, b):
        return sum(max(0, min(b, hi) - max(a, lo)) for f, lo, hi in train if f == path)

    aliased = copied = 0
    for name, p in params.items():
        for path, a, b in _file_ranges(p.data):
            shared = inside(path, a, b)
            assert shared in (0, b - a), name  # a tensor's page range lies wholly in the shards or wholly outside
            aliased, copied = aliased + shared, copied + (b - a - shared)
    assert aliased == backend.rollout.bytes_aliased > 0
    assert copied == backend.rollout.bytes_copied_per_sync > 0

    _adamw_step(backend)  # every weight moves by about lr
    shards = {n: p.detach().clone() for n, p in backend.trainable()}
    before = {n: p.detach().clone() for n, p in params.items()}
    backend.sync_rollout()
    written = sum(int((p.detach() != before[n]).sum()) * p.element_size() for n, p in params.items())
    assert all(torch.equal(p.detach(), shards[n]) for n, p in backend.trainable())  # the sync only reads them
    sync = dict(records)
    assert written == sync["rollplex/sync_bytes_copied"] == backend.rollout.bytes_copied_per_sync == copied
    assert sync["rollplex/sync_bytes_aliased"] == aliased


def test_replaced_tensor_is_refused_and_rebound(one_process, tiny_vl_path):
    backend, rollout, _ = _backend(tiny_vl_path)
    from rollplex_trl.backends.megatron.rollout_weights import StaleRolloutWeights

    embed = rollout.get_parameter("model.language_model.embed_tokens.weight")
    embed.data = embed.data.clone()  # what a loader that assigns new tensors does
    with pytest.raises(StaleRolloutWeights, match="embed_tokens.weight"):
        backend.rollout.check_fresh()
    backend.reload_from_rollout(rollout)  # resume: shards from the loaded weights, then bound again
    backend.rollout.check_fresh()
    _adamw_step(backend)
    assert torch.equal(embed, backend.policy.hf_state_dict()["model.language_model.embed_tokens.weight"])


def test_reasons_not_to_map(one_process, tiny_vl_path, monkeypatch):
    from rollplex_trl.backends.megatron import mapped_weights
    from rollplex_trl.backends.megatron.rollout_weights import LiveRolloutWeights

    backend, rollout, _ = _backend(tiny_vl_path, mapping="off")
    assert isinstance(backend.rollout, LiveRolloutWeights)
    kwargs = dict(spec=backend.rollout.spec, options=backend.policy.options, rollout_model=rollout, tp_rank=0)
    mixed = [torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))]
    assert "several dtypes" in mapped_weights.plan_mapping(train_params=mixed, **kwargs)
    assert isinstance(mapped_weights.plan_mapping(train_params=[], **kwargs), mapped_weights.MappingPlan)
    full = os.statvfs_result((4096, 4096, 1, 1, 1, 1, 1, 1, 0, 255))
    monkeypatch.setattr(mapped_weights.os, "statvfs", lambda path: full)
    assert "--shm-size" in mapped_weights.plan_mapping(train_params=[], **kwargs)
    # auto falls back to the views + rebuild path; on refuses with the reason
    backend, rollout, _ = _backend(tiny_vl_path, mapping="auto")
    assert isinstance(backend.rollout, LiveRolloutWeights)
    with pytest.raises(RuntimeError, match=r"rollplex_weight_mapping='on' cannot map .*--shm-size"):
        _backend(tiny_vl_path, mapping="on")
    # split-K row-parallel views read the mapped shards: 'on' refuses when the mapping fell back
    with pytest.raises(RuntimeError, match=r"rollplex_row_parallel_views='on' needs the weight mapping.*--shm-size"):
        _backend(tiny_vl_path, mapping="auto", row_parallel_views="on")


def test_only_the_meant_refusals_turn_the_mapping_off(one_process, tiny_vl_path, monkeypatch):
    """A layout the plan cannot build or bind (ValueError, LayoutError) or CUDA memory the driver cannot give is a
    reason (auto: the views + rebuild path; on: a named RuntimeError); any other exception is a bug and
    propagates, from plan_mapping and from the backend alike, instead of passing for "mapping off"."""
    from rollplex_trl.backends.megatron import mapped_weights
    from rollplex_trl.backends.megatron.rollout_weights import LiveRolloutWeights
    from rollplex_trl.memory.cuda_vmm import VmmUnavailable
    from rollplex_trl.sharding.layouts import LayoutError

    backend, rollout, _ = _backend(tiny_vl_path, mapping="off")
    kwargs = dict(spec=backend.rollout.spec, options=backend.policy.options, rollout_model=rollout, tp_rank=0,
                  train_params=[])
    plan_sharding = mapped_weights.plan_sharding

    def failing(error):
        def plan(*args, **kw):
            raise error
        return plan

    for bug in (AttributeError("'NoneType' object has no attribute 'rows'"), TypeError("bad operand"),
                AssertionError("plan order"), KeyError("spec")):
        monkeypatch.setattr(mapped_weights, "plan_sharding", failing(bug))
        with pytest.raises(type(bug), match=str(bug.args[0])):
            mapped_weights.plan_mapping(**kwargs)
        with pytest.raises(type(bug), match=str(bug.args[0])):
            _backend(tiny_vl_path, mapping="auto")
    for refusal in (LayoutError("q_proj: 3 heads cannot be split evenly"), ValueError("not a run of whole rows")):
        monkeypatch.setattr(mapped_weights, "plan_sharding", failing(refusal))
        reason = mapped_weights.plan_mapping(**kwargs)
        assert reason == f"the plan cannot bind the rollout model: {type(refusal).__name__}: {refusal}"
        assert isinstance(_backend(tiny_vl_path, mapping="auto")[0].rollout, LiveRolloutWeights)
        with pytest.raises(RuntimeError, match=r"rollplex_weight_mapping='on' cannot map the rollout weights: "
                                               rf"the plan cannot bind .*{refusal}; use 'auto' or 'off'"):
            _backend(tiny_vl_path, mapping="on")
    monkeypatch.setattr(mapped_weights, "plan_sharding", plan_sharding)

    def no_driver(device):
        raise VmmUnavailable("cannot load the CUDA driver library libcuda.so.1")

    monkeypatch.setattr(mapped_weights, "_memory", no_driver)
    assert "memory for the mapping is unavailable: VmmUnavailable" in mapped_weights.plan_mapping(**kwargs)
    monkeypatch.setattr(mapped_weights, "_memory", lambda device: None)  # a bug in the memory backend: propagates
    with pytest.raises(AttributeError, match="page"):
        mapped_weights.plan_mapping(**kwargs)


def test_row_parallel_views_refusals(one_process, tiny_vl_path):
    from rollplex_trl import RollplexGRPOConfig

    for kwargs in ({}, {"rollplex_backend": "megatron", "rollplex_weight_mapping": "off"}):
        with pytest.raises(ValueError, match="rollplex_row_parallel_views='on' needs rollplex_backend='megatron'"):
            RollplexGRPOConfig(output_dir="/tmp/unused", rollplex_row_parallel_views="on", report_to=[],
                               use_cpu=True, **kwargs)
    with pytest.raises(ValueError, match="with use_vllm=True the engine copies every weight"):
        _backend(tiny_vl_path, row_parallel_views="on", use_vllm=True)


def test_on_needs_the_megatron_backend():
    from rollplex_trl import RollplexGRPOConfig

    with pytest.raises(ValueError, match="rollplex_weight_mapping='on' needs rollplex_backend='megatron'"):
        RollplexGRPOConfig(output_dir="/tmp/unused", rollplex_weight_mapping="on", report_to=[], use_cpu=True)


def test_vllm_server_mode_is_refused_colocate_is_not():
    from rollplex_trl.backends.megatron.backend import refuse_megatron_setup

    def config(**kw):
        return SimpleNamespace(rollplex_backend="megatron", rollplex_tensor_parallel_size=1, deepspeed=None,
                               fsdp=None, use_vllm=True, optim="adamw_torch", **kw)

    with pytest.raises(ValueError, match="vllm_mode='server'.*use vllm_mode='colocate'"):
        refuse_megatron_setup(config(vllm_mode="server"), peft_config=None, world_size=1, train_dataset=[])
    refuse_megatron_setup(config(vllm_mode="colocate"), peft_config=None, world_size=1, train_dataset=[])


def test_split_vision_refusals(one_process, tiny_vl_path):
    """rollplex_split_vision='on' where it cannot apply is refused with the reason (t = 1 here: nothing to split
    over); auto leaves the tower replicated."""
    from rollplex_trl import RollplexGRPOConfig

    with pytest.raises(ValueError, match="rollplex_split_vision='on' needs rollplex_backend='megatron' with"):
        RollplexGRPOConfig(output_dir="/tmp/unused", rollplex_split_vision="on", report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"rollplex_split_vision='on' cannot apply: t = 1"):
        _backend(tiny_vl_path, split_vision="on")
    backend, _, _ = _backend(tiny_vl_path, split_vision="auto")
    assert backend.vision_split is None and backend.policy.vision_split is None
