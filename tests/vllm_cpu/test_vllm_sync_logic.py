"""The weight sync, the sleep state machine and the request construction, without vLLM.

`FakeTargets` stands for a vLLM model: direct parameters, one "repacked" layer whose weight must be staged and
reprocessed (what vLLM's CPU backend does), in bf16 to check the dtype conversion.
"""

import torch

from rollplex_trl.rollout.engine import RolloutRequest, RolloutSample, SamplingSpec, flatten_rows
from rollplex_trl.rollout.layout import Target
from rollplex_trl.rollout.sources import TrainerTensor, iter_sources
from rollplex_trl.rollout.vllm_engine import VLLMColocateEngine, VLLMEngineConfig
from rollplex_trl.rollout.weight_sync import WeightSync
from rollplex_trl.sharding.layouts import SlicePair


class FakeTargets:
    def __init__(self, dtype=torch.bfloat16):
        self.store = {"fused.weight": torch.zeros(6, 4, dtype=dtype), "norm.weight": torch.zeros(4, dtype=dtype)}
        self.packed: dict[str, torch.Tensor] = {}  # what the "kernel" reads for the repacked layer
        self.reprocessed = 0
        self.targets = {
            "fused.weight": Target("fused.weight", "fused", "weight", (6, 4), dtype,
                                   pieces=[SlicePair("a", "fused.weight", 0, 0, 0, 2),
                                           SlicePair("b", "fused.weight", 0, 0, 2, 4)]),
            "norm.weight": Target("norm.weight", "norm", "weight", (4,), dtype,
                                  pieces=[SlicePair("n", "norm.weight", 0, 0, 0, 4)]),
            "lin.weight": Target("lin.weight", "lin", "weight", (3, 4), dtype, repacked=True,
                                 pieces=[SlicePair("l", "lin.weight", 0, 0, 0, 3)]),
        }

    def live(self, name):
        return None if name == "lin.weight" else self.store[name]

    def reprocess(self, module_name, staged):
        self.packed[module_name] = staged.clone()  # a repack copies: the staging buffer may be reused
        self.reprocessed += 1


def _sources(trainable=True):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(2, 4), "b": torch.randn(4, 4), "n": torch.randn(4), "l": torch.randn(3, 4)}
    return {k: torch.nn.Parameter(v, requires_grad=trainable) for k, v in tensors.items()}


def test_sync_is_exact_dtype_correct_and_bucketed():
    params = _sources()
    fake = FakeTargets()
    sync = WeightSync(fake, lambda: [TrainerTensor(k, p) for k, p in params.items()], bucket_bytes=40, alias=False)
    stats = sync.sync()
    assert torch.equal(fake.store["fused.weight"], torch.cat([params["a"], params["b"]]).detach().bfloat16())
    assert torch.equal(fake.store["norm.weight"], params["n"].detach().bfloat16())
    assert torch.equal(fake.packed["lin"], params["l"].detach().bfloat16())
    assert stats.buckets == 2 and stats.tensors_copied == 4 and fake.reprocessed == 1  # [fused] [norm, lin]
    assert stats.bytes_copied == (6 * 4 + 4 + 3 * 4) * 2
    m = stats.metrics()
    assert m["rollplex/weight_sync_bytes"] == stats.bytes_copied and m["rollplex/weight_sync_s"] >= 0


def test_partial_sync_skips_frozen_tensors():
    params = _sources()
    params["n"].requires_grad_(False)
    fake = FakeTargets()
    sync = WeightSync(fake, lambda: [TrainerTensor(k, p, trainable=p.requires_grad) for k, p in params.items()],
                      alias=False)
    sync.sync()
    assert sync.sync(full=False).bytes_copied == (6 * 4 + 3 * 4) * 2


def test_alias_when_layouts_match_and_refusal_reasons():
    params = _sources()
    fake = FakeTargets(dtype=torch.float32)
    sync = WeightSync(fake, lambda: [TrainerTensor(k, p) for k, p in params.items()])
    first = sync.sync()
    assert sync.aliased_names == ["a", "b", "n"]
    assert "repacks" in sync.alias_refusals["l"]
    with torch.no_grad():
        params["a"].add_(1.0)  # an optimizer step, in place
    assert torch.equal(fake.store["fused.weight"][:2], params["a"].detach())  # no sync needed
    second = sync.sync()
    assert second.bytes_copied == 3 * 4 * 4 and second.bytes_aliased == (6 * 4 + 4) * 4
    assert first.bytes_copied >= second.bytes_copied


