"""MemoryPhaseCallback in a real transformers Trainer, with StreamedOptimizer as its optimizer."""

from collections import defaultdict

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from rollplex_trl.callbacks import MemoryPhaseCallback
from rollplex_trl.memory import (
    MemoryLedger,
    MemoryRegistry,
    Phase,
    ResidencyManager,
    StreamedOptimizer,
    register_streamed_optimizer,
)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean() * 10, "logits": out}


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(24, 6, generator=g), torch.randn(24, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class _Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _train(tmp_path, streamed: bool):
    torch.manual_seed(0)
    model = _Toy()
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=2e-2, max_grad_norm=0.5, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    callbacks, extras = [], {}
    if streamed:
        opt = StreamedOptimizer(groups, torch.optim.AdamW, chunk_bytes=1024, lr=2e-2)
        reg = MemoryRegistry()
        ledger = MemoryLedger(reg)
        mgr = ResidencyManager(reg, ledger)
        register_streamed_optimizer(reg, opt, ledger)
        reg.register_tensors("scratch", [torch.zeros(256)], "phase_local", "train", "train")
        recorder = _Recorder()
        callbacks = [MemoryPhaseCallback(mgr, ledger), recorder]
        extras = {"reg": reg, "recorder": recorder, "opt": opt}
    else:
        opt = torch.optim.AdamW(groups, lr=2e-2)
    trainer = Trainer(model=model, args=args, train_dataset=_Data(), optimizers=(opt, None), callbacks=callbacks)
    trainer.train()
    return model, extras


def test_trainer_with_streamed_optimizer_and_memory_phases(tmp_path):
    ref_model, _ = _train(tmp_path / "ref", streamed=False)
    model, x = _train(tmp_path / "streamed", streamed=True)
    # the Trainer (grad clipping, linear LR schedule, weight-decay groups) gives bit-identical weights
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        same = torch.equal(p, q)
        assert same, name
    assert len(x["opt"].last_step_chunks) > 1
    # phases per optimizer step: train -> optimizer -> sync -> idle
    phases = [p for p, _ in x["reg"]["scratch"].history]
    assert phases == [Phase.TRAIN, Phase.OPTIMIZER, Phase.SYNC, Phase.IDLE] * 3
    step_logs = [log for log in x["recorder"].logs if "loss" in log]
    assert len(step_logs) == 3
    for log in step_logs:
        assert log["rollplex/mem_phase_local_bytes"] == 256 * 4
        assert log["rollplex/mem_peak_train_bytes"] == 256 * 4
        assert 0 < log["rollplex/mem_permanent_bytes"] == log["rollplex/mem_peak_optimizer_bytes"]
        assert log["rollplex/mem_host_bytes"] == x["opt"].state_bytes()


def test_metrics_go_through_a_trl_trainer_metrics_dict():
    reg = MemoryRegistry()
    ledger = MemoryLedger(reg)
    mgr = ResidencyManager(reg, ledger)
    reg.register_tensors("kv", [torch.zeros(10)], "phase_local", "rollout", "rollout")

    class FakeTRLTrainer:
        _metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    trainer = FakeTRLTrainer()
    cb = MemoryPhaseCallback(mgr, trainer=trainer)
    cb.on_step_begin(None, None, None)
    with mgr.phase("rollout"):  # what the trainer does around generation
        pass
    cb.on_pre_optimizer_step(None, None, None)
    cb.on_optimizer_step(None, None, None)
    cb.on_step_end(None, None, None)
    assert trainer._metrics["train"]["rollplex/mem_peak_rollout_bytes"] == [40.0]
    assert trainer._metrics["train"]["rollplex/mem_phase_local_bytes"] == [40.0]
    logs = {"loss": 1.0}
    cb.on_log(None, None, None, logs=logs)
    assert logs == {"loss": 1.0}  # already delivered through _metrics


def test_ledger_logs_only_what_it_measures():
    # the default trainer's ledger: only the actor prefix (boundary, window "train") is registered
    reg = MemoryRegistry()
    ledger = MemoryLedger(reg)
    mgr = ResidencyManager(reg, ledger)
    prefix = torch.zeros(64)
    reg.register_tensors("actor_prefix", lambda: [prefix], "boundary", "train", "train")
    for phase in ("rollout", "score", "train", "optimizer", "sync", "idle"):
        mgr.enter(phase)
    m = ledger.metrics()
    assert m == {"rollplex/mem_boundary_bytes": 256.0, "rollplex/mem_peak_train_bytes": 256.0}
    # weights registered (what rollplex_memory does): the totals, the class and every phase are measured
    weights = torch.zeros(100)
    reg.register_tensors("weights", [weights], "regenerable", "sync", "optimizer")
    ledger.reset_window()
    for phase in ("rollout", "score", "train", "optimizer", "sync", "idle"):
        mgr.enter(phase)
    m = ledger.metrics()
    assert m["rollplex/mem_resident_bytes"] == 400.0 and m["rollplex/mem_host_bytes"] == 0.0
    assert m["rollplex/mem_regenerable_bytes"] == 400.0
    assert m["rollplex/mem_peak_rollout_bytes"] == 400.0 and m["rollplex/mem_peak_train_bytes"] == 656.0
    assert "rollplex/mem_permanent_bytes" not in m and "rollplex/mem_phase_local_bytes" not in m
