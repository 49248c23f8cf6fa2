"""Planner arithmetic against hand-computed cases, the paper's 32B figure, and the plan-memory CLI."""

import json

import pytest

from rollplex_trl.memory.model_dims import PRESETS, ModelDims, resolve_model
from rollplex_trl.memory.planner import GIB, PHASES, Assumptions, Workload, components, plan_memory

from helpers import assert_is_a_drawn_chart, require

QWEN32 = PRESETS["Qwen2.5-VL-32B"]
TOY = ModelDims("toy", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32,
                tied_embeddings=False)


def test_parameter_counts():
    # exact counts of the released Qwen2.5-VL configs
    assert QWEN32.llm_params() == 32_763_876_352
    assert QWEN32.vision_params() == 688_841_984
    assert QWEN32.num_params() == 33_452_718_336
    # toy, by hand: per layer q 8*8+8, k/v 2*(8*4+4), o 8*8, mlp 3*8*16, norms 2*8 = 608; embed + head 2*256; norm 8
    assert TOY.layer_params() == 608
    assert TOY.llm_params() == 2 * 608 + 512 + 8
    # tp=2: q/o/mlp halve, the single KV head is replicated (72), norms stay: 36+72+32+192+16 = 348
    assert TOY.layer_params(2) == 348
    assert TOY.llm_params(2) == 2 * 348 + 256 + 8


def test_kv_and_activation_bytes():
    assert QWEN32.kv_bytes_per_token(4) == 2 * 64 * 2 * 128 * 2 == 64 * 1024
    assert QWEN32.kv_bytes_per_token(8) == 32 * 1024
    assert QWEN32.kv_bytes_per_token(16) == 32 * 1024  # 8 KV heads: replicated beyond TP 8
    # toy at TP 2 with sequence parallelism: 4h/2 + ((2+2)*4 + 2*4 + 3*16)/2 = 16 + 36 values
    assert TOY.layer_activation_values_per_token(2, True) == 52


def test_components_hand_computed():
    wl = Workload(train_tp=2, rollout_tp=1, num_gpus=4, batch=8, num_generations=2, prompt_len=10,
                  completion_len=6, device_mem_gib=1, micro_batch=1)
    c = components(TOY, wl, Assumptions())
    params_t = 2 * 348 + 256 + 8  # 960 per training GPU
    assert c["actor_weights"].nbytes == params_t * 2
    assert c["rollout_weights"].nbytes == TOY.llm_params() * 2
    assert c["grads"].nbytes == params_t * 4
    assert c["master"].nbytes == params_t * 4 / 2  # distributed optimizer over data-parallel 2
    assert c["moments"].nbytes == params_t * 8 / 2
    # 2 prompts per engine x G * (P + C) = 2 * 16 tokens x 2*2 layers*1 head*4*2 B = 32 B/token
    assert c["rollout_kv"].nbytes == 2 * 32 * 32
    assert c["actor_prefix_kv"].nbytes == 4 * 10 * 32  # 4 prompts per training group x P x 32 B
    assert c["prefix_graph_full"].nbytes == 4 * 10 * 2 * 52 * 2
    assert c["prefix_graph_inputs"].nbytes == 4 * 10 * (2 * 8 * 2 / 2)
    logits = 32 / 2 * 4
    assert c["train_act_suffix"].nbytes == 6 * (16 + 104 + 2 * logits)
    assert c["score_temps_full"].nbytes == 16 * logits * 2
    no_ref = components(TOY, wl, Assumptions(reference_model=False, prefix_caching=True))
    assert "ref_weights" not in no_ref and "ref_prefix_kv" not in no_ref
    assert no_ref["rollout_kv"].nbytes == 2 * (10 + 2 * 6) * 32  # the G samples share the prompt


