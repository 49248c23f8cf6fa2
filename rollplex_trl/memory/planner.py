"""Analytic per-GPU memory plan for one GRPO step: serial colocation, naive overlap, and the Rollplex plan.

Pure arithmetic over model dimensions, a workload and stated assumptions; nothing is allocated. Every object is a
``Component`` with a lifetime class, a byte size per GPU and a formula; a plan says in which phases each component
is resident (and may shrink it). The plan's total is its peak: the largest per-phase sum.

- serial colocation: phases take turns on the GPU; whatever a phase does not use is offloaded (ROLL-style
  offload/reload of the training states, vLLM asleep outside rollout). No prefix reuse: training and scoring
  passes run on full prompt+completion sequences.
- naive overlap: the prefix work runs inside the decode window without lifetime management, so every persistent
  object (training states, reference model, the rollout engine's reservation, the boundary state with the prefix's
  whole autograd graph) is resident all step; only temporaries come and go with their phase.
- rollplex: each object is on the device only inside its window: permanent state streamed in chunks, bf16 rollout
  weights shared with the training weights except the layout-incompatible part, the reference model only for
  rollout+score, phase-local state freed, non-critical prefix activations recomputed (boundary = prefix KV + layer
  inputs), the KV cache sized to the rollout's need.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rollplex_trl.memory.lifetime import LifetimeClass, Phase
from rollplex_trl.memory.model_dims import ModelDims

GIB = 2**30
PHASES: tuple[Phase, ...] = (Phase.ROLLOUT, Phase.SCORE, Phase.TRAIN, Phase.OPTIMIZER, Phase.SYNC)
RUNTIME = "runtime"  # not a lifetime class: CUDA context, NCCL buffers, allocator slack
CLASSES: tuple[str, ...] = tuple(c.value for c in LifetimeClass) + (RUNTIME,)

# The paper's figure this planner is calibrated against (arXiv 2608.14498, via the summaries in
# docs/memory.md, "The paper's figures this is calibrated against"): naive colocation of Qwen2.5-VL-32B, training TP 8.
PAPER_NAIVE_GIB = 165.0
PAPER_MODEL, PAPER_TRAIN_TP = "Qwen2.5-VL-32B", 8


@dataclass(frozen=True)
class Workload:
    """One optimizer step of GRPO. ``batch`` is GLOBAL: prompts per optimizer step over all ``num_gpus``."""

    train_tp: int = 8
    rollout_tp: int = 4
    num_gpus: int = 32
    batch: int = 32
    num_generations: int = 8
    prompt_len: int = 3072
    completion_len: int = 768
    device_mem_gib: float = 80.0
    micro_batch: int = 1  # sequences per training/scoring forward-backward on one data-parallel rank

    def __post_init__(self) -> None:
        for name in ("train_tp", "rollout_tp", "num_gpus", "batch", "num_generations", "prompt_len",
                     "completion_len", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for tp in (self.train_tp, self.rollout_tp):
            if self.num_gpus % tp:
                raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of the TP degree {tp}")

    @property
    def train_dp(self) -> int:
        return self.num_gpus // self.train_tp

    @property
    def rollout_engines(self) -> int:
        return self.num_gpus // self.rollout_tp

    @property
    def prompts_per_train_group(self) -> float:
        """Prompts one training TP group (train_tp GPUs, one data-parallel rank) trains on per step."""
        return self.batch / self.train_dp

    @property
    def prompts_per_engine(self) -> float:
        return self.batch / self.rollout_engines


@dataclass(frozen=True)
class Assumptions:
    """Every number the plan rests on besides the model and the workload; ``describe()`` prints them."""

    param_bytes: int = 2  # bf16 weights (training, rollout, reference)
    grad_bytes: int = 4  # Megatron accumulates bf16 training's grads in fp32 (main_grad)
    master_bytes: int = 4  # fp32 master weights
    moment_bytes: int = 4  # fp32 Adam moments
    num_moments: int = 2  # Adam(W): m and v
    kv_bytes: int = 2  # bf16 K/V
    distributed_optimizer: bool = True  # master + moments sharded over the data-parallel ranks (ZeRO-1)
    sequence_parallel: bool = True
    vit_replicated_in_training: bool = True  # ROLL / Megatron-Bridge keep the HF ViT whole on every TP rank
    reference_model: bool = True  # KL beta > 0 (Video-R1: 0.04)
    vllm_gpu_memory_utilization: float = 0.8  # serial and naive: vLLM claims this share of the device
    prefix_caching: bool = False  # off in ROLL's Qwen2.5-VL example: each of the G samples holds its prompt's KV
    rollout_max_num_batched_tokens: int = 8192
    rollout_max_num_seqs: int = 256
    visual_token_fraction: float = 0.9  # share of prompt tokens that are video tokens (paper: 79-98%)
    runtime_overhead_gib: float = 3.0  # 3 engine processes x (CUDA context + NCCL), allocator slack
    incompatible_weight_fraction: float = 0.072  # paper: 7.2% of parameters need a rebuilt rollout copy (TP 8->4)
    optimizer_chunk_mib: int = 512
    optimizer_chunks_in_flight: int = 2  # double buffering: one chunk computing, one in transfer
    naive_keeps_full_prefix_graph: bool = True

    def describe(self, model: ModelDims, wl: Workload) -> list[str]:
        dp = wl.train_dp if self.distributed_optimizer else 1
        return [
            f"Workload: B = {wl.batch} prompts per optimizer step in total (global), over {wl.num_gpus} GPUs: "
            f"{wl.prompts_per_train_group:g} prompts per training TP group (train TP {wl.train_tp}, data-parallel "
            f"{wl.train_dp}), {wl.prompts_per_engine:g} per rollout engine (rollout TP {wl.rollout_tp}, "
            f"{wl.rollout_engines} engines); G = {wl.num_generations}, prompt P = {wl.prompt_len} tokens "
            f"({self.visual_token_fraction:.0%} video), completion C = {wl.completion_len} tokens, "
            f"micro-batch {wl.micro_batch} sequence(s).",
            f"Weights bf16 ({self.param_bytes} B/param); training layout: LLM split over train TP "
            f"(norms replicated), ViT {'replicated on every TP rank (ROLL, Megatron-Bridge)' if self.vit_replicated_in_training else 'split over train TP'}; "  # noqa: E501
            f"rollout layout (vLLM): LLM and ViT split over rollout TP; KV heads replicate when TP > KV heads.",
            f"Gradients {self.grad_bytes} B/param (Megatron main_grad), resident from backward to the optimizer "
            "step.",
            f"Optimizer: fp32 master ({self.master_bytes} B) + {self.num_moments} fp32 Adam moments "
            f"({self.moment_bytes} B each) per parameter, "
            + (f"sharded over the {dp} data-parallel ranks (Megatron distributed optimizer, on in ROLL's configs)."
               if self.distributed_optimizer else "not sharded."),
            "Reference model: " + ("bf16 copy in the training layout (KL beta > 0)." if self.reference_model
                                   else "none (beta = 0)."),
            f"Rollout (vLLM): serial and naive reserve gpu_memory_utilization = {self.vllm_gpu_memory_utilization} "
            f"of {wl.device_mem_gib:g} GiB = weights + activation workspace + KV pool (ROLL's examples: 0.8 in "
            "its Qwen3-VL 80G config, 0.9 in its Qwen2.5-VL-7B one). Rollplex sizes the KV pool to the "
            "step's need (all sequences of an engine at full length) "
            "and shrinks it to the free room if that does not fit.",
            f"KV cache per token = 2 x layers x KV heads per rank x head_dim x {self.kv_bytes} B "
            f"= {model.kv_bytes_per_token(wl.rollout_tp, self.kv_bytes) / 1024:g} KiB per rollout rank, "
            f"{model.kv_bytes_per_token(wl.train_tp, self.kv_bytes) / 1024:g} KiB per training rank; prefix "
            f"caching {'on: the G samples share their prompt' if self.prefix_caching else 'off: each of the G samples holds its prompt'}.",  # noqa: E501
            f"Rollout activation workspace: {self.rollout_max_num_batched_tokens} batched tokens through one layer "
            f"plus fp32 logits of {self.rollout_max_num_seqs} sequences.",
            "Saved activations per token and layer (bf16, flash attention, no dropout): norm inputs/outputs 4h, "
            "q/k/v + attention output (2 heads + 2 kv_heads) x head_dim, SwiGLU 3 x intermediate; split over train "
            f"TP ({'hidden-sized ones too: sequence parallel' if self.sequence_parallel else 'no sequence parallel'}).",  # noqa: E501
            "Training and scoring use per-layer recompute (Megatron recompute full / TRL gradient checkpointing): "
            "kept = each layer's input, plus one layer's activations during recompute, plus fp32 logits (and their "
            "gradient) over the vocabulary split of train TP.",
            "Boundary state (naive, Rollplex): actor and reference prefix KV of every prompt of the training group "
            "(P tokens); the actor prefix graph is "
            + ("kept whole in naive overlap (no lifetime management) and " if self.naive_keeps_full_prefix_graph
               else "")
            + "reduced to per-layer inputs in Rollplex (non-critical activations recomputed in the backward).",
            "Vision tower: recomputed per block in the backward; its working set is one prompt's patches "
            "(visual tokens x merge^2) through the ViT (block inputs + one block).",
            f"Rollplex: weights shared with the rollout engine through views except "
            f"{self.incompatible_weight_fraction:.1%} of parameters (rebuilt buffer, paper case 3); permanent state "
            f"on the host, {self.optimizer_chunks_in_flight} x {self.optimizer_chunk_mib} MiB chunks on the device "
            "during the optimizer step; reference weights only from rollout to score.",
            f"Runtime overhead {self.runtime_overhead_gib:g} GiB in every phase of every plan.",
            "No pipeline or context parallelism, no CPU offload in the baselines beyond serial's phase switching.",
        ]


@dataclass(frozen=True)
class Component:
    name: str
    lifetime: str  # a LifetimeClass value, or RUNTIME
    nbytes: float
    formula: str


@dataclass
class Entry:
    component: str
    lifetime: str
    nbytes: float
    phases: tuple[Phase, ...]
    note: str = ""


@dataclass
class Plan:
    name: str
    entries: list[Entry]
    device_mem_gib: float
    notes: list[str] = field(default_factory=list)

    def phase_bytes(self, phase: Phase) -> float:
        return sum(e.nbytes for e in self.entries if phase in e.phases)

    @property
    def peak_phase(self) -> Phase:
        return max(PHASES, key=self.phase_bytes)

    @property
    def total_bytes(self) -> float:
        return self.phase_bytes(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_mem_gib * GIB

    def by_class(self, phase: Phase | None = None) -> dict[str, float]:
        """Bytes per lifetime class resident in ``phase`` (default: the peak phase)."""
        phase = phase or self.peak_phase
        out = dict.fromkeys(CLASSES, 0.0)
        for e in self.entries:
            if phase in e.phases:
                out[e.lifetime] += e.nbytes
        return out

    def to_json(self) -> dict:
        return {
            "total_gib": round(self.total_bytes / GIB, 3),
            "fits": self.fits,
            "peak_phase": self.peak_phase.value,
            "by_class_gib": {k: round(v / GIB, 3) for k, v in self.by_class().items()},
            "phases_gib": {p.value: round(self.phase_bytes(p) / GIB, 3) for p in PHASES},
            "items": [{"name": e.component, "class": e.lifetime, "gib": round(e.nbytes / GIB, 3),
                       "phases": [p.value for p in e.phases], "note": e.note} for e in self.entries],
            "notes": list(self.notes),
        }


@dataclass
class MemoryPlanReport:
    model: ModelDims
    workload: Workload
    assumptions: Assumptions
    components: dict[str, Component]
    plans: dict[str, Plan]

    def paper_check(self) -> dict | None:
        """How far the naive plan is from the paper's ~165 GiB (only for its setting: 32B, training TP 8)."""
        if self.model.name != PAPER_MODEL or self.workload.train_tp != PAPER_TRAIN_TP:
            return None
        naive = self.plans["naive_overlap"].total_bytes / GIB
        off = naive / PAPER_NAIVE_GIB - 1
        return {"paper_naive_gib": PAPER_NAIVE_GIB, "naive_gib": round(naive, 3), "relative_error": round(off, 4),
                "within_10_percent": abs(off) <= 0.10}

    def to_json(self) -> dict:
        m = self.model
        return {
            "model": {**asdict(m), "num_params": m.num_params()},
            "workload": asdict(self.workload),
            "assumptions": {**asdict(self.assumptions),
                            "stated": self.assumptions.describe(self.model, self.workload)},
            "components": {k: {"class": c.lifetime, "gib": round(c.nbytes / GIB, 3), "formula": c.formula}
                           for k, c in self.components.items()},
            "plans": {name: plan.to_json() for name, plan in self.plans.items()},
            "paper_check": self.paper_check(),
        }


