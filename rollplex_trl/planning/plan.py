"""A run's plan: the step model's times (step_model.py) next to the memory planner's bytes (memory/planner.py), whether
each schedule fits, what overflows, and the cheapest change of settings that would fit.

Memory is not re-derived here: the per-GPU bytes per phase are memory/planner.py's plans (serial colocation for the
TRL and serial schedules, the Rollplex plan for Rollplex), with two switches the planner's plans do not have:
`offload=False` keeps the permanent state (fp32 master, Adam moments), the reference weights and the rollout copy
resident in every phase; `weight_sharing=False` gives the rollout engine its own full copy of the weights.

"Cheapest" is the fewest GPU-seconds per step (GPUs x predicted Rollplex step), over single changes (twice the
training or rollout TP, offload on, weight sharing on, half the frames, micro-batch 1, twice the GPUs) and pairs of
them.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace

from rollplex_trl.memory.lifetime import Phase
from rollplex_trl.memory.model_dims import ModelDims
from rollplex_trl.memory.planner import GIB, PHASES, Assumptions, Plan, Workload, plan_memory
from rollplex_trl.planning.hardware import Hardware
from rollplex_trl.planning.step_model import SCHEDULES, StepPrediction, StepSpec, ablation, predict_step

MEMORY_PLAN = {"trl": "serial", "serial": "serial", "rollplex": "rollplex"}
# the paper's measured speed-up of Rollplex over serial colocation (Qwen2.5-VL-32B, 32 H800, training TP 8,
# rollout TP 4), as quoted in issue 37
PAPER_SPEEDUP = (1.23, 1.30)


@dataclass(frozen=True)
class RunSettings:
    """What the user chooses besides the step's shape: memory switches of the Rollplex plan."""

    offload: bool = True  # Rollplex: permanent state on the host, streamed; serial: offloaded around the rollout
    weight_sharing: bool = True


@dataclass
class Overflow:
    schedule: str
    phase: str
    gib: float
    limit_gib: float
    tensor_class: str  # the lifetime class with the most bytes in that phase
    component: str  # the largest object in that phase
    component_gib: float

    def describe(self) -> str:
        return (f"{self.schedule}: does not fit in {self.phase}: {self.gib:.1f} GiB > {self.limit_gib:.1f} GiB per "
                f"GPU; largest class {self.tensor_class}, largest object {self.component} "
                f"({self.component_gib:.1f} GiB)")


@dataclass
class RunPlan:
    model: ModelDims
    spec: StepSpec
    hardware: Hardware
    settings: RunSettings
    predictions: dict[str, StepPrediction]
    memory: dict[str, Plan]  # per schedule
    overflows: list[Overflow]
    suggestion: dict | None = None
    ablation: list[dict] = field(default_factory=list)

    @property
    def speedup_vs_trl(self) -> float:
        return self.predictions["trl"].step_s / self.predictions["rollplex"].step_s

    @property
    def speedup_vs_serial(self) -> float:
        return self.predictions["serial"].step_s / self.predictions["rollplex"].step_s

    def fits(self, schedule: str) -> bool:
        return self.memory[schedule].fits

    def phase_memory_gib(self, schedule: str, memory_phase: str) -> float:
        return self.memory[schedule].phase_bytes(Phase(memory_phase)) / GIB

    def to_json(self) -> dict:
        out = {
            "model": {"name": self.model.name, "num_params": self.model.num_params()},
            "spec": asdict(self.spec),
            "hardware": self.hardware.to_json(),
            "settings": asdict(self.settings),
            "schedules": {},
            "speedup": {"rollplex_vs_trl": self.speedup_vs_trl, "rollplex_vs_serial": self.speedup_vs_serial},
            "fits": {s: self.fits(s) for s in self.predictions},
            "overflows": [asdict(o) | {"message": o.describe()} for o in self.overflows],
            "suggestion": self.suggestion,
            "ablation": self.ablation,
        }
        for name, pred in self.predictions.items():
            plan = self.memory[name]
            js = pred.to_json()
            for ph in js["phases"]:
                ph["memory_gib"] = round(plan.phase_bytes(Phase(ph["memory_phase"])) / GIB, 3)
            js["memory"] = {"peak_gib": round(plan.total_bytes / GIB, 3), "peak_phase": plan.peak_phase.value,
                            "fits": plan.fits, "host_gib": round(host_state_gib(self, name), 3),
                            "phases_gib": {p.value: round(plan.phase_bytes(p) / GIB, 3) for p in PHASES}}
            out["schedules"][name] = js
        return out


