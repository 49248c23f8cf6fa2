"""Video GRPO under multi-process DDP (2 CPU processes, gloo, torchrun): the shared prefix, the actor pass included,
learns what the unshared run learns, and the processes stay identical.

The actor's prefix/suffix passes run on the unwrapped model, bypassing DDP's forward, so DDP never reduces their
gradients; the trainer averages them once per window. Without that, the processes' gradient norms differ and their
weights drift apart (checked by hand when this was written: grad norms 3.17 vs 0.0 at the first step)."""

from pathlib import Path

import pytest

from helpers import run_two_processes


def _run(checkpoint, out: Path, share: str, port: int) -> list[dict]:
    return run_two_processes(Path(__file__).with_name("ddp_worker.py"), [str(checkpoint), str(out), share], out,
                             f"{share}-rank*.json", port)


def test_shared_actor_prefix_under_ddp_learns_the_same(tiny_vl_path, tmp_path):
    shared = _run(tiny_vl_path, tmp_path, "auto", 29583)
    plain = _run(tiny_vl_path, tmp_path, "off", 29584)
    assert all(r["world"] == 2 for r in shared + plain)
    assert all(r["share_actor"] for r in shared) and not any(r["share_actor"] for r in plain)
    # "auto"'s cost decision: from both processes' prompts (different on each), the same on both
    local = [r["sharing"]["local"][0] for r in shared]
    assert local[0] != local[1], "the ranks' first prompts have the same length: the test would not show a thing"
    total_tokens, total_visual, rows = (a + b for a, b in zip(*local, strict=True))
    for r in shared:
        assert r["sharing"]["share"] and r["sharing"]["shape"] == [total_tokens / rows, total_visual / rows]
    keys = ("loss", "kl", "grad_norm", "reward")
    for results in (shared, plain):  # the two processes hold the same weights and log the same numbers
        assert results[0]["checksum"] == results[1]["checksum"]
        assert [[r[k] for k in keys] for r in results[0]["logs"]] == [[r[k] for k in keys] for r in results[1]["logs"]]
    a, b = shared[0]["logs"], plain[0]["logs"]
    assert len(a) == len(b) == 2
    # step 1 is the same computation in another order: tight. Step 2 starts from weights after one AdamW step, which
    # turns rounding-level gradient differences on near-zero gradients into O(lr) weight differences: looser.
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in keys:
            assert x[key] == pytest.approx(y[key], rel=1e-5 if step == 0 else 1e-3, abs=1e-6), (step, key)


def test_auto_overlap_decision_is_the_same_on_every_rank(tiny_vl_path, tmp_path):
    # "auto" made to measure on CPU, with rank 0's measurement saying ON and rank 1's saying OFF: process 0 decides
    # and broadcasts (before, each rank decided on its own: one ON, the other OFF in the same job).
    results = _run(tiny_vl_path, tmp_path, "auto-measure", 29585)
    active = [[r["rollplex/overlap_active"] for r in result["logs"]] for result in results]
    assert active[0] == active[1] == [0.0, 0.0, 1.0, 1.0]
    assert results[0]["checksum"] == results[1]["checksum"]
