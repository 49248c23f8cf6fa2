"""The modelled time of one GRPO step, per phase, for TRL's schedule, serial colocation and Rollplex.

Every phase is counted as work, then priced on a device (planning/hardware.py):

- FLOPs come from prefix/cost.py, the model `rollplex_share_prefix="auto"` decides from (linear layers and MLPs, the
  q.k and p.v products, the vision tower's blocks, the LM head), checked against PyTorch's FLOP counter on the real
  modules (tests/prefix/test_cost.py, tests/planning/test_step_model.py);
- bytes: decode reads every weight once per generated token (per wave of at most `max_num_seqs` sequences) and the
  K/V of every token each sequence attends to; the training passes move their activations through memory
  (`ELEMENTWISE_PASSES` reads or writes of each saved value); the optimizer reads and writes its state;
- link bytes: tensor-parallel all-reduces (ring: 2 (n-1)/n of the message per device), the data-parallel gradient
  reduce-scatter and parameter all-gather, the weight sync's remote part, offload traffic over PCIe.

A phase takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + link bytes / link bandwidth + per-call
overheads (kernel launches, or on CPU the framework's Python per layer and per call: hardware.py, calibrate.py);
a decode phase runs its GEMMs (weights) and its attention (K/V) one after the other, each at that max.
Where the device measured its GEMM rate at several sizes (the calibrated CPU), each phase's GEMMs are priced at
their own rows per call (tokens of one forward; patches of one vision run): `Hardware.gemm_factor`.

Schedules (what each mechanism changes, `Mechanisms`):

- `trl`: TRL's `GRPOTrainer` as it runs: every one of the G rows prefilled with its prompt (and its own vision-tower
  run), decoded against its own copy of the prompt's K/V, scored and trained on the whole prompt + completion; the
  phases one after the other; the rollout weights rebuilt in full after the optimizer step.
- `serial`: serial colocation as RL frameworks run it (the paper's baseline): the rollout prefills each prompt once
  (vLLM's n-sampling / prefix caching, one vision run), otherwise as `trl`; training state offloaded around the
  rollout (memory/planner.py's serial plan), so its PCIe traffic is in the weight-sync phase.
- `rollplex`: shared prefill, shared-prefix decoding (the prompt's K/V read once per prompt per token), the scoring
  and actor passes on the G suffixes against one prefix per prompt, the prefix forwards (reference, old, actor) run
  in the decode window where decode leaves compute idle, only the layout-incompatible rollout weights rebuilt, the
  permanent optimizer state streamed from the host in chunks.

Per GPU: a rollout engine of r GPUs decodes B / (N / r) prompts, a training group of t GPUs trains B / (N / t); all
phases are per GPU, and every GPU does the same, so the step time is one GPU's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from rollplex_trl.memory.model_dims import ModelDims
from rollplex_trl.planning.hardware import Hardware
from rollplex_trl.prefix.cost import attention_flops_per_pair, linear_flops_per_token, vision_flops_per_visual_token

ELEMENTWISE_PASSES = 2  # scales the counted elementwise traffic (2 = as counted: one read or write per value each)
OPTIMIZER_BYTES_PER_PARAM = 30  # AdamW on a shard: grad read 4, master r/w 8, m and v r/w 16, bf16 param write 2
PERMANENT_BYTES_PER_PARAM = 12  # fp32 master + two fp32 moments: what the streamed optimizer moves each way


@dataclass(frozen=True)
class Mechanisms:
    """Which of Rollplex's mechanisms a schedule has."""

    shared_prefill: bool = False  # the rollout prefills (and runs the vision tower on) each prompt once
    shared_decode: bool = False  # decoding reads a prompt's K/V once per token for its G samples
    shared_scoring: bool = False  # reference/old/actor passes: one prefix per prompt, the G suffixes against it
    overlap: bool = False  # the prefix forwards run inside the decode window
    weight_sharing: bool = False  # the rollout reads the training weights; only incompatible tensors are rebuilt
    streamed_optimizer: bool = False  # permanent state on the host, streamed in chunks (else offloaded / reloaded)