# --- components ---------------------------------------------------------------------------------------------------


def components(model: ModelDims, wl: Workload, a: Assumptions) -> dict[str, Component]:
    """Every object of one step with its per-GPU size, before any plan decides where and when it lives."""
    T, R = wl.train_tp, wl.rollout_tp
    G, P, C = wl.num_generations, wl.prompt_len, wl.completion_len
    vit_tp = 1 if a.vit_replicated_in_training else T
    params_t = model.llm_params(T) + model.vision_params(vit_tp)
    params_r = model.llm_params(R) + model.vision_params(R)
    dp = wl.train_dp if a.distributed_optimizer else 1
    sp = T if a.sequence_parallel else 1
    act_layer = model.layer_activation_values_per_token(T, a.sequence_parallel) * a.param_bytes  # bytes/token
    kv_t = model.kv_bytes_per_token(T, a.kv_bytes)
    kv_r = model.kv_bytes_per_token(R, a.kv_bytes)
    layer_input = model.layers * model.hidden * a.param_bytes / sp  # bytes/token kept under recompute
    logits = model.vocab / T * 4  # fp32 bytes/token over the vocab split
    pt = wl.prompts_per_train_group
    c: dict[str, Component] = {}

    def add(key: str, name: str, lifetime: LifetimeClass | str, nbytes: float, formula: str) -> None:
        c[key] = Component(name, lifetime.value if isinstance(lifetime, LifetimeClass) else lifetime, nbytes,
                           formula)

    add("actor_weights", "actor weights (bf16, training layout)", LifetimeClass.REGENERABLE,
        params_t * a.param_bytes, f"{params_t:,} params/GPU x {a.param_bytes} B")
    add("rollout_weights", "rollout weights (bf16, rollout layout)", LifetimeClass.REGENERABLE,
        params_r * a.param_bytes, f"{params_r:,} params/GPU at rollout TP {R} x {a.param_bytes} B")
    if a.reference_model:
        add("ref_weights", "reference weights (bf16)", LifetimeClass.REGENERABLE, params_t * a.param_bytes,
            f"{params_t:,} params/GPU x {a.param_bytes} B")
    add("grads", "gradients (fp32 main_grad)", LifetimeClass.PHASE_LOCAL, params_t * a.grad_bytes,
        f"{params_t:,} x {a.grad_bytes} B")
    add("master", "fp32 master weights", LifetimeClass.PERMANENT, params_t * a.master_bytes / dp,
        f"{params_t:,} x {a.master_bytes} B / {dp} (distributed optimizer)")
    add("moments", "Adam moments (fp32 m, v)", LifetimeClass.PERMANENT,
        params_t * a.num_moments * a.moment_bytes / dp,
        f"{params_t:,} x {a.num_moments} x {a.moment_bytes} B / {dp}")

    tokens_per_prompt = (P + G * C) if a.prefix_caching else G * (P + C)
    add("rollout_kv", "rollout KV cache", LifetimeClass.PHASE_LOCAL,
        wl.prompts_per_engine * tokens_per_prompt * kv_r,
        f"{wl.prompts_per_engine:g} prompts/engine x {tokens_per_prompt:,} tokens x {kv_r / 1024:g} KiB "
        "(the step's need; serial/naive get vLLM's pool instead)")
    ws_tokens = a.rollout_max_num_batched_tokens
    ws_layer = (2 * model.hidden + ((model.heads + 2 * model.kv_heads) * model.head_dim + 2 * model.intermediate)
                / R) * a.param_bytes
    add("rollout_workspace", "rollout activation workspace", LifetimeClass.PHASE_LOCAL,
        ws_tokens * ws_layer + a.rollout_max_num_seqs * model.vocab * 4,
        f"{ws_tokens} tokens x one layer + {a.rollout_max_num_seqs} x vocab fp32 logits")

    add("actor_prefix_kv", "actor prefix KV (boundary)", LifetimeClass.BOUNDARY, pt * P * kv_t,
        f"{pt:g} prompts x {P} tokens x {kv_t / 1024:g} KiB")
    if a.reference_model:
        add("ref_prefix_kv", "reference prefix KV (boundary)", LifetimeClass.BOUNDARY, pt * P * kv_t,
            f"{pt:g} prompts x {P} tokens x {kv_t / 1024:g} KiB")
    add("prefix_graph_full", "actor prefix graph, whole", LifetimeClass.BOUNDARY, pt * P * model.layers * act_layer,
        f"{pt:g} prompts x {P} tokens x {model.layers} layers x {act_layer / 1024:.2f} KiB")
    add("prefix_graph_inputs", "actor prefix graph, layer inputs", LifetimeClass.BOUNDARY, pt * P * layer_input,
        f"{pt:g} prompts x {P} tokens x {model.layers} x hidden x {a.param_bytes} B / {sp}")

    vit = 0.0
    if model.vision is not None:
        v = model.vision
        patches = a.visual_token_fraction * P * v.merge**2
        vit_block = (8 * v.hidden + 3 * v.intermediate) * a.param_bytes
        vit = patches * (v.depth * v.hidden * a.param_bytes + vit_block) / vit_tp
    add("prefix_working", "prefix forward working set (ViT + one layer)", LifetimeClass.PHASE_LOCAL,
        vit + P * act_layer, "one prompt: ViT block inputs + one ViT block, plus one LLM layer over P tokens")

    full_tokens = wl.micro_batch * (P + C)
    suffix_tokens = wl.micro_batch * C
    add("score_temps_full", "scoring temporaries (logits)", LifetimeClass.PHASE_LOCAL,
        full_tokens * logits * 2, f"{full_tokens} tokens x vocab/{T} x fp32 x 2 (logits, log-softmax)")
    add("score_temps_suffix", "scoring temporaries (logits)", LifetimeClass.PHASE_LOCAL,
        suffix_tokens * logits * 2, f"{suffix_tokens} suffix tokens x vocab/{T} x fp32 x 2")
    per_train_token = layer_input + act_layer + 2 * logits
    add("train_act_full", "training activations", LifetimeClass.PHASE_LOCAL, full_tokens * per_train_token,
        f"{full_tokens} tokens x (layer inputs + one layer + fp32 logits and grad)")
    add("train_act_suffix", "training activations", LifetimeClass.PHASE_LOCAL,
        suffix_tokens * per_train_token, f"{suffix_tokens} suffix tokens x (layer inputs + one layer + logits)")
    add("prefix_recompute", "prefix backward: one layer recomputed", LifetimeClass.PHASE_LOCAL, pt * P * act_layer,
        f"{pt:g} prompts x {P} tokens x one layer")
    add("runtime", "runtime (CUDA context, NCCL, allocator slack)", RUNTIME, a.runtime_overhead_gib * GIB,
        f"{a.runtime_overhead_gib:g} GiB")
    return c


