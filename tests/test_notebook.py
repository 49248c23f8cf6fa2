"""The notebooks in examples/ run headless, top to bottom, in a fresh Jupyter kernel (nbclient + ipykernel, in the
`dev` extra), on tiny local checkpoints."""

import os
from pathlib import Path

import pytest

from helpers import REQUIRE_EXTRAS

try:
    import nbclient  # noqa: F401
    import nbformat
    from nbclient import NotebookClient
except ImportError as error:  # pragma: no cover - the dev extra installs both
    if REQUIRE_EXTRAS:
        raise
    pytest.skip(f"nbclient/nbformat are not importable ({error}); pip install -e '.[dev]'", allow_module_level=True)
try:
    import ipykernel  # noqa: F401
except ImportError as error:  # pragma: no cover
    if REQUIRE_EXTRAS:
        raise
    pytest.skip(f"ipykernel is not importable ({error}), so no Jupyter kernel can start; pip install -e '.[dev]'",
                allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _execute(name: str, tmp_path: Path, checkpoint: Path, monkeypatch, **env: str):
    """Run every cell of examples/<name>; returns the executed notebook. The kernel inherits this environment."""
    assert checkpoint.parent.name == "checkpoints"
    monkeypatch.setenv("ROLLPLEX_CACHE", str(checkpoint.parent.parent))  # reuse the session's tiny checkpoint
    monkeypatch.setenv("ROLLPLEX_NOTEBOOK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{name} is committed with outputs; clear them"
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                   ).execute()
    return notebook


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_quickstart_notebook(tiny_vl_path, tmp_path, monkeypatch):
    notebook = _execute("rollplex_quickstart.ipynb", tmp_path, tiny_vl_path, monkeypatch)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    all_text = "\n".join(_text(cell) for cell in code)
    assert "trained steps: 2" in all_text
    images = [o for cell in code for o in cell.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1, "the timeline image is displayed once"
    assert (tmp_path / "work" / "checkpoints" / "rollplex_timeline.png").exists()
    last = _text(code[-1])
    assert "answer:" in last and "solution:" in last


def test_notebook_launcher_notebook(tiny_vl_path, tmp_path, monkeypatch):
    """`accelerate.notebook_launcher(train, num_processes=2)` from a notebook: 2 forked CPU processes (gloo), one
    video GRPO step, the same weights on both ranks."""
    notebook = _execute("rollplex_notebook_launcher.ipynb", tmp_path, tiny_vl_path, monkeypatch,
                        ROLLPLEX_NOTEBOOK_PORT=_free_port())
    last = _text([cell for cell in notebook.cells if cell.cell_type == "code"][-1])
    assert "identical weights on 2 ranks: True" in last, last
