"""The `refinery` commands that only read the store: sql, catalog, lineage and export.

None of them starts Prefect. `export` writes a run's curriculum as Parquet (or its evaluation sets as
lm-eval tasks) with a dataset card, outside the store (tasks/interop/export_run.py). `sql` goes through the confined, read-only SQL of storage/query.py, printed by
flows/cli/sql_output.py (a table, CSV or JSON; every DuckDB type prints); `catalog`
writes catalog.duckdb for the stock duckdb CLI; `lineage` prints a prompt's ancestors and descendants with
their per-round scores and latest pool status, as a tree (rich) or as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex


def cmd_sql(a: argparse.Namespace) -> int:
    from flows.cli.sql_output import write_result
    from storage.query import query_batches
    from storage.store import Store

    if a.limit is not None and a.limit < 0:
        raise ValueError(f"--limit {a.limit}: a number of rows, at least 0 (0: all)")
    if a.timeout < 0:
        raise ValueError(f"--timeout {a.timeout:g}: seconds, at least 0 (0: no limit)")
    with query_batches(Store(a.store), a.query, timeout_s=a.timeout or None) as result:
        write_result(result, a.format, a.limit)
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from storage.store import Store
    from tasks.interop.export_run import export_run

    print(export_run(Store(a.store), a.run_id, a.format, a.out, round=a.round, overwrite=a.overwrite,
                     heldout=a.heldout, license=a.license))
    return 0


def cmd_catalog(a: argparse.Namespace) -> int:
    from storage.query import write_catalog
    from storage.store import Store

    path = write_catalog(Store(a.store))
    # the catalog names its files relative to the store folder (so a copied store works): open it from there
    print(f"wrote {path}; open it with: cd {shlex.quote(os.path.dirname(path))} && duckdb -readonly catalog.duckdb")
    return 0


def cmd_lineage(a: argparse.Namespace) -> int:
    from storage.lineage import lineage
    from storage.query import connect
    from storage.store import Store

    con = connect(Store(a.store))
    tree = lineage(con, a.prompt_id)
    ids = [tree["prompt"]["prompt_id"], *(d["prompt_id"] for d in tree["descendants"])]
    history = con.sql("""
        SELECT s.prompt_id, s.run_id, s.round, round(s.mean_reward, 3) AS pass_rate, round(s.eps, 3) AS eps,
               s.bucket, p.status
        FROM prompt_scores s LEFT JOIN pool p USING (run_id, round, prompt_id)
        WHERE s.prompt_id IN (SELECT unnest($ids)) ORDER BY s.run_id, s.round""", params={"ids": ids}).to_arrow_table()
    status = con.sql("""SELECT prompt_id, arg_max(status, round) AS status FROM pool
                        WHERE prompt_id IN (SELECT unnest($ids)) GROUP BY 1""", params={"ids": ids}).to_arrow_table()
    rounds: dict[str, list[dict]] = {}
    for r in history.to_pylist():
        rounds.setdefault(r.pop("prompt_id"), []).append(r)
    latest = dict(zip(status["prompt_id"].to_pylist(), status["status"].to_pylist()))
    for node in [tree["prompt"], *tree["descendants"]]:
        node["rounds"] = rounds.get(node["prompt_id"], [])
        node["status"] = latest.get(node["prompt_id"])
    if a.json:
        print(json.dumps(tree, default=str, ensure_ascii=False, indent=1))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.tree import Tree

    def label(p: dict) -> str:
        scores = "  ".join(f"r{r['round']}: pass {r['pass_rate']:.2f} EPS {r['eps']:.2f} {r['bucket']}"
                           for r in p["rounds"])
        text = p["text"].splitlines()[0][:50]
        return (f"[bold]{p['prompt_id']}[/] [cyan]{p['transform']}[/] {escape('[' + (p['status'] or 'not in a pool') + ']')} "
                f"{escape(repr(text))}" + (f"\n  {scores}" if scores else ""))

    root = Tree(label(tree["prompt"]))
    nodes = {tree["prompt"]["prompt_id"]: root}
    for d in tree["descendants"]:
        nodes[d["prompt_id"]] = nodes.get(d["parent_id"], root).add(label(d))
    console = Console()
    if tree["ancestors"]:
        console.print("ancestors: " + " <- ".join(f"{p['prompt_id']} ({p['transform']})" for p in tree["ancestors"]))
    console.print(root)
    return 0
