"""The compat boundary: third-party internals are touched only in the compat module of their upstream
(trl_compat.py: TRL and transformers; megatron_compat.py: megatron-core; vllm_compat.py: vLLM; torch_compat.py:
torch), each version-guarded and tested. This walks every other module of the package with `ast` and fails on a
new touch of a third-party internal:

- an attribute path from a third-party import through a private name (`torch._foreach_copy_`, `torch._C`,
  `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`, `transformers.x._y`);
- torch's private tensor/storage attributes on any object (`._cdata`, `._version`);
- an import of a private name, or from a private module, of a third-party package;
- a class whose base is a transformers cache class or comes from megatron-core or vLLM (the base must come from
  the compat module, which checks the internals the subclass relies on);
- a search of the call stack (`inspect.stack`, `inspect.currentframe`, `sys._getframe`, `frame.f_back`);
- vLLM's engine and layer internals, by name (vLLM objects reach us untyped: `llm.llm_engine.model_executor...`,
  `mapper._map_name`, `layer.quant_method`, `hasattr(layer, "cpu_linear")`).

Anything that must stay goes into ALLOWED with its reason; an entry that no longer matches fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rollplex_trl"
COMPAT_MODULES = {"trl_compat.py", "megatron_compat.py", "vllm_compat.py", "torch_compat.py"}
THIRD_PARTY = ("torch", "transformers", "trl", "vllm", "megatron", "accelerate", "peft")
TORCH_PRIVATE_ATTRIBUTES = {"_cdata", "_version"}  # torch's storage identity and tensor version counter
FRAME_ATTRIBUTES = {"f_back", "f_locals", "f_globals"}
STACK_CALLS = {"inspect.stack", "inspect.currentframe", "inspect.getouterframes", "inspect.trace", "sys._getframe"}
SUBCLASSED_INTERNALS = ("transformers.cache_utils.", "megatron.", "vllm.")
VLLM_INTERNALS = {"llm_engine", "model_executor", "driver_worker", "model_runner", "_map_name", "hf_to_vllm_mapper",
                  "quant_method", "process_weights_after_loading", "cpu_linear", "output_size_per_partition",
                  "input_size_per_partition"}

# (module relative to the package, finding) -> why it stays outside a compat module
ALLOWED: dict[tuple[str, str], str] = {}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _third_party(dotted: str) -> bool:
    return dotted.split(".", 1)[0] in THIRD_PARTY


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> dotted name it was imported as
        self.findings: set[str] = set()
        self.inner: set[int] = set()  # attribute nodes inside a chain already checked as a whole

    # imports ---------------------------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                root = alias.name.split(".", 1)[0]
                self.aliases[root] = root
            if _third_party(alias.name) and any(_is_private(part) for part in alias.name.split(".")):
                self.findings.add(f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}" if node.level == 0 else alias.name
        if node.level or not _third_party(module):
            return
        if any(_is_private(part) for part in module.split(".")):
            self.findings.add(f"from {module} import")
        for alias in node.names:
            if _is_private(alias.name):
                self.findings.add(f"from {module} import {alias.name}")

    # names -----------------------------------------------------------------------------------------------------
    def _dotted(self, node: ast.AST) -> str | None:
        """`a.b.c` with `a` replaced by what it was imported as; None if the chain does not start at a name."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        return ".".join([self.aliases.get(node.id, node.id), *reversed(parts)])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in TORCH_PRIVATE_ATTRIBUTES:
            self.findings.add(f".{node.attr}")
        if node.attr in FRAME_ATTRIBUTES or node.attr in VLLM_INTERNALS:
            self.findings.add(f".{node.attr}")
        if id(node) not in self.inner:  # the whole chain `a.b.c`, once (not again as `a.b`)
            if isinstance(node.value, ast.Attribute):
                self.inner.add(id(node.value))
            dotted = self._dotted(node)
            if dotted is not None and _third_party(dotted) and any(_is_private(p) for p in dotted.split(".")[1:]):
                self.findings.add(dotted)
            if dotted in STACK_CALLS:
                self.findings.add(dotted)
        elif isinstance(node.value, ast.Attribute):
            self.inner.add(id(node.value))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if self.aliases.get(node.id) in STACK_CALLS:
            self.findings.add(self.aliases[node.id])

    def visit_Call(self, node: ast.Call) -> None:
        # getattr(x, "name") / hasattr(x, "name") of a vLLM internal
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in VLLM_INTERNALS):
            self.findings.add(f".{node.args[1].value}")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            dotted = self._dotted(base)
            if dotted and dotted.startswith(SUBCLASSED_INTERNALS):
                self.findings.add(f"class {node.name}({dotted})")
        self.generic_visit(node)


def findings_of(source: str) -> set[str]:
    finder = _Finder()
    tree = ast.parse(source)
    # aliases first (an import below its use still binds the name), then the walk
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            _Finder.visit(finder, node)
    finder.visit(tree)
    return finder.findings


def _package_findings() -> dict[tuple[str, str], None]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in COMPAT_MODULES and path.parent == PACKAGE:
            continue
        rel = str(path.relative_to(PACKAGE))
        for finding in findings_of(path.read_text()):
            found[(rel, finding)] = None
    return found


def test_no_module_outside_the_compat_modules_touches_third_party_internals():
    found = _package_findings()
    offenders = sorted(key for key in found if key not in ALLOWED)
    assert not offenders, ("third-party internals touched outside the compat modules (move each into "
                           f"trl_compat/megatron_compat/vllm_compat/torch_compat, or allow it with a reason): "
                           f"{offenders}")


def test_every_allowed_touch_still_exists_and_says_why():
    found = _package_findings()
    stale = sorted(key for key in ALLOWED if key not in found)
    assert not stale, f"ALLOWED entries that no longer match anything: {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_finder_catches_each_kind_of_touch():
    source = """
import inspect
import sys
import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from transformers.cache_utils import DynamicLayer
from transformers.utils import _private_helper
from torch.utils._pytree import tree_map

class A(DynamicLayer):
    pass

class B(DotProductAttention):
    pass

def f(t, s):
    torch._foreach_copy_([t], [t])
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(t, t, t)
    F._private(t)
    frame = inspect.currentframe().f_back
    sys._getframe(1)
    llm.llm_engine.model_config
    hasattr(layer, "cpu_linear")
    return s._cdata, t._version, torch.__version__, torch.ops.aten.add
"""
    assert findings_of(source) == {
        "class A(transformers.cache_utils.DynamicLayer)",
        "class B(megatron.core.transformer.dot_product_attention.DotProductAttention)",
        "from transformers.utils import _private_helper",
        "from torch.utils._pytree import",
        "torch._foreach_copy_",
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "torch.nn.functional._private",
        "inspect.currentframe",
        ".f_back",
        "sys._getframe",
        ".llm_engine",
        ".cpu_linear",
        "._cdata",
        "._version",
    }
    # our own private names, and public third-party ones, are not findings
    assert findings_of("import torch\nclass C:\n    def f(self, t):\n        return self._x, torch.ops.aten.mm, "
                       "t.untyped_storage(), torch.__version__\n") == set()
