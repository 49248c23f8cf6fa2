"""The executor in one process (all devices' storage side by side): fast checks of views, copies and sync."""

import uuid

import pytest
import torch
from dist_worker import hf_weights, tiny_config
from vllm_reference import vllm_rank_weights

from rollplex_trl.sharding import ShardingOptions, model_spec_from_config, plan_sharding
from rollplex_trl.sharding.executor import CpuMemory, RolloutWeights, TrainingStorage
from rollplex_trl.sharding.materialize import framework_state


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    return config, model_spec_from_config(config, "tiny"), hf_weights(config)


@pytest.mark.parametrize("t,r,extra", [
    (8, 4, {}),
    (4, 2, dict(megatron_vision="sharded", megatron_vocab_multiple=16, remote="map")),
    (2, 4, dict(vllm_vision="replicated")),  # r > t: several rollout ranks read one training shard
    (8, 4, dict(page_size=65536)),  # a plan granularity above the OS page: more copies, still exact
])
def test_rollout_weights_follow_training_storage(tiny, t, r, extra):
    config, model, hf = tiny
    memory = CpuMemory()
    options = ShardingOptions(train_tp=t, rollout_tp=r, element_size=4, **{"page_size": memory.page, **extra})
    plan = plan_sharding(model, options)
    session = uuid.uuid4().hex[:8]
    storages, params = [], []
    for d in range(options.world):
        state = {n: torch.nn.Parameter(x.clone()) for n, x in framework_state(model, options, "train", d % t,
                                                                                 hf).items()}
        storage = TrainingStorage(plan, d, memory, session, torch.float32)
        storage.adopt(state)
        storages.append(storage)
        params.append(state)
    rollouts = [RolloutWeights(plan, d, memory, session, storages[d]) for d in range(options.world)]
    try:
        vision_tp = options.vllm_vision == "sharded"
        for step in range(2):
            weights = {n: w * 2 ** step for n, w in hf.items()}
            for rollout in rollouts:
                rollout.sync()
                ref = vllm_rank_weights(weights, config, r, rollout.spec.rollout_rank, vision_tp)
                for name, want in ref.items():
                    assert torch.equal(rollout.logical(name), want), (step, rollout.device, name)
            with torch.no_grad():
                for state in params:
                    for p in state.values():
                        p.mul_(2)  # in place: the arena's memory
        classes = {lay.cls for rollout in rollouts for lay in rollout.layouts.values()}
        assert "aligned" in classes and "view" in classes
    finally:
        for rollout in rollouts:
            rollout.close()
        for storage in storages:
            storage.close()