def test_alias_refused_for_other_dtype_and_global_blocker():
    params = _sources()
    sync = WeightSync(FakeTargets(), lambda: [TrainerTensor(k, p) for k, p in params.items()])
    sync.sync()
    assert sync.aliased_names == [] and "dtype differs" in sync.alias_refusals["a"]
    sync = WeightSync(FakeTargets(dtype=torch.float32), lambda: [TrainerTensor(k, p) for k, p in params.items()],
                      alias_blocker="tensor parallelism")
    sync.sync()
    assert sync.aliased_names == [] and sync.alias_refusals["n"] == "tensor parallelism"


def test_peft_sources_merge_out_of_place(tiny_qwen2_path):
    """LoRA: vLLM gets W + s·B·A, the trainer's base weights stay bit-identical (no merge/unmerge drift)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32)
    hf_names = {n for n, _ in base.named_parameters()}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=["lm_head"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    sources = {s.name: s for s in iter_sources(model)}
    assert not any("lora_" in n or "base_layer" in n or "base_model" in n for n in sources)
    assert set(sources) == hf_names
    q = sources["model.layers.0.self_attn.q_proj.weight"]
    before = q.tensor.clone()
    merged = q.tensor + q.delta()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, before.shape[1])
    assert torch.allclose(layer(x), x @ merged.T, atol=1e-5)
    assert torch.equal(q.tensor, before) and q.trainable
    assert sources["model.norm.weight"].delta is None and not sources["model.norm.weight"].trainable
    assert sources["lm_head.weight"].param is model.base_model.model.lm_head.modules_to_save["default"].weight


class FakeLLM:
    """Records vLLM's sleep API calls; level 2 'discards' by zeroing what the engine's sync wrote."""

    def __init__(self, log):
        self.log = log

    def sleep(self, level):
        self.log.append(("sleep", level))

    def release_kv_cache_memory(self):
        self.log.append(("release_kv",))

    def wake_up(self, tags=None):
        self.log.append(("wake", tuple(tags or ())))

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.log.append(("generate", len(prompts)))
        return []


class FakeSync:
    def __init__(self, aliased=()):
        self.aliased_names = list(aliased)
        self.calls = []

    def sync(self, full=True):
        from rollplex_trl.rollout.weight_sync import SyncStats

        self.calls.append(full)
        return SyncStats(full=full)


def _engine(log, residency, aliased=()):
    engine = VLLMColocateEngine(VLLMEngineConfig(model="x", enable_sleep_mode=True), llm=FakeLLM(log))
    engine._weights_asleep = engine._kv_asleep = engine._discarded_once = True  # as after start-up's sleep(2)
    engine._make_weight_sync = lambda model: FakeSync(aliased)
    engine._decide_residency = lambda model: residency
    return engine


def _generate(engine):
    import rollplex_trl.rollout.vllm_engine as vllm_engine

    original = vllm_engine.sampling_params
    vllm_engine.sampling_params = lambda spec, n: None
    try:
        return engine.generate([], SamplingSpec())
    finally:
        vllm_engine.sampling_params = original


def test_discarded_weights_are_never_stale():
    """TRL issue 5312: after sleep(level=2) a rollout at the same step must re-push the weights."""
    log, model = [], torch.nn.Linear(2, 2)
    engine = _engine(log, "discarded")
    engine.sync_weights(model, version=0)
    assert log[:2] == [("wake", ("weights",)), ("reset_prefix_cache",)]
    _generate(engine)
    engine.sleep()
    assert ("sleep", 2) in log and not engine._weights_valid
    log.clear()
    _generate(engine)  # eval rollout at the same step, no sync call from the trainer: the engine re-syncs itself
    assert engine.weight_sync.calls == [True, True]
    assert log.index(("wake", ("weights",))) < log.index(("wake", ("kv_cache",))) < log.index(("generate", 0))
    engine.sleep()
    engine.sync_weights(model, version=0)  # the trainer's own call at the same step re-syncs too
    assert engine.weight_sync.calls == [True, True, True]


def test_kept_weights_only_release_the_kv_cache():
    log, model = [], torch.nn.Linear(2, 2)
    engine = _engine(log, "kept", aliased=["w"])
    engine.sync_weights(model, version=0)
    _generate(engine)
    engine.sleep()
    assert log[-2:] == [("sleep", 0), ("release_kv",)] and engine._weights_valid
    engine.sync_weights(model, version=1)
    assert engine.weight_sync.calls == [True, False]  # weights kept: only what can change is copied
    log.clear()
    _generate(engine)
    assert log == [("wake", ("kv_cache", "scheduling")), ("generate", 0)]


def test_offloaded_weights_come_back_and_sync_partially():
    log, model = [], torch.nn.Linear(2, 2)
    engine = _engine(log, "offloaded")
    engine.sync_weights(model, version=0)
    _generate(engine)
    engine.sleep()
    assert ("sleep", 1) in log and engine._weights_valid
    log.clear()
    engine.sync_weights(model, version=1)
    _generate(engine)
    assert engine.weight_sync.calls == [True, False]
    assert log == [("wake", ("weights",)), ("reset_prefix_cache",), ("wake", ("kv_cache",)), ("generate", 0)]


def test_requests_group_consecutive_rows():
    from rollplex_trl.rollout.requests import requests_for_rows

    ids = [[1, 2], [1, 2], [1, 2], [3], [3], [1, 2]]
    requests, owner = requests_for_rows(ids, None, None, num_generations=3)
    assert [(r.prompt_ids, r.n) for r in requests] == [([1, 2], 3), ([3], 2), ([1, 2], 1)]
    assert owner == [0, 0, 0, 1, 1, 2]
    requests, _ = requests_for_rows(ids, None, None, num_generations=1)  # tool turns: one request per row
    assert [r.n for r in requests] == [1] * 6
    results = [[RolloutSample([i, j], [-0.5, -0.25]) for j in range(r.n)] for i, r in enumerate(requests)]
    completions, logprobs = flatten_rows(results)
    assert len(completions) == 6 and logprobs[0] == [-0.5, -0.25]


def test_requests_keep_different_images_apart():
    from PIL import Image

    from rollplex_trl.rollout.requests import requests_for_rows

    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    requests, _ = requests_for_rows([[1], [1], [1], [1]], [[red], [red.copy()], [blue], [blue.copy()]], None, 2)
    assert [r.n for r in requests] == [2, 2]
    assert requests[0].multi_modal_data == {"image": red} and requests[1].multi_modal_data["image"] is blue


class FakeClient:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, **kwargs):
        self.calls.append(("generate", [list(p) for p in prompts], n))
        completions = [[7, k] for _ in prompts for k in range(n)]
        return {"prompt_ids": prompts, "completion_ids": completions,
                "logprobs": [[[-1.0], [-2.0]] for _ in completions]}

    def update_named_params(self, metadata, iterator):
        self.calls.append(("update", metadata, [(n, t.clone()) for n, t in iterator]))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))


def test_server_engine_sends_each_prompt_once_and_merged_weights(tiny_qwen2_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rollplex_trl.rollout.vllm_server import VLLMServerEngine

    client = FakeClient()
    engine = VLLMServerEngine(client)
    out = engine.generate([RolloutRequest([1, 2], 4), RolloutRequest([3], 4)], SamplingSpec(max_tokens=2))
    assert client.calls[0] == ("generate", [[1, 2], [3]], 4)
    assert [len(s) for s in out] == [4, 4] and out[1][3].logprobs == [-1.0, -2.0]

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    base_q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    metrics = engine.sync_weights(model, version=3)
    _, metadata, sent = client.calls[1]
    sent = dict(sent)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.allclose(sent["model.layers.0.self_attn.q_proj.weight"], base_q + layer.get_delta_weight("default"))
    assert torch.equal(layer.base_layer.weight, base_q)
    assert metrics["rollplex/weight_sync_bytes"] == sum(t.numel() * 4 for t in sent.values())
    assert engine.sync_weights(model, version=3) == {}  # same step: nothing sent


def test_transformers_engine_shares_the_interface(tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    from rollplex_trl.rollout.engine import RolloutEngine
    from rollplex_trl.rollout.transformers_engine import TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32)
    engine = TransformersEngine(model, pad_token_id=0, eos_token_ids=[2])
    assert isinstance(engine, RolloutEngine)
    torch.manual_seed(0)
    out = engine.generate([RolloutRequest([1, 5, 9], 3), RolloutRequest([4, 4], 2)], SamplingSpec(max_tokens=5))
    assert [len(s) for s in out] == [3, 2]
    sample = out[0][0]
    seq = torch.tensor([[1, 5, 9, *sample.completion_ids]])
    with torch.no_grad():
        logps = torch.log_softmax(model(seq).logits[0, 2:-1].float(), -1)
    expected = logps.gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)
    assert engine.sync_weights(model, 0)["rollplex/weight_sync_bytes"] == 0.0