# --- plans --------------------------------------------------------------------------------------------------------

ALL = PHASES
R_, S_, T_, O_, Y_ = PHASES  # rollout, score, train, optimizer, sync


def _entry(c: Component, phases: tuple[Phase, ...], nbytes: float | None = None, note: str = "") -> Entry:
    return Entry(c.name, c.lifetime, c.nbytes if nbytes is None else nbytes, phases, note)


def _vllm_pool(c: dict[str, Component], wl: Workload, a: Assumptions) -> tuple[float, str]:
    reserved = a.vllm_gpu_memory_utilization * wl.device_mem_gib * GIB
    pool = reserved - c["rollout_weights"].nbytes - c["rollout_workspace"].nbytes
    need = c["rollout_kv"].nbytes
    note = (f"vLLM pool = {a.vllm_gpu_memory_utilization} x {wl.device_mem_gib:g} GiB - weights - workspace; "
            f"the step needs {need / GIB:.1f} GiB")
    if pool <= 0:
        note += "; the reservation does not even hold the weights (vLLM would refuse to start)"
    return max(pool, 0.0), note


def plan_serial(c: dict[str, Component], wl: Workload, a: Assumptions) -> Plan:
    pool, pool_note = _vllm_pool(c, wl, a)
    e = [
        _entry(c["actor_weights"], (S_, T_, O_, Y_), note="offloaded while vLLM runs"),
        _entry(c["rollout_weights"], (Y_, R_), note="vLLM asleep (level 1) outside rollout and weight sync"),
        _entry(c["grads"], (T_, O_)),
        _entry(c["master"], (T_, O_), note="loaded for the train step, offloaded otherwise"),
        _entry(c["moments"], (T_, O_)),
        _entry(c["rollout_kv"], (R_,), nbytes=pool, note=pool_note),
        _entry(c["rollout_workspace"], (R_,)),
        _entry(c["prefix_working"], (S_, T_), note="ViT re-run by every log-prob pass"),
        _entry(c["score_temps_full"], (S_,)),
        _entry(c["train_act_full"], (T_,), note="full prompt+completion sequences: no prefix reuse"),
        _entry(c["runtime"], ALL),
    ]
    if "ref_weights" in c:
        e.insert(2, _entry(c["ref_weights"], (S_,)))
    return Plan("serial", e, wl.device_mem_gib)


