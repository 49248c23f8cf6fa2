"""The Megatron backend in the trainer (2 CPU processes, gloo) learns what the `hf` backend learns.

- t = 2 (DP 1) against the `hf` backend in one process on the same video batches: 3 steps, beta > 0, gradient
  accumulation 2; loss, reward, KL and grad norm within 1e-4 relative, and the final weights (the rollout model's,
  rebuilt from the shards) equal.
- t = 1 (DP 2) against the `hf` backend's own 2-process DDP run (the data-parallel reference: each process samples
  with its own seed in both).
- t = 2 against the `hf` backend gradient by gradient (issue 31's configuration, the `small` preset), and the
  logged norm against an fp64 norm of them.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import require

require("megatron.core")

WORKER = Path(__file__).with_name("trainer_worker.py")
KEYS = ("loss", "kl", "grad_norm", "reward")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(checkpoint, out: Path, backend: str, tp: int, tag: str, *extra: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_port()}",
           str(WORKER), str(checkpoint), str(out), backend, str(tp), tag, *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(p.read_text()) for p in sorted(out.glob(f"{tag}-rank*.json"))]
    assert done.returncode == 0 and len(results) == 2, done.stdout[-3000:] + done.stderr[-8000:]
    return results


def _in_process(checkpoint, out: Path, tag: str) -> dict:
    sys.path.insert(0, str(WORKER.parent))
    import trainer_worker

    return trainer_worker.run(str(checkpoint), str(out), "hf", 1, tag)


def _one_process(checkpoint, out: Path, backend: str, tag: str, *extra: str) -> dict:
    """The worker as its own 1-process run (for modes that patch the trainer's classes, kept out of pytest's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(WORKER), str(checkpoint), str(out), backend, "1", tag, *extra],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-8000:]
    return json.loads((out / f"{tag}-rank0.json").read_text())


def _close(a: list[dict], b: list[dict], rel: float) -> None:
    assert len(a) == len(b) == 3
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in KEYS:
            assert x[key] == pytest.approx(y[key], rel=rel, abs=1e-6), (step, key, x[key], y[key])
    # the measured differences (pytest -s shows them)
    print({key: max(abs(x[key] - y[key]) / max(abs(y[key]), 1e-12) for x, y in zip(a, b)) for key in KEYS})


def _weights_close(a: Path, b: Path, rel: float) -> None:
    import torch

    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        diff = (wa[name] - wb[name]).abs().max().item()
        assert diff <= rel * max(1.0, wb[name].abs().max().item()), (name, diff)


def _updates_close(a: Path, b: Path, initial: Path, rel: float) -> None:
    """Per tensor, the training update of run a within ``rel`` of run b's (L2): ||a - b|| <= rel ||b - w0||.
    Not the largest element: Adam turns a gradient at float-noise level (1e-6 relative apart in the two backends)
    into a step of up to lr, so single elements of the vision tower's patch embedding ended 3e-4 apart while every
    tensor's update agreed within 5e-4 of its size (measured when written); a wrong or missing gradient moves a
    tensor's update by its own size."""
    import torch

    wa, wb, w0 = torch.load(a), torch.load(b), torch.load(initial)
    assert wa.keys() == wb.keys() == w0.keys()
    for name in wa:
        update = (wb[name] - w0[name]).norm().item()
        assert update > 0, name  # every tensor trained
        assert (wa[name] - wb[name]).norm().item() <= rel * update, (name, (wa[name] - wb[name]).norm() / update)


def _without_timings(logs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "rollplex/prefix_s"} for r in logs]


def _mapping_changes_nothing(tmp_path: Path, mapped: str, views: str) -> None:
    """rollplex_weight_mapping on vs off: the same training, bit for bit (logs but the sync's own bytes and the
    prefix timing, final weights on both ranks); only what a sync moves differs."""
    def learned(tag):
        return [_without_timings([{k: v for k, v in r.items() if not k.startswith("rollplex/sync")} for r in logs])
                for logs in (json.loads((tmp_path / f"{tag}-rank{rank}.json").read_text())["logs"]
                             for rank in (0, 1))]

    assert learned(mapped) == learned(views)
    for rank in (0, 1):
        _weights_close(tmp_path / f"{views}-rank{rank}-weights.pt", tmp_path / f"{mapped}-rank{rank}-weights.pt", 0.0)


