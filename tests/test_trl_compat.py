"""The TRL/transformers upgrade surface: every private upstream name the package uses is in trl_compat.py,
and each one still exists upstream with the parameters we rely on. A new private touch elsewhere fails here."""

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
import transformers
import trl
from trl import GRPOTrainer

from rollplex_trl import trl_compat
from rollplex_trl.trainers.grpo import RollplexGRPOTrainer

PACKAGE = Path(__file__).resolve().parents[1] / "rollplex_trl"
COMPAT = PACKAGE / "trl_compat.py"


def _upstream_private_names() -> set[str]:
    """Private names of the upstream classes we extend or drive: their methods and the `self._x` attributes their
    sources assign (TRL's GRPOTrainer and VLLMGeneration, transformers' Trainer)."""
    from transformers import Trainer

    classes = [GRPOTrainer, Trainer, trl_compat.VLLMGeneration]
    names = {n for cls in classes for n in dir(cls) if n.startswith("_") and not n.startswith("__")}
    for cls in classes:
        source = Path(inspect.getsourcefile(cls)).read_text()
        names |= set(re.findall(r"self\.(_[a-z]\w*)\s*=", source))
    return names | TRANSFORMERS_ATTENTION_PRIVATES


# transformers' attention dispatch: what trl_compat.register_attention / attention_implementation_set touch
TRANSFORMERS_ATTENTION_PRIVATES = {"_attn_implementation", "_global_mapping"}


def _private_uses(path: Path) -> set[str]:
    """`x._name` attribute reads/writes and `getattr(x, "_name")`-style strings in one module."""
    tree = ast.parse(path.read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            used.add(node.attr)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_[a-z]\w*", node.value):
            used.add(node.value)
    return used


def _defined_private_names(path: Path) -> set[str]:
    """Private names a module defines itself (methods, functions, attributes assigned on `self`)."""
    tree = ast.parse(path.read_text())
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            defined.add(node.name)
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and node.attr.startswith("_")):
            defined.add(node.attr)
    return defined


def test_the_installed_versions_are_the_supported_ones():
    trl_compat.check_versions()
    with pytest.raises(ImportError, match="trl >=1.16,<1.17; found 1.17.0"):
        trl_compat.check_versions(trl_version="1.17.0")
    with pytest.raises(ImportError, match="transformers"):
        trl_compat.check_versions(transformers_version="6.0.0")
    assert trl_compat.SUPPORTED_TRL[0] <= trl.__version__ and transformers.__version__ >= "5.16"


@pytest.mark.parametrize("name", sorted(trl_compat.TRL_OVERRIDES))
def test_every_overridden_private_method_still_exists_upstream_with_our_parameters(name):
    params, why = trl_compat.TRL_OVERRIDES[name]
    assert why, f"{name}: say why it is overridden"
    upstream = getattr(GRPOTrainer, name, None)
    assert upstream is not None, f"TRL {trl.__version__} has no GRPOTrainer.{name}: review the override"
    missing = [p for p in params if p not in inspect.signature(upstream).parameters]
    assert not missing, f"GRPOTrainer.{name} lost parameters {missing} in TRL {trl.__version__}"


def test_the_trainer_overrides_exactly_the_listed_private_methods():
    ours = {name for name, value in vars(RollplexGRPOTrainer).items()
            if name.startswith("_") and not name.startswith("__") and callable(value)}
    upstream = {name for name in ours if hasattr(GRPOTrainer, name)}
    assert upstream == set(trl_compat.TRL_OVERRIDES), (
        "a private upstream method is overridden without being listed in trl_compat.TRL_OVERRIDES (or the reverse): "
        f"{sorted(upstream ^ set(trl_compat.TRL_OVERRIDES))}")