SCHEDULES: dict[str, Mechanisms] = {
    "trl": Mechanisms(),
    "serial": Mechanisms(shared_prefill=True),
    "rollplex": Mechanisms(True, True, True, True, True, True),
}
# the order the speed-up is attributed in (each added on top of serial colocation)
ABLATION = ("shared_scoring", "shared_decode", "overlap", "weight_sharing", "streamed_optimizer")


@dataclass(frozen=True)
class StepSpec:
    """One step's settings. `batch` is GLOBAL (prompts per optimizer step over all GPUs), as in plan-memory."""

    num_gpus: int = 32
    train_tp: int = 8
    rollout_tp: int = 4
    batch: int = 32
    num_generations: int = 8
    prompt_len: int = 3072  # P: tokens of the prompt, visual tokens included
    visual_tokens: float = 0.9 * 3072  # of P: merged vision-tower outputs
    frame_patches: tuple[int, int] = (32, 32)  # one frame's height x width in patches (448 x 448): the vision
    # tower attends within windows of it (Qwen2.5-VL) or over all of it
    completion_len: int = 768  # C
    precision: str = "bf16"  # bf16 or fp32: bytes of weights, K/V and activations, and the FLOP rate
    micro_batch: int = 1  # sequences per training/scoring forward on one data-parallel rank
    reference: bool = True  # KL beta > 0
    old_pass: bool = False  # old-policy log-probs (TRL: num_iterations > 1 or steps_per_generation > grad. accum.)
    recompute: bool = True  # activation recompute / gradient checkpointing in the actor's backward
    distributed_optimizer: bool = True
    max_num_seqs: int = 256  # the rollout engine's batch: more sequences decode in waves
    incompatible_fraction: float = 0.072  # rollout parameters whose layout differs (plan-sharding: 7.0% at 8 -> 4)
    prefill_feeds_actor: bool = False  # transformers engine: the actor's prefix is the rollout prefill (no vLLM)
    weight_sync: bool = True  # False: the rollout model is the policy (the hf backend): nothing to sync or offload
    autocast: bool = False  # fp32 weights under bf16 autocast (TRL's CPU default): every call casts the weights

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be bf16 or fp32, got {self.precision!r}")
        for tp in (self.train_tp, self.rollout_tp):
            if self.num_gpus % tp:
                raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of the TP degree {tp}")

    @property
    def value_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def train_dp(self) -> int:
        return self.num_gpus // self.train_tp

    @property
    def prompts_per_engine(self) -> float:
        return self.batch / (self.num_gpus // self.rollout_tp)

    @property
    def prompts_per_train_group(self) -> float:
        return self.batch / self.train_dp


@dataclass
class PhaseCost:
    """One phase on one GPU: the work counted and the seconds it is priced at."""

    name: str
    lane: str  # rollout, prefix (the decode window's jobs), train, optimizer, sync
    memory_phase: str  # the memory planner's phase it runs in (rollout, score, train, optimizer, sync)
    flops: float = 0.0
    attention_flops: float = 0.0  # of `flops`: the q.k and p.v products (their own rate on CPU)
    vision_flops: float = 0.0  # of `flops`: the vision tower's (replicated over training TP: not split)
    mem_bytes: float = 0.0  # read by the GEMM/attention kernels themselves: weights, K/V (overlaps their compute)
    kv_bytes: float = 0.0  # of mem_bytes, the K/V a decode phase's attention reads (its weights are the rest)
    elementwise_bytes: float = 0.0  # norms, RoPE, SwiGLU, residuals, logits: separate memory-bound kernels
    link_bytes: float = 0.0
    linear_efficiency: float = 1.0  # of the device's GEMM rate, at this phase's rows per GEMM (CPU: measured)
    vision_efficiency: float = 1.0  # the same for the vision tower's GEMMs (patches per run)
    compute_s: float = 0.0
    memory_s: float = 0.0
    elementwise_s: float = 0.0
    link_s: float = 0.0
    overhead_s: float = 0.0
    seconds: float = 0.0
    bound: str = ""
    start: float = 0.0  # in the step (set by the schedule)

    def to_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class StepPrediction:
    schedule: str
    mechanisms: Mechanisms
    phases: list[PhaseCost]
    step_s: float
    hidden_s: float = 0.0  # prefix work hidden in the decode window
    notes: list[str] = field(default_factory=list)

    def phase(self, name: str) -> PhaseCost | None:
        return next((p for p in self.phases if p.name == name), None)

    def seconds(self, name: str) -> float:
        p = self.phase(name)
        return p.seconds if p else 0.0

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "mechanisms": asdict(self.mechanisms), "step_s": round(self.step_s, 6),
                "hidden_s": round(self.hidden_s, 6), "phases": [p.to_json() for p in self.phases],
                "notes": self.notes}


