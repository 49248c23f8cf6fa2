"""The README's snippet runs as written: extracted from README.md (the python block after `<!-- readme-snippet -->`),
not copied, and run in a fresh process in an empty folder."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_snippet() -> str:
    match = re.search(r"<!-- readme-snippet -->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert match, "README.md has no python block after <!-- readme-snippet -->"
    return match.group(1)


def test_readme_snippet_runs_as_written(tiny_vl_path, checkpoint_cache, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet() + "\nprint('steps', trainer.state.global_step)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ROLLPLEX_CACHE": str(checkpoint_cache)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "steps 2" in done.stdout
    assert sorted(p.name for p in tmp_path.glob("clip*.mp4")) == [f"clip{i}.mp4" for i in range(4)]
