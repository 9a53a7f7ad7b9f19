import datetime as dt
import os
import sys
from pathlib import Path

import pyarrow as pa
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# the runs tests make record one clean commit (storage/provenance.py), so that a comparison of them is not refused
# as mixed code while the working tree has uncommitted changes; tests of that refusal set their own
os.environ.setdefault("REFINERY_CODE_VERSION", "tests")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on two cores: one compute thread each (and in the processes they
    # start), or torch's two threads per worker oversubscribe the cores and every tensor op slows many times
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


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
    from tasks.core.ids import prompt_id

    texts = [f"What is {i} + {i}?" for i in range(offset, offset + n)]
    answers = [str(2 * i) for i in range(offset, offset + n)]
    ids = [prompt_id(t, a, source) for t, a in zip(texts, answers)]
    return pa.table({
        "prompt_id": ids, "text": texts, "answer": answers, "source": [source] * n, "root_id": ids,
        "transform": ["original"] * n, "created_at": [dt.datetime(2026, 1, 1, tzinfo=dt.UTC)] * n,
    })


def store_digest(root) -> str:
    """sha256 over every file under a store folder, its path and bytes, except Prefect's own home (`.prefect/`:
    its server writes its database as it runs) and the empty lock files (`.locks/`): equal before and after a
    command means the command left the store as it found it."""
    import hashlib

    h = hashlib.sha256()
    root = Path(root)
    for path in sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(root)
        if rel.parts[0] in (".prefect", ".locks"):
            continue
        h.update(str(rel).encode() + b"\0")
        h.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return h.hexdigest()


def run_python(code: str, env: dict | None = None, **kw):
    """Start `code` in a fresh interpreter rooted at the repo (for crash and concurrency tests)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **(env or {})}, **kw)


@pytest.fixture(scope="session")
def tiny_backend():
    """The tiny random Llama on the embedded tokenizer, in fp32 so comparisons are exact."""
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    return TransformersBackend(resolve("tiny-random"), dtype="fp32", batch_size=16)


@pytest.fixture(scope="session")
def scripted(tiny_backend):
    """The scripted policy (models/scripted.py) on the tiny random model's weights (shared with tiny_backend)."""
    from models.registry import resolve
    from models.scripted import ScriptedBackend

    return ScriptedBackend(resolve("tiny-random"), dtype="fp32", batch_size=16, model=tiny_backend.model,
                           tokenizer=tiny_backend.tokenizer)


def q(store, query: str) -> list[dict]:
    """Rows of a read-only SQL query over the store."""
    from storage.query import sql

    return sql(store, query).to_pylist()


def land_pool(store, run_id: str, round: int, prompt_ids: list[str], status: str = "active") -> None:
    """Land the pool stage of (run_id, round): every prompt with `status`."""
    n = len(prompt_ids)
    store.commit("pool", {"pool": pa.table({"run_id": [run_id] * n, "round": pa.array([round] * n, pa.int32()),
                                            "prompt_id": prompt_ids, "status": [status] * n})},
                 run_id=run_id, round=round)


def round_ctx(store, run_id: str, round: int = 0, **fields):
    """The RoundContext of (run_id, round) over `store`; `fields` set the rest (policy_version, model, ...)."""
    from tasks.stage import RoundContext

    return RoundContext(store=store.uri, run_id=run_id, round=round, **fields)


def run_cli(*args: str) -> tuple[int, str, str]:
    """`refinery ARGS` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def grpo_batch(b) -> list:
    """Two prompts x two completions of the tiny backend, with GRPO advantages (training-path tests)."""
    from tasks.core.advantages import group_advantages
    from tasks.core.grpo import Sequence

    pa_, pb = (b.encode([b.render([{"role": "user", "content": q}])])[0] for q in ("What is 7 * 8?", "Add 3 and 4."))
    comps = b.encode(["It is 54.", "7 * 8 = 56, so \\boxed{56}", "\\boxed{7}", "3 + 4 = 7"])
    adv = group_advantages([0.0, 1.0])
    return [Sequence(pa_, comps[0], adv[0]), Sequence(pa_, comps[1], adv[1]),
            Sequence(pb, comps[2], adv[1]), Sequence(pb, comps[3], adv[0])]


def assert_trains_alike(b, flag: str, dtype: str = "fp32") -> None:
    """Two optimizer steps of GRPO + SFT with `train.<flag>` off and on, from the tiny backend's weights: the same
    step rows and weights to float tolerance, and the weights did move."""
    import copy

    import torch

    from tasks.core.grpo import Sequence, TrainConfig, TrainPlan, train_round

    seqs = grpo_batch(b)
    sft = [Sequence(seqs[1].prompt_ids, seqs[1].completion_ids + [b.tokenizer.eos_token_id], 0.0)]
    out = []
    for on in (False, True):
        model = copy.deepcopy(b.model)
        cfg = TrainConfig(lr=1e-3, kl_coef=0.0, sft_weight=0.5, rows_per_step=2, **{flag: on})
        rows = train_round(model, None, seqs, sft, cfg, TrainPlan(0.7, b.pad_id, dtype=dtype, seed=1))
        out.append((rows, dict(model.named_parameters())))
    (rows0, w0), (rows1, w1) = out
    for r0, r1 in zip(rows0, rows1, strict=True):
        assert r0.keys() == r1.keys()
        for k in r0.keys() - {"seconds"}:
            assert r0[k] == (None if r1[k] is None else pytest.approx(r1[k], rel=1e-5, abs=1e-7)), k
    # AdamW's first steps move every coordinate by about lr (1e-3) whatever its gradient's size, so float noise in a
    # near-zero gradient shows at up to 1e-6 (the first step's on-policy ratio, tasks/core/grpo.py, takes its old
    # log-probs from each arm's own training forward): 1/1000 of one step
    for n in w0:
        assert torch.allclose(w0[n], w1[n], rtol=1e-5, atol=1e-6), n
    assert any(not torch.equal(w0[n], dict(b.model.named_parameters())[n]) for n in w0)  # it did train


def wait_for_flag(proc, flag, what: str, timeout: float = 300.0, poll: float = 0.05) -> None:
    """Wait until the subprocess `proc` writes `flag` (a fault point's marker: REFINERY_FAULT_FLAG), failing if it
    ends first or `timeout` passes; `what` names the point in the failure."""
    import time

    deadline = time.time() + timeout
    while not flag.exists():
        assert proc.poll() is None, f"the process ended before reaching {what}"
        assert time.time() < deadline, f"the process never reached {what}"
        time.sleep(poll)


def kill_at_flag(proc, flag, what: str, timeout: float = 300.0) -> None:
    """`wait_for_flag`, then SIGKILL the process and reap it: a crash at exactly that point."""
    import os
    import signal

    wait_for_flag(proc, flag, what, timeout)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
