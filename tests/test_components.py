"""The trainer's components on their own: the run plan, the batch context, the overlap schedule and the
actor window, each against an independent reference (a plain full forward, a hand count), without a trainer."""

import contextlib

import pytest
import torch

from rollplex_trl.config import RollplexGRPOConfig, rollplex_options
from rollplex_trl.data.prompt import prompt_identity
from rollplex_trl.overlap import OverlapExecutor, OverlapSchedule
from rollplex_trl.prefix import suffix_logps
from rollplex_trl.prefix.actor import ActorWindow
from rollplex_trl.prefix.batch import StepPrefixes
from rollplex_trl.trainers.context import BatchContext
from rollplex_trl.trainers.memory import KeptResident
from rollplex_trl.trainers.plan import RunFacts, plan_run

_OPTIONS = {"rollplex_share_prefix": "auto", "rollplex_overlap": "auto"}


def _defaults() -> dict:
    """Every rollplex_* option at its default (from the config class, not restated here)."""
    return rollplex_options(RollplexGRPOConfig(output_dir="unused", report_to=[], use_cpu=True))


def _decide(options=None, **overrides):
    facts = dict(model_type="qwen2_5_vl", aux_loss=False, has_tools=False, custom_rollout=False, sharded=False,
                 num_processes=1, is_vlm=True, use_vllm=False, continuous_batching=False, num_beams=1,
                 num_generations=8, reward_func_names=("accuracy_reward", "format_reward"))
    facts.update(overrides)
    return plan_run({**_defaults(), **(options if options is not None else _OPTIONS)}, RunFacts(**facts))


# ---------------------------------------------------------------------------------------------------------------
# The run plan: one decision from the configuration and the trainer's facts
# ---------------------------------------------------------------------------------------------------------------

def test_support_turns_everything_on_where_it_is_exact():
    s = _decide()
    assert (s.share_scoring, s.share_actor, s.overlap_window, s.shared_prefill, s.prepare_images) == (True,) * 5
    assert not s.average_actor_gradients and s.notices == ()
    assert _decide(num_processes=2).average_actor_gradients


@pytest.mark.parametrize("blocker,words", [({"model_type": "gpt2"}, "model type 'gpt2'"),
                                           ({"aux_loss": True}, "aux loss"), ({"has_tools": True}, "tool"),
                                           ({"sharded": True}, "DeepSpeed/FSDP")])
def test_support_names_each_blocker_once_and_on_refuses(blocker, words):
    s = _decide(**blocker)
    assert not s.share_scoring and not s.share_actor and not s.overlap_window
    assert len([n for n in s.notices if n.startswith("rollplex_share_prefix: off")]) == 1
    assert words in s.notices[0]
    with pytest.raises(ValueError, match=words):
        _decide(options={**_OPTIONS, "rollplex_share_prefix": "on"}, **blocker)
    with pytest.raises(ValueError, match="rollplex_overlap"):
        _decide(options={"rollplex_share_prefix": "auto", "rollplex_overlap": "on"}, **blocker)


def test_support_beams_keep_scoring_shared_but_not_the_prefill():
    s = _decide(num_beams=4)
    assert s.share_scoring and not s.shared_prefill and not s.overlap_window
    assert any("num_beams=4" in n for n in s.notices)
    assert _decide(num_beams=4, use_vllm=True).overlap_window  # vLLM keeps its decode window


def test_support_off_means_off_without_notices():
    s = _decide(options={"rollplex_share_prefix": "off", "rollplex_overlap": "off"}, model_type="gpt2")
    assert not s.share_scoring and s.notices == ()


def test_plan_suffix_attention_cascade_where_it_applies_and_on_refuses():
    assert _decide().suffix_attention == "cascade"
    why = "device cuda: the fused kernels with log-sum-exp are wired for CPU only"
    s = _decide(cascade_unsupported=why)
    assert s.suffix_attention == "concat" and any(why in n for n in s.notices)
    with pytest.raises(ValueError, match="rollplex_suffix_attention='cascade' cannot run here: device cuda"):
        _decide(options={**_OPTIONS, "rollplex_suffix_attention": "cascade"}, cascade_unsupported=why)
    with pytest.raises(ValueError, match="must be one of"):
        _decide(options={**_OPTIONS, "rollplex_suffix_attention": "fast"})
    # the Megatron backend's suffix pass is its own: concat without a notice, a forced cascade refused
    megatron = _decide(backend="megatron", cascade_unsupported="the Megatron backend has its own suffix pass")
    assert megatron.suffix_attention == "concat" and not any("suffix_attention" in n for n in megatron.notices)
    assert _decide(options={**_OPTIONS, "rollplex_share_prefix": "off"}).suffix_attention == "concat"