def test_tensor_parallel_2_learns_what_hf_learns(tiny_vl_path, tmp_path):
    """With the overlap on: the reference and actor prefix jobs run on Megatron (TP collectives) in the worker
    thread while the rollout decodes; the scoring passes and the actor window take their states. With
    gradient_checkpointing (every LLM layer and the vision tower recomputed in the backward, the actor's prefix
    included) the same training bit for bit in fp32."""
    reference = _in_process(tiny_vl_path, tmp_path, "hf1")
    ranks = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "tp2", "overlap")
    recomputed = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "tp2gc", "overlap+gc")
    assert ranks[0]["recompute_layers"] == 0 and recomputed[0]["recompute_layers"] > 0
    assert _without_timings(recomputed[0]["logs"]) == _without_timings(ranks[0]["logs"])
    for rank in (0, 1):
        _weights_close(tmp_path / f"tp2gc-rank{rank}-weights.pt", tmp_path / f"tp2-rank{rank}-weights.pt", 0.0)
    views = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "tp2views", "overlap+views+gloo")
    assert not views[0]["rollout"]["mapped"]
    # the mapping and the shared-memory all-reduce off (gloo) vs on: bit-identical (at t = 2 a + b = b + a)
    assert all(r["shm_all_reduce_calls"] > 0 for r in ranks) and all(r["shm_all_reduce_calls"] == 0 for r in views)
    _mapping_changes_nothing(tmp_path, "tp2", "tp2views")
    assert all(r["world"] == 2 for r in ranks)
    # one TP group: every rank logs the same numbers
    assert _without_timings(ranks[0]["logs"]) == _without_timings(ranks[1]["logs"])
    generation_steps = [r for r in ranks[0]["logs"] if "rollplex/overlap_active" in r]
    assert generation_steps and all(r["rollplex/overlap_active"] == 1 for r in generation_steps)
    _close(ranks[0]["logs"], reference["logs"], 1e-4)
    _updates_close(tmp_path / "tp2-rank0-weights.pt", tmp_path / "hf1-rank0-weights.pt",
                   tmp_path / "hf1-rank0-initial.pt", 5e-3)
    _weights_close(tmp_path / "tp2-rank1-weights.pt", tmp_path / "tp2-rank0-weights.pt", 0.0)
    for rank, result in enumerate(ranks):
        _check_mapped_across_processes(result, rank)
    _prefilled_by_the_policy([*ranks, *recomputed, *views], windows=len(generation_steps))
    # rollplex_split_vision (on at t = 2): each rank's tower ran on one of the two prompts' videos per call; off,
    # every rank ran it on both: the same training up to the order of the videos' gradient sums
    replicated = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "tp2rep", "overlap+replicated")
    assert all(r["split_vision"] and r["tower_items"] and set(r["tower_items"]) == {1} for r in ranks)
    assert all(not r["split_vision"] and set(r["tower_items"]) == {2} for r in replicated)
    _close(ranks[0]["logs"], replicated[0]["logs"], 1e-4)  # measured: 3.6e-6 (loss), 3.3e-6 (grad norm)
    _updates_close(tmp_path / "tp2-rank0-weights.pt", tmp_path / "tp2rep-rank0-weights.pt",
                   tmp_path / "hf1-rank0-initial.pt", 5e-3)


