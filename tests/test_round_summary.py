"""One renderer of a round's stage summaries (tasks/reporting/summary.py) behind the terminal's end-of-run lines and
the round's markdown artifact, and one sum of the token budget (tasks/reporting/budget.py) behind the flow's
stop and the printed figure."""

import contextlib
import io

import pyarrow as pa

from flows.cli import print_summary
from storage.schemas import TABLES
from tasks.report import round_markdown
from tasks.reporting.budget import spent_tokens
from tasks.reporting.summary import stage_lines

STAGES = [
    {"stage": "pool", "round": 0, "prompts": 16, "added": 16, "timing": {"compute_s": 0.1}},
    {"stage": "collect", "round": 0, "rollouts": 64, "prompts": 16, "pass_rate": 0.25, "tokens_per_s": 812.4,
     "dapo": {"kept": 3, "batch_size": 4, "groups_generated": 6, "generation_batches": 1, "zero_variance": 3,
              "surplus": 0, "discarded_rollouts": 12, "discarded_tokens": 480, "short": 1, "cap_hit": True,
              "max_batches": 1}},
    {"stage": "refine", "round": 0, "children": 2, "by_strategy": {"ladder": 2}, "teacher_unavailable": 1,
     "rejections": {"duplicate": 1}},
    {"stage": "shape", "round": 0, "skipped": "already landed"},
    {"stage": "train", "round": 0, "policy_version": 1, "steps": 2, "sequences": 64, "zero_variance_groups": 3,
     "sft_traces": 0, "first_loss": 0.1, "last_loss": 0.05, "tokens_per_s": 900.0},
]


def _tokens(store, rows: list[tuple[int, str, int]], run_id: str = "r") -> None:
    for rnd, purpose, tokens in rows:
        store.commit(f"t-{rnd}-{purpose}", {"generated_tokens": pa.Table.from_pylist(
            [{"run_id": run_id, "round": rnd, "stage": "collect", "purpose": purpose, "calls": 1, "completions": 1,
              "tokens": tokens}], schema=TABLES["generated_tokens"])}, run_id=run_id, round=rnd)


def test_the_terminal_and_the_round_artifact_say_the_same_of_each_stage(store):
    _tokens(store, [(0, "rollout", 100)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_summary({"store": store.uri, "run_id": "r", "stages": STAGES, "started_as": "new", "seconds": 1.0})
    terminal = [x.removeprefix("round 0: ") for x in printed.getvalue().splitlines() if x.startswith("round 0: ")]
    artifact = round_markdown("r", 0, [], STAGES).splitlines()
    # every sentence the terminal prints is in the artifact, on its stage's line
    assert terminal == [x for s in STAGES for x in stage_lines(s)] and len(terminal) == 5
    for s in STAGES:
        for sentence in stage_lines(s):
            (line,) = [x for x in artifact if x.startswith(f"- **{s['stage']}**: ")]
            assert sentence in line
    assert "; the batch is SHORT by 1 groups (the cap of 1 generation batch was hit)" in terminal[1]
    assert terminal[2] == "refine made 2 children (ladder 2); teacher unavailable for 1 prompt (fell back; see " \
                          "refinements.reason)"
    # the artifact has every stage: one without a sentence by its numbers, a skipped one says so; the terminal
    # leaves both out
    assert "- **pool**: prompts 16; added 16" in artifact and "- **shape**: skipped (already landed)" in artifact
    assert not any(x.startswith(("prompts", "skipped")) for x in terminal)


def test_the_printed_token_figure_is_the_budget_s_own_sum(store):
    """Evaluation never counts; `before_round` is what the flow compares with max_generated_tokens before a
    round; the end-of-run line prints the whole run's, from the same function."""
    _tokens(store, [(0, "rollout", 100), (0, "eval", 50), (1, "lope", 30), (1, "teacher", 7)])
    _tokens(store, [(0, "rollout", 1000)], run_id="other")
    assert [spent_tokens(store, "r", before_round=r) for r in (0, 1, 2)] == [0, 100, 137]
    assert spent_tokens(store, "r") == 137 and spent_tokens(store, "none") == 0
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_summary({"store": store.uri, "run_id": "r", "stages": [], "started_as": "new", "seconds": 1.0,
                       "stopped": "token budget reached"})
    assert "run r: 137 generated tokens, evaluation apart (generated_tokens); token budget reached\n" \
        in printed.getvalue()


def test_a_summary_missing_what_its_sentence_reads_is_listed_not_fatal():
    """An older or partial summary (no tokens_per_s) renders as its numbers instead of raising."""
    from tasks.reporting.summary import stage_lines

    lines = stage_lines({"stage": "collect", "round": 1, "rollouts": 72, "prompts": 9}, every=True)
    assert len(lines) == 1 and "rollouts 72" in lines[0] and "prompts 9" in lines[0]


def test_a_screened_collect_says_what_screening_kept_and_spent():
    screening = {"batch_size": 48, "screen_samples": 2, "threshold": 0.7, "generation_batches": 3, "screened": 131,
                 "topped_up_mixed": 40, "topped_up_posterior": 15, "screened_out": 70, "zero_variance": 7,
                 "surplus": 6, "kept": 48, "screen_tokens": 3120, "topup_tokens": 4810, "discarded_rollouts": 196,
                 "discarded_tokens": 2300, "informative_ratio": 0.3664, "short": 0, "cap_hit": False,
                 "exhausted": False, "max_batches": 4}
    (_, line) = stage_lines({"stage": "collect", "round": 2, "rollouts": 384, "prompts": 48, "pass_rate": 0.5,
                             "tokens_per_s": 300.0, "screening": screening})
    assert line == ("screening kept 48 of B = 48 groups: screened 131 prompts with 2 samples each in 3 generation "
                    "batches, topped up 40 mixed + 15 by the posterior; 70 screened out, 7 zero-variance after "
                    "top-up; 3120 screening + 4810 top-up tokens, informative ratio 0.3664")
    short = stage_lines({"stage": "collect", "round": 2, "rollouts": 0, "prompts": 0, "pass_rate": 0.0,
                         "tokens_per_s": 0.0, "screening": {**screening, "kept": 40, "short": 8, "cap_hit": True}})
    assert short[1].endswith("; the batch is SHORT by 8 groups (the cap of 4 generation batches was hit)")
