"""Fixtures of the Megatron tests."""

import pytest


@pytest.fixture(scope="module")
def one_process():
    """A 1-process world made by init_model_parallel itself; torn down so later tests see no process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    was_initialized = dist.is_initialized()
    yield
    parallel_state.destroy_model_parallel()
    if not was_initialized and dist.is_initialized():
        dist.destroy_process_group()
