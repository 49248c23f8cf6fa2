"""The cost model behind `rollplex_share_prefix="auto"` (prefix/cost.py) against references:

- its FLOPs against PyTorch's FLOP counter on the real passes of a tiny Qwen2 and Qwen2.5-VL (TRL's full forward and
  the shared prefix + suffix), by kind: the linear layers and LM head exactly, eager attention's products exactly
  (the concat suffix computes every (query, key) pair; the serial path's modelled half is the fused kernels' causal
  case, and eager computes the whole square), the vision tower's blocks exactly;
- its decisions against the measured benchmark (benchmarks/results/shared_prefix_low_share*.json): at every measured
  (G, prompt share) and suffix attention, the path it picks was at least 0.98x of serial in the measurement;
- the once-per-run decision: from every process's prompts (the reduction), taken once, G = 1 never shares.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rollplex_trl.memory.model_dims import PRESETS, dims_from_config
from rollplex_trl.prefix.batch import shared_prefix_logps
from rollplex_trl.prefix.cost import (
    SHARE_MARGIN,
    ScoringShape,
    SharingDecision,
    choose_sharing,
    serial_flops,
    shared_flops,
    vision_attention_keys_per_patch,
    vision_flops_per_visual_token,
)
from rollplex_trl.prefix.suffix_attention import unsupported_reason

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
_MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul")


def _counted(fn) -> dict[str, float]:
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op): float(n) for op, n in counter.get_flop_counts()["Global"].items()}


def _text_model(path, attention: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).eval()


def _text_batch(G: int, P: int, C: int):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 300, (1, P), generator=gen).repeat(G, 1)
    completions = torch.randint(10, 300, (G, C), generator=gen)
    ids = torch.cat([prompt, completions], 1)
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_serial_flops_equal_the_counted_full_forward(tiny_qwen2_path, attention):
    """TRL's full forward of G rows: linear + head counted exactly; eager attention's two products are the full
    square per row, i.e. exactly twice the modelled causal half (sdpa's fused CPU kernel is not counted)."""
    model = _text_model(tiny_qwen2_path, attention)
    dims = dims_from_config(model.config, "tiny")
    G, P, C = 3, 17, 11
    ids, mask = _text_batch(G, P, C)
    with torch.no_grad():
        counted = _counted(lambda: model(input_ids=ids, attention_mask=mask, logits_to_keep=C))
    modelled = serial_flops(dims, ScoringShape(P, C, G))
    linear = counted.get("aten.mm", 0) + counted.get("aten.addmm", 0)
    # eager attention: q.k and p.v are bmm/matmul; the projections and head are mm/addmm
    products = sum(n for op, n in counted.items() if op in ("aten.bmm", "aten.matmul"))
    assert linear == pytest.approx(modelled.linear + modelled.head, rel=1e-9)
    if attention == "eager":
        assert products == pytest.approx(2 * modelled.attention, rel=1e-9)
    else:
        assert products == 0


@pytest.mark.parametrize("suffix", ["concat", "cascade"])
def test_shared_flops_equal_the_counted_prefix_and_suffix_passes(tiny_qwen2_path, suffix):
    """The shared path on the real passes (prefix once, G suffix rows): linear + head exactly; with eager attention
    and the concat suffix, the attention products too (every pair of the masked suffix, the prefix's full square)."""
    from rollplex_trl.prefix import suffix_logps

    G, P, C = 4, 19, 9
    ids, mask = _text_batch(G, P, C)
    model = _text_model(tiny_qwen2_path, "eager")
    dims = dims_from_config(model.config, "tiny")
    if suffix == "cascade" and unsupported_reason(model, torch.device("cpu")) is not None:
        pytest.skip("the cascade suffix does not apply here")

    def passes():
        shared_prefix_logps(model, ids, mask, C, None, temperature=1.0, compute_entropy=False, prompts_per_chunk=8,
                            suffix_fn=lambda *a, **k: suffix_logps(*a, **k, attention=suffix))

    with torch.no_grad():
        counted = _counted(passes)
    modelled = shared_flops(dims, ScoringShape(P, C, G), suffix)
    linear = counted.get("aten.mm", 0) + counted.get("aten.addmm", 0)
    assert linear == pytest.approx(modelled.linear + modelled.head, rel=1e-9)
    products = sum(n for op, n in counted.items() if op in ("aten.bmm", "aten.matmul"))
    prefix_square = 2 * (P - 1) ** 2 / 2 * 4 * dims.heads * dims.head_dim * dims.layers  # eager: the full square
    if suffix == "concat":
        assert products == pytest.approx(modelled.attention - prefix_square / 2 + prefix_square, rel=1e-9)
    else:  # the cascade's suffix attention runs fused CPU kernels (uncounted): only the eager prefix is counted
        assert products == pytest.approx(prefix_square, rel=1e-9)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("grid", [(2, 4, 6), (2, 12, 20), (1, 16, 16)], ids=lambda g: "x".join(map(str, g)))
def test_vision_flops_equal_the_counted_vision_tower(family, grid):
    """The whole vision tower per merged visual token, attention included, against PyTorch's FLOP counter on the
    real tower (eager attention: its products are counted matmuls): the blocks' projections and MLPs, the patch
    embedding's convolution, the merger(s) and the attention within windows (Qwen2.5-VL: the 12 x 20 frame has
    partial windows at its bottom and right edges) or over each temporal slice (the full blocks, Qwen3-VL)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from rollplex_trl.testing.checkpoints import get_checkpoint

    path = get_checkpoint(family, "tiny")
    dims = dims_from_config(AutoConfig.from_pretrained(path), "tiny")
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager").eval()
    v = dims.vision
    thw = torch.tensor([grid])
    patches = int(thw.prod())
    pixels = torch.randn(patches, v.in_channels * v.temporal_patch * v.patch * v.patch)
    with torch.no_grad():
        counted = _counted(lambda: model.model.visual(pixels, grid_thw=thw))
    assert set(counted) <= {"aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"}, counted
    modelled = vision_flops_per_visual_token(dims, frame=grid[1:]) * patches / v.merge**2
    assert sum(counted.values()) == pytest.approx(modelled, rel=1e-9)
    # without a frame: everything but the attention products
    assert sum(n for op, n in counted.items() if op != "aten.bmm") == pytest.approx(
        vision_flops_per_visual_token(dims) * patches / v.merge**2, rel=1e-9)


def test_vision_attention_keys_by_hand():
    """Qwen2.5-VL-7B's tower (32 blocks, 4 of them full, 112-pixel windows = 8 x 8 patches) on 448 x 448 frames
    (32 x 32 patches): 28 window blocks of 64 keys and 4 full blocks of 1024; on 12 x 20 patches the windows are
    8 x 8, 8 x 8, 8 x 4 and 4 x 8, 4 x 8, 4 x 4 (sizes 64, 64, 32, 32, 32, 16: squares summing to 11,520 over 240
    patches); Qwen3-VL attends over the frame in every block."""
    dims = PRESETS["Qwen2.5-VL-7B"]
    assert vision_attention_keys_per_patch(dims, (32, 32)) == 28 * 64 + 4 * 1024
    assert vision_attention_keys_per_patch(dims, (12, 20)) == 28 * 11_520 / 240 + 4 * 240
    qwen3 = PRESETS["Qwen3-VL-8B"]
    assert vision_attention_keys_per_patch(qwen3, (12, 20)) == qwen3.vision.depth * 240


def _benchmark_rows():
    rows = []
    for path in sorted(RESULTS.glob("shared_prefix_low_share*.json")):
        rows += json.loads(path.read_text())["rows"]
    return rows


def _visual_tokens(frames: int = 16, size: int = 112) -> int:
    return frames // 2 * (size // 28) ** 2  # the benchmark's clip: temporal patch 2, 14-px patches merged 2x2


@pytest.mark.parametrize("row", _benchmark_rows(), ids=lambda r: f"G{r['G']}-C{r['C']}")
def test_decisions_pick_a_path_the_measurement_says_is_not_slower(row):
    """At every measured point (small preset, P = 289 with 128 visual tokens): the decision's path was >= 0.98x of
    serial (ref + actor passes), for both suffix attentions; and where the measured gain is clear (>= 1.3x), it
    shares."""
    from transformers import AutoConfig

    from rollplex_trl.testing.checkpoints import get_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        dims = dims_from_config(AutoConfig.from_pretrained(get_checkpoint("qwen2_5_vl", "small", cache_dir=tmp)),
                                "small")
    shape = ScoringShape(row["P"], row["C"], row["G"], _visual_tokens())
    serial = row["serial"]["ref_s"] + row["serial"]["actor_s"]
    for attention, measured in (("concat", row["shared_concat"]), ("cascade", row["shared"])):
        ratio = serial / (measured["ref_s"] + measured["actor_s"])
        choice = choose_sharing(dims, shape, attention)
        picked = ratio if choice.share else 1.0
        assert picked >= 0.98, (attention, choice, ratio)
        if ratio >= 1.3:
            assert choice.share, (attention, choice, ratio)


def test_the_decision_is_taken_once_from_every_process_and_logged():
    from rollplex_trl.memory.model_dims import PRESETS

    dims = PRESETS["Qwen2.5-VL-7B"]
    seen, logged = [], []

    def reduce_sums(values):  # stands in for the all-reduce: another process contributes long prompts
        seen.append(values)
        return [values[0] + 4 * 3000.0, values[1] + 4 * 2500.0, values[2] + 4]

    decision = SharingDecision(dims, attention="concat", group_size=4, completion_bound=512,
                               reduce_sums=reduce_sums, warn=logged.append)
    choice = decision.decide([40] * 4, [0] * 4)  # this process alone: short text prompts (7% share: no gain)
    assert choice.shape.prompt_tokens == pytest.approx((4 * 40 + 4 * 3000) / 8)
    assert choice.shape.visual_tokens == pytest.approx(4 * 2500 / 8)
    assert choice.share and choice.modelled_speedup >= SHARE_MARGIN
    assert decision.decide([5] * 4, [0] * 4) is choice and len(seen) == 1  # once
    assert len(logged) == 1 and "rollplex_share_prefix=auto: on" in logged[0]
    alone = choose_sharing(dims, ScoringShape(40, 512, 4), "concat")
    assert not alone.share  # what this process's prompts alone would have decided
    assert not choose_sharing(dims, ScoringShape(3000, 16, 1), "cascade").share  # G = 1: nothing to share
