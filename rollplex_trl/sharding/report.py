"""Inspecting a plan: the JSON summary and the printed table (side by side with the paper's numbers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollplex_trl.sharding.classify import CLASSES

if TYPE_CHECKING:
    from rollplex_trl.sharding.plan import DevicePlan, ShardingPlan

GIB = float(1 << 30)


def _device_bytes(plan: ShardingPlan, dev: DevicePlan) -> dict[str, int]:
    copied = sum(t.copied_bytes for t in dev.tensors)
    aliased = sum(t.nbytes - t.copied_bytes for t in dev.tensors if t.cls != "copy")
    remote_mapped = sum(p.nbytes for t in dev.tensors for p in t.spans
                        if p.source == "train" and p.train_rank != dev.train_rank)
    from_peers = sum(c.total for t in dev.tensors for c in t.copies if c.train_rank != dev.train_rank)
    return {
        "aliased": aliased,
        "copied": copied,
        "full_copy": sum(t.nbytes for t in dev.tensors),
        "incompatible": sum(t.nbytes for t in dev.tensors if t.cls == "copy"),
        "peer": sum(t.remote_bytes for t in dev.tensors if t.cls != "copy"),
        "training": sum(e.nbytes for e in plan.arenas[dev.train_rank]),
        "buffer": dev.buffer_size,
        "alignment_padding": plan.arena_padding[dev.train_rank],
        "remote_mapped": remote_mapped if plan.options.remote == "map" else 0,
        "sync_from_peers": from_peers,
        "sync_local": copied - from_peers,
    }


def summarize(plan: ShardingPlan) -> dict:
    """The plan's numbers as plain JSON-able values (the schema is in docs/sharding.md)."""
    from rollplex_trl.sharding.plan import COUNTING_RULE, PAPER, kinds_table

    opts = plan.options
    n_rep = opts.world // opts.rollout_tp
    by_params = dict.fromkeys(CLASSES, 0.0)
    by_bytes = dict.fromkeys(CLASSES, 0)
    for dev in plan.devices:
        for t in dev.tensors:
            by_params[t.cls] += t.params
            by_bytes[t.cls] += t.nbytes
    total_params = plan.model.numel
    devices = [{"device": d.device, "train_rank": d.train_rank, "rollout_replica": d.replica,
                "rollout_rank": d.rollout_rank, **_device_bytes(plan, d)} for d in plan.devices]
    # Per GPU: the device that copies the most per sync (the worst case), every field from that same device.
    worst = max(devices, key=lambda d: (d["copied"], -d["device"]))
    per_gpu = {k: worst[k] for k in ("aliased", "copied", "full_copy", "incompatible", "peer", "training", "buffer",
                                     "alignment_padding", "remote_mapped")}
    all_bytes = sum(by_bytes.values())
    return {
        "model": plan.model.name,
        "train_tp": opts.train_tp,
        "rollout_tp": opts.rollout_tp,
        "world_size": opts.world,
        "options": {"megatron_vision": opts.megatron_vision, "vllm_vision": opts.vllm_vision,
                    "megatron_vocab_multiple": opts.megatron_vocab_multiple,
                    "vllm_vocab_multiple": opts.vllm_vocab_multiple, "page_size": opts.page_size,
                    "element_size": opts.element_size, "remote": opts.remote, "placement": opts.placement},
        "counting_rule": COUNTING_RULE,
        "total_params": total_params,
        "by_params": {c: by_params[c] / (n_rep * total_params) for c in CLASSES},
        "by_bytes": {c: by_bytes[c] / all_bytes for c in CLASSES},
        "per_gpu_bytes": per_gpu,
        "sync_bytes_per_gpu": {"from_peers": worst["sync_from_peers"], "local": worst["sync_local"]},
        "sync_bytes_total": sum(d["sync_from_peers"] + d["sync_local"] for d in devices),
        "placement": {"slots": [[d.replica, d.rollout_rank] for d in plan.devices],
                      "local_fraction": plan.local_fraction["chosen"],
                      "naive_local_fraction": plan.local_fraction["naive"]},
        "by_kind": {k: {"params_fraction": v["params"] / total_params,
                        **{c: v[c] / max(v["params"], 1e-30) for c in CLASSES}}
                    for k, v in kinds_table(plan).items()},
        "paper": {"by_params": PAPER["by_params"], "buffer_bytes": int(PAPER["buffer_gib"] * GIB),
                  "full_copy_bytes": int(PAPER["full_copy_gib"] * GIB)},
        "devices": devices,
    }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 1 << 24 else f"{n / (1 << 20):.2f} MiB" if n >= 1 << 10 else f"{n:.0f} B"


