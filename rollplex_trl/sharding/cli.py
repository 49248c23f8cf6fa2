"""``rollplex-trl plan-sharding``: print (or emit as JSON) the weight-sharing plan for a model and (t, r)."""

from __future__ import annotations

import argparse
import json
import sys

_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _size(text: str) -> int:
    """Bytes: a plain number or with a KiB / MiB / GiB suffix (case-insensitive)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    return int(low)


def _plan_sharding(args: argparse.Namespace) -> int:
    from rollplex_trl.sharding import ShardingOptions, load_model_spec, plan_sharding

    options = ShardingOptions(
        train_tp=args.train_tp, rollout_tp=args.rollout_tp, world_size=args.world_size,
        megatron_vision=args.megatron_vision, vllm_vision=args.vllm_vision,
        megatron_vocab_multiple=args.megatron_vocab_multiple, vllm_vocab_multiple=args.vllm_vocab_multiple,
        page_size=args.page_size, element_size=_DTYPES[args.dtype], remote=args.remote, placement=args.placement)
    try:
        plan = plan_sharding(load_model_spec(args.model), options)
    except (KeyError, ValueError) as err:  # LayoutError is a ValueError: a split that does not divide
        print(f"rollplex-trl plan-sharding: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    if args.json:
        summary = plan.summary()
        if not args.devices:
            summary.pop("devices")
        print(json.dumps(summary, indent=2))
    else:
        print(plan.format())
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan-sharding`` subcommand to the ``rollplex-trl`` parser."""
    p = subparsers.add_parser(
        "plan-sharding", help="weight sharing plan: Megatron-Core TP=t training -> vLLM TP=r rollout",
        description="Classify every rollout (vLLM) tensor against the training (Megatron-Core) shards as aligned, "
                    "view or copy; report parameter fractions, bytes per GPU and bytes moved per sync. Shapes come "
                    "from the config only (meta device, no weights).")
    p.add_argument("--model", required=True,
                   help="Qwen2.5-VL-3B/7B/32B/72B (preset), or a Hugging Face config.json (or its directory)")
    p.add_argument("--train-tp", type=int, required=True, help="Megatron-Core tensor-parallel size t")
    p.add_argument("--rollout-tp", type=int, required=True, help="vLLM tensor-parallel size r")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--devices", action="store_true", help="with --json: include the per-device breakdown")
    p.add_argument("--world-size", type=int, default=None, help="GPUs shared by both (default max(t, r))")
    p.add_argument("--megatron-vision", default="replicated", choices=["replicated", "sharded"],
                   help="vision tower in training: replicated (Megatron-Bridge, ROLL) or sharded (verl, mbridge)")
    p.add_argument("--vllm-vision", default="sharded", choices=["sharded", "replicated"],
                   help='vision tower in vLLM: sharded (mm_encoder_tp_mode="weights") or replicated ("data")')
    p.add_argument("--megatron-vocab-multiple", type=int, default=0,
                   help="Megatron-LM make_vocab_size_divisible_by (vocab padded to a multiple of it x t); "
                        "0: no padding (Megatron-Bridge default)")
    p.add_argument("--vllm-vocab-multiple", type=int, default=64, help="vLLM vocabulary padding (default 64)")
    p.add_argument("--page-size", type=_size, default=2 << 20,
                   help="mapping granularity: 2MiB for CUDA VMM (default), 4KiB for CPU shared memory")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="weight dtype (bytes per element)")
    p.add_argument("--remote", default="copy", choices=["copy", "map"],
                   help="aliasable bytes held by another GPU: copy them each sync, or map them (peer access)")
    p.add_argument("--placement", default="optimal", choices=["optimal", "naive"],
                   help="rollout ranks on devices: maximize local aliasing, or replica-major")
    p.set_defaults(func=_plan_sharding)
