"""The compiled decode step (`rollplex_compile_decode`, prefix/compiled_decode.py) decodes what HF `generate` does.

The default run compiles with dynamo's "eager" backend: dynamo captures the decode step (the cache updates, the
thread-local switch and cascade attention inside the graph: what can go wrong here) without inductor's code
generation, which takes minutes on 2 cores. The slow tests run inductor itself.
"""

import threading

import pytest
import torch
from test_shared_decode import _config, _video_prompts, _vl_inputs
from torch._dynamo.utils import counters
from transformers import AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2ForCausalLM

import rollplex_trl.prefix.compiled_decode as compiled_decode
from rollplex_trl.prefix.generation import generate_with_shared_prefill


@pytest.fixture()
def backend(request, monkeypatch):
    monkeypatch.setattr(compiled_decode, "BACKEND", getattr(request, "param", "eager"))
    torch._dynamo.reset()
    yield compiled_decode.BACKEND
    torch._dynamo.reset()


@pytest.fixture()
def compiled_calls(monkeypatch):
    """How many decoder forwards went through the compiled function (and how many took the eager one)."""
    calls = {"compiled": 0, "eager": 0}
    original = compiled_decode.compiled_decoding

    def counting(causal_lm, is_decoding):
        def predicate():
            decoding = is_decoding()
            calls["compiled" if decoding else "eager"] += 1
            return decoding
        return original(causal_lm, predicate)

    monkeypatch.setattr(compiled_decode, "compiled_decoding", counting)
    return calls


def _generate(model, inputs, rows, config, *, compile_decode, seed=5):
    torch.manual_seed(seed)
    with torch.no_grad():
        if compile_decode is None:
            return model.generate(**inputs, generation_config=config)
        return generate_with_shared_prefill(model, **inputs, rows=rows, shared_decode="on",
                                            compile_decode=compile_decode, generation_config=config)


def _text(tiny_qwen2_path):
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_path)
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_path).eval()
    texts = ["count to three", "a much longer prompt about counting objects"]
    enc = dict(tok([t for t in texts for _ in range(4)], return_tensors="pt", padding=True, padding_side="left"))
    return model, enc


def test_text_greedy_and_sampled_equal_generate(tiny_qwen2_path, backend, compiled_calls):
    model, enc = _text(tiny_qwen2_path)
    for do_sample in (False, True):
        plain = _generate(model, enc, None, _config(do_sample, 10), compile_decode=None)
        compiled = _generate(model, enc, None, _config(do_sample, 10), compile_decode="on")
        assert torch.equal(plain, compiled), f"do_sample={do_sample}"
    # every decode step (the last prompt token, then 9 fed-back tokens) went through the compiled forward
    assert compiled_calls == {"compiled": 2 * 10, "eager": 0}
    assert "forward" not in vars(compiled_decode.text_decoder(model)), "the forward switch must be undone"
    # later generate calls with other shapes (prompt width, rows, length): the graphs of the first and of the
    # later steps of a call are specialised to the first call's sizes once (dynamo's automatic dynamic shapes);
    # from the second call on the same graphs serve every shape: no recompiles
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_path)
    for i, texts in enumerate([["two", "a prompt about objects that move to the left of the screen"],
                               ["three objects", "none of them move"]]):
        enc2 = dict(tok([t for t in texts for _ in range(3 + i)], return_tensors="pt", padding=True,
                        padding_side="left"))
        graphs = counters["stats"]["unique_graphs"]
        assert torch.equal(_generate(model, enc2, None, _config(False, 4 + i), compile_decode=None),
                           _generate(model, enc2, None, _config(False, 4 + i), compile_decode="on"))
    assert counters["stats"]["unique_graphs"] == graphs, "a new generate call recompiled the decode step"


