"""Rollplex's informational messages (rollplex_trl/notices.py): INFO records, shown once as `[rollplex] …` on stderr by
default, hidden by ROLLPLEX_VERBOSITY=warning, never printed twice under a script's logging.basicConfig."""

import logging
import os
import subprocess
import sys

SCRIPT = """
import logging, sys
{setup}
from rollplex_trl.notices import notice
notice("rollplex_overlap=auto: serial schedule on cpu")
print("done", file=sys.stderr)
"""


def _stderr(setup: str = "", **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_notice_is_one_info_line_on_stderr(notices, capsys):
    from rollplex_trl.notices import NOTICE_LOGGER, notice

    notice("phase timeline written to x.json")
    assert capsys.readouterr().err == "[rollplex] phase timeline written to x.json\n"
    assert notices == ["phase timeline written to x.json"]
    logger = logging.getLogger(NOTICE_LOGGER)
    assert logger.getEffectiveLevel() == logging.INFO and not logger.propagate  # not printed again by the root


def test_shown_by_default_once_even_under_basic_config():
    line = "[rollplex] rollplex_overlap=auto: serial schedule on cpu"
    assert _stderr().splitlines() == [line, "done"]
    for level in ("WARNING", "INFO", "DEBUG"):
        text = _stderr(f"logging.basicConfig(level=logging.{level})")
        assert text.count("rollplex_overlap=auto") == 1, text


def test_verbosity_warning_hides_notices_and_a_typo_is_named():
    assert _stderr(ROLLPLEX_VERBOSITY="warning").splitlines() == ["done"]
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(setup="")], capture_output=True, text=True,
                          env={**os.environ, "ROLLPLEX_VERBOSITY": "loud"}, timeout=120)
    assert done.returncode != 0 and "ROLLPLEX_VERBOSITY='loud'" in done.stderr and "warning" in done.stderr
