"""benchmarks/gpu_check.py's correctness part on the CPU (`--device cpu`), so the GPU script, and the GRPO
check it shares with benchmarks/vllm_check.py, cannot rot unseen between the sessions that have a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_correctness_runs_on_the_cpu(tmp_path):
    from models.registry import resolve

    out, flat = tmp_path / "gpu.json", tmp_path / "flat.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--skip-speed",
                    "--tiny", resolve("tiny-random"), "--config-dir", resolve("default"), "--out", str(out),
                    "--json", str(flat)], check=True, capture_output=True, cwd=tmp_path, timeout=600)
    c = json.loads(out.read_text())["correctness"]
    figures = json.loads(flat.read_text())  # the same figures as flat keys
    assert figures["correctness_score_vs_generate_max_abs_diff"] == c["score_vs_generate_max_abs_diff"]
    assert all(not isinstance(v, (dict, list)) for v in figures.values())
    assert c["keyed_sampling_batch_invariant"] and c["mcmc_batched_equals_sequential"]
    assert c["score_vs_generate_max_abs_diff"] < 1e-4 and c["score_vs_generate_max_abs_diff_t07"] < 1e-4
    rewarded, penalised = c["grpo_fixed_token_share_rewarded"], c["grpo_fixed_token_share_penalised"]
    assert rewarded[-1] > rewarded[0] and penalised[-1] < penalised[0]  # GRPO moves the share both ways
