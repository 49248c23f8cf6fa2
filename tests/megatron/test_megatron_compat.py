"""rollplex_trl.megatron_compat: the version guard, and every CPU shim both needed (its probe fails without it, in a
fresh process) and sufficient (the probe passes with it). A megatron-core upgrade that fixes one of these paths
makes the "without" half fail: then the shim can go."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import require

require("megatron.core")

import rollplex_trl.megatron_compat as compat  # noqa: E402

WORKER = Path(__file__).with_name("megatron_worker.py")
PROBES = {  # probe -> (shim, what megatron-core does without it)
    "current_device:rope": ("current_device", "NVIDIA"),
    "current_device:memory_buffer": ("current_device", "NVIDIA"),
    "current_device:all_gather": ("current_device", "NVIDIA"),
    "rng_tracker": ("rng_tracker", "is not added"),
    "causal_mask": ("causal_mask", "NVIDIA"),
    "autocast:linear": ("autocast", "same dtype"),
    "autocast:frozen_linear": ("autocast", "same dtype"),
}


@pytest.fixture(scope="module")
def probes():
    if torch.cuda.is_available():
        pytest.skip("the CPU shims apply only without CUDA")
    done = subprocess.run([sys.executable, str(WORKER), "probes"], capture_output=True, text=True, timeout=300,
                          cwd=WORKER.parent)
    line = [x for x in done.stdout.splitlines() if x.startswith("PROBES ")]
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[0].removeprefix("PROBES "))


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_shim_is_needed_and_sufficient(probes, probe):
    _shim, symptom = PROBES[probe]
    assert symptom in probes[f"without:{probe}"], f"megatron-core no longer fails here: {probes[f'without:{probe}']}"
    assert probes[f"with:{probe}"] == "ok"


def test_every_shim_is_probed_and_applied(probes):
    assert set(probes["applied"]) == set(compat.SHIMS) == {shim for shim, _ in PROBES.values()}
    assert probes["applied_again"] == probes["applied"]  # idempotent: a second call is harmless


def test_shims_are_idempotent_and_scoped():
    import importlib

    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel import random as mrandom

    compat.apply_cpu_shims()
    tracker = mrandom.get_cuda_rng_tracker()
    forward = layers.LinearWithGradAccumulationAndAsyncCommunication.forward
    proxies = [importlib.import_module(m).torch for m in compat.CURRENT_DEVICE_MODULES]
    compat.apply_cpu_shims()
    assert mrandom.get_cuda_rng_tracker() is tracker
    assert layers.LinearWithGradAccumulationAndAsyncCommunication.forward is forward
    assert [importlib.import_module(m).torch for m in compat.CURRENT_DEVICE_MODULES] == proxies
    # scoped: megatron's modules see the CPU as current device, torch itself is untouched
    assert proxies[0].cuda.current_device() == torch.device("cpu")
    assert proxies[0].Tensor is torch.Tensor
    with pytest.raises(Exception):  # noqa: B017  torch's own answer without a GPU
        torch.cuda.current_device()


def test_version_guard(monkeypatch):
    assert compat.check_megatron_version("0.16.1") == "0.16.1"
    with pytest.raises(ImportError, match=r"megatron-core >=0\.16,<0\.17; found 0\.15\.2.*rollplex-trl\[megatron\]"):
        compat.check_megatron_version("0.15.2")
    with pytest.raises(ImportError, match=r"found 0\.17\.0"):
        compat.check_megatron_version("0.17.0")

    def missing(_name):
        raise compat.PackageNotFoundError(_name)

    monkeypatch.setattr(compat, "version", missing)
    with pytest.raises(ImportError, match=r"pip install 'rollplex-trl\[megatron\]'"):
        compat.check_megatron_version()


def test_the_tensor_parallel_all_reduces_are_where_the_routing_looks():
    """route_tensor_parallel_all_reduce proxies the global `torch` of these modules: their TP sums must still be
    `torch.distributed.all_reduce` calls (the trainer test counts the routed calls; this names the place if an
    upgrade moves them), the routing is scoped to them, and undo restores what was there."""
    import importlib
    import inspect

    from megatron.core.tensor_parallel import layers, mappings

    assert "torch.distributed.all_reduce(input_.contiguous(), group=group)" in inspect.getsource(mappings._reduce)
    backward = inspect.getsource(layers.LinearWithGradAccumulationAndAsyncCommunication.backward)
    assert "torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)" in backward
    assert "torch.distributed.all_reduce(" in inspect.getsource(layers.LinearWithFrozenWeight.backward)

    compat.apply_cpu_shims()
    before = {name: importlib.import_module(name).torch for name in compat.ALL_REDUCE_MODULES}
    seen = []
    undo = compat.route_tensor_parallel_all_reduce("group", lambda t: seen.append(t) or t.mul_(2))
    x = torch.ones(3)
    assert mappings.torch.distributed.all_reduce(x, group="group") is None and torch.equal(x, torch.full((3,), 2.0))
    handle = layers.torch.distributed.all_reduce(x, group="group", async_op=True)
    assert handle.wait() and len(seen) == 2
    assert layers.torch.Tensor is torch.Tensor  # everything else is torch's
    assert torch.distributed.all_reduce is not layers.torch.distributed.all_reduce  # torch itself untouched
    undo()
    assert {name: importlib.import_module(name).torch for name in compat.ALL_REDUCE_MODULES} == before
    assert mappings.torch.distributed is torch.distributed


def test_the_core_attention_internals_the_prefix_subclass_relies_on_still_hold():
    """backends/megatron/prefix.py's PrefixCoreAttention subclasses DotProductAttention (its base comes from
    megatron_compat.core_attention_base) and reads the attributes listed there: each one must still be set by
    megatron-core's own constructors, and forward must still take the parameters it passes on."""
    import inspect
    import re

    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rollplex_trl.backends.megatron.prefix import PrefixCoreAttention

    assert compat.core_attention_base() is DotProductAttention
    assert issubclass(PrefixCoreAttention, DotProductAttention)

    def assigned(cls) -> set[str]:
        return set(re.findall(r"self\.(\w+)\s*=", inspect.getsource(cls.__init__)))

    missing = set(compat.CORE_ATTENTION_ATTRIBUTES) - assigned(DotProductAttention)
    assert not missing, f"DotProductAttention.__init__ no longer sets {sorted(missing)}"
    missing = set(compat.CORE_ATTENTION_SOFTMAX_ATTRIBUTES) - assigned(FusedScaleMaskSoftmax)
    assert not missing, f"FusedScaleMaskSoftmax.__init__ no longer sets {sorted(missing)}"
    upstream = list(inspect.signature(DotProductAttention.forward).parameters)[1:]
    assert upstream == list(compat.CORE_ATTENTION_FORWARD), f"DotProductAttention.forward is now {upstream}"
    ours = list(inspect.signature(PrefixCoreAttention.forward).parameters)[1:]
    assert ours == upstream
