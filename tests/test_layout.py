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


def test_console_script_is_the_cli():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["refinery"] == "flows.cli:main"
    assert meta["project"]["name"] == "curriculum-refinery"
