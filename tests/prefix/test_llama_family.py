"""The shared prefix on a Llama decoder (listed as supported): batch-level log-probs and grads vs the full forward."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollplex_trl.prefix.batch import shared_prefix_logps


def test_llama_shared_prefix_matches_full_forward():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).float()
    G, P, C = 4, 12, 6
    lengths = [12, 7, 9]
    prompts = torch.zeros(len(lengths), P, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    for i, n in enumerate(lengths):  # left padding
        prompts[i, P - n:] = torch.randint(3, 128, (n,))
        prompt_mask[i, P - n:] = 1
    prompt_ids, prompt_mask = prompts.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    completion_ids = torch.randint(3, 128, (prompt_ids.size(0), C))
    completion_mask = (torch.rand(prompt_ids.size(0), C) > 0.2).long().cumprod(-1)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    advantages = torch.randn(ids.size(0), 1)

    logits = model(input_ids=ids, attention_mask=mask).logits[:, P - 1:-1] / 0.7
    reference = logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    (-(reference * completion_mask * advantages).sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logps, _, unique = shared_prefix_logps(model, ids, mask, C, None, temperature=0.7, compute_entropy=False,
                                           prompts_per_chunk=2)
    assert unique == len(lengths)
    assert ((logps - reference).abs() * completion_mask).max() <= 1e-5
    (-(logps * completion_mask * advantages).sum()).backward()
    for name, p in model.named_parameters():
        scale = ref_grads[name].abs().max().clamp(min=1e-12)
        assert ((p.grad - ref_grads[name]).abs().max() / scale) <= 1e-4, name
