"""What one user query may cost, and its failures as one line (storage/query.py `query_batches` runs it).

- Memory and threads (`sql_limits`): DuckDB's `memory_limit` is half the memory this process may use (the
  machine's, or its container's cgroup limit where less: `machine_memory`) and `threads` every core it may run
  on, set before the configuration is locked; $REFINERY_SQL_MEMORY (e.g. `4GB`) and $REFINERY_SQL_THREADS
  override them. DuckDB's own default, 80% of the machine, starves one that also trains; a query that needs
  more fails in one line (there is no spilling: nothing is written).
- Seconds (`Budget`): a timeout (`refinery sql --timeout`, default 60 s) counts the seconds DuckDB works on the
  query, fetching included, but not the time spent writing the rows out (a slow pipe or a large CSV is not cut
  short), and interrupts it from a timer thread.
- Failures (`duckdb_errors`): DuckDB's errors keep their first line and hint, whether raised while planning
  or, through Arrow's stream as an OSError, while a later batch streams; the timeout says so and how to
  raise it; an out-of-memory error names the limit.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from storage.sql_filter import QueryError, QueryRefused, first_line_and_hint

__all__ = ["Budget", "QueryResult", "budgeted", "duckdb_errors", "machine_memory", "sql_limits"]


CGROUP_MEMORY_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def machine_memory(cgroup_files: tuple[str, ...] = CGROUP_MEMORY_FILES) -> int:
    """The bytes of memory this process may use: the machine's, or its container's limit (cgroup v2 or v1,
    as in a Kubernetes pod) where that is less; half the host's memory in a smaller pod is an OOM kill."""
    import psutil

    total = psutil.virtual_memory().total
    for path in cgroup_files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 says "max" when unlimited, v1 a number near 2**63
            total = min(total, int(text))
    return total


def sql_limits() -> dict[str, str | int]:
    """DuckDB's `memory_limit` and `threads` for user SQL: half the memory this process may use
    (`machine_memory`; DuckDB's own default, 80%, starves a machine that also trains) and every core it may
    run on; $REFINERY_SQL_MEMORY (a DuckDB size such as `4GB`) and $REFINERY_SQL_THREADS override them. A
    query that needs more memory fails in one line (there is no spilling: nothing is written)."""
    memory = os.environ.get("REFINERY_SQL_MEMORY", "").strip() or f"{machine_memory() // 2 // 2**20}MiB"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = os.environ.get("REFINERY_SQL_THREADS", "").strip() or str(cores)
    if not threads.isdigit() or int(threads) < 1:
        raise QueryError(f"REFINERY_SQL_THREADS={threads!r}: expected a whole number of threads, at least 1")
    try:
        duckdb.connect(config={"memory_limit": memory}).close()
    except duckdb.Error as e:
        raise QueryError(f"REFINERY_SQL_MEMORY={memory!r} is not a memory size DuckDB takes (e.g. 4GB, "
                         f"512MB): {first_line_and_hint(e)}") from None
    return {"memory_limit": memory, "threads": int(threads)}


@dataclass
class QueryResult:
    """A running query's columns (`names` may repeat: `SELECT a.x, b.x`), DuckDB's type of each, and its
    rows as a stream of Arrow batches. With `text`, batch column 2i is column i's value and 2i+1 DuckDB's own
    text for it (`CAST(... AS VARCHAR)`: every DuckDB type has one, infinite timestamps, intervals and unions
    included, where Python or polars cannot convert some values)."""

    names: list[str]
    types: list[str]
    schema: pa.Schema
    batches: Iterator[pa.RecordBatch]


class Budget:
    """A query's `timeout_s`, spent only inside `running()` blocks: a timer thread interrupts the connection
    when the seconds left run out there. (An interrupt that lands just after a block ends stops the next
    fetch: the budget is then spent anyway.)"""

    def __init__(self, con: duckdb.DuckDBPyConnection, timeout_s: float | None) -> None:
        self.con, self.left = con, timeout_s or None  # None (or 0): no limit

    @contextmanager
    def running(self) -> Iterator[None]:
        if self.left is None:
            yield
            return
        timer = threading.Timer(max(self.left, 0.001), self.con.interrupt)
        timer.daemon = True
        started = time.monotonic()
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            self.left -= time.monotonic() - started


def budgeted(reader: pa.RecordBatchReader, query: str, timeout_s: float | None,
             budget: Budget) -> Iterator[pa.RecordBatch]:
    """The reader's batches, each fetched within the query's budget, with DuckDB's errors while fetching
    turned into one-line QueryErrors."""
    with duckdb_errors(query, timeout_s):
        while True:
            with budget.running():
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
            yield batch


# DuckDB's error kinds ("Conversion Error: ...") as they reach us through Arrow's stream, as an OSError
_DUCKDB_TEXT = re.compile(r"^(?:[A-Z][A-Za-z]*(?: [A-Za-z]+)*) Error: ")


@contextmanager
def duckdb_errors(query: str, timeout_s: float | None) -> Iterator[None]:
    stopped = (f"query stopped after {timeout_s:g} s: raise --timeout (0: no limit) or narrow the query"
               if timeout_s else "query interrupted")
    try:
        yield
    except duckdb.InterruptException:
        raise QueryError(stopped) from None
    except duckdb.PermissionException as e:
        raise QueryRefused(f"refused: {first_line_and_hint(e)} (queries may read only the store's tables)") from None
    except duckdb.Error as e:
        message = first_line_and_hint(e)
        if "configuration has been locked" in message or "external access" in message.lower():
            raise QueryRefused(f"refused: {message}") from None
        raise QueryError(with_memory_hint(message, e)) from None
    except (pa.ArrowException, OSError) as e:
        message = first_line_and_hint(e)
        # an error DuckDB raised while a later batch streamed (a failing cast, the timeout, memory) comes
        # through pyarrow's stream reader as an OSError holding DuckDB's text; else pyarrow failed on a file
        if message.startswith("INTERRUPT Error"):
            raise QueryError(stopped) from None
        if _DUCKDB_TEXT.match(message):
            raise QueryError(with_memory_hint(message, e)) from None
        raise QueryError(f"reading the store failed: {message}") from None


def with_memory_hint(message: str, e: BaseException) -> str:
    if isinstance(e, duckdb.OutOfMemoryException) or message.startswith("Out of Memory Error"):
        return message + " (the limit is REFINERY_SQL_MEMORY's, else half this machine's memory)"
    return message
