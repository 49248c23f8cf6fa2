"""rollplex_trl.vllm_compat: importable without vLLM, the version guard, and each accessor of vLLM's internals. The
accessors are checked here against stand-ins shaped as vLLM 0.32's objects; the `needs_vllm` test checks them on a
real engine's classes (the .venv-vllm tier, `bash scripts/test_vllm.sh`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rollplex_trl import vllm_compat


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="where vLLM is installed, TRL imports it itself (GRPOTrainer's module); the lazy import is "
                    "checked where vLLM is absent: the main suite")
def test_importable_without_vllm_and_imports_it_lazily():
    """Importing the compat module (and the engine module that uses it) does not import vLLM."""
    code = ("import sys, rollplex_trl.vllm_compat, rollplex_trl.rollout.vllm_engine, rollplex_trl.rollout.vllm_targets;"
            " print(sorted(n for n in sys.modules if n.split('.')[0] == 'vllm'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_version_guard():
    assert vllm_compat.check_vllm_version("0.32.0") == "0.32.0"
    assert vllm_compat.check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    with pytest.raises(ImportError, match="vllm >=0.11,<0.33; found 0.33.0"):
        vllm_compat.check_vllm_version("0.33.0")
    with pytest.raises(ImportError, match="found 0.10.2"):
        vllm_compat.check_vllm_version("0.10.2")


def test_inprocess_model_and_max_model_len_follow_the_engine_chain():
    model = torch.nn.Linear(2, 2)
    runner = SimpleNamespace(model=model)
    config = SimpleNamespace(max_model_len=128)
    for worker in (SimpleNamespace(model_runner=runner), SimpleNamespace(worker=SimpleNamespace(model_runner=runner))):
        llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker),
                                                         model_config=config))
        assert vllm_compat.inprocess_model(llm) is model
        assert vllm_compat.max_model_len(llm) == 128


def test_layer_accessors():
    plain = torch.nn.Linear(3, 2)
    assert vllm_compat.hf_to_vllm_name(plain, "model.x") == "model.x"  # no mapper: the HF name
    plain.hf_to_vllm_mapper = SimpleNamespace(_map_name=lambda name: None if "drop" in name else f"v.{name}")
    assert vllm_compat.hf_to_vllm_name(plain, "a") == "v.a" and vllm_compat.hf_to_vllm_name(plain, "drop") is None
    assert not vllm_compat.is_repacked(plain)
    calls = []
    plain.cpu_linear = object()
    plain.output_size_per_partition, plain.input_size_per_partition = 2, 3
    plain.quant_method = SimpleNamespace(process_weights_after_loading=calls.append)
    assert vllm_compat.is_repacked(plain) and vllm_compat.partition_sizes(plain) == (2, 3)
    vllm_compat.reprocess_weights(plain)
    assert calls == [plain]


@pytest.mark.needs_vllm
def test_the_installed_vllm_has_the_internals_we_read():
    import inspect

    from vllm import LLM

    assert vllm_compat.llm_class() is LLM
    source = inspect.getsource(LLM.__init__)
    assert "self.llm_engine" in source, "LLM no longer keeps its engine as `llm_engine`"