def plan_naive(c: dict[str, Component], wl: Workload, a: Assumptions) -> Plan:
    pool, pool_note = _vllm_pool(c, wl, a)
    graph = c["prefix_graph_full"] if a.naive_keeps_full_prefix_graph else c["prefix_graph_inputs"]
    e = [
        _entry(c["actor_weights"], ALL),
        _entry(c["rollout_weights"], ALL, note="separate copy in the rollout layout"),
        _entry(c["grads"], ALL, note="Megatron's grad buffer stays allocated"),
        _entry(c["master"], ALL),
        _entry(c["moments"], ALL),
        _entry(c["rollout_kv"], ALL, nbytes=pool, note=pool_note),
        _entry(c["rollout_workspace"], ALL, note="part of vLLM's reservation"),
        _entry(c["actor_prefix_kv"], (R_, S_, T_)),
        _entry(graph, (R_, S_, T_), note="autograd graph of the prefix forward, kept to the backward"),
        _entry(c["prefix_working"], (R_,)),
        _entry(c["score_temps_suffix"], (S_,)),
        _entry(c["train_act_suffix"], (T_,)),
        _entry(c["runtime"], ALL),
    ]
    if "ref_weights" in c:
        e.insert(2, _entry(c["ref_weights"], ALL))
        e.insert(9, _entry(c["ref_prefix_kv"], (R_, S_)))
    return Plan("naive_overlap", e, wl.device_mem_gib)