@pytest.fixture(scope="module")
def small_vl_path(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return get_checkpoint("qwen2_5_vl", "small", cache_dir=checkpoint_cache)


def test_tensor_parallel_2_gradients_equal_hf_per_parameter(small_vl_path, tmp_path):
    """Issue 31's configuration (8-frame clips, 4 prompts, G = 4, GA 2, lr 1e-3, beta 0.04, fp32, 3 steps; the
    `small` preset, whose 2M-element embedding is long enough for fp32's norm rounding to show): per optimizer
    step, the gradients the clip sees (DP/TP-reduced, the split vision tower summed over TP once after both
    micro-batches, not yet clipped), in HF layout, against the hf backend's, tensor by tensor; and the logged norm
    (clipping active: above max_grad_norm = 1) against an fp64 norm of those gradients. Measured: gradients within
    3e-5 of each tensor's size, the logged norm 2.6e-8 from the fp64 norm of its own gradients (5.9e-6 before the
    norm's fp64 accumulation, an error that on Qwen-sized tensors reaches 1e-4 to 1e-3), 1.3e-6 from the hf
    gradients' (the hf backend's own fp32 norm, torch's clip_grad_norm_, is 8e-6 off it)."""
    import torch

    reference = _one_process(small_vl_path, tmp_path, "hf", "hfg4", "g4+grads")
    ranks = _torchrun(small_vl_path, tmp_path, "megatron", 2, "tp2g4", "g4+grads")
    _close(ranks[0]["logs"], reference["logs"], 1e-4)
    hf = torch.load(tmp_path / "hfg4-rank0-grads.pt")
    ours, peer = (torch.load(tmp_path / f"tp2g4-rank{rank}-grads.pt") for rank in (0, 1))
    assert len(hf) == len(ours) == len(peer) == 3

    def fp64_norm(grads):
        return sum(g.double().pow(2).sum() for g in grads.values()).sqrt().item()

    worst, norms = 0.0, []
    for step, (want, got, other) in enumerate(zip(hf, ours, peer, strict=True)):
        # every parameter has a gradient on both sides, no extra or missing one
        assert got.keys() == want.keys() == other.keys() == {n for n, _ in _named(tmp_path / "hfg4-rank0-initial.pt")}
        for name, g in want.items():
            assert torch.equal(got[name], other[name]), (step, name)  # one TP group: the same reduced gradients
            diff = (got[name].double() - g.double()).norm().item()
            worst = max(worst, diff / g.double().norm().item())
            assert diff <= 1e-4 * g.double().norm().item() + 1e-12, (step, name, diff, g.norm().item())
        logged = ranks[0]["logs"][step]["grad_norm"]
        assert logged > 1.0  # max_grad_norm = 1: the clip scales this step's update by 1 / logged
        norms.append((abs(logged / fp64_norm(got) - 1), abs(logged / fp64_norm(want) - 1),
                      abs(reference["logs"][step]["grad_norm"] / fp64_norm(want) - 1)))
    print(f"per-tensor gradients vs hf: {worst:.1e}; logged norm vs fp64 of its own gradients, of hf's; hf's "
          f"logged vs fp64 of its own: {norms}")
    assert all(own <= 1e-6 and hf_grads <= 1e-5 for own, hf_grads, _ in norms), norms


def _named(path: Path):
    import torch

    return torch.load(path).items()


def _check_mapped_across_processes(result: dict, rank: int, split_k: bool = True) -> None:
    """rollplex_weight_mapping (auto: on) at t = 2: the rollout model equals the trained shards after the last sync;
    each tensor's pages lie in the training shards' shared files (a peer's too) or, for the copied ones, in this
    rank's rebuild buffer; every sync copied exactly the plan's copy bytes. What must be copied follows from the
    layouts: q/k/v's fused bias (128-byte pieces per KV group) does not lie on 4096-byte pages, nor does a
    row-parallel weight (o_proj, down_proj: each HF row holds both ranks' columns, 128 bytes each), which with
    rollplex_row_parallel_views (``split_k``) is read in place as one strided view of both ranks' shards instead;
    everything else lies on pages."""
    binding = result["rollout"]
    assert binding["mapped"] and binding["unequal_to_trained"] == []
    files = binding["files"]
    peer = f"train-{1 - rank}"
    row_parallel = {n for n in files if ".language_model.layers." in n and n.endswith(("o_proj.weight",
                                                                                          "down_proj.weight"))}
    biases = {n for n in files if ".language_model.layers." in n and n.endswith(("q_proj.bias", "k_proj.bias",
                                                                                   "v_proj.bias"))}
    copied = {n for n, (mode, _) in files.items() if mode == "buffer"}
    assert copied == (biases if split_k else biases | row_parallel)
    assert {n for n, (mode, _) in files.items() if mode == "split-k"} == (row_parallel if split_k else set())
    for name, (mode, backing) in files.items():
        if mode == "buffer":
            assert backing == [f"buffer-{rank}"], name
        elif mode == "split-k":  # both ranks' column shards, nothing of the rebuild buffer
            assert backing == ["train-0", "train-1"], (name, backing)
        else:
            assert set(backing) <= {"train-0", "train-1"}, (name, backing)
    assert any(peer in backing for _, backing in files.values())  # the peer's shard pages, mapped here
    assert files["model.language_model.embed_tokens.weight"][1] == ["train-0", "train-1"]  # vocab split over ranks
    sync = [r for r in result["logs"] if "rollplex/sync_bytes_copied" in r]
    assert sync and all(r["rollplex/sync_bytes_copied"] == binding["plan_copy_bytes"] > 0 for r in sync)
    assert all(r["rollplex/sync_bytes_aliased"] == binding["aliased_bytes"] > 8 * binding["plan_copy_bytes"]
               for r in sync)


def test_tensor_parallel_2_through_the_vllm_path_learns_what_hf_learns(tiny_vl_path, tmp_path):
    """use_vllm=True (colocate) on the Megatron backend: the engine syncs from the transformers model, which the
    backend brings to the shards first (mapped), so the sampler's log-probs equal the Megatron model's own (TRL's
    importance-sampling metric) and the run learns what the hf backend with the same vLLM path learns. The engine
    is the main suite's stand-in (real vLLM: tests/vllm_cpu/test_vllm_megatron_cpu.py, t = 1)."""
    reference = _one_process(tiny_vl_path, tmp_path, "hf", "hfv", "vllm")
    ranks = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "tp2v", "vllm")
    _close(ranks[0]["logs"], reference["logs"], 1e-4)
    for result in ranks:
        assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in result["logs"]), result["logs"]
        assert result["rollout"]["mapped"] and result["rollout"]["unequal_to_trained"] == []