def format_plan(plan: ShardingPlan) -> str:
    s = summarize(plan)
    o, p = s["options"], s["paper"]
    page = f"{o['page_size'] >> 20} MiB" if o["page_size"] >= 1 << 20 else f"{o['page_size']} B"
    lines = [
        f"plan-sharding: {s['model']}  ({s['total_params']:,} parameters)",
        f"  training: Megatron-Core TP={s['train_tp']}  ->  rollout: vLLM TP={s['rollout_tp']}  on {s['world_size']} "
        f"devices, {o['element_size']}-byte elements, mapping granularity {page}",
        f"  vision tower: Megatron {o['megatron_vision']}, vLLM {o['vllm_vision']};  vocabulary padding: Megatron "
        f"{o['megatron_vocab_multiple'] or 'none'}{' x t' if o['megatron_vocab_multiple'] else ''}, vLLM "
        f"{o['vllm_vocab_multiple']};  bytes on another device: {o['remote']}",
        "",
        f"  {'':34}{'this plan':>14}{'paper*':>12}",
    ]
    for c in CLASSES:
        lines.append(f"  {'parameters ' + c:34}{100 * s['by_params'][c]:>13.2f}%{100 * p['by_params'][c]:>11.1f}%")
    g = s["per_gpu_bytes"]
    rows = [("per GPU: aliased (zero-copy)", g["aliased"], None),
            ("per GPU: copied each sync (buffer)", g["copied"], None),
            ("  incompatible layouts (copy class)", g["incompatible"], p["buffer_bytes"]),
            ("  aliasable, but on a peer GPU", g["peer"], None),
            ("per GPU: full second copy", g["full_copy"], p["full_copy_bytes"]),
            ("per GPU: training shard", g["training"], None),
            ("per GPU: alignment padding", g["alignment_padding"], None),
            ("moved per sync per GPU: from peers", s["sync_bytes_per_gpu"]["from_peers"], None),
            ("moved per sync per GPU: local", s["sync_bytes_per_gpu"]["local"], None),
            ("moved per sync, all GPUs", s["sync_bytes_total"], None)]
    if o["remote"] == "map":
        rows.insert(1, ("  of which peer-mapped", g["remote_mapped"], None))
    for label, value, paper in rows:
        lines.append(f"  {label:34}{_gib(value):>14}{_gib(paper) if paper else '':>12}")
    pl = s["placement"]
    lines += ["", f"  placement (replica, rank) per device: {pl['slots']}",
              f"  rollout bytes beside their training shard: {100 * pl['local_fraction']:.1f}% "
              f"(naive replica-major placement: {100 * pl['naive_local_fraction']:.1f}%)", "",
              f"  {'kind':22}{'params':>9}" + "".join(f"{c:>10}" for c in CLASSES)]
    for kind, v in s["by_kind"].items():
        lines.append(f"  {kind:22}{100 * v['params_fraction']:>8.2f}%"
                     + "".join(f"{100 * v[c]:>9.0f}%" for c in CLASSES))
    lines += ["", "  * paper: Rollplex's numbers for Qwen2.5-VL-32B at t = 8, r = 4 (docs/sharding.md: why they"
              " differ).",
              "  counting rule: " + s["counting_rule"]]
    return "\n".join(line.rstrip() for line in lines)
