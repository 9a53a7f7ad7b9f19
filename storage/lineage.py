"""Prompt lineage: every prompt row carries parent_id and root_id, so ancestry is one recursive query."""

from __future__ import annotations

import duckdb

from storage.schemas import NotFound

_COLS = "prompt_id, parent_id, root_id, transform, source, run_id, round, text"

_ANCESTORS = f"""
WITH RECURSIVE up(depth, prompt_id, parent_id) AS (
    SELECT 0, prompt_id, parent_id FROM prompts WHERE prompt_id = $id
    UNION ALL
    SELECT up.depth + 1, p.prompt_id, p.parent_id FROM prompts p JOIN up ON p.prompt_id = up.parent_id
    WHERE up.depth < 1000
)
SELECT up.depth, {", ".join("p." + c for c in _COLS.split(", "))}
FROM up JOIN prompts p USING (prompt_id) WHERE up.depth > 0 ORDER BY up.depth
"""

_DESCENDANTS = f"""
WITH RECURSIVE down(depth, prompt_id) AS (
    SELECT 0, prompt_id FROM prompts WHERE prompt_id = $id
    UNION ALL
    SELECT down.depth + 1, p.prompt_id FROM prompts p JOIN down ON p.parent_id = down.prompt_id
    WHERE down.depth < 1000
)
SELECT DISTINCT down.depth, {", ".join("p." + c for c in _COLS.split(", "))}
FROM down JOIN prompts p USING (prompt_id) WHERE down.depth > 0 ORDER BY down.depth, p.prompt_id
"""


def _rows(con: duckdb.DuckDBPyConnection, q: str, prompt_id: str) -> list[dict]:
    return con.sql(q, params={"id": prompt_id}).to_arrow_table().to_pylist()


def lineage(con: duckdb.DuckDBPyConnection, prompt_id: str) -> dict:
    """The prompt, its ancestors (nearest first) and its descendants (by depth), from a store connection."""
    me = con.sql(f"SELECT {_COLS} FROM prompts WHERE prompt_id = $id", params={"id": prompt_id}).to_arrow_table()
    if me.num_rows == 0:
        raise NotFound(f"no prompt with id {prompt_id!r} in the store")
    return {
        "prompt": me.to_pylist()[0],
        "ancestors": _rows(con, _ANCESTORS, prompt_id),
        "descendants": _rows(con, _DESCENDANTS, prompt_id),
    }