def test_the_vllm_generation_hooks_still_exist():
    assert hasattr(trl_compat.VLLMGeneration, trl_compat.VLLM_INIT_METHOD)
    assert hasattr(GRPOTrainer, trl_compat.GENERATE_METHOD)
    import trl.trainer.grpo_trainer as grpo_module

    assert grpo_module.VLLMGeneration is trl_compat.VLLMGeneration, "GRPOTrainer no longer builds VLLMGeneration"


def test_no_module_but_trl_compat_touches_upstream_private_names():
    upstream = _upstream_private_names()
    listed = set(trl_compat.TRL_OVERRIDES)
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        # names the module defines itself are its own (a collision with an upstream name on the trainer class
        # is caught by the override test above)
        foreign = (_private_uses(path) & upstream) - _defined_private_names(path) - listed
        if foreign:
            offenders[str(path.relative_to(PACKAGE))] = sorted(foreign)
    assert not offenders, f"private TRL/transformers names used outside trl_compat.py: {offenders}"


def test_the_attention_dispatch_names_still_exist_upstream(tiny_qwen2_path):
    """The private names behind trl_compat's attention switch: registering a wrapper makes it dispatchable, and
    setting the config's implementation inside the block routes the model's attention through it."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert hasattr(AttentionInterface, "_global_mapping")
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, attn_implementation="sdpa")
    trl_compat.register_attention("rollplex_compat_probe", counting, mask_like="sdpa")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with trl_compat.attention_implementation_set(model, "rollplex_compat_probe"):
            assert trl_compat.attention_implementation(model) == "rollplex_compat_probe"
            got = model(input_ids=ids).logits
    assert trl_compat.attention_implementation(model) == "sdpa"
    assert len(calls) == model.config.num_hidden_layers
    assert torch.equal(got, expected)


def test_no_module_but_trl_compat_imports_from_inside_trl():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trl."):
                offenders.append(f"{path.relative_to(PACKAGE)}: from {node.module}")
            if isinstance(node, ast.Import) and any(a.name.startswith("trl.") for a in node.names):
                offenders.append(f"{path.relative_to(PACKAGE)}: import {[a.name for a in node.names]}")
            if isinstance(node, ast.ImportFrom) and node.module == "trl":
                offenders += [f"{path.relative_to(PACKAGE)}: trl.{a.name} is not public"
                              for a in node.names if not hasattr(trl, a.name)]
    assert not offenders, offenders


def test_checkpointing_as_restores_what_generation_turned_off(tiny_vl_path):
    """The snapshot/restore behind the actor prefix job's checkpointing (TRL's generation context turns it off):
    inside the block every layer checkpoints with the user's kwargs (transformers' disable resets the function to a
    plain `checkpoint`, which would drop them), concurrent no-grad decoding keeps its cache, and after the block the
    modules are as the generation context left them."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    training = trl_compat.checkpointing_state(model)
    assert sum(flag for _, flag, _ in training) > len(model.model.language_model.layers)  # the vision blocks too
    model.gradient_checkpointing_disable()  # what unwrap_model_for_generation does
    generation = trl_compat.checkpointing_state(model)
    assert not any(flag for _, flag, _ in generation)
    layer = model.model.language_model.layers[0]
    assert not trl_compat.checkpointing_is_non_reentrant(layer)  # the kwargs are gone
    with trl_compat.checkpointing_as(training):
        assert all(module.gradient_checkpointing for module, flag, _ in training if flag)
        assert trl_compat.checkpointing_is_non_reentrant(layer)
        with torch.no_grad():  # a decode step on another thread's grad mode: the cache survives
            out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
        assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 3
    after = trl_compat.checkpointing_state(model)
    assert [(m, f) for m, f, _ in after] == [(m, f) for m, f, _ in generation]
    assert all(a is b for (_, _, a), (_, _, b) in zip(after, generation, strict=True))


