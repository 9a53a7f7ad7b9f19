"""`refinery export RUN --heldout --format lm-eval OUT_DIR`: the run's held-out split (and its `eval --dataset`
sets) as local lm-evaluation-harness tasks (tasks/interop/lm_eval.py), their scoring against Refinery's own
extraction and matching where docs say they agree and differ, a real `lm_eval` run on the tiny model where the
harness is installed, and what the format refuses.

lm-eval is not in the locked venv: the run test uses `lm_eval` from this interpreter when it imports, else the
Python named by $REFINERY_LM_EVAL_PYTHON (a scratch venv with `pip install "lm-eval[hf]==0.4.13"`), and is
skipped otherwise; the task's keys are checked against the harness's task schema either way.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from conftest import q, run_cli
from test_cli_errors import assert_one_line_error, refinery
from test_import import TOK, write_verl

from storage.schemas import schema
from storage.store import Store
from tasks.core.answers import exact_match, extract_answer
from tasks.interop.lm_eval import FINAL_ANSWER, IGNORE

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "golden" / "scripted"
INSTRUCTION = "Put your final answer within \\boxed{}."

# lm-eval 0.4's task YAML keys (TaskConfig in lm_eval/config/task.py, documented in
# https://github.com/EleutherAI/lm-evaluation-harness/blob/main/docs/task_guide.md#parameters)
TASK_KEYS = {"task", "task_alias", "tag", "group", "custom_dataset", "dataset_path", "dataset_name",
             "dataset_kwargs", "training_split", "validation_split", "test_split", "fewshot_split", "process_docs",
             "doc_to_text", "doc_to_target", "doc_to_image", "doc_to_audio", "unsafe_code", "doc_to_choice",
             "process_results", "use_prompt", "description", "target_delimiter", "fewshot_delimiter",
             "fewshot_config", "num_fewshot", "metric_list", "output_type", "generation_kwargs", "repeats",
             "filter_list", "should_decontaminate", "doc_to_decontamination_query", "gen_prefix", "metadata"}
OUTPUT_TYPES = {"loglikelihood", "loglikelihood_rolling", "generate_until", "multiple_choice"}


@pytest.fixture
def golden(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    return Store(str(root))


def add_dataset_set(store: Store, name: str, n: int = 2) -> list[str]:
    """`eval_results` rows of a `refinery eval --dataset NAME` on n trainable prompts (as if it had run)."""
    ids = [r["prompt_id"] for r in q(store, "SELECT prompt_id FROM pool WHERE run_id = 'scripted' AND round = 0 "
                                            "AND status = 'active' ORDER BY prompt_id")][:n]
    rows = [{"run_id": "scripted", "round": 1, "policy_version": 1, "split": f"dataset:{name}", "prompt_id": p,
             "n_samples": 1, "n_correct": 0, "n_tokens": 5} for p in ids]
    store.commit(f"eval-v1-{name}-test", {"eval_results": pa.Table.from_pylist(rows, schema=schema("eval_results"))},
                 run_id="scripted", round=1)
    return ids


def export(store: Store, out: Path) -> dict:
    code, stdout, err = run_cli("export", "scripted", "--heldout", "--format", "lm-eval", str(out),
                                "--store", store.root)
    assert code == 0, err
    return {"stdout": stdout, "tasks": {p.stem: yaml.safe_load(p.read_text()) for p in out.glob("*.yaml")}}


def test_the_export_is_one_harness_task_per_evaluation_set(golden, tmp_path):
    extra = add_dataset_set(golden, "extra")
    out = tmp_path / "lm"
    result = export(golden, out)
    tasks = result["tasks"]
    assert sorted(tasks) == ["refinery_scripted_dataset_extra", "refinery_scripted_heldout"]
    heldout = {r["prompt_id"] for r in q(golden, "SELECT prompt_id FROM pool WHERE run_id = 'scripted' "
                                                 "AND round = 0 AND status = 'heldout'")}
    text = {r["prompt_id"]: r for r in q(golden, "SELECT prompt_id, text, answer FROM prompts")}
    max_new = json.loads(q(golden, "SELECT config FROM runs WHERE run_id = 'scripted'")[-1]["config"])["rollout"][
        "max_new_tokens"]
    for name, task in tasks.items():
        assert set(task) <= TASK_KEYS and task["output_type"] in OUTPUT_TYPES and task["task"] == name
        assert task["generation_kwargs"] == {"until": [], "do_sample": False, "temperature": 0.0,
                                             "max_gen_toks": max_new}
        data = Path(task["dataset_kwargs"]["data_files"][task["test_split"]])
        assert data.is_absolute() and data.parent == out / "data"
        docs = [json.loads(line) for line in data.read_text().splitlines()]
        assert {d["prompt_id"] for d in docs} == (heldout if name.endswith("heldout") else set(extra))
        for d in docs:  # doc_to_text / doc_to_target are columns: the user turn our evaluation sends, the answer
            assert d[task["doc_to_text"]] == f"{text[d['prompt_id']]['text']}\n{INSTRUCTION}"
            assert d[task["doc_to_target"]] == text[d["prompt_id"]]["answer"]
        (flt,) = task["filter_list"]
        assert [f["function"] for f in flt["filter"]] == ["regex", "take_first"]
        assert task["metric_list"][0]["metric"] == "exact_match"
    assert (out / "README.md").is_file() and "--include_path" in result["stdout"]
    assert not list(tmp_path.glob(".*.tmp"))


def harness_score(completion: str, reference: str) -> float:
    """What the exported task scores: lm-eval's RegexFilter (findall, the match at group_select = -1, its first
    non-empty group, stripped; else the fallback), then exact_match with ignore_case and regexes_to_ignore."""
    found = re.findall(FINAL_ANSWER, completion)
    pred = next((g for g in found[-1] if g), "[no answer]").strip() if found else "[no answer]"
    for pattern in IGNORE:
        pred, reference = re.sub(pattern, "", pred), re.sub(pattern, "", reference)
    return float(pred.lower() == reference.lower())


@pytest.mark.parametrize("completion, reference, same", [
    ("so \\boxed{42}", "42", True),
    ("first \\boxed{1}, then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}", True),
    ("<answer> Paris </answer>", "paris", True),
    ("\\boxed{7}. then <answer>8</answer>", "8", True),
    ("\\boxed{$12$.}", "12", True),
    ("\\boxed{13}", "12", True),  # both wrong
    ("The answer is 42.", "42", False),  # non-strict fallback: Refinery 1, harness 0
    ("\\boxed{1,000}", "1000", False),  # numbers by value
    ("\\boxed{5.0}", "5", False),
    ("\\boxed{\u22123}", "-3", False),  # the Unicode minus sign
])
def test_the_harness_scoring_agrees_with_ours_where_documented(completion, reference, same):
    ours = exact_match(extract_answer(completion), reference)
    assert (harness_score(completion, reference) == ours) is same, (harness_score(completion, reference), ours)


def lm_eval_python() -> str | None:
    if importlib.util.find_spec("lm_eval") is not None:
        return sys.executable
    other = os.environ.get("REFINERY_LM_EVAL_PYTHON")
    return other if other and Path(other).exists() else None


def test_lm_eval_scores_the_exported_task_on_the_tiny_model(golden, tmp_path):
    python = lm_eval_python()
    if python is None:
        pytest.skip("lm_eval is not installed here (not in the lock); set REFINERY_LM_EVAL_PYTHON to a Python "
                    "that has lm-eval[hf]==0.4.13 to run the harness")
    from models.registry import build_tiny_random

    out = tmp_path / "lm"
    task = next(iter(export(golden, out)["tasks"]))
    p = subprocess.run([python, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={build_tiny_random()},dtype=float32", "--include_path", str(out), "--tasks", task,
                        "--apply_chat_template", "--limit", "4", "--device", "cpu", "--output_path",
                        str(tmp_path / "results")], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    (results,) = (tmp_path / "results").rglob("results_*.json")
    score = json.loads(results.read_text())["results"][task]["exact_match,final_answer"]
    assert 0.0 <= score <= 1.0


def test_what_the_lm_eval_format_refuses(golden, tmp_path):
    cases = [
        (["--heldout", str(tmp_path / "a.parquet")], "never exported as training data"),
        (["--format", "lm-eval", str(tmp_path / "a.parquet")], "writes a folder"),
        (["--format", "lm-eval", "--round", "1", str(tmp_path / "b")], "fixed at round 0"),
        (["--format", "lm-eval", str(Path(golden.root) / "lm")], "is inside the store"),
    ]
    for args, needle in cases:
        assert_one_line_error(refinery("export", "scripted", *args, "--store", golden.root, cwd=tmp_path), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_run_without_a_heldout_split_has_nothing_to_export(store, tmp_path):
    write_verl(tmp_path / "dump")  # an imported run: no held-out split
    assert run_cli("import", "verl", str(tmp_path / "dump"), "--run-id", "ext", "--store", store.root, *TOK)[0] == 0
    code, _, err = run_cli("export", "ext", "--format", "lm-eval", str(tmp_path / "t"), "--store", store.root)
    assert code == 1 and "no held-out prompts" in err and not (tmp_path / "t").exists()
    assert not list(tmp_path.glob(".t.*"))
