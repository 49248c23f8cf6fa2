"""Plans for the real Qwen2.5-VL sizes (shapes from configs on the meta device) and the plan-sharding CLI."""

import json
import re

import pytest

from rollplex_trl.cli import main
from rollplex_trl.sharding import ShardingOptions, load_model_spec, plan_sharding

GIB = 1 << 30


@pytest.fixture(scope="module")
def qwen32b():
    return load_model_spec("Qwen2.5-VL-32B")


def _fraction(model, pattern: str) -> float:
    """Parameters whose HF name matches ``pattern``, counted from the HF shapes (not from the planner)."""
    names = {n for g in model.groups for n in g.hf_names}
    shapes = {n: s for g in model.groups for n, s in zip(g.hf_names, g.shapes)}
    return sum(shapes[n][0] * shapes[n][1] * (3 if "attn.qkv" in n else 1) for n in names
               if re.search(pattern, n)) / model.numel


def test_32b_shapes_come_from_the_config(qwen32b):
    assert qwen32b.numel == 33_452_718_336  # the released config: LLM 32,763,876,352 + vision 688,841,984


def test_32b_t8_r4_at_cuda_granularity(qwen32b):
    s = plan_sharding(qwen32b, ShardingOptions(train_tp=8, rollout_tp=4)).summary()
    qkv = _fraction(qwen32b, r"language_model\..*self_attn\.[qkv]_proj")
    assert s["by_params"]["copy"] == pytest.approx(qkv)  # 6.25 MiB / 1.25 MiB q/k/v pieces: not 2 MiB pages
    assert sum(s["by_params"].values()) == pytest.approx(1.0)
    g = s["per_gpu_bytes"]
    assert g["aliased"] + g["copied"] == g["full_copy"]
    assert g["incompatible"] == pytest.approx(1.09 * GIB, rel=0.01)  # the paper's 1.1 GiB buffer
    assert g["full_copy"] == pytest.approx(qwen32b.numel * 2 / 4, rel=0.001)
    assert s["placement"]["local_fraction"] > 0.5 > s["placement"]["naive_local_fraction"]


def test_32b_t8_r4_at_cpu_page_granularity(qwen32b):
    s = plan_sharding(qwen32b, ShardingOptions(train_tp=8, rollout_tp=4, page_size=4096)).summary()
    row_parallel = _fraction(qwen32b, r"(o_proj|down_proj|attn\.proj|merger\.mlp\.2)\.weight")
    assert row_parallel == pytest.approx(0.3276, abs=1e-4)  # the paper's 32.8 %
    vit_qkv_bias = _fraction(qwen32b, r"attn\.qkv\.bias")  # [3, 320] view of the replicated bias
    assert s["by_params"]["view"] == pytest.approx(row_parallel + vit_qkv_bias)  # split-K views
    assert s["by_params"]["copy"] < 1e-4  # only the LLM QKV biases (1.25 KiB pieces)


def test_peer_bytes_mapped_instead_of_copied(qwen32b):
    s = plan_sharding(qwen32b, ShardingOptions(train_tp=8, rollout_tp=4, remote="map")).summary()
    g = s["per_gpu_bytes"]
    assert g["copied"] == pytest.approx(g["incompatible"], rel=0.01)
    assert g["remote_mapped"] > 6 * GIB


def test_presets_and_their_limits(capsys):
    assert main(["plan-sharding", "--model", "Qwen2.5-VL-7B", "--train-tp", "8", "--rollout-tp", "4"]) == 2
    assert "28 query heads" in capsys.readouterr().err
    assert main(["plan-sharding", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--train-tp", "8", "--rollout-tp", "4",
                 "--megatron-vision", "sharded"]) == 2
    assert "3420 rows" in capsys.readouterr().err  # the 3B/7B vision MLP cannot be split 8 ways
    three_b = load_model_spec("Qwen2.5-VL-3B")
    assert not any(g.kind.key == "llm.lm_head" for g in three_b.groups)  # tied embeddings


def test_cli_text_states_the_rule_and_the_paper(capsys):
    assert main(["plan-sharding", "--model", "Qwen2.5-VL-3B", "--train-tp", "4", "--rollout-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "counting rule:" in out and "paper" in out and "60.0%" in out and "3,754,622,976" in out


def test_cli_json_for_any_hf_config(tmp_path, capsys):
    from dist_worker import tiny_config

    path = tmp_path / "config.json"
    tiny_config().to_json_file(str(path))
    assert main(["plan-sharding", "--model", str(path), "--train-tp", "4", "--rollout-tp", "2", "--json",
                 "--page-size", "4KiB", "--dtype", "fp32"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s["by_params"]) == {"aligned", "view", "copy"}
    assert {"aliased", "copied", "full_copy"} <= set(s["per_gpu_bytes"])
    assert s["by_params"]["aligned"] > 0 and s["per_gpu_bytes"]["aliased"] > 0
    assert s["counting_rule"].startswith("Each element")
