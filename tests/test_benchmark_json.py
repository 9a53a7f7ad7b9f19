"""The benchmarks' --json output at the smallest sizes: each script runs for real and writes its figures as
flat keys with the names its docstring promises (issue 14: results comparable across commits)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

QUICK = {
    "store.py": (["--rows", "3000", "--repeats", "1"],
                 {"append_ratio", "groups_naive_full_s", "groups_duckdb_open_speedup", "groups_polars_s"}),
    "sql_confined.py": (["--rows", "3000", "--repeats", "1"], {"group_stats_ratio", "point_filter_sql_s"}),
    "select.py": (["--pool", "3000", "--batch", "64", "--repeats", "1", "--texts", "16"],
                  {"select_kmeans_s", "entropy_own_kmeans", "mean_eps_uniform", "embed_texts_per_s"}),
    "decode_attention.py": (["--groups", "2", "--samples", "16", "--prefix", "128", "--suffix", "4", "--calls", "10"],
                            {"attn_sdpa_ms_P128_S4", "attn_cascade_ms_P128_S4", "attn_cascade_speedup_P128_S4"}),
    "decode_batch.py": (["--store", "tests/data/golden/scripted", "--run-id", "scripted", "--model", "tiny-random",
                         "--baseline", "HEAD", "--group", "2", "--max-new-tokens", "4", "--repeats", "1"],
                        {"decode_batch_speedup", "decode_batch_s", "baseline_decode_batch_s", "decode_batch_select_s"}),
    "first_step.py": (["--store", "tests/data/golden/scripted", "--run-id", "scripted", "--model", "tiny-random",
                       "--repeats", "1"], {"train_first_step_speedup", "first_step_on_s", "first_step_off_s"}),
    "command_start.py": (["--repeats", "1"], {"eval_landed_s", "eval_unknown_s", "rescore_unknown_s",
                                               "eval_landed_min_s", "rescore_unknown_max_s"}),
    "prefect_start.py": (["--repeats", "1"], {"prefect_seeded_speedup", "prefect_first_run_new_s",
                                               "prefect_first_run_seeded_s", "run_start_at_flow_s",
                                               "run_start_early_s", "run_start_saved_s"}),
    "screening.py": (["--model", "tiny-random", "--set", "model.backend=scripted", "--set", "select.batch_size=6",
                      "--set", "rollout.group_size=4", "--set", "rollout.fewshot_k=0", "--set", "select.embedder=hashing",
                      "--set", 'pool.sources=[{"source": "rg:products", "size": 40, "params": {"max_digits": 1}}]',
                      "--thresholds", "0.7"],
                     {"informative_per_1k_off", "informative_per_1k_t0p7", "ratio_t0p7", "zero_variance_t0p7"}),
    "screening_ceiling.py": (["--store", "tests/data/golden/scripted", "--runs", "scripted"],
                             {"ratio_best", "ratio_oracle", "tokens_per_informative_plain",
                              "informative_share_plain_0"}),
    "shape.py": (["--model", "tiny-random", "--traces", "2", "--steps", "1", "--max-new-tokens", "8", "--seeds", "2"],
                 {"shape_batched_s", "shape_batched_speedup", "shape_decisions_agree", "shape_decisions"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(QUICK))
def test_benchmark_writes_flat_json(script, tmp_path):
    args, keys = QUICK[script]
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert keys <= figures.keys(), sorted(figures)
    assert all(isinstance(v, (int, float, str, bool)) or v is None for v in figures.values())
    if script == "shape.py":  # every decision made both ways, and the same (the tiny model's proposals are all
        assert figures["shape_decisions"] == 2 * 2 * 1  # cut by the length limit: seeds x traces x steps)
        assert figures["shape_decisions_agree"] == figures["shape_decisions"]


@pytest.mark.slow
def test_shape_benchmark_refuses_a_baseline_that_is_not_a_commit(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shape.py"), "--model", "tiny-random",
                           "--baseline", "no-such-ref-xyz"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"shape.py: --baseline no-such-ref-xyz is not a commit of {ROOT}"


@pytest.mark.slow
def test_first_step_benchmark_names_a_round_without_rollouts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_step.py"), "--store",
                           "tests/data/golden/scripted", "--run-id", "scripted", "--round", "99", "--model",
                           "tiny-random"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == ("first_step: no rollouts of run 'scripted' round 99 in "
                                                    "tests/data/golden/scripted")


def test_the_vllm_cpu_benchmark_names_the_venv_it_needs():
    """benchmarks/vllm_cpu.py runs in make test-vllm's venv (tests/test_vllm_cpu.py runs it there); in this one,
    where vllm does not import, it says where to run it in one line and exits 2."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_cpu.py"), "--repeats", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    if proc.returncode == 0:
        pytest.skip("vllm imports in this venv: the benchmark ran (tests/test_vllm_cpu.py checks its figures)")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and ".venv-vllm/bin/python" in proc.stderr
