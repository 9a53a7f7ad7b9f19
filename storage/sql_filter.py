"""The statement filter of user SQL (`refinery sql`): the first of two independent read-only layers.

The text must be exactly one statement of type SELECT (which covers WITH, VALUES, TABLE, FROM-first, UNPIVOT,
SUMMARIZE, DESCRIBE, SHOW and PIVOT with an IN list), or a PIVOT that DuckDB splits into several statements
(MULTI) that is a query: it still parses as a single statement when wrapped as `SELECT * FROM (<text>)`, which
nothing but a query does, or an EXPLAIN [ANALYZE] whose target, re-parsed on its own, is one of those.
Everything else (COPY, EXPLAIN COPY, ATTACH, DDL, DML, SET, PRAGMA, CALL, EXPORT, PREPARE, ...) is refused.
Table functions that run SQL from a string (`query`, `query_table`, `json_execute_serialized_sql`) or change
the engine's state (`checkpoint`, `enable_logging`, ...) are refused wherever they appear, found with DuckDB's
tokenizer. The filter works on DuckDB's own parse and never touches a store; the second layer, a connection
that can read nothing but the landed data, is in storage/query.py.

Every failure is a `QueryError` (a ValueError) with a one-line message: refusals are `QueryRefused`;
DuckDB's errors keep their first line and a "Did you mean" / "Candidate bindings" hint when it gives one
(`first_line_and_hint`).
"""

from __future__ import annotations

import threading

import duckdb


class QueryError(ValueError):
    """A query failed; the message is one line that names the problem."""


class QueryRefused(QueryError):
    """A query asked for something the read-only SQL interface does not allow."""


# Functions refused wherever they appear: they run SQL given as a string (which the filter cannot see), scan
# Python memory by pointer, or change the engine's state (logging, profiling, grammar, checkpoints).
_REFUSED_FUNCTIONS = frozenset({
    "query", "query_table", "json_execute_serialized_sql",
    "checkpoint", "force_checkpoint", "enable_logging", "disable_logging", "truncate_duckdb_logs",
    "enable_profiling", "disable_profiling", "write_log", "add_grammar_extension", "remove_grammar_extension",
    "create_external_resource", "register_external_resource", "register_external_resource_type",
    "deregister_external_resource", "destroy_external_resource",
    "arrow_scan", "arrow_scan_dumb", "python_arrow_scan", "pandas_scan", "python_map_function",
    "nextval", "setval", "setseed",
})
READ_ONLY_HINT = "the SQL interface is read-only: SELECT, WITH, PIVOT, SUMMARIZE, DESCRIBE, SHOW, EXPLAIN SELECT"


_parser_lock = threading.Lock()
_parser_con: duckdb.DuckDBPyConnection | None = None


def _statements(text: str) -> list:
    """DuckDB's parse of `text`, on one shared connection that never executes anything (a new in-memory
    database costs tens of milliseconds; parsing costs well under one)."""
    global _parser_con
    with _parser_lock:
        if _parser_con is None:
            _parser_con = duckdb.connect()
        return _parser_con.extract_statements(text)


def _parse(text: str) -> list:
    try:
        return _statements(text)
    except duckdb.ParserException as e:
        raise QueryError(f"SQL syntax error: {first_line_and_hint(e)}") from None
    except (duckdb.Error, ValueError) as e:  # e.g. a statement type the Python API cannot name
        raise QueryRefused(f"not allowed: {first_line_and_hint(e)}; {READ_ONLY_HINT}") from None


def _tokens(text: str) -> list[tuple[str, str]]:
    """DuckDB's own tokens of `text` as (kind, text), comments dropped."""
    try:
        raw = duckdb.tokenize(text)
    except Exception as e:  # the tokenizer rejects what the parser would too
        raise QueryError(f"SQL syntax error: {first_line_and_hint(e)}") from None
    out = []
    for i, (pos, kind) in enumerate(raw):
        end = raw[i + 1][0] if i + 1 < len(raw) else len(text)
        if kind.name != "comment":
            out.append((kind.name, text[pos:end].strip()))
    return out


