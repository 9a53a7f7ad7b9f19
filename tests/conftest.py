import datetime as dt
import os
import sys
from pathlib import Path

import pyarrow as pa
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One real (ephemeral) Prefect API for the whole session: starting one costs seconds."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def store(tmp_path):
    from storage.store import Store

    return Store(tmp_path / "store")


def prompt_rows(n: int, offset: int = 0, source: str = "test") -> pa.Table:
    from storage.ids import prompt_id

    texts = [f"What is {i} + {i}?" for i in range(offset, offset + n)]
    answers = [str(2 * i) for i in range(offset, offset + n)]
    ids = [prompt_id(t, a, source) for t, a in zip(texts, answers)]
    return pa.table({
        "prompt_id": ids, "text": texts, "answer": answers, "source": [source] * n, "root_id": ids,
        "transform": ["original"] * n, "created_at": [dt.datetime(2026, 1, 1, tzinfo=dt.UTC)] * n,
    })


def run_python(code: str, env: dict | None = None, **kw):
    """Start `code` in a fresh interpreter rooted at the repo (for crash and concurrency tests)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **(env or {})}, **kw)


@pytest.fixture(scope="session")
def tiny_backend():
    """The tiny random Llama on the embedded tokenizer, in fp32 so comparisons are exact."""
    from models.hf import TransformersBackend
    from models.registry import resolve

    return TransformersBackend(resolve("tiny-random"), dtype="fp32", batch_size=16)