def test_the_cache_layer_internals_our_layers_rely_on_still_hold():
    """prefix/forward.py, prefix/suffix_attention.py and prefix/shared_decode.py subclass transformers' cache classes
    and set `keys`, `values`, `device`, `is_initialized` themselves; DynamicLayer's inherited methods must read them
    as below, or the prefix caches silently serve the wrong length."""
    from transformers import cache_utils

    assert trl_compat.DynamicLayer is cache_utils.DynamicLayer
    assert trl_compat.CacheLayerMixin is cache_utils.CacheLayerMixin and trl_compat.Cache is cache_utils.Cache
    assert issubclass(trl_compat.DynamicLayer, trl_compat.CacheLayerMixin)
    assert trl_compat.CacheLayerMixin.__abstractmethods__ <= trl_compat.CACHE_LAYER_ABSTRACT, (
        "CacheLayerMixin has new abstract methods: SharedPrefixLayer must implement them")
    for name, params in trl_compat.CACHE_LAYER_METHODS.items():
        method = getattr(trl_compat.DynamicLayer, name, None)
        assert method is not None, f"transformers {transformers.__version__}: DynamicLayer.{name} is gone"
        missing = [p for p in params if p not in inspect.signature(method).parameters]
        assert not missing, f"DynamicLayer.{name} lost parameters {missing}"
    assert "layers" in inspect.signature(trl_compat.Cache.__init__).parameters

    fresh = trl_compat.DynamicLayer()  # what our layers' super().__init__() leaves
    for name in trl_compat.CACHE_LAYER_ATTRIBUTES:
        if name != "device":  # set by lazy_initialization (and by our layers)
            assert hasattr(fresh, name), f"DynamicLayer() no longer sets {name}"
    assert fresh.is_initialized is False and fresh.keys is None and fresh.get_seq_length() == 0
    k, v = torch.zeros(2, 1, 3, 4), torch.ones(2, 1, 3, 4)
    fresh.lazy_initialization(k, v)  # _CaptureLayer's first update
    assert fresh.is_initialized is True and fresh.device == k.device
    built = trl_compat.DynamicLayer()  # _ReadOnlyLayer / CascadeSuffixLayer: built around existing K/V
    built.keys, built.values, built.device, built.is_initialized = k, v, k.device, True
    assert built.get_seq_length() == 3 and built.get_mask_sizes(2) == (5, 0)
    cache = trl_compat.Cache(layers=[built])
    assert cache.get_seq_length() == 3
    keys, values = cache.update(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), 0)
    assert keys.shape[-2] == 4  # DynamicLayer.update appends to the keys we set


def test_trainer_running_callback_finds_the_trainer_a_few_frames_up():
    from types import SimpleNamespace

    callback = object()

    class Loop:
        def __init__(self):
            self.callback_handler = SimpleNamespace(callbacks=[callback])

        def train(self):
            return self.fire()

        def fire(self):
            return trl_compat.trainer_running_callback(callback)

    loop = Loop()
    assert loop.train() is loop
    assert trl_compat.trainer_running_callback(callback) is None  # not called from inside a trainer
    assert trl_compat.trainer_running_callback(object(), max_frames=1) is None


def test_trls_regular_generation_branch_is_the_one_the_transformers_engine_re_implements():
    """rollout/transformers_rollout.py re-implements the regular-generation branch of TRL's `_generate_single_turn`
    (with the shared prefill called directly): a TRL that changes that branch must be re-read before it is trusted."""
    import hashlib

    source = trl_compat.regular_generation_source()
    assert source.lstrip().startswith("else:") and "Regular generation path" in source
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == trl_compat.TRL_REGULAR_GENERATION_SHA256, (
        f"TRL {trl.__version__} changed the regular-generation branch of GRPOTrainer._generate_single_turn (sha256 "
        f"{digest}). Re-check rollout/transformers_rollout.py `TransformersRollout` against it (padding, multimodal "
        "fields, _prepare_inputs, unwrap_model_for_generation's arguments, the generate call and its config, the "
        "EOS mask) and trl_compat's generation helpers, then update trl_compat.TRL_REGULAR_GENERATION_SHA256.")