# --- counting -----------------------------------------------------------------------------------------------------


def head_flops_per_token(dims: ModelDims) -> float:
    return 2.0 * dims.hidden * dims.vocab


def decoder_weight_bytes(dims: ModelDims, tp: int, value_bytes: int) -> float:
    """Bytes of weights one decode step reads on one of `tp` ranks: every decoder layer and the LM head (the
    embedding is a lookup of one row per token; the vision tower is not run while decoding)."""
    return (dims.layers * dims.layer_params(tp) + dims.vocab * dims.hidden / tp) * value_bytes


def decode_bytes(dims: ModelDims, spec: StepSpec, prompts: float, shared: bool) -> tuple[float, float]:
    """(weight bytes, K/V bytes) read by the C decode steps of `prompts` prompts x G samples on one rollout rank.

    Step t (1..C) of a sequence reads the K/V of P + t - 1 earlier tokens and writes its own; with shared-prefix
    decoding the P prompt tokens are read once per prompt, not once per sample. Weights are read once per step and
    wave (a wave: at most `max_num_seqs` sequences)."""
    G, P, C = spec.num_generations, spec.prompt_len, spec.completion_len
    kv = dims.kv_bytes_per_token(spec.rollout_tp, spec.value_bytes)
    seqs = prompts * G
    waves = max(1, math.ceil(seqs / spec.max_num_seqs))
    own = seqs * C * (C + 1) / 2  # each sample's own tokens, the one being written included
    prompt_reads = (prompts if shared else seqs) * C * P
    weights = waves * C * decoder_weight_bytes(dims, spec.rollout_tp, spec.value_bytes)
    return weights, (prompt_reads + own) * kv


@dataclass(frozen=True)
class Work:
    """Forward FLOPs by kind: linear (projections, MLPs, LM head), attention products, vision-tower blocks."""

    linear: float = 0.0
    attention: float = 0.0
    vision: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.vision

    def __add__(self, other: Work) -> Work:
        return Work(self.linear + other.linear, self.attention + other.attention, self.vision + other.vision)

    def __mul__(self, k: float) -> Work:
        return Work(self.linear * k, self.attention * k, self.vision * k)


def forward_work(dims: ModelDims, tokens: float, pairs: float, visual: float, scored: float,
                 frame: tuple[int, int] | None = None) -> Work:
    """Forward FLOPs of `tokens` through the decoder, `pairs` (query, key) attention pairs, `visual` merged visual
    tokens through the vision tower (its attention over frames of `frame` patches, if given) and `scored` positions
    through the LM head (prefix/cost.py's terms)."""
    return Work(tokens * linear_flops_per_token(dims) + scored * head_flops_per_token(dims),
                pairs * attention_flops_per_pair(dims), visual * vision_flops_per_visual_token(dims, frame))


