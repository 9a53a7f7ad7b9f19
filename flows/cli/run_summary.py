"""What `refinery run` prints when a run ends: a line per stage that did work, the round's scores, and what to try.

Each stage's line is drawn from the summary dict its Prefect task returned (flows/curriculum.py collects them) by
tasks/reporting/summary.py, which also words each round's markdown artifact; the token figure is the budget's
own sum (tasks/reporting/budget.py); the table of buckets and EPS quantiles per round is read back from the
store with the same SQL a user would write (`try_command` prints such a query, quoted for the shell).
"""

from __future__ import annotations

import shlex

from flows.cli.sql_output import format_table


def print_summary(out: dict) -> None:
    from storage.query import sql
    from storage.store import Store
    from tasks.core.eps import ROUND_OWN_SCORES
    from tasks.reporting.budget import spent_tokens
    from tasks.reporting.summary import stage_lines

    store, run = Store(out["store"]), out["run_id"]
    for s in out["stages"]:
        for line in stage_lines(s):
            print(f"round {s['round']}: {line}")
    q = f"""SELECT round, bucket, count(*) AS prompts, round(avg(mean_reward), 3) AS mean_pass,
            round(quantile_cont(eps, 0.25), 3) AS eps_p25, round(median(eps), 3) AS eps_p50,
            round(quantile_cont(eps, 0.75), 3) AS eps_p75, round(max(eps), 3) AS eps_max
            FROM (SELECT * FROM prompt_scores WHERE run_id = '{run}' {ROUND_OWN_SCORES})
            GROUP BY ALL ORDER BY round, bucket"""
    print(format_table(sql(store, q), "table"))
    reports = [s["path"] for s in out["stages"] if s.get("stage") == "report"]
    if reports:
        print(f"report: {reports[-1]} (redraw it with: refinery report {run})")
    how = "resumed" if out["started_as"] == "resumed" else "new run"
    print(f"run {run}: {spent_tokens(store, run)} generated tokens, evaluation apart (generated_tokens)"
          + (f"; {out['stopped']}" if out.get("stopped") else ""))
    print(f"run {run} ({how}) finished in {out['seconds']:.0f} s; store: {store.uri}")
    print(f"try: {try_command(store.uri, run)}")


def try_command(store_uri: str, run_id: str) -> str:
    """A `refinery sql` command line for the end of a run, quoted so that a shell gives it back as argv."""
    literal = "'" + run_id.replace("'", "''") + "'"  # an SQL string literal (run ids cannot hold quotes today)
    example = f"SELECT round, bucket, count(*) FROM prompt_scores WHERE run_id = {literal} GROUP BY ALL ORDER BY ALL"
    return shlex.join(["refinery", "sql", "--store", store_uri, example])