def plan_rollplex(c: dict[str, Component], wl: Workload, a: Assumptions) -> Plan:
    perm_total = c["master"].nbytes + c["moments"].nbytes
    in_flight = min(a.optimizer_chunks_in_flight * a.optimizer_chunk_mib * 2**20, perm_total)
    share = c["master"].nbytes / perm_total if perm_total else 0.0
    chunk_note = (f"home: host ({perm_total / GIB:.1f} GiB); {a.optimizer_chunks_in_flight} x "
                  f"{a.optimizer_chunk_mib} MiB chunks on the device")
    e = [
        _entry(c["actor_weights"], ALL, note="theta_k: read by rollout (views), prefix, suffix; updated in place"),
        _entry(c["rollout_weights"], (Y_, R_), nbytes=c["rollout_weights"].nbytes * a.incompatible_weight_fraction,
               note=f"only the layout-incompatible {a.incompatible_weight_fraction:.1%} is rebuilt"),
        _entry(c["grads"], (T_, O_)),
        _entry(c["master"], (O_,), nbytes=in_flight * share, note=chunk_note),
        _entry(c["moments"], (O_,), nbytes=in_flight * (1 - share), note=chunk_note),
        _entry(c["rollout_kv"], (R_,), note="sized to the step's need"),
        _entry(c["rollout_workspace"], (R_,)),
        _entry(c["actor_prefix_kv"], (R_, S_, T_)),
        _entry(c["prefix_graph_inputs"], (R_, S_, T_), note="non-critical activations recomputed in the backward"),
        _entry(c["prefix_working"], (R_,)),
        _entry(c["score_temps_suffix"], (S_,)),
        _entry(c["train_act_suffix"], (T_,)),
        _entry(c["prefix_recompute"], (T_,)),
        _entry(c["runtime"], ALL),
    ]
    if "ref_weights" in c:
        e.insert(2, _entry(c["ref_weights"], (R_, S_), note="reloaded from the host for the prefix and scoring"))
        e.insert(9, _entry(c["ref_prefix_kv"], (R_, S_)))
    plan = Plan("rollplex", e, wl.device_mem_gib)
    _fit_kv_pool(plan, c, wl)
    return plan