def forward_flops(dims: ModelDims, tokens: float, pairs: float, visual: float, scored: float,
                  frame: tuple[int, int] | None = None) -> float:
    return forward_work(dims, tokens, pairs, visual, scored, frame).total


def elementwise_values_per_token(dims: ModelDims, tp: int = 1) -> float:
    """Values one token's forward reads and writes outside the GEMM and attention kernels, all decoder layers, on
    one of `tp` ranks (sequence parallel: hidden-sized ones split too), as transformers' Qwen2 layer runs them:
    two RMSNorms in fp32 (cast, square, mean, scale, weight: ~8 hidden-sized passes each), RoPE on q and k (two
    products, rotate-half's slice, negation and concatenation, a sum: ~8 passes of (heads + kv_heads) x head_dim),
    SwiGLU (SiLU reads and writes, the product reads two and writes one: 5 x intermediate), two residual adds
    (read two, write one: 6 x hidden)."""
    per_layer = (22 * dims.hidden + 8 * (dims.heads + dims.kv_heads) * dims.head_dim + 5 * dims.intermediate) / tp
    return ELEMENTWISE_PASSES / 2 * dims.layers * per_layer


def vision_elementwise_values_per_visual_token(dims: ModelDims) -> float:
    """The same for the vision tower's blocks, per merged visual token (merge**2 patches; q and k rotated)."""
    if dims.vision is None:
        return 0.0
    v = dims.vision
    return ELEMENTWISE_PASSES / 2 * v.depth * v.merge**2 * (22 * v.hidden + 16 * v.hidden + 5 * v.intermediate)


def activation_bytes_per_token(dims: ModelDims, tp: int, value_bytes: int) -> float:
    """Elementwise bytes one token moves through memory in one forward on one of `tp` ranks (all layers)."""
    return elementwise_values_per_token(dims, tp) * value_bytes


def allreduce_bytes(group: int, message: float) -> float:
    """Bytes a device sends in a ring all-reduce of `message` bytes over `group` devices."""
    return 0.0 if group <= 1 else 2 * (group - 1) / group * message


# --- pricing ------------------------------------------------------------------------------------------------------


