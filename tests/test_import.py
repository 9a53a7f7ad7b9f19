"""`refinery import`: other trainers' rollout dumps become runs of the store, with EPS buckets per step,
lineage and a report. Each fixture is written the way its trainer writes it:

- verl (volcengine/verl, verl/trainer/ppo/ray_trainer.py `RayPPOTrainer._dump_generations`):
  `{rollout_data_dir}/{global_steps}.jsonl`, one `json.dumps` line per sample with `input`, `output`, `gts`,
  `score`, `step` and the reward function's extra keys; rows reordered by `_balance_batch`, no group id;
- TRL (huggingface/trl, trl/trainer/grpo_trainer.py `GRPOTrainer.log`): `{output_dir}/completions/
  completions_{global_step:05d}.parquet` with `step` (int64), `prompt`, `completion`, one float column per
  reward function, `advantage`; `num_generations` consecutive rows per prompt;
- prime-rl (PrimeIntellect-ai/prime-rl, src/prime_rl/monitors/file.py `FileMonitor.log_episodes`, records of
  verifiers' `Episode.to_record`): `rollouts/step_{n}/train/{all,effective}/traces.jsonl`, one episode per line.
"""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from storage.query import sql

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 6 * 7?", "42"), ("What is 9 - 12?", "-3")]
RIGHT, WRONG = "The sum is \\boxed{{{}}}.", "I think it is \\boxed{{{}}}."
TOK = ["--tokenizer", "tiny-random"]


def _samples(step: int):
    """4 samples per question: question 0 all right (saturated), 1 mixed (informative), 2 all wrong."""
    for qi, (question, answer) in enumerate(QUESTIONS):
        for j in range(4):
            ok = qi == 0 or (qi == 1 and j < 2 + (step > 1))
            yield question, answer, (RIGHT.format(answer) if ok else WRONG.format(int(answer) + 1)), float(ok)


def write_verl(folder, steps=(1, 2)):
    folder.mkdir(parents=True)
    template = "system\nYou are a helpful assistant.\nuser\n{}\nassistant\n"
    for step in steps:
        lines = [json.dumps({"input": template.format(q), "output": out, "gts": a, "score": r, "step": step,
                             "acc": r == 1.0, "pred": out[-4:]}, ensure_ascii=False)
                 for q, a, out, r in _samples(step)]
        random.Random(step).shuffle(lines)  # _balance_batch reorders the batch: siblings are not adjacent
        (folder / f"{step}.jsonl").write_text("\n".join(lines) + "\n")


def write_trl(folder, steps=(10, 20)):
    (folder / "completions").mkdir(parents=True)
    template = "system\nPlease reason step by step.\nuser\n{}\nassistant\n"
    for k, step in enumerate(steps, 1):
        rows = list(_samples(k))
        table = pa.table({"step": pa.array([step] * len(rows), pa.int64()),
                          "prompt": pa.array([template.format(q) for q, *_ in rows], pa.large_string()),
                          "completion": pa.array([out for _, _, out, _ in rows], pa.large_string()),
                          "accuracy_reward": pa.array([r for *_, r in rows], pa.float64()),
                          "format_reward": pa.array([float("nan") if i == 0 else 0.0 for i in range(len(rows))]),
                          "advantage": pa.array([0.0] * len(rows), pa.float64())})
        pq.write_table(table, folder / "completions" / f"completions_{step:05d}.parquet")


def _episode(step: int, qi: int, group: str, question: str, answer: str, out: str, r: float) -> dict:
    task = {"type": "MathTask", "data": {"idx": qi, "prompt": question, "answer": answer}, "key": f"k{qi}",
            "hash": f"k{qi}"}
    return {"id": f"e{step}-{group}-{random.random()}", "env": {"id": "math", "name": "math"}, "task": task,
            "group": {"id": group},
            "run": {"type": "train", "id": "9b1f", "name": "r", "work": {"type": "train", "step": step,
                                                                         "policy": {"start": step - 1, "end": step}}},
            "ok": True, "errors": [],
            "traces": [{"version": 1, "id": "t", "task": task, "tools": [],
                        "nodes": [{"message": {"role": "user", "content": question}, "sampled": False,
                                   "token_ids": [1, 2], "mask": [False, False], "logprobs": []},
                                  {"parent": 0, "message": {"role": "assistant", "content": out}, "sampled": True,
                                   "token_ids": [3, 4, 5], "mask": [True, True, True], "logprobs": [-0.1] * 3,
                                   "advantages": [0.0] * 3}],
                        "calls": [{"node": 1, "model": "m", "finish_reason": "stop",
                                   "usage": {"prompt_tokens": 2, "completion_tokens": 3}}],
                        "rewards": {"correct": {"score": r, "weight": 1.0}}, "metrics": {}, "info": {},
                        "is_completed": True, "ok": True, "stop_condition": "agent_completed", "errors": []}]}