def test_data_parallel_2_learns_what_hf_ddp_learns(tiny_vl_path, tmp_path):
    """Also the rollout binding of rollplex_weight_mapping='off': views of the local shards (t = 1: all but
    q/k/v, which Megatron interleaves per KV group), the rest rebuilt after each step."""
    reference = _torchrun(tiny_vl_path, tmp_path, "hf", 1, "hfddp")
    ranks = _torchrun(tiny_vl_path, tmp_path, "megatron", 1, "dp2", "views")
    for result in ranks:
        assert not result["rollout"]["mapped"] and result["rollout"]["unequal_to_trained"] == []
        sync = [r for r in result["logs"] if "rollplex/sync_bytes_copied" in r]
        assert sync and all(r["rollplex/sync_bytes_copied"] > 0 for r in sync)
    _close(ranks[0]["logs"], reference[0]["logs"], 1e-4)
    _close(ranks[1]["logs"], ranks[0]["logs"], 0.0)
    # the serial schedule ("auto" on CPU): the Megatron prefix jobs ran right after decoding
    generation_steps = [r for r in ranks[0]["logs"] if "rollplex/prefix_s" in r]
    assert generation_steps and all(r["rollplex/prefix_s"] > 0 and r["rollplex/overlap_active"] == 0
                                    for r in generation_steps)
    _updates_close(tmp_path / "dp2-rank0-weights.pt", tmp_path / "hfddp-rank0-weights.pt",
                   tmp_path / "hfddp-rank0-initial.pt", 5e-3)
    _weights_close(tmp_path / "dp2-rank1-weights.pt", tmp_path / "dp2-rank0-weights.pt", 0.0)
    _prefilled_by_the_policy(ranks, windows=len(generation_steps))