class _Pricer:
    def __init__(self, dims: ModelDims, spec: StepSpec, hw: Hardware) -> None:
        self.dims, self.spec, self.hw = dims, spec, hw

    def price(self, cost: PhaseCost, tp: int, calls: float = 0.0, steps: float = 0.0, collectives: float = 0.0,
              link_group: int = 1, link_bw: float | None = None, vision_tp: int | None = None,
              vision_runs: float = 0.0, shared_decode: bool = False) -> PhaseCost:
        """Seconds of `cost` on one GPU of a `tp` group: a GEMM's compute and the bytes it reads overlap (the larger
        counts); elementwise kernels, links and overheads add. `calls`: forward calls (each pays its layers' and its
        own overhead); `steps`: decode steps (each pays the engine's per-token overhead and its per-layer decode cost,
        `shared_decode`: of the two-part attention; a decode phase passes steps, not calls, and its bytes are read
        at the decode bandwidth); `collectives`: how many
        collectives the link time pays a latency for; `vision_tp`: ranks the vision tower's FLOPs split over
        (default `tp`); `vision_runs`: vision-tower runs (each pays its blocks' overhead)."""
        hw, dims = self.hw, self.dims
        rate = hw.flops(self.spec.precision)
        # a decode step's attention has one query per row: the CPU's fused kernel is slow there (its own measured
        # rate); the shared-prefix decode's prompt part is one batched matmul per prompt (prefix/cascade.py)
        attn_rate = ((rate if shared_decode else hw.decode_attention_rate(self.spec.precision)) if steps
                     else hw.attention_rate(self.spec.precision))
        vit = vision_tp or tp
        linear = cost.flops - cost.vision_flops - cost.attention_flops
        gemm_s = linear / (tp * rate * cost.linear_efficiency)
        attention_s = cost.attention_flops / (tp * attn_rate)
        cost.compute_s = gemm_s + attention_s + cost.vision_flops / (vit * rate * cost.vision_efficiency)
        cost.memory_s = cost.mem_bytes / (hw.decode_bandwidth(self.spec.precision) if steps else hw.bandwidth())
        if steps:  # a decode step's kernels run one after another, each at the larger of its compute and its reads:
            # the GEMMs stream the weights, the attention reads the K/V
            kv_s = cost.kv_bytes / hw.decode_bandwidth(self.spec.precision)
            kernels_s = max(gemm_s, cost.memory_s - kv_s) + max(attention_s, kv_s)
        else:
            kernels_s = max(cost.compute_s, cost.memory_s)
        if self.spec.autocast and calls:  # read the fp32 weights, write and read their bf16 copies, per call
            cost.elementwise_bytes += calls * self.dims.llm_params(tp) * (4 + 2 + 2)
        cost.elementwise_s = cost.elementwise_bytes / hw.bandwidth()
        bw = link_bw if link_bw is not None else hw.link_bw(link_group)
        cost.link_s = (cost.link_bytes / bw if cost.link_bytes else 0.0) + collectives * hw.collective_latency_s
        cost.overhead_s = (calls * (hw.call_overhead_s + dims.layers * hw.layer_overhead_s)
                           + steps * (hw.decode_step_overhead_s + dims.layers * hw.decode_layer_cost_s(shared_decode))
                           + vision_runs * (dims.vision.depth if dims.vision else 0) * hw.vision_block_overhead_s)
        cost.seconds = kernels_s + cost.elementwise_s + cost.link_s + cost.overhead_s
        parts = {"compute": cost.compute_s, "memory": cost.memory_s + cost.elementwise_s, "link": cost.link_s,
                 "overhead": cost.overhead_s}
        cost.bound = max(parts, key=parts.get)
        return cost


def vision_tower_seconds(dims: ModelDims, hw: Hardware, precision: str, frame: tuple[int, int], visual: float,
                         train: bool) -> tuple[float, float]:
    """(all seconds, seconds of its FLOPs) the step model gives one vision-tower run over `visual` merged tokens
    of `frame` patches, forward or forward + backward, before any tower factor: what planning/calibrate.py's
    `vision_tower_factors` compares a measured run with."""
    spec = StepSpec(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, precision=precision, frame_patches=frame)
    passes = 3 if train else 1
    work = forward_work(dims, 0.0, 0.0, visual, 0.0, frame) * passes
    elem = visual * vision_elementwise_values_per_visual_token(dims) * spec.value_bytes * passes
    c = PhaseCost("vision", "train", "train", flops=work.total, vision_flops=work.vision, elementwise_bytes=elem)
    c.vision_efficiency = hw.gemm_factor(precision, "vision", visual * (dims.vision.merge**2 if dims.vision else 1))
    _Pricer(dims, spec, hw).price(c, 1, vision_runs=passes - 1 if train else 1)
    return c.seconds, c.compute_s


