"""docs/performance.md is built from benchmarks/results/*.json by benchmarks/performance_page.py: the committed page
is what the data builds, every figure names its commit, machine and command, the page stays short, and a
benchmark's --json output becomes a results file with `--add`."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "benchmarks" / "performance_page.py"
_spec = importlib.util.spec_from_file_location("performance_page", SCRIPT)  # a script, not a package module
performance_page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(performance_page)


def page_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_the_committed_page_is_what_the_results_build():
    assert (ROOT / "docs" / "performance.md").read_text() == performance_page.build(performance_page.load())
    proc = page_script("--check")
    assert proc.returncode == 0, proc.stderr


def test_the_page_has_at_most_250_lines():
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 250


def test_every_results_file_names_its_commit_machine_and_command():
    files = sorted(RESULTS.glob("*.json"))
    assert len(files) >= 5
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip() == "true"
    for path in files:
        r = json.loads(path.read_text())
        assert re.fullmatch(r"[0-9a-f]{7,40}", r["commit"]), path.name
        if not shallow:  # the commit is one of this repository's
            assert subprocess.run(["git", "cat-file", "-e", f"{r['commit']}^{{commit}}"], cwd=ROOT).returncode == 0, path.name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), path.name
        m = r["machine"]
        assert m["cpu"] and m["cores"] >= 1 and isinstance(m["avx512_bf16"], bool) and isinstance(m["amx"], bool), path.name
        script = re.search(r"benchmarks/(\w+)\.py", r["command"])
        assert (script and (ROOT / "benchmarks" / f"{script.group(1)}.py").exists()) or re.search(
            r"^make test$|refinery run", r["command"]), (path.name, r["command"])
        assert r["figures"] and all(isinstance(v, int | float | str) for v in r["figures"].values()), path.name


def test_a_target_reads_met_or_missed_from_the_figures():
    by = {(r["benchmark"], r["machine_kind"]): r for r in performance_page.load()}
    verdict = dict((t.key, v) for t, v in performance_page.verdicts(by["round", "epyc-avx2"]))
    assert verdict["round_wall_ratio_vs_baseline"] == "not targeted"  # AVX2 is reported, not targeted
    amx = dict(by["round", "xeon-amx"], figures=dict(by["round", "xeon-amx"]["figures"],
                                                     round_wall_ratio_vs_baseline=0.41))
    assert dict((t.key, v) for t, v in performance_page.verdicts(amx))["round_wall_ratio_vs_baseline"] == "missed"


@pytest.fixture
def copy(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    page = tmp_path / "performance.md"
    page.write_text((ROOT / "docs" / "performance.md").read_text())
    return results, page


def test_check_names_a_stale_page_in_one_line(copy):
    results, page = copy
    page.write_text(page.read_text().replace("3:53.29", "3:50.00"))
    proc = page_script("--check", "--results", str(results), "--page", str(page))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"performance_page.py: {page} differs from what {results}/ builds (run python benchmarks/performance_page.py)"]


def test_a_results_file_without_a_commit_is_refused_by_name(copy):
    results, page = copy
    path = results / "round-xeon-amx.json"
    record = json.loads(path.read_text())
    del record["commit"]
    path.write_text(json.dumps(record))
    proc = page_script("--results", str(results), "--page", str(page))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"performance_page.py: {path}: missing commit"]


def test_add_turns_a_benchmarks_json_output_into_a_results_file(copy, tmp_path):
    results, page = copy
    figures = tmp_path / "train.json"
    figures.write_text(json.dumps({"train_prefix_speedup": 2.93, "train_prefix_speedup_min": 2.9,
                                   "train_prefix_speedup_max": 2.97, "train_ratio_vs_bare": 0.77}))
    command = "python benchmarks/train.py --json train.json"
    proc = page_script("--add", str(figures), "--machine-kind", "epyc-avx512bf16", "--command", command,
                       "--results", str(results), "--page", str(page))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((results / "train-epyc-avx512bf16.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert (record["commit"], record["command"], record["figures"]["train_prefix_speedup"]) == (head, command, 2.93)
    old = json.loads((RESULTS / "train-epyc-avx512bf16.json").read_text())
    assert record["machine"] == old["machine"]
    assert [h["key"] for h in record["headline"]] == ["train_prefix_speedup", "train_ratio_vs_bare"]
    row = next(line for line in page.read_text().splitlines() if line.startswith("| train |") and head in line)
    assert "2.93x [2.9-2.97x, 3 repeats]" in row and ">= 2.5: met" in row
