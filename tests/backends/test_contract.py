"""The `TrainingBackend` contract (rollplex_trl/backends/base.py): the same checks on every backend against an
independent full forward (a plain transformers forward of prompt + completion, log_softmax(logits / T) at the
completion tokens, padded positions zeroed), fp32, on the tiny Qwen2.5-VL (video + image prompts) and Qwen2 (text)
checkpoints. What is checked and how: contract_worker.py.

- reference / old log-probs and entropies (`logps_and_entropies` under no_grad, share_prefix True and False):
  1e-5 max abs; the reference pass against a perturbed copy of the weights (a backend scoring the policy fails);
  `hf` with share_prefix=False and no prepared rows must return None (TRL's own pass);
- the actor's pass outside a window (`logps_and_entropies` with gradients) and inside one (`build_actor_prefix` +
  `actor_suffix_logps`): log-probs 1e-5, the global grad norm (`clip_grad_norm(None)`) 1e-4 relative, and every
  parameter's gradient, in HF names (Megatron: the TP shards all-gathered), 1e-4 relative to its max;
- sensitivity: the reference at a wrong temperature, and the reference model vs the policy, are > 1e-3 away from the
  backend's values (the comparisons can fail).

Backends: `hf` (suffix attention "auto" = cascade on CPU, and "concat"), `megatron` at t = 1 in this process and
t = 2 over 2 spawned processes (gloo). A new backend is one more entry in contract_worker.BACKENDS.
"""

from __future__ import annotations

import json
import socket

import contract_worker as cw
import pytest
import torch.multiprocessing as mp

from helpers import require

pytestmark = pytest.mark.filterwarnings("ignore")

BACKENDS = list(cw.BACKENDS)
# Known departures from the contract, as strict xfails (they flag the day they are fixed): (backend, check) -> why
KNOWN: dict[tuple[str, str], str] = {}  # (backend, check) -> why it is expected to fail today


def _spawn(name: str, processes: int, paths: dict[str, str], out) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(cw.main, args=(processes, port, name, paths, str(out)), nprocs=processes)
    finally:
        records = [r for p in sorted(out.glob("rank*.json")) for r in json.loads(p.read_text())]
    return records


@pytest.fixture(scope="module")
def process_group_teardown():
    """What an in-process backend initialized (megatron-core's grid and its 1-process gloo group), torn down after
    the module so later tests see no process group."""
    import sys

    import torch.distributed as dist

    was_initialized = dist.is_initialized()
    yield
    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if not was_initialized and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=BACKENDS)
def contract(request, tiny_vl_path, tiny_qwen2_path, tmp_path_factory) -> tuple[str, list[dict]]:
    """(backend name, its records): every check run once per backend, on every rank."""
    name, spec = request.param, cw.BACKENDS[request.param]
    if spec.requires:
        require(spec.requires)
    paths = {"vl": str(tiny_vl_path), "text": str(tiny_qwen2_path)}
    if spec.processes > 1:
        return name, _spawn(name, spec.processes, paths, tmp_path_factory.mktemp(f"contract-{name}"))
    request.getfixturevalue("process_group_teardown")
    records: list[dict] = []

    def record(model, check, ok, value=None, tol=None, detail=""):
        records.append({"backend": name, "model": model, "check": f"{model}: {check}", "rank": 0, "ok": bool(ok),
                        "value": value, "tol": tol, "detail": detail})

    cw.run_contract(name, paths, record)
    return name, records


def _assert_check(name: str, records: list[dict], check: str) -> None:
    failed = [r for r in records if r["check"].endswith("no exception")]
    assert not failed, failed[0]["detail"]
    mine = [r for r in records if r["check"] == check]
    processes = cw.BACKENDS[name].processes
    assert {r["rank"] for r in mine} == set(range(processes)), f"{check!r}: records of ranks {mine}"
    bad = [f"rank {r['rank']}: {r['value']} (tolerance {r['tol']}; {r['detail']})" for r in mine if not r["ok"]]
    assert not bad, f"{name}, {check}: " + "; ".join(bad)


@pytest.mark.parametrize("check", cw.check_names())
def test_contract(contract, check):
    name, records = contract
    _assert_check(name, records, check)


@pytest.mark.parametrize("model", cw.MODELS)
def test_padded_positions(contract, model, request):
    name, records = contract
    if (name, cw.PADDED_CHECK) in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN[name, cw.PADDED_CHECK]))
    _assert_check(name, records, f"{model}: {cw.PADDED_CHECK}")


def test_registry_covers_every_backend_class():
    """Every `TrainingBackend` implementation has an entry in BACKENDS (a new class added here fails until it
    has one), and each implements every method of the interface."""
    from rollplex_trl.backends.base import TrainingBackend

    methods = [m for m in vars(TrainingBackend) if not m.startswith("_") and callable(vars(TrainingBackend)[m])]
    classes = {"hf": "rollplex_trl.backends.hf:HfBackend",
               "megatron": "rollplex_trl.backends.megatron.backend:MegatronBackend"}
    assert {n.split("-")[0] for n in BACKENDS} == set(classes)
    import importlib

    for family, where in classes.items():
        if family == "megatron":
            require("megatron.core")
        module, cls = where.split(":")
        backend = getattr(importlib.import_module(module), cls)
        missing = [m for m in methods if not callable(getattr(backend, m, None))]
        assert not missing, f"{cls} lacks {missing}"
        assert backend.name == family