def predict_step(dims: ModelDims, spec: StepSpec, hw: Hardware, schedule: str | Mechanisms) -> StepPrediction:
    """The modelled phases and step time of one GPU for a schedule name (`SCHEDULES`) or a set of mechanisms."""
    mech = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    name = schedule if isinstance(schedule, str) else "custom"
    pr = _Pricer(dims, spec, hw)
    G, P, C, V = spec.num_generations, spec.prompt_len, spec.completion_len, spec.visual_tokens
    frame = spec.frame_patches
    R, T = spec.rollout_tp, spec.train_tp
    vb, h, L = spec.value_bytes, dims.hidden, dims.layers
    ne, nt = spec.prompts_per_engine, spec.prompts_per_train_group

    def tp_comm(tp: int, tokens: float, passes: float) -> tuple[float, float]:
        msgs = passes * 2 * L  # two all-reduces per layer per pass
        return (allreduce_bytes(tp, tokens * h * vb) * passes * 2 * L, msgs if tp > 1 else 0.0)

    phases: list[PhaseCost] = []

    def elementwise(tokens: float, visual: float, tp: int, vit_tp: int) -> float:
        return (tokens * elementwise_values_per_token(dims, tp)
                + visual * vision_elementwise_values_per_visual_token(dims) / vit_tp) * vb

    def cost(name: str, lane: str, memory_phase: str, work: Work, mem: float, elem: float) -> PhaseCost:
        return PhaseCost(name, lane, memory_phase, flops=work.total, attention_flops=work.attention,
                         vision_flops=work.vision, mem_bytes=mem, elementwise_bytes=elem)

    patches = dims.vision.merge**2 if dims.vision else 1

    def at_sizes(c: PhaseCost, parts: list[tuple[Work, float, float]], train: bool = False) -> PhaseCost:
        """Set `c`'s GEMM efficiencies from its parts: (work, tokens per forward call, merged visual tokens per
        call); a phase of several sizes takes the FLOP-weighted harmonic mean (what its seconds add up to). The
        vision tower's also carries what the tower run whole costs beyond its GEMMs (`train`: with its backward)."""
        for kind, tower, size, scale in (("linear", "llm", 1, 1), ("vision", "vision", 2, patches)):
            flops = sum(getattr(part[0], kind) for part in parts)
            if flops:
                slow = sum(getattr(part[0], kind) / hw.gemm_factor(spec.precision, tower, part[size] * scale)
                           for part in parts if getattr(part[0], kind))
                setattr(c, f"{kind}_efficiency", flops / slow)
        c.vision_efficiency /= hw.vision_tower_factor(spec.precision, train)
        return c

    # rollout prefill: prompts once (shared) or G times, each with its vision-tower run (vLLM: ViT split over r)
    copies = 1 if mech.shared_prefill else G
    tokens = ne * copies * P
    work = forward_work(dims, tokens, ne * copies * P * P / 2, ne * copies * V, ne * G, frame)
    c = at_sizes(cost("rollout_prefill", "rollout", "rollout", work, decoder_weight_bytes(dims, R, vb),
                      elementwise(tokens, ne * copies * V, R, R)), [(work, tokens, ne * copies * V)])
    c.link_bytes, n = tp_comm(R, tokens, 1)
    phases.append(pr.price(c, R, calls=1, collectives=n, link_group=R, vision_runs=ne * copies if V else 0))

    # rollout decode: memory-bound reads of weights and K/V per generated token
    w_bytes, kv_bytes = decode_bytes(dims, spec, ne, mech.shared_decode)
    seqs = ne * G
    pairs = seqs * (C * P + C * (C + 1) / 2)
    c = cost("rollout_decode", "rollout", "rollout", forward_work(dims, seqs * C, pairs, 0.0, seqs * C),
             w_bytes + kv_bytes, elementwise(seqs * C, 0.0, R, R))
    c.kv_bytes = kv_bytes
    c.link_bytes, _ = tp_comm(R, seqs * C, 1)
    waves = max(1, math.ceil(seqs / spec.max_num_seqs))
    phases.append(pr.price(c, R, steps=C * waves, collectives=2 * L * C * waves if R > 1 else 0, link_group=R,
                           shared_decode=mech.shared_decode))
    decode = phases[-1]

    # the prefix forwards (Rollplex): reference, old, actor over P - 1 tokens per prompt, vision once, training
    # layout (ViT replicated over training TP)
    prefix_work = forward_work(dims, nt * (P - 1), nt * (P - 1) ** 2 / 2, nt * V, 0.0, frame)
    prefix_elem = elementwise(nt * (P - 1), nt * V, T, 1)
    prefix_jobs: list[PhaseCost] = []
    if mech.shared_scoring:
        jobs = [("ref_prefix", spec.reference), ("old_prefix", spec.old_pass),
                ("actor_prefix", not spec.prefill_feeds_actor)]
        for job, on in jobs:
            if not on:
                continue
            c = at_sizes(cost(job, "prefix" if mech.overlap else "train", "rollout" if mech.overlap else "score",
                              prefix_work, dims.llm_params(T) * vb, prefix_elem), [(prefix_work, P - 1, V)])
            c.link_bytes, n = tp_comm(T, nt * (P - 1), 1)
            prefix_jobs.append(pr.price(c, T, calls=nt, collectives=n, link_group=T, vision_tp=1,
                                        vision_runs=nt if V else 0))

    # scoring passes (forward, no grad) and the actor (forward, backward = 2 forwards, recompute = 1 more)
    def scoring(kind: str, grad: bool) -> PhaseCost:
        if mech.shared_scoring:
            rows = 1 + C
            tok = nt * G * rows
            pair = nt * G * (rows * (P - 1) + rows * rows / 2)
            vis = 0.0
        else:
            tok = nt * G * (P + C)
            pair = nt * G * (P + C) ** 2 / 2
            vis = nt * G * V
        passes = (3 + (1 if spec.recompute else 0)) if grad else 1
        work = forward_work(dims, tok, pair, vis, nt * G * C, frame) * passes
        per_call = spec.micro_batch / (nt * G)  # of the pass's tokens and visual tokens, per forward call
        parts = [(work, tok * per_call, vis * per_call)]
        logits = nt * G * C * dims.vocab / T * 4 * 3  # fp32 logits, log-softmax, gather
        elem = (elementwise(tok, vis, T, 1) + logits) * passes
        mem = dims.llm_params(T) * vb * (3 if grad else 1)  # weights read per pass (forward, backward twice)
        calls = nt * G / spec.micro_batch * (passes - 1 if grad else 1)
        link_tokens = tok * passes
        runs = (nt * G if vis else 0.0) * (passes - 1 if grad else 1)
        if grad and mech.shared_scoring:  # the prefix's backward (and recompute) in the train phase
            work = work + prefix_work * (passes - 1)
            parts.append((prefix_work * (passes - 1), P - 1, V))
            elem += prefix_elem * (passes - 1)
            link_tokens += nt * (P - 1) * (passes - 1)
            calls += nt * (passes - 1)
            runs += (nt if V else 0.0) * (passes - 1)
        c = at_sizes(cost(kind, "train", "train" if grad else "score", work, mem, elem), parts, train=grad)
        c.link_bytes, n = tp_comm(T, link_tokens, 1)
        return pr.price(c, T, calls=calls, collectives=n * passes, link_group=T, vision_tp=1, vision_runs=runs)

    train_phases = []
    if spec.reference:
        train_phases.append(scoring("reference", False))
    if spec.old_pass:
        train_phases.append(scoring("old", False))
    train_phases.append(scoring("actor", True))

    # optimizer: the AdamW update of this GPU's shard, the gradient reduce-scatter and the parameter all-gather
    # over the data-parallel ranks (the network beyond a node), the permanent state streamed over PCIe
    params_t = dims.llm_params(T) + dims.vision_params(1)  # ViT replicated over training TP (memory/planner.py)
    dp = spec.train_dp if spec.distributed_optimizer else 1
    shard = params_t / dp
    dp_span = spec.num_gpus if spec.train_dp > 1 else 1
    c = PhaseCost("optimizer", "optimizer", "optimizer", mem_bytes=shard * OPTIMIZER_BYTES_PER_PARAM,
                  link_bytes=(allreduce_bytes(spec.train_dp, params_t * 4) / 2
                              + allreduce_bytes(spec.train_dp, params_t * vb) / 2))
    pr.price(c, 1, collectives=2 if spec.train_dp > 1 else 0, link_group=dp_span)
    if mech.streamed_optimizer and hw.host_bw > 0:  # chunks stream in and out while the previous one computes
        stream = shard * PERMANENT_BYTES_PER_PARAM / hw.host_bw
        if stream > c.memory_s:
            c.seconds += stream - c.memory_s
            c.bound = "host link"
        c.link_bytes += 2 * shard * PERMANENT_BYTES_PER_PARAM
    optimizer = c

    # weight sync: the rollout copy rebuilt from the training shards (all of it, or the incompatible part);
    # serial colocation also reloads the permanent state before training and offloads it after (planner's serial)
    frac = (spec.incompatible_fraction if mech.weight_sharing else 1.0) if spec.weight_sync else 0.0
    params_r = dims.llm_params(R) + dims.vision_params(R)
    rebuilt = params_r * vb * frac
    remote = max(0.0, 1 - R / T) if T > R else (1 - 1 / R if R > 1 else 0.0)
    c = PhaseCost("weight_sync", "sync", "sync", mem_bytes=2 * rebuilt, link_bytes=rebuilt * remote)
    pr.price(c, 1, collectives=1 if remote else 0, link_group=max(R, T))
    if not mech.streamed_optimizer and hw.host_bw > 0 and spec.weight_sync:  # host_bw 0: no host (the CPU entry)
        offload = 2 * shard * PERMANENT_BYTES_PER_PARAM + 2 * params_t * vb  # state and weights, out and back
        c.link_bytes += offload
        c.link_s += offload / hw.host_bw
        c.seconds += offload / hw.host_bw
    sync = c

    # the schedule: rollout, then (Rollplex) the prefix jobs hidden in the decode window where decode leaves
    # compute idle, then scoring, actor, optimizer, sync one after the other
    notes: list[str] = []
    prefill = phases[0]
    t = 0.0
    prefill.start = t
    t += prefill.seconds
    decode.start = t
    hidden = 0.0
    ordered = [prefill, decode]
    if mech.overlap and prefix_jobs:
        # the decode window's spare compute: what its kernels leave idle; on a CPU the prefix jobs take cores the
        # decode's own kernels and Python run on, so nothing is hidden (measured: decode slows by what the jobs take)
        idle = 0.0 if hw.overheads_occupy_compute else decode.seconds - decode.compute_s
        js = t
        for job in prefix_jobs:
            job.start = js
            js += job.seconds
        total = sum(j.seconds for j in prefix_jobs)
        hidden = min(total, max(idle, 0.0))
        t += max(decode.seconds, decode.seconds + total - hidden)
        ordered += prefix_jobs
        if total > hidden:
            notes.append(f"prefix jobs {total:.3g} s exceed the decode window's idle compute {idle:.3g} s: "
                         f"{total - hidden:.3g} s extend the rollout")
    else:
        t += decode.seconds
        for job in prefix_jobs:
            job.start = t
            t += job.seconds
        ordered += prefix_jobs
    for p in [*train_phases, optimizer, sync]:
        p.start = t
        t += p.seconds
        ordered.append(p)
    return StepPrediction(name, mech, ordered, t, hidden, notes)


def ablation(dims: ModelDims, spec: StepSpec, hw: Hardware) -> list[dict]:
    """Serial colocation with Rollplex's mechanisms added one at a time (`ABLATION` order): the step time after each."""
    mech = SCHEDULES["serial"]
    rows = [{"added": "serial colocation", "step_s": predict_step(dims, spec, hw, mech).step_s}]
    for m in ABLATION:
        mech = replace(mech, **{m: True})
        rows.append({"added": m, "step_s": predict_step(dims, spec, hw, mech).step_s})
    base = rows[0]["step_s"]
    for r in rows:
        r["speedup_vs_serial"] = base / r["step_s"]
    return rows