def test_plan_temporal_refusals_and_accuracy_reward():
    on = {**_OPTIONS, "rollplex_temporal": True}
    plan = _decide(options={**on, "rollplex_temporal_reward": "format_reward"})
    assert plan.temporal and not plan.len_control and plan.temporal_reward_index == 1
    assert _decide(options=on).temporal_reward_index == 0  # '' : the first reward function
    with pytest.raises(NotImplementedError, match="rollplex_backend='megatron'"):
        _decide(options=on, backend="megatron")
    with pytest.raises(NotImplementedError, match="rollout_func"):
        _decide(options=on, custom_rollout=True)
    with pytest.raises(ValueError, match="rollplex_temporal_reward='acc' names no reward function"):
        _decide(options={**on, "rollplex_temporal_reward": "acc"})
    assert _decide(options={**_OPTIONS, "rollplex_len_control": True}).len_control


def test_plan_audit_is_on_for_both_backends():
    assert _decide().audit.every > 0  # None (auto): on
    assert _decide(backend="megatron").audit.every == _decide().audit.every
    assert _decide(options={**_OPTIONS, "rollplex_verify_every": 5}, backend="megatron").audit.every == 5


def test_plan_memory_on_holds_or_raises_and_auto_follows_the_measurement():
    kept = KeptResident("optimizer state", "the optimizer cannot stream", "optim='adamw_torch'")
    with pytest.raises(ValueError, match="rollplex_memory='on' cannot move the optimizer state"):
        _decide(options={**_OPTIONS, "rollplex_memory": "on"}, memory_kept=(kept,))
    with pytest.raises(ValueError, match="rollplex_memory='on' cannot act here: DeepSpeed"):
        _decide(options={**_OPTIONS, "rollplex_memory": "on"}, memory_unsupported="DeepSpeed shards")
    with pytest.raises(ValueError, match="rollplex_offload_activations='on'"):
        _decide(options={**_OPTIONS, "rollplex_memory": "off", "rollplex_offload_activations": "on"})
    assert _decide(options={**_OPTIONS, "rollplex_memory": "on"}).memory
    auto = {**_OPTIONS, "rollplex_memory": "auto"}
    pays = _decide(options=auto, memory_pays=(True, "90% of the device"), memory_kept=(kept,))
    assert pays.memory and pays.memory_kept == (kept,) and any("stays resident" in n for n in pays.notices)
    assert not _decide(options=auto, memory_pays=(False, "3% of the device")).memory


def test_plan_is_frozen_and_the_data_decision_is_made_once():
    plan = _decide()
    assert plan.sharing_pays is None
    decided = plan.decided_sharing(False)
    assert decided.sharing_pays is False and plan.sharing_pays is None  # a new plan; the old one unchanged
    with pytest.raises(RuntimeError, match="made once"):
        decided.decided_sharing(True)
    with pytest.raises(AttributeError):
        plan.share_scoring = False


# ---------------------------------------------------------------------------------------------------------------
# BatchContext
# ---------------------------------------------------------------------------------------------------------------

def test_batch_context_restores_the_outer_batch():
    ctx = BatchContext()
    outer, inner = ["a"], ["b"]
    with ctx.generating(outer):
        assert ctx.generation_rows is outer and ctx.scored_rows is outer
        with ctx.scoring(inner, actor=("prefix", None)):
            assert ctx.scored_rows is inner and ctx.actor == ("prefix", None)
        assert ctx.scored_rows is outer and ctx.actor is None
    assert ctx.generation_rows is None and ctx.scored_rows is None
    with pytest.raises(KeyError), ctx.scoring(inner):
        raise KeyError
    assert ctx.scored_rows is None


def test_one_prompt_identity():
    assert prompt_identity([1, 2]) == prompt_identity((1, 2)) != prompt_identity([1, 2, 3])
    import numpy as np
    red, blue = np.zeros((2, 2, 3), np.uint8), np.ones((2, 2, 3), np.uint8)
    assert prompt_identity([1], images=[red]) == prompt_identity([1], images=[red.copy()])
    assert prompt_identity([1], images=[red]) != prompt_identity([1], images=[blue])


