"""Shared fixtures: local checkpoints built once per test session (no model hub)."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def checkpoint_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_vl_path(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return get_checkpoint("qwen2_5_vl", "tiny", cache_dir=checkpoint_cache)


@pytest.fixture(scope="session")
def tiny_qwen2_path(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return get_checkpoint("qwen2", "tiny", cache_dir=checkpoint_cache)


@pytest.fixture()
def video_dataset(tmp_path):
    """Four rows over real MP4 clips (tests/helpers.py `video_rows`), questions of growing length."""
    from datasets import Dataset

    from helpers import video_rows

    return Dataset.from_list(video_rows(tmp_path / "clips"))


@pytest.fixture()
def video_dataset_q(tmp_path):
    """As `video_dataset`, with questions "", "Q", "QQ", ... (prompt lengths that differ by one token)."""
    from datasets import Dataset

    from helpers import video_rows

    return Dataset.from_list(video_rows(tmp_path / "clips", lambda i: "Q" * i))


@pytest.fixture()
def notices():
    """The messages `rollplex_trl.notices.notice` logs during the test, in order (a handler on the notices' logger,
    which does not propagate to the root logger that caplog watches)."""
    import logging

    from rollplex_trl.notices import notice_logger

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, logger = Collect(), notice_logger()
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
