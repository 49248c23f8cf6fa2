"""A compiled decode step for shared-prefix decoding (`rollplex_compile_decode`).

Each decode step of transformers' `generate` is one forward of the text decoder for one token per row: dozens of
small operations per layer (norms, rotary, residual adds, the cascade merge) whose per-op overhead is a large part
of the step for small batches. With the switch on, inside `shared_decode.decoding_with` the decoding thread's calls
of the text decoder (`language_model` of a VL model, the base model of a text model) go through one
`torch.compile`d forward (`dynamic=True`: one graph serves every step of every call, as the suffix grows and the
batch's prompt width changes; inductor fuses the small operations). HF's `generate` stays the loop around it, so
sampling, logits processors and stopping criteria are untouched; calls from other threads (the overlap's prefix jobs
on the same model) and every forward outside the block run the model's own forward.

What is computed does not change: the same operations in the same order; inductor's fused kernels may round the
last bit differently (tested: greedy tokens equal to the eager path, sampled tokens' log-probs within 1e-5).

Measured on CPU (benchmarks/results/shared_decode_compiled*.json): the compile takes minutes on 2 cores for the small
preset, paid once per process; afterwards each decode step is faster. So `"auto"` leaves it off (a short run never
pays the compile back), and on CUDA it has never run: there it compiles with inductor's default mode too (CUDA
graphs would need a fixed-size cache view; not built).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

# torch.compile backend. Tests set "eager" (dynamo's capture of the decode step, the part that can go wrong here,
# without inductor's code generation: seconds instead of minutes); the slow tests run inductor.
BACKEND = "inductor"
# decoder module -> (its forward's function, that forward compiled), kept across rollouts; weak keys: an entry goes
# with its module (modules hash and compare by identity)
_COMPILED: weakref.WeakKeyDictionary[nn.Module, tuple[Callable, Callable]] = weakref.WeakKeyDictionary()


def text_decoder(causal_lm: nn.Module) -> nn.Module:
    """The module whose forward runs the decoder layers for one decode step."""
    backbone = causal_lm.base_model
    return getattr(backbone, "language_model", backbone)


def use_compiled_decode(mode: str, shared_decode: bool) -> bool:
    """Whether this `generate` call decodes through the compiled step. `mode` is `rollplex_compile_decode`; it
    applies only with shared-prefix decoding (whose cache the compiled graph was built for): "on" without it is an
    error, "auto" is off (see the module docstring: on CPU the compile is not paid back in a short run)."""
    if mode == "on" and not shared_decode:
        raise ValueError("rollplex_compile_decode='on' needs shared-prefix decoding, which does not run for this "
                         "generate call (rollplex_shared_decode is 'off', or 'auto' below 8 generations or where it "
                         "cannot apply: see the logged reason). Set rollplex_shared_decode='on' or "
                         "rollplex_compile_decode='off'.")
    return mode == "on"


def _compiled_forward(decoder: nn.Module, forward: Callable) -> Callable:
    compiled = _COMPILED.get(decoder)
    if compiled is None or compiled[0] is not getattr(forward, "__func__", forward):
        # dynamic=True from the first call: the suffix length, the prompt width and the row count change between
        # steps and rollouts; a specialised first graph would recompile at once
        compiled = (getattr(forward, "__func__", forward), torch.compile(forward, dynamic=True, backend=BACKEND))
        _COMPILED[decoder] = compiled
    return compiled[1]


@contextlib.contextmanager
def compiled_decoding(causal_lm: nn.Module, is_decoding: Callable[[], bool]) -> Iterator[None]:
    """Within the block, calls of the text decoder for which `is_decoding()` holds (the decoding thread with its
    shared-prefix cache active) run the compiled forward; all others the decoder's own."""
    decoder = text_decoder(causal_lm)
    had_instance_forward = "forward" in decoder.__dict__  # e.g. an accelerate hook's wrapper: compiled with it
    eager = decoder.forward
    compiled = _compiled_forward(decoder, eager)

    def forward(*args, **kwargs):
        return compiled(*args, **kwargs) if is_decoding() else eager(*args, **kwargs)

    decoder.forward = forward
    try:
        yield
    finally:
        if had_instance_forward:
            decoder.forward = eager
        else:
            del decoder.forward
