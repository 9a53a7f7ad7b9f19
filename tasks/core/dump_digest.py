"""A dump's identity: a digest of the files its reader reads (`refinery import` keys a run by it, not by the
dump's path: tasks/interop/import_run.py).

sha256 over each file's path relative to the dump folder (empty for a dump that is one file, so a renamed copy
is the same dump), its size and its bytes, streamed in 1 MiB blocks (dumps can be large), in path order. Files
the reader ignores (a prime-rl run's `eval/` traces, logs beside a verl dump) do not count.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tasks.core.dumps import dump_files


def dump_digest(fmt: str, path: str, chunk: int = 1 << 20) -> str:
    """The digest of the dump at `path` in format `fmt` (module docstring)."""
    h = hashlib.sha256()
    for f in sorted(dump_files(fmt, path), key=lambda f: _relative(f, path)):
        name = _relative(f, path).encode()
        h.update(len(name).to_bytes(8, "big") + name + f.stat().st_size.to_bytes(8, "big"))
        with f.open("rb") as stream:
            while block := stream.read(chunk):
                h.update(block)
    return h.hexdigest()


def _relative(f: Path, path: str) -> str:
    return f.relative_to(path).as_posix() if Path(path).is_dir() else ""