def _prefilled_by_the_policy(ranks: list[dict], windows: int, audited_steps: int = 1) -> None:
    """The rollout decoded from the Megatron policy's prefix pass, kept with its graph as the actor's prefix
    (MegatronBackend.rollout_prefill; at t = 2 a collective, on the pooled rollout's peer too): no transformers
    prefill, one graph-carrying prompt forward per generation window (not the prefill and then the window's actor
    job), and the reference's no-grad job per window. Plus, per audited step (the default audits step 0), the
    exactness audit's own graph-carrying shared-prefix pass (its gradient check; its plain passes share nothing)."""
    for result in ranks:
        assert result["prefix_passes"] == {"transformers": 0, "megatron_graph": windows + audited_steps,
                                           "megatron_no_grad": windows}, result["prefix_passes"]


def test_tensor_parallel_checkpoint_loads_in_transformers_and_resumes_exactly(tiny_vl_path, tmp_path):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    full = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "tpsave", "save")
    checkpoint = tmp_path / "run-tpsave" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "optimizer-tp1-of-2.pt").is_file()
    # the saved model is a transformers checkpoint holding the trained (synced) weights
    loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "final-tpsave", dtype=torch.float32)
    trained = torch.load(tmp_path / "tpsave-rank0-weights.pt")
    for name, param in loaded.named_parameters():
        assert torch.equal(param.detach().float(), trained[name]), name
    resumed = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "tpres", "resume:tpsave")
    for rank, result in enumerate(resumed):  # bound again after the checkpoint's load, still mapped
        _check_mapped_across_processes(result, rank)
    assert resumed[0]["steps"] == full[0]["steps"] == [1, 2, 3]  # the first two from the checkpoint's state
    _close_step(resumed[0]["logs"][2], full[0]["logs"][2])
    _weights_close(tmp_path / "tpres-rank0-weights.pt", tmp_path / "tpsave-rank0-weights.pt", 0.0)
    _weights_close(tmp_path / "tpres-rank1-weights.pt", tmp_path / "tpsave-rank1-weights.pt", 0.0)


def _close_step(x: dict, y: dict) -> None:
    for key in KEYS:
        assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), (key, x[key], y[key])


