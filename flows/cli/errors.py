"""Errors as one line: what the CLI prints and what `runs.reason` records for a failed run.

Choices, and why:
- A message is flattened, not truncated at its first line: DuckDB puts "Did you mean ...?" on its second
  line, and an ingest rejection lists its bad rows on the lines after the first, so every line that says
  something is kept, joined with "; " (or a space after a line that ends with ':', ',' or ';'). Lines that
  only point into a query (DuckDB's "LINE 1: ..." and its caret line) are dropped: the query is the user's
  own input.
- At most `MAX_PARTS` lines and `MAX_CHARS` characters survive, with a count of what was left out, so a
  rejection of 10,000 rows stays one readable line.
- User-facing errors (bad input the user can fix: ValueError, OSError, DuckDB's errors, or any exception
  with `user_facing = True`, such as storage's NotFound for an unknown table or prompt id) print their
  message alone; anything else is a fault, and its type name is kept so that a bug report says what broke.
  A plain KeyError is a fault: `data["choices"]` on a malformed answer is a bug, reported as
  `KeyError: 'choices'` with the hint to rerun with --debug, never as a bare "choices".
"""

from __future__ import annotations

MAX_PARTS = 6
MAX_CHARS = 2000


def is_user_facing(e: BaseException) -> bool:
    if getattr(e, "user_facing", False) or isinstance(e, ValueError | OSError):
        return True
    return type(e).__module__.split(".")[0] in ("duckdb", "_duckdb")  # Binder, Catalog, Parser errors


def message(e: BaseException) -> str:
    """The exception's text: a user-facing KeyError's message without repr quotes, else str(e) (a plain
    KeyError keeps its quotes: `'choices'` reads as a key, a bare `choices` would not)."""
    if isinstance(e, KeyError) and is_user_facing(e) and len(e.args) == 1 and isinstance(e.args[0], str):
        return e.args[0]
    return str(e)


def flatten(text: str) -> str:
    """`text` as one line (see the module docstring)."""
    lines = [ln.strip() for ln in text.splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("LINE ") and set(ln) != {"^"}]
    left_out = max(0, len(kept) - MAX_PARTS)
    out = ""
    for ln in kept[:MAX_PARTS]:
        out += ln if not out else (" " if out.endswith((":", ",", ";")) else "; ") + ln
    if left_out:
        out += f" (and {left_out} more)"
    return out if len(out) <= MAX_CHARS else out[: MAX_CHARS - 1] + "…"


def one_line(e: BaseException) -> str:
    """`e` as one line: its message, prefixed with its type name unless it is user-facing."""
    text = flatten(message(e))
    if is_user_facing(e) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def reason(e: BaseException) -> str:
    """`runs.reason` of a run that `e` ended: always with the type name, since a reader of `runs` has no
    traceback to tell a KeyboardInterrupt from a ValueError."""
    text = flatten(message(e))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