def test_plans_are_the_sums_they_claim():
    report = plan_memory(QWEN32, Workload())
    c = {k: v.nbytes for k, v in report.components.items()}
    a = report.assumptions
    serial, naive, rp = (report.plans[k] for k in ("serial", "naive_overlap", "rollplex"))
    # serial: vLLM owns exactly its reservation during rollout; the plan total is the largest phase
    assert serial.phase_bytes(PHASES[0]) == pytest.approx(0.8 * 80 * GIB + c["runtime"])
    assert serial.phase_bytes(PHASES[2]) == pytest.approx(
        c["actor_weights"] + c["grads"] + c["master"] + c["moments"] + c["prefix_working"] + c["train_act_full"]
        + c["runtime"])
    assert serial.total_bytes == max(serial.phase_bytes(p) for p in PHASES)
    # naive: every persistent object at once, plus the rollout window's temporaries
    persistent = (c["actor_weights"] + c["ref_weights"] + c["grads"] + c["master"] + c["moments"]
                  + 0.8 * 80 * GIB + c["actor_prefix_kv"] + c["ref_prefix_kv"] + c["prefix_graph_full"]
                  + c["runtime"])
    assert naive.phase_bytes(PHASES[0]) == pytest.approx(persistent + c["prefix_working"])
    # rollplex: optimizer = weights + grads + two 512 MiB chunks; rollout = the overlap window
    assert rp.phase_bytes(PHASES[3]) == pytest.approx(c["actor_weights"] + c["grads"] + 2 * 512 * 2**20
                                                      + c["runtime"])
    assert rp.phase_bytes(PHASES[0]) == pytest.approx(
        c["actor_weights"] + a.incompatible_weight_fraction * c["rollout_weights"] + c["ref_weights"]
        + c["rollout_kv"] + c["rollout_workspace"] + c["actor_prefix_kv"] + c["ref_prefix_kv"]
        + c["prefix_graph_inputs"] + c["prefix_working"] + c["runtime"])
    by_class = rp.by_class()
    assert sum(by_class.values()) == pytest.approx(rp.total_bytes)


def test_paper_figure_for_32b():
    report = plan_memory(QWEN32, Workload(train_tp=8, rollout_tp=4))
    check = report.paper_check()
    assert check["within_10_percent"], check
    assert 148.5 <= report.plans["naive_overlap"].total_bytes / GIB <= 181.5
    assert not report.plans["naive_overlap"].fits
    assert report.plans["serial"].fits
    assert report.plans["rollplex"].fits
    assert report.plans["rollplex"].total_bytes < 80 * GIB
    assert plan_memory(PRESETS["Qwen2.5-VL-7B"], Workload()).paper_check() is None


def test_rollplex_kv_pool_shrinks_then_reports_what_does_not_fit():
    big = plan_memory(QWEN32, Workload(batch=256))
    kv = next(e for e in big.plans["rollplex"].entries if e.component == "rollout KV cache")
    assert "shrunk" in kv.note and kv.nbytes < big.components["rollout_kv"].nbytes
    assert big.plans["rollplex"].fits
    small = plan_memory(QWEN32, Workload(device_mem_gib=24))
    assert not small.plans["rollplex"].fits
    assert any("does not fit" in n for n in small.plans["rollplex"].notes)


def test_workload_validation():
    with pytest.raises(ValueError, match="multiple"):
        Workload(num_gpus=12, train_tp=8)
    with pytest.raises(ValueError, match="preset"):
        resolve_model("no-such-model")


def test_hf_config(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2Config

    text = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3456, num_heads=16, out_hidden_size=5120)
    Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False).save_pretrained(tmp_path / "vl")
    dims = resolve_model(str(tmp_path / "vl" / "config.json"))
    assert dims.num_params() == QWEN32.num_params()
    assert dims.kv_bytes_per_token(4) == QWEN32.kv_bytes_per_token(4)
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path / "llm")
    llm = resolve_model(str(tmp_path / "llm"))
    assert llm.vision is None and llm.head_dim == 16
    report = plan_memory(llm, Workload(train_tp=2, rollout_tp=1, num_gpus=2, batch=2, device_mem_gib=8))
    assert report.plans["rollplex"].fits


def _cli(capsys, *argv) -> str:
    from rollplex_trl.cli import main

    assert main(["plan-memory", *argv]) == 0
    return capsys.readouterr().out


def test_cli_json_schema(capsys):
    out = json.loads(_cli(capsys, "--model", "Qwen2.5-VL-32B", "--train-tp", "8", "--rollout-tp", "4", "--batch",
                          "32", "--num-generations", "8", "--prompt-len", "3072", "--completion-len", "768",
                          "--device-mem-gib", "80", "--json"))
    plans = out["plans"]
    for name in ("serial", "naive_overlap", "rollplex"):
        assert isinstance(plans[name]["total_gib"], float)
        assert isinstance(plans[name]["fits"], bool)
        assert set(plans[name]["by_class_gib"]) == {"boundary", "permanent", "regenerable", "phase_local",
                                                    "runtime"}
    assert plans["rollplex"]["fits"] is True
    assert abs(out["paper_check"]["relative_error"]) <= 0.10
    assert out["assumptions"]["stated"]


def test_cli_text_and_plot(capsys, tmp_path):
    require("matplotlib")
    png = tmp_path / "plan.png"
    text = _cli(capsys, "--plot", str(png))
    assert "Paper check" in text and "Assumptions:" in text and "TOTAL (peak phase)" in text
    assert_is_a_drawn_chart(png)
