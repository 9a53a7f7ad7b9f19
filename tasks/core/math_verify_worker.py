"""math-verify equivalence in a worker process that a timeout can kill.

math-verify's own timeouts use SIGALRM (main thread only), and a thread cannot bound it either: sympy
evaluates e.g. 10^{10^{10}} exactly, a big-integer power that holds the GIL for minutes, so a timed wait on a
worker thread never even returns, and a stuck thread cannot be stopped. A process can be: a check that
overruns its timeout scores 0, is flagged (`math_check`'s timed_out, counted by the collect and evaluate
stages) and logged, and its worker is killed and replaced, so the next check starts on a fresh one.
Equal answers (`exact_match`) and over-long ones (MAX_VERIFY_CHARS) never reach the worker.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tasks.core.answers import exact_match

MAX_VERIFY_CHARS = 2_000  # longer extracted answers are wrong for our sources, and slow to parse
MATH_VERIFY_TIMEOUT_S = 5.0
log = logging.getLogger("refinery.verify")


def serve_math_verify() -> None:
    """The worker process's loop: one JSON [pred, ref] per stdin line -> "1" or "0" per stdout line."""
    if sys.platform.startswith("linux"):
        import ctypes

        # die with the parent even mid-check (stdin's EOF is only read between checks), or a SIGKILLed run
        # would leave a hung check computing for minutes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    from math_verify import parse
    from math_verify import verify as mv_verify

    # it warns on every call that its (SIGALRM) timeouts are off; they are, on purpose: see module docstring
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    replies = sys.stdout
    sys.stdout = sys.stderr  # a library's stray print must never be taken for a reply
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        pred, ref = json.loads(line)
        try:
            gold = parse(f"${ref}$", parsing_timeout=None)
            guess = parse(f"${pred}$", parsing_timeout=None)
            ok = bool(gold and guess and mv_verify(gold, guess, timeout_seconds=None))
        except Exception:  # math-verify raises assorted errors on malformed LaTeX: malformed means wrong
            ok = False
        replies.write("1\n" if ok else "0\n")
        replies.flush()


class MathVerifyWorker:
    """A math-verify worker process, started on first use and replaced after a timeout (or a crash).

    Checks are serialised by a lock (one process, one check at a time); a forked child starts its own worker.
    The start-up (importing sympy, about 0.5 s) is not charged to the first check's timeout. On Linux the
    worker gets SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG), so it never outlives its
    process; the next check then starts a fresh one.
    """

    START_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take seconds

    def __init__(self) -> None:
        self._forget()
        self.timeouts = 0  # checks that overran, in this process's lifetime
        self.starts = 0

    def _forget(self) -> None:
        """A fresh state: also what a forked child gets, so it never shares its parent's pipes or a held lock."""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[2])  # the worker imports this module from this checkout
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with tempfile.TemporaryFile() as errors:  # closed whether or not the worker starts
            serve = "from tasks.core.math_verify_worker import serve_math_verify as s; s()"
            proc = subprocess.Popen([sys.executable, "-c", serve],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, env=env,
                                    text=True, bufsize=1, start_new_session=True)  # Ctrl-C goes to us, not to it
            ready = select.select([proc.stdout], [], [], self.START_TIMEOUT_S)[0] and proc.stdout.readline()
            if ready != "ready\n":
                self._kill(proc)
                errors.seek(0)
                tail = errors.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"the math-verify worker process did not start: {tail[0]}")
        self.starts += 1
        return proc

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()

    def check(self, pred: str, ref: str, timeout: float) -> bool | None:
        """math-verify's verdict on pred == ref, or None if it overran `timeout` seconds (the worker is
        then killed, and the next check starts a new one)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write(json.dumps([pred, ref]) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it died between checks (killed from outside): one retry on a fresh one
                self._kill(proc)
                self._proc = proc = self._start()
                proc.stdin.write(json.dumps([pred, ref]) + "\n")
                proc.stdin.flush()
            if select.select([proc.stdout], [], [], timeout)[0]:
                reply = proc.stdout.readline()
                if reply in ("1\n", "0\n"):
                    return reply == "1\n"
            self.timeouts += 1  # no reply in time, or it died mid-check: either way this check cost its budget
            self._kill(proc)
            self._proc = None
            return None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)
            self._proc = None


MATH_VERIFY = MathVerifyWorker()
atexit.register(MATH_VERIFY.close)
os.register_at_fork(after_in_child=MATH_VERIFY._forget)


def math_check(pred: str | None, ref: str, timeout: float | None = None) -> tuple[float, bool]:
    """(score, timed_out): math-verify equivalence, bounded by `timeout` seconds (default
    MATH_VERIFY_TIMEOUT_S; a timeout scores 0)."""
    timeout = MATH_VERIFY_TIMEOUT_S if timeout is None else timeout
    if pred is None or len(pred) > MAX_VERIFY_CHARS:
        return 0.0, False
    if exact_match(pred, ref):
        return 1.0, False
    ok = MATH_VERIFY.check(pred, ref, timeout)
    if ok is None:
        log.warning("math-verify timed out after %.1f s on answer %.80r (reference %.40r): scored 0, worker "
                    "replaced (%d timeouts so far)", timeout, pred, ref, MATH_VERIFY.timeouts)
        return 0.0, True
    return float(ok), False


def math_equiv(pred: str | None, ref: str, timeout: float | None = None) -> float:
    """math-verify equivalence, bounded by `timeout` seconds (a timeout scores 0)."""
    return math_check(pred, ref, timeout)[0]
