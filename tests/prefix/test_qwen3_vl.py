"""What only Qwen3-VL (transformers' `qwen3_vl`) has, at the model level: its DeepStack (the tower's per-block
features added to the LLM's first layers) must reach the split's prefix, and the patch-shuffle feature reuse must
permute the DeepStack features too. Everything every family passes (log-probs, entropies and gradients against the
family's own full forward, shared-prefill decoding against `generate`, training on = off, image parity with
`trl.GRPOTrainer`) is in tests/models/test_family_contract.py; the trainer's Qwen3-VL specifics in
tests/test_qwen3_vl_trainer.py.
"""

import pytest
import torch
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

from rollplex_trl.data.prompt import prepare_prompt
from rollplex_trl.data.video import SampledVideo
from rollplex_trl.prefix.batch import run_prefix
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore
from rollplex_trl.temporal import shuffled_prompt

from family_inputs import frames, full_forward, left_pad, scoring_batch, split_forward


@pytest.fixture(scope="module")
def qwen3_vl(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    path = get_checkpoint("qwen3_vl", "tiny", cache_dir=checkpoint_cache)
    return path, AutoProcessor.from_pretrained(path)


def _model(path):
    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).train()  # no dropout


def test_the_split_needs_the_deepstack_injections(qwen3_vl):
    """The contract test (tests/models/test_family_contract.py) checks the split against Qwen3-VL's full forward;
    this checks that the check can fail there: without DeepStack's injections into the LLM the log-probs move
    (0.12 in the probe), so a split that dropped them would be caught."""
    path, processor = qwen3_vl
    model = _model(path)
    b = scoring_batch(processor, ["video", "video_small", "image"], G=3)
    with torch.no_grad():
        ref_logps, _ = full_forward(model, b)
        logps, _ = split_forward(model, b)
    assert (logps - ref_logps).abs().max() <= 1e-5
    deepstack = model.model.language_model._deepstack_process
    model.model.language_model._deepstack_process = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        with torch.no_grad():
            broken, _ = split_forward(model, b)
    finally:
        model.model.language_model._deepstack_process = deepstack
    assert (broken - ref_logps).abs().max() > 1e-2


def test_patch_shuffle_reuses_the_deepstack_features_too(qwen3_vl):
    """Qwen3-VL's tower encodes each temporal patch on its own, DeepStack levels included: the shuffled copy's
    prefill with the ordered clip's features permuted equals the prefill of its pixels, without the tower."""
    path, processor = qwen3_vl
    model = _model(path).eval()
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "which way?"}]}]
    ordered = [prepare_prompt(processor, messages, sample_id="a", videos=[SampledVideo(
        frames=frames(8, 64, 96, 3), sample_fps=2.0, source="<frames>", video_fps=2.0, total_frames=8,
        frame_indices=list(range(8)))])]
    copy, how = shuffled_prompt(ordered[0], seed=1, step=2, granularity="patch")
    assert not torch.equal(how.permutations[0], torch.arange(how.permutations[0].numel()))
    pad = processor.tokenizer.pad_token_id

    def prefill(rows, store=None):
        ids, mask = left_pad([torch.tensor(r.prompt_ids) for r in rows], pad)
        with torch.no_grad():
            return run_prefix(model, ids, mask, rows, keep_graph=False, generate_positions=True, video_store=store)

    plain = prefill([copy])
    store = VideoFeatureStore()
    prefill(ordered, store)
    assert len(store.features[(ordered[0].prompt_key, 0)].deepstack) == 2
    store.derive(copy, ordered[0], how.permutations)
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    try:
        reused = prefill([copy], store)
    finally:
        hook.remove()
    assert calls == [] and store.reused == 1
    for a, b in zip(reused.keys + reused.values, plain.keys + plain.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