def _positions(text: str) -> list[int]:
    return [pos for pos, kind in duckdb.tokenize(text) if kind.name != "comment"]


def first_word(text: str) -> str:
    tokens = _tokens(text)
    return tokens[0][1].upper() if tokens else "?"


def _name(statement) -> str:
    """What to call a refused statement: its first word (COPY, ATTACH, CHECKPOINT, ...), or DuckDB's type
    for one that opens with WITH or a parenthesis (WITH x AS (...) INSERT ... is an INSERT)."""
    word = first_word(statement.query)
    if word in ("WITH", "(") and statement.type.name != "MULTI":
        return statement.type.name.replace("_", " ")
    return word


def _is_query(statement) -> bool:
    """Is this parsed statement a read: SELECT, or a multi-statement PIVOT that is a query?"""
    kind = statement.type.name
    if kind == "SELECT":
        return True
    if kind == "MULTI":  # PIVOT without an IN list: DuckDB adds a CREATE TYPE for the pivot values first
        try:
            wrapped = _statements(f"SELECT * FROM (\n{statement.query}\n)")
        except (duckdb.Error, ValueError):
            return False  # COPY (PIVOT ...) TO, CREATE TABLE AS PIVOT, ...: not a query
        return len(wrapped) == 1 and wrapped[0].type.name in ("SELECT", "MULTI")
    return False


def _explain_targets(text: str) -> list[str]:
    """The statement an EXPLAIN [ANALYZE] [(options)] names, under each reading of its optional parts."""
    positions, tokens = _positions(text), _tokens(text)
    i = 1  # after EXPLAIN
    if i < len(tokens) and tokens[i][1].upper() in ("ANALYZE", "ANALYSE"):
        i += 1
    targets = [text[positions[i]:]] if i < len(tokens) else []
    if i < len(tokens) and tokens[i][1] == "(":  # EXPLAIN (FORMAT json) ...: skip the balanced option list
        depth = 0
        for j in range(i, len(tokens)):
            depth += tokens[j][1].count("(") - tokens[j][1].count(")")
            if depth <= 0:
                if j + 1 < len(tokens):
                    targets.append(text[positions[j + 1]:])
                break
    return targets


def check_read_only(query: str) -> None:
    """Raise QueryRefused unless `query` is exactly one read (see the module docstring), QueryError if it
    does not parse. Does not touch the store."""
    if not query.strip():
        raise QueryRefused("empty query")
    statements = _parse(query)
    if len(statements) != 1:
        raise QueryRefused(f"expected exactly one statement, got {len(statements)}")
    statement = statements[0]
    kind = statement.type.name
    if kind == "EXPLAIN" or (kind == "MULTI" and first_word(statement.query) == "EXPLAIN"):  # EXPLAIN PIVOT
        readings = []
        for target in _explain_targets(statement.query):
            try:
                parsed = _statements(target)
            except (duckdb.Error, ValueError):
                continue
            if len(parsed) == 1:
                readings.append((target, parsed[0]))
        if not readings:
            raise QueryRefused(f"EXPLAIN of something other than a query is not allowed; {READ_ONLY_HINT}")
        for _, parsed in readings:
            if not _is_query(parsed):
                raise QueryRefused(f"EXPLAIN {_name(parsed)} is not allowed; {READ_ONLY_HINT}")
    elif not _is_query(statement):
        raise QueryRefused(f"{_name(statement)} is not allowed; {READ_ONLY_HINT}")
    tokens = _tokens(query)
    for (kind, word), (_, after) in zip(tokens, tokens[1:]):
        name = word.strip('"').lower()
        if kind in ("identifier", "keyword") and name in _REFUSED_FUNCTIONS and after.startswith("("):
            raise QueryRefused(f"{name}() is not allowed; {READ_ONLY_HINT}")


def first_line_and_hint(e: BaseException | str) -> str:
    """DuckDB's message in one line: its first line, plus the hint line that follows when there is one."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    out = lines[0] if lines else type(e).__name__
    if len(lines) > 1 and lines[1].startswith(("Did you mean", "Candidate bindings")):
        out += " " + lines[1]
    return out