# ---------------------------------------------------------------------------------------------------------------
# OverlapSchedule
# ---------------------------------------------------------------------------------------------------------------

def _schedule(mode, records, **kwargs):
    executor = OverlapExecutor("cpu", timeout_s=30)
    return OverlapSchedule(mode, executor, record=lambda m, training: records.append((m, training)),
                           warn=lambda message: None, **kwargs)


def _jobs(seen):
    def job(name):
        def run():
            seen.append((name, torch.is_grad_enabled()))
            return f"state of {name}"
        return name, run
    return [job("ref"), job("actor")]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_schedule_hands_each_state_to_scoring_once(mode):
    records, seen = [], []
    schedule = _schedule(mode, records)
    weight = torch.nn.Parameter(torch.zeros(2))
    prefixes = StepPrefixes()
    with torch.no_grad(), schedule.window(_jobs(seen), [weight], training=True, into=prefixes):
        pass
    assert prefixes.take_scoring(reference=True) == "state of ref" and prefixes.take_scoring(reference=True) is None
    assert prefixes.old is None and prefixes.take_actor() == "state of actor" and prefixes.take_actor() is None
    assert [name for name, _ in seen] == ["ref", "actor"] and all(not grad for _, grad in seen)  # caller's grad mode
    assert records[-1][0]["rollplex/overlap_active"] == (1.0 if mode == "on" else 0.0)
    schedule.close()


def test_schedule_auto_counts_training_windows_only_and_asks_process_0(monkeypatch):
    monkeypatch.setattr(OverlapSchedule, "auto_measures_on_cpu", True)
    records, asked = [], []
    schedule = _schedule("auto", records, broadcast=lambda decision: asked.append(decision) or True)
    weight = torch.nn.Parameter(torch.zeros(2))
    for training in (False, True, False, True, True, True):
        with schedule.window(_jobs([]), [weight], training=training, into=StepPrefixes()):
            pass
    active = [m["rollplex/overlap_active"] for m, training in records if training]
    assert active == [0.0, 0.0, 1.0, 1.0]  # warm-up, serial measurement, overlapped measurement, decided ON
    assert len(asked) == 1 and schedule.decided and schedule.active  # process 0's answer (True) won
    assert [m["rollplex/overlap_active"] for m, training in records if not training] == [0.0, 0.0]
    schedule.close()


def test_schedule_auto_is_serial_on_cpu_without_measuring():
    records = []
    schedule = _schedule("auto", records)
    assert schedule.decided and not schedule.active
    schedule.close()


# ---------------------------------------------------------------------------------------------------------------
# ActorWindow: the window's prefix gradient equals a plain full forward's
# ---------------------------------------------------------------------------------------------------------------

def test_actor_window_gradients_equal_the_full_forward(tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_path), dtype=torch.float32)
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    # two prompts (left-padded), two completions each, split over two micro-batches as TRL scatters them
    prompts = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completions = torch.randint(1, vocab, (4, 3))
    rows_prompt = [0, 1, 1, 0]
    micro_batches = [[0, 1], [2, 3]]

    def full_forward_loss():
        ids = torch.cat([prompts[rows_prompt], completions], 1)
        mask = torch.cat([prompt_mask[rows_prompt], torch.ones_like(completions)], 1)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 3:-1]  # as TRL calls it
        return logits.log_softmax(-1).gather(-1, completions[..., None]).sum()

    full_forward_loss().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    window = ActorWindow(contextlib.nullcontext, pad_token_id=0)
    window_prompts = [(prompts[rows_prompt][mb], prompt_mask[rows_prompt][mb], None) for mb in micro_batches]
    for mb in micro_batches:
        window.open(accumulation_steps=2)
        ids, mask = prompts[rows_prompt][mb], prompt_mask[rows_prompt][mb]
        actor, row_to_prompt = window.prefix_for(model, ids, mask, None, window_index=0,
                                                 window_prompts=lambda: window_prompts, precomputed=lambda: None)
        logps, _ = suffix_logps(model, actor.leaf_state, row_to_prompt, completions[mb],
                                torch.ones_like(completions[mb]), temperature=1.0, compute_entropy=False)
        logps.sum().backward()
        window.step_done(model)
    assert window.steps_left == 0 and window.prefixes == []  # one backward through the prefix, then released
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------------------------
# DatasetPreparation: which datasets take the prepared-prompt path
# ---------------------------------------------------------------------------------------------------------------

