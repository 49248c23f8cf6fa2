"""Benchmark: shared-prefix decoding vs today's shared prefill (expanded cache), side by side in one run.

For each (G, prompt share) it builds U video prompts on the `small` local Qwen2.5-VL (random frames through the real
processor), repeats each G times as TRL's rollout does, and runs transformers' `generate` through
`generate_with_shared_prefill` twice on the same inputs: `shared_decode="off"` (each prompt prefilled once, its K/V
copied to the G rows: today's path) and `"on"` (the prompt's K/V held once, cascade attention). It reports
- decode time per step: one decode forward (the model step `generate` runs per token: cache read and append,
  attention, MLP, LM head) at the middle of the completion (cache after C/2 tokens: the mean step, as a step's cost
  grows linearly with the position), the two paths alternating step by step (each step is undone with `crop`), the
  median over --steps alternations. Alternating single steps keeps a machine shared with other jobs from loading one
  path more than the other. Whole `generate` calls (HF's sampling loop included) are timed too (`generate_s`, a
  median over --repeats, alternating);
- K/V bytes per group at the end of generation (the cache object's tensors: expanded = G rows x (P - 1 + C)
  positions; shared = the prompt once + the G rows' preallocated suffix buffers), against the ideal
  (P + G*C) / (G*(P + C));
- that both produce the same tokens (greedy).

The prompt share P / (P + C) is set through C (generation forced to exactly C tokens with min_new_tokens).

`--compile` adds the shared path's decode step through the compiled forward (`rollplex_compile_decode="on"`, with
its warm-up time: the compile); `--whole-step N` trains N video steps with shared-prefix decoding off and on,
alternating, and reports the whole step on the wall clock (`bench_common.wall_step_clock`; TRL's `step_time` in
the JSON) and the rollout's decode time (`rollplex/decode_s`).

Usage:  .venv/bin/python benchmarks/bench_shared_decode.py [--quick] [--compile] [--whole-step 4]
            [--out benchmarks/results/shared_decode.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
import warnings
from pathlib import Path

import torch
from bench_common import run_meta, wall_step_clock


def _prompts(processor, num_prompts: int, frames: int, size: int):
    from rollplex_trl.data.prompt import prepare_prompt
    from rollplex_trl.data.video import VideoSamplingConfig, frames_to_video

    sampling = VideoSamplingConfig(min_pixels=4 * 28 * 28, max_pixels=size * size)
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(num_prompts):
        clip = torch.randint(0, 255, (frames, 3, size, size), dtype=torch.uint8, generator=gen)
        video = frames_to_video(clip, 2.0, sampling)
        text = "How many objects move to the left? Answer briefly. " * (1 + i % 2)
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
        prompts.append(prepare_prompt(processor, messages, sample_id=str(i), videos=[video]))
    return prompts


def _inputs(prompts, G: int, pad_id: int) -> tuple[dict, list]:
    from trl.trainer.utils import pad

    from rollplex_trl.data.prompt import generation_fields

    rows = [p for p in prompts for _ in range(G)]
    fields = generation_fields(rows)
    inputs = dict(
        input_ids=pad([torch.tensor(r.prompt_ids) for r in rows], padding_value=pad_id, padding_side="left"),
        attention_mask=pad([torch.ones(r.num_prompt_tokens, dtype=torch.long) for r in rows], padding_value=0,
                           padding_side="left"),
        mm_token_type_ids=pad([torch.tensor(x) for x in fields.pop("mm_token_type_ids")], padding_value=0,
                              padding_side="left"),
        **fields,
    )
    return inputs, rows


def _cache_bytes(cache) -> int:
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _generate(model, inputs, rows, mode: str, C: int, caches: list | None = None) -> torch.Tensor:
    from transformers import GenerationConfig

    from rollplex_trl.prefix import generation

    config = GenerationConfig(max_new_tokens=C, min_new_tokens=C, do_sample=False, pad_token_id=0, eos_token_id=[])
    # keep the cache object (to weigh it and to time single decode steps on it)
    originals = generation._expanded_cache, generation._shared_cache

    def keep(fn):
        def wrapped(*args, **kwargs):
            cache = fn(*args, **kwargs)
            if caches is not None:
                caches.append(cache)
            return cache
        return wrapped

    generation._expanded_cache, generation._shared_cache = keep(originals[0]), keep(originals[1])
    try:
        with torch.no_grad():
            return generation.generate_with_shared_prefill(
                model, **inputs, rows=rows, shared_decode="on" if mode == "compiled" else mode,
                compile_decode="on" if mode == "compiled" else "off", generation_config=config)
    finally:
        generation._expanded_cache, generation._shared_cache = originals


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _step_fn(model, inputs, rows, mode: str, t: int):
    """A function running one decode step on the cache as `generate` has it after t tokens, then undoing it.

    The cache is brought there quickly: `generate` for one token (the shared prefill, then the last prompt token),
    then the other t - 1 tokens (random ids: the cost does not depend on them) in one forward through the same
    cache and attention, at the positions `generate` would give them."""
    from rollplex_trl.prefix import compiled_decode, shared_decode
    from rollplex_trl.prefix.forward import cache_kwarg

    caches: list = []
    out = _generate(model, inputs, rows, "on" if mode == "compiled" else mode, 1, caches)
    cache, backbone = caches[-1], model.base_model
    deltas = backbone.rope_deltas  # generate's M-RoPE deltas for these rows (generate_with_shared_prefill sets them)
    switch = (lambda: shared_decode.decoding_with(model, cache)) if mode in ("on", "compiled") \
        else contextlib.nullcontext
    gen = torch.Generator().manual_seed(0)
    filler = torch.randint(100, 500, (out.size(0), t), generator=gen).to(out.device)
    ids = torch.cat([out, filler], dim=1)
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(ids[:, inputs["input_ids"].size(1):])], dim=1)

    def forward(tokens: torch.Tensor, width: int) -> None:
        # the positions HF's generate gives these tokens (explicit: the VL model cannot infer them with a cache)
        positions = (mask[:, :width].long().cumsum(-1) - 1)[:, width - tokens.size(1):]
        if deltas is not None:
            positions = (positions + deltas).unsqueeze(0).expand(3, -1, -1)
        with torch.no_grad(), switch():
            model(input_ids=tokens, attention_mask=mask[:, :width], position_ids=positions,
                  **{cache_kwarg(model): cache}, logits_to_keep=1)

    # the cache holds prompt[:-1] + the last prompt token (P positions); feed generated tokens 0 .. t-2, so that the
    # timed step feeds token t-1 against P + t - 1 cached positions, as `generate`'s step for token t does
    P = inputs["input_ids"].size(1)
    if t > 1:
        forward(ids[:, P: P + t - 1], P + t - 1)

    def step() -> None:
        if mode == "compiled":  # only the timed one-token step runs compiled (as in generate)
            with compiled_decode.compiled_decoding(model, shared_decode.decoding_on_this_thread):
                forward(ids[:, P + t - 1: P + t], P + t)
        else:
            forward(ids[:, P + t - 1: P + t], P + t)
        cache.crop(-1)

    return step


def _measure(model, inputs, rows, C: int, repeats: int, steps: int, compiled: bool = False) -> dict[str, dict]:
    """Both paths, alternating (a machine shared with other jobs then loads both alike). repeats = 0: single steps
    only (no whole generate: no token comparison, K/V bytes from the shapes). `compiled`: also the shared path's
    decode step through the compiled forward (prefix/compiled_decode.py), single steps only, after a warm-up
    whose time (the compile, the first time) is reported as `first_steps_s`."""
    device = inputs["input_ids"].device
    result = {}
    modes = ("off", "on", "compiled") if compiled else ("off", "on")
    for mode in modes:
        result[mode] = {"generate": [], "step": [], "step_cpu": []}
        if repeats:
            caches: list = []
            start = time.perf_counter()
            result[mode]["tokens"] = _generate(model, inputs, rows, mode, C, caches)  # warm-up, tokens, cache size
            result[mode]["first_generate_s"] = time.perf_counter() - start  # compiled: includes the compile
            result[mode]["kv_bytes"] = _cache_bytes(caches[-1])
    for _ in range(repeats):
        for mode in modes:
            start = time.perf_counter()
            _generate(model, inputs, rows, mode, C)
            _sync(device)
            result[mode]["generate"].append(time.perf_counter() - start)
    step = {mode: _step_fn(model, inputs, rows, mode, max(1, C // 2)) for mode in modes}
    if compiled:
        start = time.perf_counter()
        for _ in range(3):  # compiles (the first shape, then the dynamic graph) or reuses the graphs
            step["compiled"]()
        result["compiled"]["first_steps_s"] = time.perf_counter() - start
    for _ in range(steps):
        for mode in modes:
            _sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            step[mode]()
            _sync(device)
            result[mode]["step"].append(time.perf_counter() - start)
            result[mode]["step_cpu"].append(time.process_time() - start_cpu)
    for r in result.values():
        r["decode_step_s"] = statistics.median(r.pop("step"))
        r["decode_step_cpu_s"] = statistics.median(r.pop("step_cpu"))
        generate = r.pop("generate")
        r["generate_s"] = statistics.median(generate) if generate else None
    return result


def _kv_bytes_from_shapes(model, inputs, G: int, U: int, C: int) -> tuple[int, int]:
    """K/V bytes at the end of generation, from the shapes (what the two caches hold, as measured when repeats>0)."""
    config = model.config.get_text_config()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * next(model.parameters()).element_size()
    width = inputs["input_ids"].size(1)
    real = inputs["attention_mask"][::G].sum(1)  # the unique prompts' lengths (trimmed to the longest)
    trimmed = int(real.max()) - 1
    expanded = U * G * (width - 1 + C) * per_token
    shared = (U * trimmed + U * G * (C + 1)) * per_token  # prompts once; suffix buffers preallocated to C + 1
    return expanded, shared


def _whole_step(model_path, G: int, C: int, args, mode: str, tmp: Path, index: int) -> dict:
    """One short training run (video, the synthetic task at --frames x --size) with shared-prefix decoding `mode`:
    the median step time and rollout decode time over its steps after the first."""
    from bench_shared_prefix import _dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data import accuracy_reward, format_reward

    steps = args.whole_step
    dataset = _dataset(tmp / f"data-{G}-{C}", num_prompts=max(8, args.prompts * steps), frames=args.frames,
                       size=args.size)
    config = RollplexGRPOConfig(
        output_dir=str(tmp / f"out-{G}-{C}-{mode}-{index}"), max_steps=steps,
        per_device_train_batch_size=G * args.prompts, num_generations=G, max_completion_length=C,
        generation_kwargs={"min_new_tokens": C}, beta=0.04,
        learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        use_cpu=not torch.cuda.is_available(), bf16=False, gradient_checkpointing=True, rollplex_shared_decode=mode,
        rollplex_video_max_frames=args.frames, rollplex_video_min_pixels=28 * 28 * 4,
        rollplex_video_max_pixels=args.size * args.size, rollplex_prefix_chunk_prompts=args.prompts)
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=[accuracy_reward, format_reward], args=config,
                                  train_dataset=dataset)
    clock = wall_step_clock()
    trainer.add_callback(clock)
    trainer.train()
    logs = trainer.state.log_history
    step_times = [r["step_time"] for r in logs if "step_time" in r][1:]  # the first step warms up
    decode = [r["rollplex/decode_s"] for r in logs if "rollplex/decode_s" in r][1:]
    return {"step_s": statistics.median(clock.steps[1:]), "trl_step_time_s": statistics.median(step_times),
            "decode_s": statistics.median(decode) if decode else None,
            "prompt_tokens": max(r.get("num_tokens", 0) for r in logs) / steps / (G * args.prompts) - C}


def _whole_steps(model_path, G: int, C: int, args) -> dict:
    """Off and on alternating, --repeats runs each (at least 1): medians over the runs."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="rollplex-bench-decode-"))
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for index in range(max(1, args.repeats)):
        for mode in ("off", "on"):
            torch.manual_seed(0)
            runs[mode].append(_whole_step(model_path, G, C, args, mode, tmp, index))
    out = {mode: {"step_s": statistics.median(r["step_s"] for r in rs),
                  "decode_s": statistics.median(r["decode_s"] for r in rs), "runs": rs} for mode, rs in runs.items()}
    out["step_speedup"] = out["off"]["step_s"] / out["on"]["step_s"]
    out["decode_speedup"] = out["off"]["decode_s"] / out["on"]["decode_s"]
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _write(path: str, args, rows: list[dict]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**run_meta(), "preset": args.preset, "frames": args.frames, "size": args.size, "prompts": args.prompts,
            "repeats": args.repeats, "steps": args.steps, "device": "cuda" if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--generations", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.9, 0.5], help="prompt shares P / (P + C)")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--prompts", type=int, default=2, help="unique prompts U per generate call")
    parser.add_argument("--repeats", type=int, default=3,
                        help="whole generate calls per path (0: none, and no token comparison)")
    parser.add_argument("--steps", type=int, default=30, help="single decode steps per path")
    parser.add_argument("--max-completion", type=int, default=None, help="cap C (CPU time)")
    parser.add_argument("--quick", action="store_true",
                        help="single steps only (20 per path, no whole generate), 4 frames (P ~ 190)")
    parser.add_argument("--whole-step", type=int, default=0, metavar="STEPS",
                        help="also train STEPS steps (video, the synthetic task) with shared-prefix decoding off and "
                        "on, alternating (--repeats runs each), and report the whole step and the rollout's decode")
    parser.add_argument("--compile", action="store_true",
                        help="also time the shared path's decode step compiled (rollplex_compile_decode='on')")
    parser.add_argument("--out", default="benchmarks/results/shared_decode.json")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.frames = 0, 20, 4
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from rollplex_trl.testing.checkpoints import get_checkpoint

    hf_logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = get_checkpoint("qwen2_5_vl", args.preset)
    processor = AutoProcessor.from_pretrained(path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).to(device).eval()
    prompts = _prompts(processor, args.prompts, args.frames, args.size)
    P = max(p.num_prompt_tokens for p in prompts)
    results = []
    for share in args.shares:
        C = max(2, round(P * (1 - share) / share))
        if args.max_completion:
            C = min(C, args.max_completion)
        for G in args.generations:
            inputs, rows = _inputs(prompts, G, processor.tokenizer.pad_token_id)
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            measured = _measure(model, inputs, rows, C, args.repeats, args.steps, compiled=args.compile)
            off, on = measured["off"], measured["on"]
            U = args.prompts
            if args.repeats:
                tokens = {mode: r.pop("tokens") for mode, r in measured.items()}
                same = all(bool(torch.equal(tokens["off"], t)) for t in tokens.values())
            else:
                same = None
                off["kv_bytes"], on["kv_bytes"] = _kv_bytes_from_shapes(model, inputs, G, U, C)
            row = {"G": G, "P": P, "C": C, "prompt_share": P / (P + C), "expanded": off, "shared": on,
                   "same_tokens": same, "decode_speedup": off["decode_step_s"] / on["decode_step_s"],
                   "decode_speedup_cpu_time": off["decode_step_cpu_s"] / on["decode_step_cpu_s"],
                   "kv_bytes_per_group_expanded": off["kv_bytes"] / U, "kv_bytes_per_group_shared": on["kv_bytes"] / U,
                   "kv_ratio": on["kv_bytes"] / off["kv_bytes"], "kv_ratio_ideal": (P + G * C) / (G * (P + C))}
            if args.whole_step:
                row["whole_step"] = _whole_steps(path, G, C, args)
                w = row["whole_step"]
                print(f"      whole step off/on {w['off']['step_s']:.2f}/{w['on']['step_s']:.2f} s "
                      f"({w['step_speedup']:.2f}x), rollout decode {w['off']['decode_s']:.2f}/"
                      f"{w['on']['decode_s']:.2f} s ({w['decode_speedup']:.2f}x)", flush=True)
            if args.compile:
                row["compiled"] = measured["compiled"]
                row["decode_speedup_compiled"] = off["decode_step_s"] / measured["compiled"]["decode_step_s"]
            results.append(row)
            _write(args.out, args, results)
            print(f"G={G:>2} P={P} C={C:>4} share={row['prompt_share']:.0%}  decode/step "
                  f"{off['decode_step_s'] * 1e3:.1f}/{on['decode_step_s'] * 1e3:.1f} ms "
                  f"({row['decode_speedup']:.2f}x; CPU time {row['decode_speedup_cpu_time']:.2f}x)  "
                  f"K/V {row['kv_ratio']:.2f} (ideal {row['kv_ratio_ideal']:.2f})  same tokens: {same}", flush=True)
            if args.compile:
                c = measured["compiled"]
                generate = "" if c["generate_s"] is None else (
                    f"; generate {off['generate_s']:.2f}/{on['generate_s']:.2f}/{c['generate_s']:.2f} s "
                    f"(first compiled call {c['first_generate_s']:.1f} s)")
                print(f"      compiled: decode/step {c['decode_step_s'] * 1e3:.1f} ms "
                      f"({row['decode_speedup_compiled']:.2f}x of expanded; warm-up {c['first_steps_s']:.1f} s)"
                      f"{generate}", flush=True)

    out = _write(args.out, args, results)
    print()
    print("| G | P | C | prompt share | decode step expanded (ms) | decode step shared (ms) | speed-up | "
          "speed-up (CPU time) | generate expanded (s) | generate shared (s) | "
          "K/V per group expanded (MB) | K/V per group shared (MB) | ratio | ideal | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['G']} | {r['P']} | {r['C']} | {r['prompt_share']:.0%} | "
              f"{r['expanded']['decode_step_s'] * 1e3:.1f} | {r['shared']['decode_step_s'] * 1e3:.1f} | "
              f"{r['decode_speedup']:.2f}x | {r['decode_speedup_cpu_time']:.2f}x | "
              f"{_fmt(r['expanded']['generate_s'])} | {_fmt(r['shared']['generate_s'])} | "
              f"{r['kv_bytes_per_group_expanded'] / 2**20:.1f} | "
              f"{r['kv_bytes_per_group_shared'] / 2**20:.1f} | {r['kv_ratio']:.2f} | {r['kv_ratio_ideal']:.2f} | "
              f"{ {True: 'yes', False: 'NO', None: '-'}[r['same_tokens']]} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
