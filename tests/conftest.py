"""Shared fixtures: local checkpoints built once per test session (no model hub)."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def checkpoint_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_vl_path(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return get_checkpoint("qwen2_5_vl", "tiny", cache_dir=checkpoint_cache)


@pytest.fixture(scope="session")
def tiny_qwen2_path(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return get_checkpoint("qwen2", "tiny", cache_dir=checkpoint_cache)
