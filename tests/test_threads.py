"""Thread budgets (models/threads.py): a process that runs torch takes cores // live torch processes threads,
counted from real processes' registrations; a dead one, or a pid reused since, stops counting; the
environment's explicit setting wins; every stage start applies it."""

import json
import subprocess

import pytest
import torch

from models import threads
from tasks.stage import RoundContext, stage


@pytest.fixture
def budget(tmp_path, monkeypatch):
    monkeypatch.setenv("REFINERY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("REFINERY_TORCH_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    sleepers = []

    def other_torch_process():
        p = subprocess.Popen(["sleep", "120"])
        sleepers.append(p)
        (threads.folder() / str(p.pid)).write_text(json.dumps({"pid": p.pid, "started": threads._started(p.pid)}))
        return p

    yield other_torch_process
    for p in sleepers:
        p.kill()
        p.wait()
    torch.set_num_threads(before)


def test_the_share_follows_the_live_torch_processes(budget):
    cores = threads.cores()
    assert threads.claim() == cores and torch.get_num_threads() == cores  # alone: every core
    a, b = budget(), budget()
    assert threads.live() == 3 and threads.claim() == max(1, cores // 3) == torch.get_num_threads()
    a.kill()
    a.wait()
    assert threads.live() == 2 and threads.claim() == max(1, cores // 2)
    assert not (threads.folder() / str(a.pid)).exists()  # a dead process's record is dropped
    # a record whose pid now belongs to another process (started at another time) does not count
    (threads.folder() / str(b.pid)).write_text(json.dumps({"pid": b.pid, "started": "1"}))
    assert threads.live() == 1 and threads.claim() == cores


def test_every_stage_start_claims_the_share(budget, tmp_path):
    @stage("probe")
    def probe(ctx, store):
        return {"threads": torch.get_num_threads()}

    budget()
    torch.set_num_threads(1 if threads.cores() > 1 else 2)  # anything but the share
    ctx = RoundContext(store=str(tmp_path / "store"), run_id="r", round=0)
    assert probe.fn(ctx)["threads"] == max(1, threads.cores() // 2)


def test_the_environment_fixes_the_count(budget, monkeypatch):
    budget()
    monkeypatch.setenv("REFINERY_TORCH_THREADS", "1")
    assert threads.claim() == 1 and not (threads.folder() / str(__import__("os").getpid())).exists()
    monkeypatch.setenv("REFINERY_TORCH_THREADS", "two")
    with pytest.raises(ValueError, match="REFINERY_TORCH_THREADS='two' is not a whole number"):
        threads.claim()
    monkeypatch.setenv("REFINERY_TORCH_THREADS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        threads.claim()