@pytest.mark.slow  # the default run covers video through the trainer test below; the inductor test runs this
def test_video_greedy_equals_generate_and_logprobs_match(tiny_vl_path, backend, compiled_calls):
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path).eval()
    inputs, rows = _vl_inputs(processor, _video_prompts(processor))
    plain = _generate(model, inputs, rows, _config(False), compile_decode=None)
    config = _config(True, temperature=0.9, output_logits=True, return_dict_in_generate=True)
    sampled = {mode: _generate(model, inputs, rows, config, compile_decode=mode) for mode in ("off", "on")}
    assert torch.equal(plain, _generate(model, inputs, rows, _config(False), compile_decode="on"))
    assert torch.equal(sampled["off"].sequences, sampled["on"].sequences)
    P = inputs["input_ids"].size(1)
    completion = sampled["on"].sequences[:, P:]

    def logps(out):
        return torch.stack(out.logits, 1).log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)

    torch.testing.assert_close(logps(sampled["on"]), logps(sampled["off"]), atol=1e-5, rtol=0)
    assert compiled_calls["compiled"] == 2 * 8 and compiled_calls["eager"] == 0


def test_other_threads_run_the_eager_forward(tiny_qwen2_path, backend):
    """The overlap's prefix jobs call the same decoder from a worker thread during decoding: eager for them."""
    model, enc = _text(tiny_qwen2_path)
    decoder = compiled_decode.text_decoder(model)
    seen = {}
    with torch.no_grad():
        want = model(**enc).logits
        decoding = threading.local()
        decoding.on = True
        with compiled_decode.compiled_decoding(model, lambda: getattr(decoding, "on", False)):
            compiled = compiled_decode._COMPILED[decoder][1]
            worker = threading.Thread(target=lambda: seen.__setitem__("worker", model(**enc).logits))
            worker.start()
            worker.join()
            assert compiled is compiled_decode._COMPILED[decoder][1]
    assert torch.equal(seen["worker"], want)
    assert "forward" not in vars(decoder)


def test_on_needs_shared_decoding_and_auto_is_off(tiny_qwen2_path):
    model, enc = _text(tiny_qwen2_path)
    with torch.no_grad(), pytest.raises(ValueError, match="rollplex_compile_decode='on' needs shared-prefix"):
        generate_with_shared_prefill(model, **enc, shared_decode="off", compile_decode="on",
                                     generation_config=_config(False, 2))
    assert not compiled_decode.use_compiled_decode("auto", True)
    assert not compiled_decode.use_compiled_decode("off", True)
    assert compiled_decode.use_compiled_decode("on", True)


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_trainer_compiled_vs_eager_same_numbers(tiny_vl_path, tmp_path, backend, compiled_calls, defaults):
    """3 GRPO steps on video, compiled decode step on vs off (shared-prefix decoding on), same seed; in fp32 and
    under TRL's defaults (bf16 autocast, gradient checkpointing, beta 0, dapo)."""
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    from helpers import video_rows

    dataset = Dataset.from_list(video_rows(tmp_path))

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"]) % 5) for c in completions]

    precision = (dict(bf16=True, gradient_checkpointing=True, beta=0.0, loss_type="dapo") if defaults
                 else dict(bf16=False, gradient_checkpointing=False, beta=0.1))

    def run(mode):
        config = RollplexGRPOConfig(
            output_dir=str(tmp_path / mode), max_steps=3, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=6, learning_rate=5e-3, logging_steps=1, report_to=[], seed=11,
            use_cpu=True, save_strategy="no", rollplex_shared_decode="on", rollplex_compile_decode=mode,
            rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84, **precision)
        trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=reward, args=config, train_dataset=dataset)
        trainer.train()
        return [r for r in trainer.state.log_history if "loss" in r]

    on = run("on")
    assert compiled_calls["compiled"] > 0
    off = run("off")
    assert len(on) == len(off) == 3
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        for key in ("loss", "reward", "grad_norm") + (() if defaults else ("kl",)):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), f"{key} differs at step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor"], indirect=True)
def test_inductor_text_and_video(tiny_qwen2_path, tiny_vl_path, backend, compiled_calls):
    """Inductor's generated kernels (minutes of compile on 2 cores): greedy tokens equal plain generate."""
    test_text_greedy_and_sampled_equal_generate(tiny_qwen2_path, backend, compiled_calls)
    compiled_calls.update(compiled=0, eager=0)
    test_video_greedy_equals_generate_and_logprobs_match(tiny_vl_path, backend, compiled_calls)
