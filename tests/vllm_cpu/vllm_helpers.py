"""Shared by the vLLM CPU tests: the trainer's log-probs for fixed sequences and vLLM's distance to them, and a
stand-in for the colocated vLLM engine (for the trainer tests that run in the main environment)."""

import copy

import torch

from rollplex_trl.rollout.transformers_engine import TransformersEngine

TOL = 1e-4
SEQUENCES = [[1, 5, 9, 20, 33, 100, 200, 300, 400, 7, 8, 9, 500, 600], [2, 44, 45, 46, 47, 300, 301]]


def trainer_logprobs(model, sequences):
    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0])
    return out


def max_gap(engine, model, sequences=SEQUENCES):
    got = engine.score(sequences)
    want = trainer_logprobs(model, sequences)
    return max((torch.tensor(g) - w).abs().max().item() for g, w in zip(got, want, strict=True))


def optimizer_step(model, lr=1e-2, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids = torch.randint(3, 700, (2, 12))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


class StandInEngine:
    """A colocated 'vLLM' that samples with its own copy of the weights (so a missing sync would show)."""

    def __init__(self, model, processor=None, pad_token_id=0, eos_token_ids=(2,)):
        self.copy = copy.deepcopy(model).eval()
        self.inner = TransformersEngine(self.copy, pad_token_id=pad_token_id, eos_token_ids=list(eos_token_ids),
                                        processor=processor)
        self.requests_seen = []
        self.requests = []

    def sync_weights(self, model, version):
        with torch.no_grad():
            for dst, src in zip(self.copy.parameters(), model.parameters(), strict=True):
                dst.copy_(src)
        return {"rollplex/weight_sync_s": 1e-3, "rollplex/weight_sync_bytes": 1.0}

    def generate(self, requests, sampling):
        self.requests_seen.append([r.n for r in requests])
        self.requests.append(requests)
        return self.inner.generate(requests, sampling)

    def sleep(self):
        pass

    def wake(self):
        pass