def host_state_gib(plan: RunPlan, schedule: str) -> float:
    """Host memory per GPU of the training state parked off the device: with offload, the fp32 master weights and
    Adam moments and the reference weights (Rollplex: outside rollout and score; serial: the actor's weights too,
    while vLLM runs). The video data's host memory is reported separately (memory/host.py)."""
    if not plan.settings.offload:
        return 0.0
    comps = plan_memory(plan.model, _workload(plan.spec, plan.hardware), _assumptions(plan.spec)).components
    keys = ["master", "moments", "ref_weights"] + (["actor_weights"] if schedule != "rollplex" else [])
    return sum(comps[k].nbytes for k in keys if k in comps) / GIB


def _workload(spec: StepSpec, hw: Hardware) -> Workload:
    return Workload(train_tp=spec.train_tp, rollout_tp=spec.rollout_tp, num_gpus=spec.num_gpus, batch=spec.batch,
                    num_generations=spec.num_generations, prompt_len=spec.prompt_len,
                    completion_len=spec.completion_len, device_mem_gib=hw.mem_gib, micro_batch=spec.micro_batch)


def _assumptions(spec: StepSpec, weight_sharing: bool = True) -> Assumptions:
    b = spec.value_bytes
    return Assumptions(param_bytes=b, kv_bytes=b, reference_model=spec.reference,
                       distributed_optimizer=spec.distributed_optimizer,
                       visual_token_fraction=spec.visual_tokens / max(spec.prompt_len, 1),
                       incompatible_weight_fraction=spec.incompatible_fraction if weight_sharing else 1.0)


def _resident_everywhere(plan: Plan, components: dict, keys: tuple[str, ...]) -> None:
    """Without offload: these objects stay on the device, whole, in every phase."""
    names = {components[k].name: components[k].nbytes for k in keys if k in components}
    for e in plan.entries:
        if e.component in names:
            e.phases, e.nbytes = PHASES, names[e.component]
            e.note = "resident all step (no offload)"


def memory_plans(model: ModelDims, spec: StepSpec, hw: Hardware, settings: RunSettings) -> dict[str, Plan]:
    report = plan_memory(model, _workload(spec, hw), _assumptions(spec, settings.weight_sharing))
    comps = report.components
    plans = {name: report.plans[MEMORY_PLAN[name]] for name in SCHEDULES}
    if not settings.offload:
        # a fresh report so TRL/serial and Rollplex do not share mutated entries
        for name in SCHEDULES:
            fresh = plan_memory(model, _workload(spec, hw), _assumptions(spec, settings.weight_sharing))
            plan = fresh.plans[MEMORY_PLAN[name]]
            keys = ("master", "moments", "ref_weights", "actor_weights")
            if name == "rollplex" and not settings.weight_sharing:
                keys += ("rollout_weights",)
            _resident_everywhere(plan, comps, keys)
            plans[name] = plan
    return plans


def overflows(memory: dict[str, Plan]) -> list[Overflow]:
    out = []
    for name, plan in memory.items():
        limit = plan.device_mem_gib * GIB
        for phase in PHASES:
            total = plan.phase_bytes(phase)
            if total <= limit:
                continue
            classes = plan.by_class(phase)
            cls = max(classes, key=classes.get)
            big = max((e for e in plan.entries if phase in e.phases), key=lambda e: e.nbytes)
            out.append(Overflow(name, phase.value, total / GIB, plan.device_mem_gib, cls, big.component,
                                big.nbytes / GIB))
    return out


