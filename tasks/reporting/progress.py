"""Progress on long work: a rich progress bar on the terminal and, inside a Prefect run, a progress artifact."""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def in_prefect_run() -> bool:
    """Is this code running inside a Prefect flow run or task run?"""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


@contextmanager
def progress_reporter(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yields `advance(k)`. The bar goes to stderr; the artifact is updated at most every 5%."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    artifact_id = None
    if in_prefect_run():
        from prefect.artifacts import create_progress_artifact

        artifact_id = create_progress_artifact(progress=0.0, description=label)
    done = {"n": 0, "reported": 0.0}
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   transient=False, disable=not sys.stderr.isatty())
    with bar:
        tid = bar.add_task(label, total=total)

        def advance(k: int) -> None:
            done["n"] += k
            bar.update(tid, completed=done["n"])
            pct = 100.0 * done["n"] / max(total, 1)
            if artifact_id is not None and (pct - done["reported"] >= 5 or done["n"] >= total):
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(artifact_id=artifact_id, progress=pct)
                done["reported"] = pct

        yield advance


def sig4(x: float) -> float:
    """A figure for a stage summary, to 4 significant digits."""
    return float(f"{x:.4g}")


def timed(fn: Callable[..., dict]) -> Callable[..., dict]:
    """A stage's own compute time, measured inside its Prefect task: the returned summary gains
    `timing = {"compute_s", "start", "end"}` (perf_counter seconds), so that a round's wall time minus its
    stages' compute is the orchestration overhead (benchmarks/overhead.py)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> dict:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        end = time.perf_counter()
        if isinstance(out, dict):
            out = {**out, "timing": {"compute_s": sig4(end - start), "start": start, "end": end}}
        return out

    return wrapper


def report_timeouts(stage: str, round: int, n: int) -> None:
    """One warning line for a stage whose math-verify checks timed out: in Prefect's run log inside a run
    (where the UI shows it), else on the verifier's logger (`refinery.verify`)."""
    if not n:
        return
    msg = f"{stage} round {round}: {n} math-verify check(s) timed out and scored 0"
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().warning(msg)
    except MissingContextError:
        logging.getLogger("refinery.verify").warning(msg)
