"""Checkpoint retention (`train.keep_checkpoints`, models/checkpoints.py `prune_checkpoints`): a run that keeps only
its evaluated checkpoints deletes the other folders after each round, never the newest two or an evaluated one; the
rows stay; `refinery eval` of a pruned version says so in one line; a row naming a folder that is not the store's
own checkpoint of that run is never deleted; the default keeps everything."""

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import q
from test_screening import scripted

from flows.config import load_config
from flows.curriculum import curriculum
from flows.evaluate import eval_target
from models.checkpoints import checkpoint_dir, prune_checkpoints
from storage.schemas import schema
from storage.store import Store

SETS = scripted("refine.strategies=[]", "shape.enabled=false", "train.kl_coef=0", "train.micro_batch=24",
                "eval.milestone_tokens=1000000")  # evaluated: the base model and the run's end only


def _folders(store: Store, run: str) -> list[int]:
    return sorted(int(p.name[1:]) for p in (Path(store.root, "_checkpoints", f"run_id={run}")).iterdir()
                  if p.name.startswith("v"))


def test_only_the_newest_two_and_the_evaluated_checkpoints_stay(prefect_api, tmp_path):
    store = Store(tmp_path / "store")
    curriculum(load_config(sets=[*SETS, "train.keep_checkpoints=evaluated"], run_id="lean", store=store.root,
                           rounds=3))
    curriculum(load_config(sets=SETS, run_id="all", store=store.root, rounds=3))
    evaluated = {r["policy_version"] for r in q(store, "SELECT DISTINCT policy_version FROM evals WHERE run_id = 'lean'")}
    assert evaluated == {0, 3}
    # v2 sampled the last round: a resume that raises `rounds` refines it with v2 as the teacher
    assert _folders(store, "lean") == [2, 3] and _folders(store, "all") == [1, 2, 3]
    rows = q(store, "SELECT policy_version FROM checkpoints WHERE run_id = 'lean' ORDER BY policy_version")
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]  # the rows stay: lineage names every version
    with pytest.raises(ValueError, match=r"^run lean's checkpoint 1 was pruned \(train.keep_checkpoints") as e:
        eval_target(store, "lean", 1, None, None)
    assert "\n" not in str(e.value)
    assert eval_target(store, "lean", 3, None, None).checkpoint_row["policy_version"] == 3
    assert prune_checkpoints(store, "lean") == []  # nothing left to prune: it is idempotent


def test_a_pruned_run_resumes_past_its_deleted_checkpoints(prefect_api, tmp_path):
    """Resuming walks the landed rounds again; their policies' folders may be pruned, and nothing loads them:
    the resume goes on from the newest checkpoint (it failed on v1's missing folder before)."""
    store = Store(tmp_path / "store")
    sets = [*SETS, "train.keep_checkpoints=evaluated"]
    curriculum(load_config(sets=sets, run_id="lean", store=store.root, rounds=3))
    assert _folders(store, "lean") == [2, 3]
    out = curriculum(load_config(sets=sets, run_id="lean", store=store.root, rounds=4))
    assert out["started_as"] == "resumed"
    evaluated = {r["policy_version"] for r in q(store, "SELECT DISTINCT policy_version FROM evals WHERE run_id = 'lean'")}
    assert evaluated == {0, 3, 4}
    assert _folders(store, "lean") == [3, 4]


def test_a_row_naming_another_folder_is_never_deleted(store, tmp_path):
    """A checkpoints row is data: one that names a folder outside the run's own checkpoint folder (another run's,
    or anything on disk) is skipped; the run's own unevaluated, older folder is deleted."""
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "config.json").write_text("{}")
    other = checkpoint_dir(store, "other", 1)
    other.mkdir(parents=True)
    own = checkpoint_dir(store, "r", 2)
    own.mkdir(parents=True)
    lookalike = Path(str(checkpoint_dir(store, "r", 4)) + "-x")  # not v4's folder, though it starts like it
    lookalike.mkdir()
    now = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [{"run_id": "r", "policy_version": v, "round": v, "path": p, "parent_version": max(v - 1, 0),
             "created_at": now}
            for v, p in ((0, "tiny-random"), (1, str(victim)), (2, str(own)), (3, str(other)), (4, str(lookalike)),
                         (5, str(checkpoint_dir(store, "r", 5))))]
    store.commit("train", {"checkpoints": pa.Table.from_pylist(rows, schema=schema("checkpoints"))}, run_id="r",
                 round=0)
    assert prune_checkpoints(store, "r") == [2]
    assert victim.is_dir() and other.is_dir() and lookalike.is_dir() and not own.exists()


def test_a_resume_that_lowers_rounds_below_the_landed_ones_is_refused_in_one_line(prefect_api, tmp_path):
    """rounds = 1 on a run that ran 2 would make round 0 its last and evaluate v1 at the run's end, a folder
    keep_checkpoints = evaluated may have deleted: refused before anything changes; the same rounds resume."""
    store = Store(tmp_path / "store")
    sets = [*SETS, "train.keep_checkpoints=evaluated"]
    curriculum(load_config(sets=sets, run_id="lean", store=store.root, rounds=2))
    status = q(store, "SELECT status FROM runs WHERE run_id = 'lean' ORDER BY created_at")
    with pytest.raises(ValueError, match=r"^run lean has already run rounds 0-1: rounds = 1 would end it before "
                                         r".*resume with rounds >= 2, or") as e:
        curriculum(load_config(sets=sets, run_id="lean", store=store.root, rounds=1))
    assert "\n" not in str(e.value)
    assert q(store, "SELECT status FROM runs WHERE run_id = 'lean' ORDER BY created_at") == status  # unmarked
    assert curriculum(load_config(sets=sets, run_id="lean", store=store.root, rounds=2))["started_as"] == "resumed"