def _candidates(model: ModelDims, spec: StepSpec, hw: Hardware, settings: RunSettings,
                frames: int | None) -> list[tuple[str, str, StepSpec, RunSettings]]:
    """(kind, label, spec, settings) of every single change; changes of one kind exclude each other."""
    out: list[tuple[str, str, StepSpec, RunSettings]] = []
    node = min(hw.gpus_per_node, spec.num_gpus)
    tps = [t for t in (2, 4, 8, 16) if t <= node and model.heads % t == 0 and spec.num_gpus % t == 0]
    out += [("train_tp", f"train TP {t}", replace(spec, train_tp=t), settings) for t in tps if t > spec.train_tp]
    out += [("rollout_tp", f"rollout TP {t}", replace(spec, rollout_tp=t), settings)
            for t in tps if t > spec.rollout_tp]
    if not settings.offload:
        out.append(("offload", "offload on (permanent state streamed from the host)", spec,
                    replace(settings, offload=True)))
    if not settings.weight_sharing:
        out.append(("sharing", "weight sharing on", spec, replace(settings, weight_sharing=True)))
    if spec.micro_batch > 1:
        out.append(("micro_batch", "micro-batch 1", replace(spec, micro_batch=1), settings))
    for div in (2, 4):
        cut = spec.visual_tokens * (1 - 1 / div)
        if spec.visual_tokens / div >= 1:
            label = (f"{frames // div} frames" if frames and frames // div >= 2
                     else f"1/{div} of the visual tokens ({spec.visual_tokens / div:.0f})")
            out.append(("frames", label, replace(spec, visual_tokens=spec.visual_tokens / div,
                                                 prompt_len=round(spec.prompt_len - cut)), settings))
    for mult in (2, 4):
        out.append(("gpus", f"{spec.num_gpus * mult} GPUs", replace(spec, num_gpus=spec.num_gpus * mult), settings))
    return out


def cheapest_fit(model: ModelDims, spec: StepSpec, hw: Hardware, settings: RunSettings,
                 frames: int | None = None) -> dict | None:
    """The fewest changes (1 to 3, of different kinds) after which the Rollplex plan fits; among those, the one with
    the fewest GPU-seconds per step."""
    singles = _candidates(model, spec, hw, settings, frames)
    for size in (1, 2, 3):
        options = []
        for combo in itertools.combinations(singles, size):
            if len({kind for kind, *_ in combo}) < size:
                continue
            s, st = spec, settings
            for _, _, cs, cst in combo:  # each change on top of the others: the fields that differ from the base
                s = replace(s, **{k: v for k, v in asdict(cs).items() if getattr(spec, k) != v})
                st = replace(st, **{k: v for k, v in asdict(cst).items() if getattr(settings, k) != v})
            try:
                mem = memory_plans(model, s, hw, st)["rollplex"]
            except ValueError:  # e.g. GPUs not a multiple of the TP degree
                continue
            if not mem.fits:
                continue
            step = predict_step(model, s, hw, _mechanisms(st)).step_s
            options.append({"change": " + ".join(label for _, label, _, _ in combo), "num_gpus": s.num_gpus,
                            "step_s": step, "gpu_seconds": step * s.num_gpus, "peak_gib": mem.total_bytes / GIB,
                            "peak_phase": mem.peak_phase.value})
        if options:
            return min(options, key=lambda o: o["gpu_seconds"])
    return None


def _mechanisms(settings: RunSettings):
    return replace(SCHEDULES["rollplex"], weight_sharing=settings.weight_sharing,
                   streamed_optimizer=settings.offload)


def plan_run(model: ModelDims, spec: StepSpec, hw: Hardware, settings: RunSettings | None = None,
             frames: int | None = None) -> RunPlan:
    settings = settings or RunSettings()
    preds = {}
    for name in SCHEDULES:
        mech = _mechanisms(settings) if name == "rollplex" else SCHEDULES[name]
        pred = predict_step(model, spec, hw, mech)
        pred.schedule = name
        preds[name] = pred
    memory = memory_plans(model, spec, hw, settings)
    over = overflows(memory)
    suggestion = None
    if not memory["rollplex"].fits:
        suggestion = cheapest_fit(model, spec, hw, settings, frames)
    return RunPlan(model, spec, hw, settings, preds, memory, over, suggestion, ablation(model, spec, hw))