def _fit_kv_pool(plan: Plan, c: dict[str, Component], wl: Workload) -> None:
    """Shrink the KV pool to the room left in the rollout phase; say what it still holds, or what does not fit."""
    kv = next(e for e in plan.entries if e.component == c["rollout_kv"].name)
    limit = wl.device_mem_gib * GIB
    others = plan.phase_bytes(R_) - kv.nbytes
    per_seq = c["rollout_kv"].nbytes / max(wl.prompts_per_engine * wl.num_generations, 1e-9)
    if others + kv.nbytes > limit:
        kv.nbytes = max(limit - others, 0.0)
        seqs = int(kv.nbytes // per_seq) if per_seq else 0
        total = round(wl.prompts_per_engine * wl.num_generations)
        kv.note = (f"shrunk to the free room: holds {seqs} of {total} sequences at full length; vLLM decodes the "
                   "rest in later waves")
        if seqs < 1:
            plan.notes.append(f"does not fit: the rollout phase needs {others / GIB:.1f} GiB before any KV cache "
                              f"(limit {wl.device_mem_gib:g} GiB)")
    plan.notes.append(f"rollout phase: {plan.phase_bytes(R_) / limit:.0%} of the device; the rollout engine itself "
                      f"(KV pool + workspace) ~ gpu_memory_utilization "
                      f"{(kv.nbytes + c['rollout_workspace'].nbytes) / limit:.2f}, weights shared with training")
    for phase in PHASES:
        if plan.phase_bytes(phase) > limit:
            over = [f"{e.component} {e.nbytes / GIB:.1f} GiB" for e in plan.entries if phase in e.phases]
            plan.notes.append(f"does not fit in {phase.value}: {plan.phase_bytes(phase) / GIB:.1f} GiB > "
                              f"{wl.device_mem_gib:g} GiB ({', '.join(over)})")


def plan_memory(model: ModelDims, workload: Workload, assumptions: Assumptions | None = None) -> MemoryPlanReport:
    a = assumptions or Assumptions()
    c = components(model, workload, a)
    plans = {"serial": plan_serial(c, workload, a), "naive_overlap": plan_naive(c, workload, a),
             "rollplex": plan_rollplex(c, workload, a)}
    return MemoryPlanReport(model, workload, a, c, plans)