def write_prime(folder, steps=(1, 2)):
    for step in steps:
        eps = [_episode(step, qi, f"g{step}-{qi}", q, a, out, r)
               for qi, (q, a) in enumerate(QUESTIONS) for (qq, _, out, r) in _samples(step) if qq == q]
        for sub, subset in (("train/all", eps), ("train/effective", eps[4:8]), ("eval/all", eps[:2])):
            d = folder / "rollouts" / f"step_{step}" / sub
            d.mkdir(parents=True)
            (d / "traces.jsonl").write_text("".join(json.dumps(e) + "\n" for e in subset))


@pytest.mark.parametrize("fmt, write", [("verl", write_verl), ("trl", write_trl), ("prime-rl", write_prime)])
def test_a_trainer_dump_becomes_a_run_with_buckets_per_step_and_a_report(store, tmp_path, fmt, write):
    write(tmp_path / "dump")
    code, out, err = run_cli("import", fmt, str(tmp_path / "dump"), "--run-id", "ext", "--store", store.root, *TOK)
    assert code == 0, err
    assert out.startswith(f"import {fmt}: run ext, 24 rollouts over 2 round(s) of 3 distinct prompts")
    code, out, err = run_cli("sql", "--store", store.root, "--format", "json",
                             "SELECT round, bucket, count(*) AS n FROM prompt_scores WHERE run_id = 'ext' "
                             "GROUP BY ALL ORDER BY ALL")
    assert code == 0, err
    buckets = {(r["round"], r["bucket"]): r["n"] for r in json.loads(out)}
    assert buckets == {(0, "informative"): 1, (0, "saturated"): 1, (0, "too_hard"): 1,
                       (1, "informative"): 1, (1, "saturated"): 1, (1, "too_hard"): 1}
    groups = sql(store, "SELECT round, prompt_id, count(*) AS n, list(sample_idx ORDER BY sample_idx) AS idx, "
                        "avg(reward) AS r FROM rollouts WHERE run_id = 'ext' GROUP BY ALL ORDER BY ALL").to_pylist()
    assert len(groups) == 6 and all(g["n"] == 4 and g["idx"] == [0, 1, 2, 3] for g in groups)
    assert sorted(g["r"] for g in groups if g["round"] == 1) == [0.0, 0.75, 1.0]  # step 2: 3 of 4 right
    # every augmentation is strict JSON, also where the dump holds a NaN (TRL's format_reward of its first
    # row); DuckDB's json_valid would accept the NaN token, Python's parser is told to refuse it
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in augmentation {text}"))

    augmentations = sql(store, "SELECT augmentation FROM rollouts WHERE run_id = 'ext'").column(0).to_pylist()
    assert len([strict(a) for a in augmentations]) == 24
    steps = sql(store, "SELECT DISTINCT round, json_extract(augmentation, '$.import.step')::INT AS step "
                       "FROM rollouts WHERE run_id = 'ext' ORDER BY round").to_pylist()
    assert [s["step"] for s in steps] == ([10, 20] if fmt == "trl" else [1, 2])
    tokens = sql(store, "SELECT min(n_tokens) AS lo FROM rollouts WHERE run_id = 'ext'").to_pylist()[0]["lo"]
    assert tokens == 3 if fmt == "prime-rl" else tokens > 3  # prime-rl records its count; others are counted
    code, out, err = run_cli("lineage", groups[0]["prompt_id"], "--store", store.root)
    assert code == 0 and "r0: pass" in out and "r1: pass" in out, err  # per-step pass rate, EPS, bucket
    code, out, err = run_cli("report", "ext", "--store", store.root)
    assert code == 0, err
    report = json.loads((tmp_path / "store" / "_reports" / "run_id=ext" / "report.json").read_text())
    assert report["plots"]  # the bucket plots are drawn from the imported scores
    # the same import again lands nothing new; another dump under the same run id is refused
    code, out, err = run_cli("import", fmt, str(tmp_path / "dump"), "--run-id", "ext", "--store", store.root, *TOK)
    assert code == 0 and "0 round(s) landed now" in out, err
    assert sql(store, "SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 24}]
    write_verl(tmp_path / "other", steps=(7,))
    code, out, err = run_cli("import", "verl", str(tmp_path / "other"), "--run-id", "ext", "--store", store.root,
                             *TOK)
    assert code == 1 and "run ext already exists" in err and err.count("\n") <= 2


def test_prompts_are_content_addressed_as_on_ingest(store, tmp_path):
    from tasks.core.ids import prompt_id

    rows = [{"prompt": q, "completion": "x", "reward": 0.0, "answer": a} for q, a in QUESTIONS]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    code, out, err = run_cli("import", "plain", str(tmp_path / "p.jsonl"), "--run-id", "p", "--store", store.root,
                             *TOK)
    assert code == 0, err
    ids = {r["prompt_id"] for r in sql(store, "SELECT prompt_id FROM prompts").to_pylist()}
    assert ids == {prompt_id(q, a, "import:plain") for q, a in QUESTIONS}


def test_bad_rows_are_named_and_nothing_lands(store, tmp_path):
    good = {"prompt": "What is 1 + 1?", "completion": "2", "reward": 1.0}
    lines = [json.dumps(good), "{not json", json.dumps({**good, "reward": "high"}), json.dumps({**good, "step": -1}),
             json.dumps({**good, "prompt": ""}), json.dumps([1, 2]), json.dumps({**good, "reward": float("nan")})]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = run_cli("import", "plain", str(tmp_path / "bad.jsonl"), "--run-id", "b", "--store", store.root,
                             *TOK)
    assert code == 1 and "6 bad row(s), nothing written" in err
    for line, problem in [(2, "not valid JSON"), (3, "reward 'high' is not a finite number"),
                          (4, "step -1 is not a non-negative integer"), (5, "prompt missing or not text")]:
        assert f"bad.jsonl line {line}: {problem}" in err
    assert not (tmp_path / "store" / "rollouts").exists()
    code, out, err = run_cli("import", "plain", str(tmp_path / "bad.jsonl"), "--run-id", "b", "--store", store.root,
                             "--skip-invalid", *TOK)
    assert code == 0 and "1 rollouts" in out and err.count("skipped ") == 6
    for bad_args, message in [(["verl", str(tmp_path / "nope")], "no such file or folder"),
                              (["plain", str(tmp_path / "bad.jsonl"), "--run-id", "../x"], "--run-id '../x'"),
                              (["trl", str(tmp_path)], "no completions_*.parquet files")]:
        args = bad_args if "--run-id" in bad_args else [*bad_args, "--run-id", "z"]
        code, _, err = run_cli("import", *args, "--store", store.root, *TOK)
        assert code == 1 and message in err and err.startswith("refinery: error:"), err


def test_odd_but_valid_dump_content(store, tmp_path):
    """What real dumps hold besides the happy path: a prime-rl episode that failed (no trace), a reward that
    did not run (null), a judge trace listed before the trainable one, a tool-call turn without content; a
    TRL row that no reward function could score (all NaN); two groups of one prompt in one step; a dump
    field named like a lineage key."""
    ep = _episode(1, 0, "g", "What is 3 + 4?", "7", "The sum is \\boxed{7}.", 1.0)
    judge = {**ep["traces"][0], "agent": {"name": "judge", "trainable": False},
             "rewards": {"correct": {"score": 0.0, "weight": 1.0}}}
    trainable = {**ep["traces"][0], "agent": {"name": "agent", "trainable": True},
                 "rewards": {"correct": {"score": 1.0, "weight": 1.0}, "judge": None},
                 "nodes": [*ep["traces"][0]["nodes"], {"message": {"role": "assistant", "tool_calls": [{"id": "1"}]},
                                                       "sampled": True}]}
    folder = tmp_path / "prime" / "rollouts" / "step_1" / "train" / "all"
    folder.mkdir(parents=True)
    (folder / "traces.jsonl").write_text(json.dumps({**ep, "traces": [judge, trainable]}) + "\n"
                                         + json.dumps({**ep, "traces": [], "ok": False, "errors": ["timeout"]}) + "\n")
    code, out, err = run_cli("import", "prime-rl", str(tmp_path / "prime"), "--run-id", "pr", "--store", store.root,
                             "--skip-invalid", *TOK)
    assert code == 0 and "1 rollouts" in out and "a failed episode: no trace" in err, err
    assert sql(store, "SELECT reward, completion FROM rollouts WHERE run_id = 'pr'").to_pylist() == [
        {"reward": 1.0, "completion": "The sum is \\boxed{7}."}]  # the trainable trace; the null reward left out

    (tmp_path / "trl").mkdir()
    pq.write_table(pa.table({"step": pa.array([1, 1], pa.int64()), "prompt": ["q", "q"], "completion": ["a", "b"],
                             "r1": [float("nan"), 1.0], "r2": [float("nan"), float("nan")]}),
                   tmp_path / "trl" / "completions_00001.parquet")
    code, out, err = run_cli("import", "trl", str(tmp_path / "trl"), "--run-id", "t", "--store", store.root, *TOK)
    assert code == 1 and "completions_00001.parquet line 1: reward None is not a finite number" in err

    rows = [{"prompt": "q", "completion": c, "reward": r, "group": g, "file": "mine", "step": 3}
            for g, c, r in [("a", "1", 1.0), ("a", "2", 0.0), ("b", "3", 1.0), ("b", "4", 1.0)]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli("import", "plain", str(tmp_path / "p.jsonl"), "--run-id", "pl", "--store", store.root,
                             *TOK)
    assert code == 0, err
    got = sql(store, "SELECT sample_idx, json_extract_string(augmentation, '$.import.file') AS f, "
                     "json_extract_string(augmentation, '$.import.extra.file') AS x FROM rollouts "
                     "WHERE run_id = 'pl' ORDER BY sample_idx").to_pylist()
    assert [g["sample_idx"] for g in got] == [0, 1, 2, 3] and {(g["f"], g["x"]) for g in got} == {("p.jsonl", "mine")}
    assert sql(store, "SELECT n, mean_reward FROM prompt_scores WHERE run_id = 'pl'").to_pylist() == [
        {"n": 4, "mean_reward": 0.75}]
