"""Shared by the vLLM CPU tests: the trainer's log-probs for fixed sequences and vLLM's distance to them."""

import torch

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
