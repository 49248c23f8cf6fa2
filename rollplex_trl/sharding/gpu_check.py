"""GPU check of the CUDA backend, for a machine with one GPU: ``python -m rollplex_trl.sharding.gpu_check``.

1. Driver VMM primitives: two allocations, one range stitched from their granules in reverse order; writes through
   either side are visible through the other (same physical memory, no copy).
2. The executor with :class:`~rollplex_trl.sharding.executor.CudaMemory`: every device of a t=8 -> r=4 plan is
   simulated on GPU 0 in this process (allocations are still shared by descriptor, through the UNIX-socket path),
   for a bf16 Qwen2 whose pieces are 2 MiB multiples. Every rollout tensor must equal the layout algebra's
   materialization; after an in-place update of the training parameters, aliased tensors must follow at once and
   copied ones after ``sync()`` (side stream) + ``wait()``.

Prints one JSON line per check and exits 1 if any fails. Needs torch with CUDA and the CUDA driver (the binding,
:mod:`rollplex_trl.memory.cuda_vmm`, is ctypes); the planner needs transformers (no trl, vLLM or megatron-core).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollplex_trl.sharding.executor import CpuMemory, CudaMemory


def _report(results: list, name: str, ok: bool, **detail) -> None:
    results.append(ok)
    print(json.dumps({"check": name, "ok": bool(ok), **detail}), flush=True)


def check_primitives(results: list) -> None:
    from rollplex_trl.memory import cuda_vmm

    gran = cuda_vmm.granularity(0, recommended=True)
    tag = uuid.uuid4().hex[:8]
    a = cuda_vmm.CudaFile.create(f"check-{tag}-a", 2 * gran, 0)
    b = cuda_vmm.CudaFile.create(f"check-{tag}-b", 2 * gran, 0)
    b_peer = cuda_vmm.CudaFile.open(f"check-{tag}-b", 0)  # imported by descriptor, as a peer process would
    a.bytes().view(torch.int32).copy_(torch.arange(2 * gran // 4, dtype=torch.int32, device="cuda"))
    b.bytes().view(torch.int32).fill_(-1)
    rng = cuda_vmm.CudaRange(3 * gran, 0)
    rng.map(0, b_peer, gran, gran)
    rng.map(gran, a, 0, 2 * gran)  # a non-zero allocation offset in the first map above
    view = rng.bytes().view(torch.int32)
    n = gran // 4
    same = bool((view[:n] == -1).all()) and torch.equal(view[n:], a.bytes().view(torch.int32))
    a.bytes().view(torch.int32)[7] = 4242
    view[3] = 99
    torch.cuda.synchronize()
    shared = view[n + 7].item() == 4242 and b.bytes().view(torch.int32)[n + 3].item() == 99
    _report(results, "vmm: stitched range reads both allocations", same, granularity=gran)
    _report(results, "vmm: writes visible both ways (no copy)", shared)
    rng.close()
    b_peer.close()
    a.close()
    b.close()


def check_executor(results: list, remote: str, memory: CpuMemory | CudaMemory | None = None) -> None:
    """``memory``: a backend (default ``CudaMemory(0)``); ``CpuMemory()`` runs the same script logic on a CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rollplex_trl.sharding import ShardingOptions, model_spec_from_config, plan_sharding
    from rollplex_trl.sharding.executor import CudaMemory, RolloutWeights, TrainingStorage
    from rollplex_trl.sharding.materialize import framework_state

    config = Qwen2Config(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, intermediate_size=8192, vocab_size=32768, tie_word_embeddings=False)
    model = model_spec_from_config(config, "check-qwen2")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    memory = memory or CudaMemory(0)
    device = memory.device
    options = ShardingOptions(train_tp=8, rollout_tp=4, page_size=max(memory.page, 2 << 20), element_size=2,
                              remote=remote)
    plan = plan_sharding(model, options)
    session = uuid.uuid4().hex[:8]
    storages, params = [], []
    for d in range(options.world):
        state = {n: torch.nn.Parameter(x.to(device)) for n, x in framework_state(model, options, "train", d % 8,
                                                                                   hf).items()}
        storage = TrainingStorage(plan, d, memory, session, torch.bfloat16)
        storage.adopt(state)
        storages.append(storage)
        params.append(state)
    rollouts = [RolloutWeights(plan, d, memory, session, storages[d]) for d in range(options.world)]
    classes: dict[str, int] = {}
    for rollout in rollouts:
        for lay in rollout.layouts.values():
            classes[f"{lay.cls}/{lay.mode}"] = classes.get(f"{lay.cls}/{lay.mode}", 0) + 1

    def references(step: int) -> dict:
        weights = {n: w * 2 ** step for n, w in hf.items()}
        return {j: framework_state(model, options, "rollout", j, weights) for j in range(options.rollout_tp)}

    def mismatches(names_of, ref) -> list[str]:
        return [f"device {r.device}: {n}" for r in rollouts for n in names_of(r)
                if not torch.equal(r.logical(n).cpu(), ref[r.spec.rollout_rank][n])]

    for step in range(2):
        ref = references(step)
        start = time.perf_counter()
        moved = 0
        for rollout in rollouts:
            moved += rollout.sync()["bytes"]
            rollout.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        bad = mismatches(lambda r: list(r.layouts), ref)
        _report(results, f"executor ({remote}): step {step}: every rollout tensor current after sync", not bad,
                bad=bad[:4], classes=classes, sync_bytes=moved, sync_seconds=round(seconds, 4))
        with torch.no_grad():
            for state in params:
                for p in state.values():
                    p.mul_(2)  # in place: the training arena
        if device.type == "cuda":
            torch.cuda.synchronize()
        stale = mismatches(lambda r: [n for n, lay in r.layouts.items() if lay.copied_bytes == 0], references(step + 1))
        _report(results, f"executor ({remote}): step {step}: aliased tensors follow without sync", not stale,
                stale=stale[:4])
    for rollout in rollouts:
        rollout.close()
    for storage in storages:
        storage.close()


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"check": "cuda available", "ok": False}))
        return 1
    results: list[bool] = []
    for name, fn in (("primitives", lambda: check_primitives(results)),
                     ("executor copy", lambda: check_executor(results, "copy")),
                     ("executor map", lambda: check_executor(results, "map"))):
        try:
            fn()
        except Exception as err:  # report and go on: each check is independent
            _report(results, f"{name} raised", False, error=repr(err))
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