def test_tensor_parallel_2_under_trl_defaults_bf16(tiny_vl_path, tmp_path):
    """bf16 autocast + gradient checkpointing (TRL's defaults: every LLM layer recomputed), with the weight
    mapping, the shared-memory all-reduce and the pooled rollout on and off (bit-identical: the same sampled tokens).
    Against the hf backend, measured when written: step 1 grad norm 7e-5 relative, entropy 6e-7; step 2 loss and KL
    5e-3 relative on a CPU with bf16 units (AMX), 2.7e-2 on one without (AVX2 only: torch emulates bf16 there and
    rounds differently): the bf16 rounding of two different kernels, amplified by one AdamW step (an element whose
    gradient is float noise moves by up to lr either way). Hence 6e-2 at step 2, which still catches a wrong update:
    KL grows with the square of the step, so an update off by 25% moves it by ~50%. By step 3 the rollouts sample
    different tokens (the rollout weights differ in the last bf16 bits), so only steps 1-2 are compared. Since the
    rollout decodes from the Megatron policy's prefill, its prompt K/V come from Megatron's kernels (TP-split sums):
    equal sampled tokens at steps 1-2 hold on this machine, and could in principle not on a CPU that rounds bf16
    differently."""
    sys.path.insert(0, str(WORKER.parent))
    import trainer_worker

    reference = trainer_worker.run(str(tiny_vl_path), str(tmp_path), "hf", 1, "hfbf", "bf16")["logs"]
    ranks = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "mgbf", "bf16")
    every_rank = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "mgbfviews", "bf16+views+gloo+allranks")
    # the prefix jobs concurrent with the decode (a worker thread on each rank), while the rollout model's weights
    # are marked for autocast's cast cache: the jobs run the Megatron models' own parameters, so the same numbers
    overlapped = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "mgbfoverlap", "bf16+overlap")
    assert all(r["rollplex/overlap_active"] == 1 for r in overlapped[0]["logs"] if "rollplex/overlap_active" in r)
    def learned(logs):
        return [{k: v for k, v in r.items() if k != "rollplex/overlap_active"} for r in _without_timings(logs)]

    assert learned(overlapped[0]["logs"]) == learned(ranks[0]["logs"])
    assert ranks[0]["rollout"]["mapped"] and ranks[0]["rollout"]["unequal_to_trained"] == []
    assert ranks[0]["shm_all_reduce_calls"] > 0
    assert ranks[0]["recompute_layers"] == ranks[1]["recompute_layers"] > 0  # gradient_checkpointing on the LLM
    # the first rank decoded with both ranks' threads (one each under torchrun here), the peer waited
    assert ranks[0]["pooled_threads"] == min(2, len(os.sched_getaffinity(0))) and every_rank[0]["pooled_threads"] == 0
    _mapping_changes_nothing(tmp_path, "mgbf", "mgbfviews")
    assert _without_timings(ranks[0]["logs"]) == _without_timings(ranks[1]["logs"])
    # the frozen rollout model's weights (split-K views included) cast once per generate call, not at every decode
    # step as autocast does for frozen weights (rollout_weights.autocast_caches_weights); its flags restored
    decoded = [result["rollout_weight_casts"] for result in (ranks[0], *every_rank, *overlapped)]
    assert ranks[1]["rollout_weight_casts"]["calls"] == []  # the pooled rollout's peer does not decode
    for counts in decoded:
        assert counts["calls"] and all(call["steps"] >= 2 for call in counts["calls"]), counts
        assert all(0 < call["casts"] <= counts["weights"] for call in counts["calls"]), counts
    assert all(result["rollout_frozen"] for result in (*ranks, *every_rank, *overlapped))
    # the pooled rollout's peer ran the first rank's prefill with it (a collective), and kept it as its actor prefix
    _prefilled_by_the_policy([*ranks, *every_rank, *overlapped], windows=3)
    # rollplex_split_vision on (these runs) vs off, under TRL's defaults: the same sampled tokens (equal rewards),
    # step 1 as tight as fp32's rounding allows, step 2 within the bf16 bound used against the hf backend below
    replicated = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "mgbfrep", "bf16+replicated")[0]["logs"]
    ours = ranks[0]["logs"]
    assert [r["reward"] for r in ours[:2]] == [r["reward"] for r in replicated[:2]]
    assert ours[0]["loss"] == pytest.approx(replicated[0]["loss"], abs=1e-6)
    assert ours[0]["grad_norm"] == pytest.approx(replicated[0]["grad_norm"], rel=1e-3)
    split_step2 = {key: abs(ours[1][key] - replicated[1][key]) / abs(replicated[1][key])
                   for key in ("loss", "kl", "grad_norm", "entropy")}
    print("bf16 step 2, split vision vs replicated:", split_step2)
    assert all(diff <= 6e-2 for diff in split_step2.values()), split_step2
    assert ours[0]["loss"] == pytest.approx(reference[0]["loss"], abs=1e-6)
    assert ours[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-3)
    assert ours[0]["entropy"] == pytest.approx(reference[0]["entropy"], rel=1e-4)
    assert ours[0]["reward"] == reference[0]["reward"] and ours[1]["reward"] == reference[1]["reward"]
    step2 = {key: abs(ours[1][key] - reference[1][key]) / abs(reference[1][key])
             for key in ("loss", "kl", "grad_norm", "entropy")}
    print("bf16 step 2, relative to the hf backend:", step2)  # pytest -s shows it
    assert all(diff <= 6e-2 for diff in step2.values()), step2


