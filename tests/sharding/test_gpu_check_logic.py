"""The GPU check script's executor half, run with the CPU backend (its CUDA half needs a GPU)."""

import pytest

from rollplex_trl.sharding.executor import CpuMemory


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["copy", "map"])
def test_gpu_check_executor_logic_on_cpu(remote):
    from rollplex_trl.sharding.gpu_check import check_executor

    results: list[bool] = []
    check_executor(results, remote, CpuMemory())
    assert results and all(results)
