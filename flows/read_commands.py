"""The `refinery` commands that only read the store: sql, catalog, lineage and export, and the output formats.

None of them starts Prefect. `export` writes a run's curriculum as a Parquet file outside the store
(tasks/export_run.py). `sql` goes through the confined, read-only SQL of storage/query.py; `catalog`
writes catalog.duckdb for the stock duckdb CLI; `lineage` prints a prompt's ancestors and descendants with
their per-round scores and latest pool status, as a tree (rich) or as JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex


def format_table(t, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(t.to_pylist(), default=str, ensure_ascii=False, indent=1)
    if fmt == "csv":
        import csv

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(t.column_names)
        w.writerows(tuple(r.values()) for r in t.to_pylist())
        return buf.getvalue().rstrip("\n")
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=100, tbl_hide_dataframe_shape=True):
        return str(pl.from_arrow(t)) + f"\n({t.num_rows} rows)"


def cmd_sql(a: argparse.Namespace) -> int:
    from storage.query import sql
    from storage.store import Store

    print(format_table(sql(Store(a.store), a.query), a.format))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from storage.store import Store
    from tasks.export_run import export_run

    print(export_run(Store(a.store), a.run_id, a.format, a.out, round=a.round, overwrite=a.overwrite))
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
