"""What `refinery run` prints when a run ends: a line per stage that did work, the round's scores, and what to try.

Each stage's line is drawn from the summary dict its Prefect task returned (flows/curriculum.py collects them);
the table of buckets and EPS quantiles per round is read back from the store with the same SQL a user would
write (`try_command` prints such a query, quoted for the shell).
"""

from __future__ import annotations

import shlex

from flows.cli.sql_output import format_table


def teacher_unavailable(stage: dict, what: str) -> str:
    """The tail of a stage's line when its teacher could not answer some prompts (they fell back)."""
    n = stage.get("teacher_unavailable") or 0
    return f"; teacher unavailable for {n} prompt{'s' * (n != 1)} ({what})" if n else ""


def short_batch(dapo: dict) -> str:
    """The tail of a dapo_filter round's line when its batch came up short, and why."""
    if not dapo["short"]:
        return ""
    why = (f"the cap of {dapo['max_batches']} generation batch{'es' * (dapo['max_batches'] != 1)} was hit"
           if dapo["cap_hit"]
           else "every candidate was generated")
    return f"; the batch is SHORT by {dapo['short']} groups ({why})"


def print_summary(out: dict) -> None:
    from storage.query import sql
    from storage.store import Store
    from tasks.core.eps import ROUND_OWN_SCORES

    store, run = Store(out["store"]), out["run_id"]
    for s in out["stages"]:
        if "skipped" in s:
            continue
        if s["stage"] == "collect":
            print(f"round {s['round']}: {s['rollouts']} rollouts over {s['prompts']} prompts, pass rate "
                  f"{s['pass_rate']:.1%}, {s['tokens_per_s']:.0f} tokens/s")
            lope = s.get("lope") or {}
            if lope.get("groups"):
                print(f"round {s['round']}: LoPE resampled {lope['groups']} all-fail groups ({lope['resamples']} "
                      f"samples, {lope.get('seconds', 0):.0f} s), rescued {lope['rescued']}, replaced {lope['replaced']} rollouts")
            if s.get("verify_timeouts"):
                print(f"round {s['round']}: {s['verify_timeouts']} math-verify checks timed out and scored 0 "
                      f"(rollouts.verify_timeout)")
            if d := s.get("dapo"):
                print(f"round {s['round']}: dapo_filter kept {d['kept']} of B = {d['batch_size']} groups from "
                      f"{d['groups_generated']} generated in {d['generation_batches']} generation batch"
                      f"{'es' * (d['generation_batches'] != 1)}; discarded "
                      f"{d['zero_variance']} zero-variance + {d['surplus']} surplus groups ({d['discarded_rollouts']} "
                      f"rollouts, {d['discarded_tokens']} tokens; see discarded_rollouts)" + short_batch(d))
        elif s["stage"] == "score":  # rescued groups apart: their replacements train, the buckets are the policy's
            rescued = dict(s.get("rescued") or {})
            n = rescued.pop("groups", 0)
            own = ", ".join(f"{k} {v}" for k, v in sorted(rescued.items()))
            print(f"round {s['round']}: {s['buckets'].get('informative', 0)} of {s['prompts']} groups informative; "
                  f"{n} rescued by LoPE (training only; scored on the policy's own samples" + (f": {own})" if n else ")"))
        elif s["stage"] == "select" and "clusters" in s:
            print(f"round {s['round']}: selected {s['selected']} of {s['candidates']} over {s['clusters']} clusters "
                  f"({s['selected_unscored']} never scored; scored ones: mean EPS {s['mean_eps_selected']:.3f} "
                  f"vs {s['mean_eps_pool']:.3f} over the candidates)")
        elif s["stage"] == "shape":
            print(f"round {s['round']}: shaped {s['in_c']} of {s['traces']} off-policy traces (acceptance "
                  f"{s['accept_rate'] if s['accept_rate'] is not None else '-'}, mean log-prob gain "
                  f"{s['logprob_gain'] if s['logprob_gain'] is not None else '-'})" + teacher_unavailable(s, "skipped"))
        elif s["stage"] == "train":
            print(f"round {s['round']}: trained v{s['policy_version']} in {s['steps']} steps on {s['sequences']} "
                  f"sequences ({s['zero_variance_groups']} zero-variance groups skipped, {s['sft_traces']} SFT "
                  f"traces), loss {s['first_loss']} -> {s['last_loss']}, {s['tokens_per_s']:.0f} tokens/s")
        elif s["stage"] == "evaluate":
            for v, m in sorted(s["versions"].items()):
                print(f"round {s['round']}: held-out v{v}: " + ", ".join(f"{k} {x:.3f}" for k, x in m.items()))
        elif s["stage"] == "refine":
            detail = ", ".join(f"{k} {v}" for k, v in sorted(s["by_strategy"].items()))
            print(f"round {s['round']}: refine made {s['children']} children ({detail})"
                  + teacher_unavailable(s, "fell back; see refinements.reason"))
            if s.get("rejections"):
                why = ", ".join(f"{k} {v}" for k, v in sorted(s["rejections"].items()))
                print(f"round {s['round']}: rejected {sum(s['rejections'].values())} children ({why}; "
                      f"see refinements.reason)")
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
    spent = sql(store, f"SELECT coalesce(sum(tokens), 0) AS t FROM generated_tokens WHERE run_id = '{run}' "
                       "AND purpose <> 'eval'").to_pylist()[0]["t"]
    print(f"run {run}: {spent} generated tokens, evaluation apart (generated_tokens)"
          + (f"; {out['stopped']}" if out.get("stopped") else ""))
    print(f"run {run} ({how}) finished in {out['seconds']:.0f} s; store: {store.uri}")
    print(f"try: {try_command(store.uri, run)}")


def try_command(store_uri: str, run_id: str) -> str:
    """A `refinery sql` command line for the end of a run, quoted so that a shell gives it back as argv."""
    literal = "'" + run_id.replace("'", "''") + "'"  # an SQL string literal (run ids cannot hold quotes today)
    example = f"SELECT round, bucket, count(*) FROM prompt_scores WHERE run_id = {literal} GROUP BY ALL ORDER BY ALL"
    return shlex.join(["refinery", "sql", "--store", store_uri, example])
