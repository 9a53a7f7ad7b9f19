"""The layers stay visible (docs/architecture.md): pure algorithms in tasks/core import neither Prefect nor the
store, stages take typed sections, every config field says what it does, and adding a strategy stays a
one-file change. Each test reads the source (ast), so a lazy import inside a function counts too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPED = ("cfg", "config", "backend", "teacher", "model", "reward", "utility")  # parameter names that carry them


def _imports(f: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_core_imports_neither_prefect_nor_the_store_nor_stages():
    files = sorted((ROOT / "tasks" / "core").glob("*.py"))
    assert len(files) >= 10
    for f in files:
        for name in _imports(f):
            top = name.split(".")[0]
            assert top not in ("prefect", "storage", "flows"), f"{f.relative_to(ROOT)} imports {name}"
            assert not (top == "tasks" and not name.startswith("tasks.core")), \
                f"{f.relative_to(ROOT)} imports the stage module {name}: core modules import only tasks.core"


def test_a_bare_worker_imports_every_core_module_without_prefect_or_storage():
    """In a fresh interpreter: importing all of tasks.core loads no prefect or storage module."""
    import subprocess
    import sys

    mods = [f"tasks.core.{f.stem}" for f in sorted((ROOT / "tasks" / "core").glob("*.py")) if f.stem != "__init__"]
    code = ("import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in mods)
            + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'storage', 'flows'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing tasks.core loaded {out.stdout.strip()}"


def test_tasks_never_import_flows():
    for f in sorted((ROOT / "tasks").rglob("*.py")):
        for name in _imports(f):
            assert name.split(".")[0] != "flows", f"{f.relative_to(ROOT)} imports {name}"


def test_no_untyped_or_any_config_or_backend_parameter_in_tasks():
    bad = []
    for f in sorted((ROOT / "tasks").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for a in node.args.args + node.args.kwonlyargs:
                if a.arg in TYPED or a.arg.endswith("_cfg"):
                    ann = ast.unparse(a.annotation) if a.annotation else None
                    if ann is None or "Any" in ann:
                        bad.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}({a.arg}: {ann})")
    assert not bad, "untyped config or backend parameters:\n" + "\n".join(bad)


def test_every_config_field_has_a_description():
    from pydantic import BaseModel

    from flows.config import RunConfig

    missing, seen = [], set()

    def walk(model: type[BaseModel], path: str) -> None:
        if model in seen:
            return
        seen.add(model)
        if not (model.__doc__ or "").strip() and path:
            missing.append(f"{path} (section docstring)")
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                missing.append(f"{path}{name}")
            ann = field.annotation
            for t in (ann, *getattr(ann, "__args__", ())):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    walk(t, f"{path}{name}.")

    walk(RunConfig, "")
    assert not missing, f"config fields without a description: {', '.join(missing)}"
    schema = RunConfig.model_json_schema()  # what the Prefect UI form renders
    assert schema["$defs"]["TrainConfig"]["properties"]["kl_clamp"]["description"]


def test_every_benchmark_still_imports_what_it_uses_and_takes_json():
    """A moved or renamed name breaks a benchmark only when someone next runs it: run each one's --help (its
    imports and argument parser) in one fresh interpreter. Every benchmark offers --json PATH (its figures as
    flat keys, comparable across commits); vllm_check.py is gpu_check.py's part runner, whose figures reach
    gpu_check's --json. A module a script imports (no `__main__`) is not a benchmark."""
    import subprocess
    import sys

    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")
                     if "__main__" in p.read_text())  # a script; a helper module (evidence_design.py) is none
    code = ("import contextlib, io, runpy, sys\nfailed = []\n"
            f"for s in {scripts!r}:\n"
            "    sys.argv = [s, '--help']\n"
            "    text = io.StringIO()\n"
            "    try:\n"
            "        with contextlib.redirect_stdout(text):\n"
            "            runpy.run_path(s, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        if e.code not in (0, None):\n"
            "            failed.append(f'{s}: exit {e.code}')\n"
            "    except Exception as e:\n"
            "        failed.append(f'{s}: {type(e).__name__}: {e}')\n"
            "    if '--json' not in text.getvalue() and not s.endswith('vllm_check.py'):\n"
            "        failed.append(f'{s}: no --json in its --help')\n"
            "print('FAILED ' + '; '.join(failed) if failed else 'ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout[-2000:] + out.stderr[-2000:]
