"""The stage contract (tasks/stage.py): a name known only at run time, the landed check on it, what a stage
outside a run's rounds keeps out of `generated_tokens`, the releases features register, and that the contract
imports no feature. Plus the shared generate-and-verify pass (tasks/sampling/verified.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import round_ctx  # noqa: E402
from test_layout import ROOT, feature_imports  # noqa: E402

from models.meter import record  # noqa: E402
from storage.query import scan  # noqa: E402
from tasks.stage import STAGE_END, at_stage_end, stage  # noqa: E402


def _probe(calls: list, **options):
    """A stage named `probe-<tag>` at run time, that records its calls, generates 7 tokens and commits."""

    @stage(lambda ctx, tag, **_: f"probe-{tag}", **options)
    def probe_task(ctx, store, tag: str, extra: int = 0) -> dict:
        calls.append(tag)
        record("eval", [[SimpleNamespace(n_tokens=7)]])
        store.commit(f"probe-{tag}", {}, run_id=ctx.run_id, round=ctx.round)
        return {"extra": extra}

    return probe_task


def test_a_stage_named_at_run_time_runs_once_then_skips_when_landed(store):
    calls = []
    probe = _probe(calls)
    ctx = round_ctx(store, "r", 2)
    first = probe.fn(ctx, "a", extra=3)
    assert (first["stage"], first["round"], first["extra"], "skipped" in first) == ("probe-a", 2, 3, False)
    again = probe.fn(ctx, tag="a")  # by keyword: the name is computed from the bound arguments
    assert again["stage"] == "probe-a" and again["skipped"] == "already landed" and "timing" in again
    other = probe.fn(ctx, "b")  # another name is another stage
    assert "skipped" not in other and calls == ["a", "b"]
    assert store.landed("r", 2, "probe-a") and store.landed("r", 2, "probe-b") and not store.landed("r", 2, "probe")
    assert probe.name == "probe"  # the Prefect task: the function's name less `_task`


def test_on_landed_and_metered_off_for_stages_outside_the_rounds(store):
    """`refinery eval` and rescore run as stages but stay out of the run's generated_tokens (its budget and
    the comparison's accounting read them), and a landed one says what the command prints."""
    counted = _probe([])
    counted.fn(round_ctx(store, "r"), "in")
    quiet = _probe([], metered=False, on_landed=lambda ctx, tag, **_: {"skipped": f"{tag} done before"})
    quiet.fn(round_ctx(store, "r"), "out")
    rows = scan(store, "generated_tokens").collect()
    assert rows.select("stage", "purpose", "tokens").to_dicts() == [{"stage": "probe-in", "purpose": "eval",
                                                                     "tokens": 7}]
    assert quiet.fn(round_ctx(store, "r"), "out")["skipped"] == "out done before"


def test_a_registered_release_runs_when_any_stage_ends_even_a_failing_one(store):
    released = []
    release = at_stage_end(lambda: released.append(1))
    try:
        @stage("boom")
        def boom_task(ctx, store):
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            boom_task.fn(round_ctx(store, "r"))
        _probe([]).fn(round_ctx(store, "r"), "ok")
        assert released == [1, 1]
    finally:
        STAGE_END.remove(release)


def test_the_stage_contract_imports_no_feature_and_the_check_catches_one():
    source = (ROOT / "tasks" / "stage.py").read_text()
    assert feature_imports(source) == []
    planted = source + "\n\ndef later():\n    from tasks.selectors.embed import release_embedder\n"
    assert feature_imports(planted) == ["tasks.selectors.embed"]
    assert feature_imports(source.replace("import functools\n", "import functools\nimport tasks.collect\n")) \
        == ["tasks.collect"]


def test_generate_verified_is_the_seeded_pass_each_caller_made(scripted):
    """The same completions as the backend's own keyed call, verified against each prompt's answer, counted
    under the caller's purpose; the section's sampling seeds round r as seed * 1000 + r."""
    from models.meter import metering
    from tasks.core.seeds import row_seeds
    from tasks.core.verdicts import verdicts
    from tasks.sampling.verified import config_sampling, generate_verified, plain_messages

    prompts = pl.DataFrame({"prompt_id": ["p1", "p2", "p3"], "answer": ["56", "12", "-5"],
                            "text": ["What is 7 * 8?", "What is 3 * 4?", "What is 4 - 9?"],
                            "source": ["t"] * 3, "meta": [None] * 3})
    cfg = SimpleNamespace(temperature=0.7, top_p=1.0, max_new_tokens=48, seed=4, instruction="Box it.")
    sampling = config_sampling(cfg, 2)
    assert sampling.seed == 4002
    with metering() as meter:
        got = generate_verified(scripted, prompts, plain_messages(prompts, cfg.instruction), 3, sampling,
                                _reward(), "rescore")
    rendered = [scripted.render([{"role": "user", "content": f"{t}\nBox it."}]) for t in prompts["text"]]
    direct = scripted.generate(rendered, 3, sampling, row_seeds=row_seeds(4002, ["p1", "p2", "p3"]))
    assert got.rendered == rendered
    assert [[c.text for c in g] for g in got.groups] == [[c.text for c in g] for g in direct]
    assert got.checked == verdicts(prompts, direct, _reward())
    assert meter.rows() == [{"purpose": "rescore", "calls": 1, "completions": 9, "tokens": got.n_tokens}]
    assert any(v.correct for vs in got.checked for v in vs) and got.timeouts == 0


def _reward():
    from tasks.core.rewards import RewardConfig

    return RewardConfig()
