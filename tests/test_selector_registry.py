"""Selectors are one file each behind one protocol (tasks/selectors/): a selector written in a single file outside
the project, registered the way a user registers theirs (its module named in REFINERY_SELECTORS), runs real
rounds of `refinery run` on the scripted policy and its picks land in `selections` under its name; the config
offers exactly the registered names and refuses any other in one line naming them; and no code outside
tasks/selectors/ decides anything by testing a selector's name (it reads the selector's flags instead)."""

import ast
import os
import textwrap

import pytest
from conftest import ROOT, q
from test_cli_errors import assert_one_line_error, refinery

from storage.store import Store
from tasks.selectors import REGISTRY, selector

# the user's selector: the B candidates of highest latest EPS (never-scored ones last), in one file
TOP_EPS = '''
"""`top_eps`: greedy selection, the B candidates of highest latest EPS first (never scored: last, by prompt_id)."""

import numpy as np

from tasks.selectors import Picks, Selector, pick_rows, register


@register
class TopEps(Selector):
    name = "top_eps"
    description = "the highest latest EPS first"

    def select(self, candidates, view, cfg):
        eps = np.where(np.isnan(candidates.eps), -1.0, candidates.eps)
        ids = candidates.ids
        order = sorted(range(len(ids)), key=lambda i: (-eps[i], ids[i]))[: cfg.batch_size]
        return Picks(pick_rows([ids[i] for i in order], [f"top_eps: rank {r}" for r in range(len(order))]))
'''

SETS = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
        "rollout.max_new_tokens=40", "rollout.fewshot_k=0", "rollout.lope_prefixes=0", "select.batch_size=4",
        "rollout.screen_samples=0",  # the selector's own picks, no screening refills
        "refine.strategies=[]", "shape.enabled=false", "train.enabled=false", "eval.enabled=false",
        'pool.sources=[{"source": "rg:products", "size": 10, "params": {"max_digits": 1}}]']


@pytest.fixture
def plugin_env(tmp_path) -> dict:
    """REFINERY_SELECTORS naming a one-file selector module on PYTHONPATH, as a user's own would be."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "top_eps_selector.py").write_text(textwrap.dedent(TOP_EPS))
    return {"PYTHONPATH": str(folder), "REFINERY_SELECTORS": "top_eps_selector"}


@pytest.fixture
def api_env(prefect_api) -> dict:
    """The session's Prefect API, for the `refinery run` subprocess (as tests/test_cli_errors.py shares it)."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": os.environ["PREFECT_HOME"]}


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def test_a_selector_in_one_file_runs_rounds_and_its_picks_land_under_its_name(tmp_path, plugin_env, api_env):
    p = refinery("run", "--store", "store", "--run-id", "greedy", "--rounds", "2",
                 *_sets(*SETS, "select.selector=top_eps"), cwd=tmp_path, env={**api_env, **plugin_env})
    assert p.returncode == 0, p.stderr[-3000:]
    store = Store(tmp_path / "store")
    rows = q(store, "SELECT round, prompt_id, selector, reason FROM selections WHERE run_id = 'greedy' "
                    "ORDER BY round, reason")
    assert {r["selector"] for r in rows} == {"top_eps"} and [r["round"] for r in rows] == [0] * 4 + [1] * 4
    assert [r["reason"] for r in rows[:4]] == [f"top_eps: rank {i}" for i in range(4)]
    # round 1 picked by the selector's own rule over the EPS round 0 scored: the scored ones of highest EPS first
    eps = {r["prompt_id"]: r["eps"] for r in q(store, "SELECT prompt_id, eps FROM prompt_scores "
                                                      "WHERE run_id = 'greedy' AND round = 0")}
    pool = [r["prompt_id"] for r in q(store, "SELECT prompt_id FROM pool WHERE run_id = 'greedy' AND round = 1 "
                                             "AND status = 'active' ORDER BY prompt_id")]
    want = sorted(pool, key=lambda i: (-eps.get(i, -1.0), i))[:4]
    assert [r["prompt_id"] for r in rows[4:]] == want
    # each selected prompt was collected for: the selection is what collect generated
    collected = q(store, "SELECT round, count(DISTINCT prompt_id) AS n FROM rollouts WHERE run_id = 'greedy' "
                         "GROUP BY round ORDER BY round")
    assert collected == [{"round": 0, "n": 4}, {"round": 1, "n": 4}]


def test_the_config_offers_the_registered_selectors_and_refuses_others_in_one_line(tmp_path, plugin_env):
    p = refinery("run", "--store", "store", *_sets("select.selector=greedy"), cwd=tmp_path, env=plugin_env)
    line = assert_one_line_error(p, "select.selector")
    for name in [*REGISTRY, "top_eps"]:  # the built-in ones and the user's, which the config now offers
        assert f"'{name}'" in line, line
    from flows.config import load_config

    with pytest.raises(ValueError) as refused:  # this process registered no top_eps
        load_config(sets=["select.selector=top_eps"])
    offered, got = str(refused.value).split("select.selector: Input should be ")[1].split(", got ")
    assert got == "'top_eps'"  # the line names what was refused
    assert "top_eps" not in offered and all(f"'{name}'" in offered for name in REGISTRY)


def test_the_registry_and_the_config_agree():
    from tasks.select import SelectConfig

    field = SelectConfig.model_json_schema()["properties"]["selector"]
    assert set(field["enum"]) == set(REGISTRY) >= {"kmeans", "uniform", "dapo_filter", "all"}
    assert all(f"{n}: {REGISTRY[n].description}" in field["description"] for n in REGISTRY)
    flags = {n: (s.needs_embeddings, s.generates, s.whole_pool) for n, s in REGISTRY.items()}
    assert flags["kmeans"] == (True, False, False) and flags["uniform"] == (False, False, False)
    assert flags["dapo_filter"] == (False, True, False) and flags["all"] == (False, False, True)
    with pytest.raises(ValueError, match=r"no selector 'nope' is registered .*registered: all, dapo_filter, kmeans"):
        selector("nope")


def _name_tests(path) -> list[str]:
    """Comparisons in `path` that decide by a selector's name: against the string 'dapo_filter' anywhere, or
    against any registered name on an expression that mentions `selector`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        consts = {c.value for s in sides for c in ast.walk(s)
                  if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        names = consts & set(REGISTRY)
        if "dapo_filter" in consts or (names and "selector" in ast.unparse(node)):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_the_selectors_folder_tests_a_selector_by_name(tmp_path):
    files = [f for pkg in ("flows", "tasks") for f in sorted((ROOT / pkg).rglob("*.py"))
             if (ROOT / "tasks" / "selectors") not in f.parents]
    assert len(files) > 50
    found = [f"{f.parent.relative_to(ROOT)}/{hit}" for f in files for hit in _name_tests(f)]
    assert not found, "read the selector's flags (tasks/selectors/base.py) instead of its name:\n" + "\n".join(found)
    bad = tmp_path / "bad.py"  # the check itself sees what it must refuse
    bad.write_text('if cfg.select.selector == "kmeans" or x in ("dapo_filter",):\n    pass\n')
    assert len(_name_tests(bad)) == 2
