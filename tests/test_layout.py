"""The project's declared entry points exist: prefect.yaml deployments resolve to flows, the console script
resolves to the CLI, and the one-way data flow (flows -> tasks -> storage, models) holds."""

import ast
import importlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_entrypoints_are_flows():
    from prefect import Flow

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert spec["deployments"]
    for d in spec["deployments"]:
        path, name = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert isinstance(getattr(module, name), Flow), d["entrypoint"]
        assert d["work_pool"]["name"] == "refinery-process"


def test_storage_and_models_never_import_flows_or_tasks():
    """ast.walk visits every node, so an import inside a function (a lazy import) is caught too."""
    files = [f for pkg in ("storage", "models") for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 5
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert n.split(".")[0] not in ("flows", "tasks"), f"{f.relative_to(ROOT)} imports {n}"


# what tasks/stage.py may import of the project: the store, the model infrastructure, the stage timer
STAGE_MAY_IMPORT = ("storage", "models.config", "models.memory", "models.meter", "models.sharded", "models.threads",
                    "tasks.reporting.progress")


def feature_imports(source: str) -> list[str]:
    """The project modules `source` imports, anywhere in it (lazy imports too), beyond STAGE_MAY_IMPORT."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module.count(".") else [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in ("flows", "tasks", "storage", "models")
                  and not any(n == ok or n.startswith(ok + ".") for ok in STAGE_MAY_IMPORT)]
    return found


def test_the_stage_contract_imports_no_feature():
    """issue 48: tasks/stage.py knows no feature (it imported the embedder's cache); a feature registers what
    should run when a stage ends (`at_stage_end`) instead. tests/test_stage.py plants an import to see this fail."""
    assert feature_imports((ROOT / "tasks" / "stage.py").read_text()) == []


def test_console_script_is_the_cli():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["refinery"] == "flows.cli:main"
    assert meta["project"]["name"] == "curriculum-refinery"


def _project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (lazy imports inside functions too)."""
    modules = {".".join(f.relative_to(ROOT).with_suffix("").parts): f
               for pkg in ("flows", "tasks", "storage", "models") for f in (ROOT / pkg).rglob("*.py")
               if f.name != "__init__.py"}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, f in modules.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from flows import sessions` imports flows.server.sessions; `from tasks.x import f` imports tasks.x
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in modules and t != mod}
    return graph


def test_no_import_cycles_between_project_modules():
    """A cycle (cli <-> serve, ladder <-> rewards were two) makes import order matter and layers invisible; lazy
    imports hid both, so imports inside functions count too."""
    graph = _project_imports()
    assert len(graph) > 30 and graph["flows.server.serve"] and graph["tasks.strategies.ladder"]
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_no_module_imports_another_modules_private_name():
    """A leading underscore says "only this module uses it": `from x import _y`, or `x._y` on an imported project
    module, in another module breaks that promise (rename it to a public name instead)."""
    offenders = []
    for pkg in ("flows", "tasks", "storage", "models"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            modules: set[str] = set()  # local names bound to project modules
            tree = ast.parse(f.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                        and node.module.split(".")[0] in ("flows", "tasks", "storage", "models"):
                    for a in node.names:
                        if a.name.startswith("_"):
                            offenders.append(f"{f.relative_to(ROOT)}: from {node.module} import {a.name}")
                        elif (ROOT / node.module.replace(".", "/") / f"{a.name}.py").exists():
                            modules.add(a.asname or a.name)  # `from flows import serve`
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] in ("flows", "tasks", "storage", "models"):
                            modules.add(a.asname or a.name)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    base = ast.unparse(node.value)
                    if base in modules:
                        offenders.append(f"{f.relative_to(ROOT)}: {base}.{node.attr}")
    assert not offenders, "private names used across modules: " + "; ".join(offenders)


MAX_LINES = 300


def test_modules_stay_small_or_say_why():
    """A module over MAX_LINES lines is split along its seams, unless its docstring says why not with the words
    "over 300 lines because" (benchmarks and tests are exempt)."""
    skip = {"benchmarks", "tests"}
    offenders = []
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT).parts
        if parts[0] in skip or any(p.startswith(".") or p.endswith(".egg-info") or p == "__pycache__" for p in parts):
            continue
        text = f.read_text(encoding="utf-8")
        n = len(text.splitlines())
        if n > MAX_LINES and "over 300 lines because" not in (ast.get_docstring(ast.parse(text)) or ""):
            offenders.append(f"{f.relative_to(ROOT)} ({n} lines)")
    assert not offenders, f"over {MAX_LINES} lines with no reason in the docstring: " + ", ".join(offenders)


def _decorated(f: Path, names: tuple[str, ...]) -> list[str]:
    """Module-level functions of `f` decorated with one of `names` (`@stage("x")`, `@task(...)`, `@flow`)."""
    out = []
    for node in ast.parse(f.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if isinstance(target, ast.Name) and target.id in names:
                    out.append(node.name)
    return out


def test_the_tasks_root_holds_only_stages_one_per_module():
    """issue 48's house: a module at tasks/'s root is one stage, named for it; helpers live in sub-folders."""
    offenders = []
    for f in sorted((ROOT / "tasks").glob("*.py")):
        if f.name in ("__init__.py", "stage.py"):
            continue
        stages = _decorated(f, ("stage", "task"))
        if len(stages) != 1:
            offenders.append(f"{f.name}: {stages or 'no stage'}")
    assert not offenders, "tasks/ root modules that are not exactly one stage: " + "; ".join(offenders)
    assert (ROOT / "tasks" / "collect.py").exists()


# compare runs curriculum flows side by side; resume holds the config's resume rules, which the curriculum flow,
# the sampler, compare and the CLI share
NOT_FLOWS = {"config", "preflight", "sampler", "compare", "resume"}


def test_the_flows_root_holds_flows_config_preflight_and_the_sampler():
    offenders = [f.name for f in sorted((ROOT / "flows").glob("*.py"))
                 if f.name != "__init__.py" and f.stem not in NOT_FLOWS and len(_decorated(f, ("flow",))) != 1]
    assert not offenders, "flows/ root modules that are neither a flow nor config/preflight/sampler/compare/resume: " \
        + ", ".join(offenders)


def test_folders_are_the_agreed_ones():
    """One kind of thing per folder (DESIGN.md's layout): a new folder is a decision, so this test names them."""
    def subfolders(pkg: str) -> set[str]:
        return {p.name for p in (ROOT / pkg).iterdir() if p.is_dir() and (p / "__init__.py").exists()}

    assert subfolders("flows") == {"cli", "server"}
    assert subfolders("tasks") == {"core", "strategies", "sampling", "selectors", "reporting", "compare", "interop"}
    assert subfolders("models") == {"hf", "training"}


def test_no_core_module_imports_the_transformers_backend():
    """Pure cores run under autocast from models/training, never by importing models/hf (a 500-line backend)."""
    offenders = []
    for f in sorted((ROOT / "tasks" / "core").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{f.name}: {n}" for n in names if n == "models.hf" or n.startswith("models.hf.")]
    assert not offenders, "core modules importing the transformers backend: " + "; ".join(offenders)


def test_paths_computed_from_a_module_s_place_still_name_the_repository():
    """A move changes `Path(__file__).parents[n]`: serve's prefect.yaml and provenance's git tree must stay the
    repository's (a move of serve.py into flows/server/ once pointed `prefect deploy` at flows/)."""
    from flows.server.serve import REPO as SERVE_REPO
    from storage.provenance import REPO as PROVENANCE_REPO

    assert SERVE_REPO == PROVENANCE_REPO == ROOT and (SERVE_REPO / "prefect.yaml").is_file()