def test_one_process_under_trl_defaults_bf16(tiny_vl_path, tmp_path):
    """t = 1 in one process under TRL's defaults (bf16 autocast + gradient checkpointing) against the hf backend:
    the rollout decodes from the Megatron policy's prefill (its V cast to the dtype HF caches), kept as the actor's
    prefix. Step 1 as tight as t = 2's (the same sampled tokens: equal rewards; loss, grad norm, entropy), step 2
    within the two kernels' bf16 rounding after one AdamW step (see test_tensor_parallel_2_under_trl_defaults_bf16).
    The sampled tokens could in principle differ on another CPU: the prompt's K/V come from Megatron's kernels
    here, whose bf16 rounding differs from HF's in the last bits."""
    sys.path.insert(0, str(WORKER.parent))
    import trainer_worker

    reference = trainer_worker.run(str(tiny_vl_path), str(tmp_path), "hf", 1, "hf1bf", "bf16")["logs"]
    result = _one_process(tiny_vl_path, tmp_path, "megatron", "mg1bf", "bf16")
    _prefilled_by_the_policy([result], windows=3)
    ours = result["logs"]
    assert ours[0]["reward"] == reference[0]["reward"] and ours[1]["reward"] == reference[1]["reward"]
    assert ours[0]["loss"] == pytest.approx(reference[0]["loss"], abs=1e-6)
    assert ours[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-3)
    assert ours[0]["entropy"] == pytest.approx(reference[0]["entropy"], rel=1e-4)
    step2 = {key: abs(ours[1][key] - reference[1][key]) / abs(reference[1][key])
             for key in ("loss", "kl", "grad_norm", "entropy")}
    print("t = 1 bf16, step 1 grad norm", abs(ours[0]["grad_norm"] / reference[0]["grad_norm"] - 1), "step 2:", step2)
    assert all(diff <= 6e-2 for diff in step2.values()), step2


def test_tensor_parallel_2_audit_within_tolerance_and_catches_a_wrong_prefix(tiny_vl_path, tmp_path):
    """The exactness audit on the Megatron backend (t = 2): its plain pass is the Megatron model's own full rows (no
    shared prefix, no prefix built ahead), every rank checks, the values are reduced over the ranks. Clean: every
    pass and the actor's gradient within the fp32 tolerances, no warning. With the decode window's prefix values
    off by 1e-3 on rank 1 only: the reference log-probs exceed the tolerance and the mechanism is named. Under TRL's
    defaults (bf16, checkpointing, a pooled rollout): within the bf16 tolerances."""
    from rollplex_trl.trainers.verify import GRAD_TOLERANCE, TOLERANCE

    clean = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "mgaudit", "audit+overlap")
    audited = [[{k: v for k, v in row.items() if k.startswith("rollplex/verify_")} for row in rank["logs"]]
               for rank in clean]
    assert audited[0] == audited[1], "the audit's values are reduced over the ranks"
    passes = {k for row in clean[0]["logs"] for k in row if k.endswith("_logp_abs")}
    assert {"rollplex/verify_ref_logp_abs", "rollplex/verify_actor_logp_abs"} <= passes, passes
    assert all(v <= TOLERANCE["fp32"] for row in clean[0]["logs"] for k, v in row.items() if k.endswith("logp_abs"))
    min_cos, max_rel = GRAD_TOLERANCE["fp32"]
    grads = [(row["rollplex/verify_actor_grad_cos"], row["rollplex/verify_actor_grad_rel"])
             for row in clean[0]["logs"] if "rollplex/verify_actor_grad_cos" in row]
    assert grads and all(cos >= min_cos and rel <= max_rel for cos, rel in grads), grads
    assert not clean[0]["warnings"] and not clean[1]["warnings"]
    # TRL's defaults (bf16 autocast, gradient checkpointing): within the bf16 tolerances
    bf16 = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "mgauditbf", "audit+bf16")
    min_cos, max_rel = GRAD_TOLERANCE["bf16"]
    for row in bf16[0]["logs"]:
        assert all(v <= TOLERANCE["bf16"] for k, v in row.items() if k.endswith("logp_abs")), row
        assert row["rollplex/verify_actor_grad_cos"] >= min_cos and row["rollplex/verify_actor_grad_rel"] <= max_rel
    assert not bf16[0]["warnings"] and not bf16[1]["warnings"]
    fault = _torchrun(tiny_vl_path, tmp_path, "megatron", 2, "mgauditfault", "audit+overlap+prefixfault")
    assert fault[0]["logs"][0]["rollplex/verify_ref_logp_abs"] > TOLERANCE["fp32"]
    named = [w for rank in fault for w in rank["warnings"] if "Re-run without the prefix built ahead" in w]
    assert named, [rank["warnings"] for rank in fault]