def _preparation(**overrides):
    from rollplex_trl.data.prepared import MediaOptions
    from rollplex_trl.data.video import VideoSamplingConfig
    from rollplex_trl.trainers.media import DatasetPreparation

    kwargs = dict(processor=object(), options=MediaOptions(sampling=VideoSamplingConfig()), is_vlm=True,
                  prepare_images=False, framed=False, custom_rollout=False)
    kwargs.update(overrides)
    return DatasetPreparation(**kwargs)


def test_media_leaves_text_and_unshared_image_datasets_to_trl():
    from datasets import Dataset

    from rollplex_trl.data.prepared import PreparedPromptDataset

    text = Dataset.from_dict({"prompt": ["a", "b"]})
    images = Dataset.from_dict({"prompt": ["a"], "image": ["x.png"]})
    prep = _preparation()
    assert prep.wrap(text, "train") is text and prep.wrap(images, "train") is images
    assert isinstance(_preparation(prepare_images=True).wrap(images, "train"), PreparedPromptDataset)
    assert not prep.has_video(text, images)


def test_media_refuses_what_cannot_carry_video():
    from datasets import Dataset

    from rollplex_trl.data.errors import RollplexDataError

    videos = Dataset.from_dict({"prompt": ["a"], "video": ["clip.mp4"]})
    with pytest.raises(RollplexDataError, match="the eval dataset has a video column but the processing class is a "
                                                "tokenizer"):
        _preparation(is_vlm=False).wrap(videos, "eval")
    with pytest.raises(NotImplementedError, match="tools, environments or a rollout_func"):
        _preparation(custom_rollout=True).wrap(videos, "train")
    with pytest.raises(RollplexDataError, match="not a datasets.IterableDataset"):
        _preparation().wrap(torch.utils.data.IterableDataset.__new__(_Stream), "train")
    stream = Dataset.from_dict({"prompt": ["a"], "video": ["clip.mp4"]}).to_iterable_dataset()
    prep = _preparation(framed=True)
    assert prep.wrap(stream, "train") is stream and prep.stream_preparer is not None and prep.has_video()


class _Stream(torch.utils.data.IterableDataset):
    column_names = ["prompt", "video"]

    def __iter__(self):
        yield {"prompt": "a", "video": "clip.mp4"}


# ---------------------------------------------------------------------------------------------------------------
# VLLMRollout: one request per prompt, a sync per optimizer step, the decode window around generation
# ---------------------------------------------------------------------------------------------------------------

class _Engine:
    def __init__(self):
        self.requests, self.slept = [], 0

    def generate(self, requests, spec):
        from rollplex_trl.rollout.engine import RolloutSample

        self.requests.append([(list(r.prompt_ids), r.n) for r in requests])
        return [[RolloutSample([len(r.prompt_ids), k], [-0.5, -0.25]) for k in range(r.n)] for r in requests]

    def sleep(self):
        self.slept += 1


class _Generation:
    def __init__(self):
        self.engine, self.synced = _Engine(), []

    def sync_weights(self, version):
        self.synced.append(version)
        return {"rollplex/weight_sync_s": 0.0}

    def sampling_spec(self):
        return None


def test_vllm_rollout_sends_each_prompt_once_and_syncs_once_per_step():
    from rollplex_trl.rollout.trl_vllm import VLLMRollout

    generation = _Generation()
    rollout = VLLMRollout(generation, pad_token_id=0, device=torch.device("cpu"))
    prompts = [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]  # two prompts, G = 2, as TRL's sampler orders them
    windows, records = [], []

    @contextlib.contextmanager
    def window(ids, mask):
        windows.append((ids.tolist(), mask.tolist()))
        yield

    synced = None
    for step in (0, 0, 1):
        (ids, logprobs), synced = rollout.generate(prompts, None, None, 2, weights_step=step, synced_step=synced,
                                                   decode_window=window, record=lambda k, v: records.append(k))
    assert generation.synced == [0, 1], "one sync per optimizer step"
    assert generation.engine.requests[0] == [([5, 6], 2), ([7, 8, 9], 2)], "one request per prompt, n = G"
    assert ids == [[2, 0], [2, 1], [3, 0], [3, 1]] and logprobs == [[-0.5, -0.25]] * 4  # TRL's row order
    assert windows[0] == ([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]], [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    assert generation.engine.slept == 3 and "rollplex/vllm_requests_per_row" in records
