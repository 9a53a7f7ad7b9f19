"""One default round timed per stage, with its wall time and peak RSS, side by side with a baseline commit, and
each stage's ratio to its own lower bound where one is measurable (issue 14).

    python benchmarks/round.py [--baseline REF] [--rounds 1] [--set section.key=value ...] [--tiny] [--json PATH]

Arms. This checkout, and with --baseline a git worktree of REF (made under /tmp, removed afterwards). Each arm
runs in a child process whose working folder and PYTHONPATH are that tree, with its own PREFECT_HOME and a
fresh store: the curriculum flow for --rounds rounds at the default config with shaping on (`shape.enabled`,
off by default since issue 50; on here so that both arms do the work the baseline's default did), plus --set.
The child prints each
stage's compute seconds (measured inside the stage's task by tasks.reporting.progress.timed, which every commit since
issue 6 records), each round's wall time (from the end of the previous round's last stage; round 0 from the
flow call, so it includes starting Prefect's temporary server and creating the run), the same without that
start (`round_stages_wall_s`: from the round's first stage to its last; `startup_s`: from the flow call to the
first stage) and the flow process's peak RSS (getrusage; the temporary Prefect server and the math-verify
worker are other processes, reported apart as children). The arms run one after
the other, never together: on 2 cores two torch processes would slow each other many times over. Each arm's
Prefect home is prepared as that commit's `refinery run` prepares it: where the commit has
flows/server/prefect_home.py, a fresh home starts from a copy of the migrated database; before it (4425eb0),
Prefect migrates a new database on its first start, as it did for that commit's users.

Lower bounds, measured afterwards in this process on the current arm's store, for its last round:
- train: a bare forward/backward of the same model (bf16 autocast where native, as the stage) over the round's
  training tokens as the stage counts them with the shared prefix (each group's prompt once plus its
  completions), in 1024-token sequences with a plain causal mask, plus two no-gradient forwards over the same
  tokens (the old and the reference log-prob passes). No optimizer step, no loss beyond a sum.
  `train_ratio_vs_bare` = train_s / that time; `train_fwd_bwd_s` is the forward/backward alone (where the
  sampler's log-probs serve as the old ones, tasks/train.py, and in round 0, whose reference is the policy,
  the stage runs no full no-gradient pass, so it can take less than the bound).
- collect: the round's generated tokens (kept and discarded rollouts) at the rate of `model.generate` with the
  length forced (no early stop; bf16 weights where native) on the round's own prompts, measured now.
  `collect_ratio_vs_ceiling` = collect_s / that time; collect also verifies, runs LoPE's extra samples and
  writes the store, which the bound leaves out.

Figures go to --json as flat keys: round_wall_s, round_stages_wall_s, startup_s, round_peak_rss_gib,
collect_s, train_s, shape_s, evaluate_s, ..._s for every other stage, train_ratio_vs_bare, collect_ratio_vs_ceiling, the shape stage's own counts
(shape_mcmc_s: its MCMC apart from the teacher's solutions; shape_traces, shape_teacher_calls,
shape_cut_proposals, shape_irreversible: two arms whose collect solved different prompts shape different
chains), and with a baseline the same keys prefixed `baseline_` plus `round_wall_ratio_vs_baseline` (current /
baseline) and one per stage.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.policy=tiny-random", "model.dtype=fp32", "rollout.max_new_tokens=8", "rollout.group_size=4",
        "select.embedder=hashing", "select.batch_size=8",
        'pool.sources=[{"source": "rg:products", "size": 12, "params": {"max_digits": 1}}]']
MARK = "ROUND_BENCHMARK_JSON "
WALL_KEYS = ("round_wall_s", "round_stages_wall_s", "startup_s")  # the round's own lines, printed first

# runs inside the arm's tree; only names every commit since issue 6 has (load_config, curriculum, timing)
CHILD = r"""
import json, os, resource, sys, threading, time
t0 = time.perf_counter()
samples = []  # (perf_counter, RSS GiB) every 0.2 s: each stage's peak is the largest sample inside its timing


def sample_rss():
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        with open("/proc/self/statm") as f:
            samples.append((time.perf_counter(), int(f.read().split()[1]) * page / 2**30))
        time.sleep(0.2)


threading.Thread(target=sample_rss, daemon=True).start()
from flows.config import load_config
from flows.curriculum import curriculum
import tasks
args = json.loads(sys.argv[1])
cfg = load_config(sets=args["sets"], run_id="round", store=args["store"], rounds=args["rounds"])
try:  # Prefect's home as this commit's `refinery run` prepares it (a copy of a migrated database, where it can)
    from flows.server.prefect_home import seed_database
except ImportError:  # a commit before it: Prefect migrates a new database, as it did for its users
    pass
else:
    from pathlib import Path
    seed_database(Path(os.environ["PREFECT_HOME"]))
t_call = time.perf_counter()
out = curriculum(cfg)
total = time.perf_counter() - t_call
stages = [{"round": s.get("round"), "stage": s.get("stage"), "compute_s": s["timing"]["compute_s"],
           "start": s["timing"]["start"], "end": s["timing"]["end"],
           "counts": {k: v for k, v in s.items() if type(v) in (int, float) and k != "round"},
           "peak_rss_gib": max([g for t, g in samples if s["timing"]["start"] <= t <= s["timing"]["end"]],
                               default=None)}
          for s in out["stages"] if isinstance(s, dict) and "timing" in s]
walls, spans, prev = [], [], t_call
for r in range(args["rounds"]):
    ends = [s["end"] for s in stages if s["round"] == r]
    walls.append(max(ends) - prev if ends else None)
    spans.append(max(ends) - min(s["start"] for s in stages if s["round"] == r) if ends else None)
    prev = max(ends) if ends else prev
print(MARK_PLACEHOLDER + json.dumps({"tree": os.path.dirname(os.path.abspath(tasks.__path__[0])), "flow_s": total,
      "imports_s": t_call - t0, "round_walls": walls, "round_spans": spans, "stages": stages,
      "startup_s": min((s["start"] for s in stages), default=t_call) - t_call,
      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
      "children_peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}), flush=True)
""".replace("MARK_PLACEHOLDER", repr(MARK))


def check_commit(ref: str, tool: str) -> None:
    """Exit with one line unless `ref` names a commit of this repository (before any arm runs)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                      capture_output=True).returncode:
        raise SystemExit(f"{tool}: --baseline {ref} is not a commit of {ROOT}")


@contextlib.contextmanager
def baseline_tree(ref: str, tool: str):
    """A detached git worktree of `ref` under /tmp for the `with` block, removed afterwards (also on failure)."""
    check_commit(ref, tool)
    tree = Path(tempfile.mkdtemp(prefix="refinery-baseline-")) / "tree"
    made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
                          capture_output=True, text=True)
    if made.returncode:
        shutil.rmtree(tree.parent, ignore_errors=True)
        raise SystemExit(f"{tool}: no worktree of {ref}: {made.stderr.strip().splitlines()[-1]}")
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(tree.parent, ignore_errors=True)


def run_arm(tree: Path, sets: list[str], rounds: int, label: str) -> dict:
    """The flow in a child process over `tree`; its JSON line, with the store's path."""
    work = Path(tempfile.mkdtemp(prefix=f"refinery-round-{label}-"))
    env = {**os.environ, "PYTHONPATH": str(tree), "PREFECT_HOME": str(work / ".prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    (work / ".prefect").mkdir()
    args = {"sets": sets, "store": str(work / "store"), "rounds": rounds}
    print(f"[{label}] running {rounds} round(s) in {tree} (store {work / 'store'}) ...", flush=True)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=tree, env=env, text=True,
                          capture_output=True)
    out = arm_result(proc, MARK, tree, label, "round.py")
    out["store"], out["process_s"] = args["store"], time.perf_counter() - t
    return out


def arm_result(proc: subprocess.CompletedProcess, mark: str, tree: Path, label: str, tool: str) -> dict:
    """An arm's child process -> its last `mark`ed JSON line; exits with its stderr's tail if it failed, or if
    it imported its code from another tree than `tree` (the arm would have measured the wrong commit)."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    if proc.returncode or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise SystemExit(f"{tool}: the {label} arm failed (exit {proc.returncode}):\n{tail}")
    out = json.loads(lines[-1][len(mark):])
    if Path(out["tree"]).resolve() != tree.resolve():
        raise SystemExit(f"{tool}: the {label} arm imported its code from {out['tree']}, not {tree}")
    return out


# the shape stage's own counts (its summary, the same keys since 4425eb0): the MCMC's seconds apart from the
# teacher's solutions, and the work the chains did, so two arms that shaped different chains can be compared
SHAPE_COUNTS = {"seconds": "shape_mcmc_s", "traces": "shape_traces", "teacher_calls": "shape_teacher_calls",
                "irreversible": "shape_irreversible", "cut_proposals": "shape_cut_proposals"}


def figures(arm: dict, rnd: int) -> dict:
    stages = {s["stage"]: s["compute_s"] for s in arm["stages"] if s["round"] == rnd}
    shape = next((s.get("counts", {}) for s in arm["stages"] if s["round"] == rnd and s["stage"] == "shape"), {})
    return {**{name: shape[k] for k, name in SHAPE_COUNTS.items() if k in shape},
            "round_wall_s": arm["round_walls"][rnd], "round_stages_wall_s": arm["round_spans"][rnd],
            "startup_s": arm["startup_s"], "round_peak_rss_gib": arm["peak_rss_gib"],
            "children_peak_rss_gib": arm["children_peak_rss_gib"], "flow_s": arm["flow_s"],
            **{f"{k}_s": v for k, v in stages.items()},
            **{f"{s['stage']}_peak_rss_gib": s["peak_rss_gib"] for s in arm["stages"]
               if s["round"] == rnd and s["peak_rss_gib"] is not None}}


def round_of(store: str, rnd: int, sets: list[str]):
    """The arm's config and a RoundContext for its round `rnd` (the store's this-round filter, in one place)."""
    from flows.config import load_config
    from tasks.stage import RoundContext

    cfg = load_config(sets=sets, run_id="round", store=store, rounds=rnd + 1)
    return cfg, RoundContext(store=store, run_id="round", round=rnd, policy_version=0, base=cfg.model.policy,
                             rounds=rnd + 1, model=cfg.model)


def bare_train_seconds(store: str, rnd: int, sets: list[str]) -> tuple[float, int, float]:
    """Bare forward/backward + two no-grad forwards over the round's shared-prefix training tokens: (seconds,
    tokens, seconds of the forward/backward alone)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.registry import resolve
    from models.training.autocast import autocast
    from storage.query import table_rows_with_schema
    from storage.store import Store
    from tasks.train import rollout_sequences

    cfg, ctx = round_of(store, rnd, sets)
    rollouts = table_rows_with_schema(Store(store), "rollouts", [  # token_ids: the ids training runs, where kept
        "prompt_id", "sample_idx", "prompt_text", "completion", "reward", "finish_reason", "augmentation",
        "token_ids"], ctx.run_id, ctx.round)
    model = AutoModelForCausalLM.from_pretrained(resolve(cfg.model.policy), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(resolve(cfg.model.policy))
    seqs, _, _ = rollout_sequences(rollouts, tok, tok.eos_token_id, True, cfg.rollout.max_new_tokens)
    prompts = {tuple(s.prompt_ids) for s in seqs}
    tokens = sum(len(p) for p in prompts) + sum(len(s.completion_ids) for s in seqs)
    chunks = [1024] * (tokens // 1024) + ([tokens % 1024] if tokens % 1024 else [])
    vocab = model.config.vocab_size
    t = time.perf_counter()
    model.train()
    for n in chunks:
        ids = torch.randint(0, vocab, (1, n))
        with autocast("cpu", cfg.model.dtype):
            h = model.model(input_ids=ids).last_hidden_state
        model.lm_head(h).float().logsumexp(-1).sum().backward()
    fwd_bwd = time.perf_counter() - t
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            for n in chunks:
                with autocast("cpu", cfg.model.dtype):
                    model(input_ids=torch.randint(0, vocab, (1, n)))
    return time.perf_counter() - t, tokens, fwd_bwd


def collect_bound_seconds(store: str, rnd: int, sets: list[str]) -> tuple[float, int]:
    """The round's generated tokens (kept and discarded) at `generate`'s forced-length rate on 8 of its prompts."""
    import importlib.util

    from storage.store import Store

    cfg, ctx = round_of(store, rnd, sets)
    st = Store(store)
    rows = ctx.rows(st, "rollouts").select("prompt_text", "n_tokens").collect()
    generated = int(rows["n_tokens"].sum()) + int(ctx.rows(st, "discarded_rollouts").select("n_tokens")
                                                  .collect()["n_tokens"].sum())
    spec = importlib.util.spec_from_file_location("rollout_bench", ROOT / "benchmarks" / "rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rate = bench.forced_rate(cfg.model.policy, rows["prompt_text"].unique(maintain_order=True).to_list()[:8],
                             cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.model.dtype)
    return generated / rate, generated


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default=None, metavar="REF", help="a commit to run side by side (a worktree)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--tiny", action="store_true", help="the tiny random model and a 12-prompt pool (a quick check)")
    p.add_argument("--no-bounds", action="store_true", help="skip the lower-bound measurements")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as flat keys")
    p.add_argument("--keep", action="store_true", help="keep the arms' stores (default: removed at the end)")
    a = p.parse_args()
    sets = ["shape.enabled=true", *(TINY if a.tiny else []), *a.set]  # the baseline's default round: like for like
    last = a.rounds - 1
    if a.baseline:
        check_commit(a.baseline, "round.py")
    arms = {"current": run_arm(ROOT, sets, a.rounds, "current")}
    if a.baseline:
        with baseline_tree(a.baseline, "round.py") as tree:
            arms["baseline"] = run_arm(tree, sets, a.rounds, f"baseline {a.baseline}")
    out = figures(arms["current"], last)
    if not a.no_bounds:
        bare, tokens, fwd_bwd = bare_train_seconds(arms["current"]["store"], last, sets)
        out |= {"train_bare_s": bare, "train_tokens": tokens, "train_fwd_bwd_s": fwd_bwd}
        if out.get("train_s") and tokens:  # a round whose groups were all zero-variance trained nothing
            out["train_ratio_vs_bare"] = out["train_s"] / bare
        bound, generated = collect_bound_seconds(arms["current"]["store"], last, sets)
        out |= {"collect_ceiling_s": bound, "collect_generated_tokens": generated}
        if out.get("collect_s"):
            out["collect_ratio_vs_ceiling"] = out["collect_s"] / bound
    if "baseline" in arms:
        base = figures(arms["baseline"], last)
        out |= {f"baseline_{k}": v for k, v in base.items()}
        out["baseline_ref"] = a.baseline
        for k, v in base.items():
            if k.endswith("_s") and v and out.get(k) is not None:
                out[f"{k.removesuffix('_s')}_ratio_vs_baseline"] = out[k] / v
        if out["round_wall_s"] and base["round_wall_s"]:
            out["round_wall_ratio_vs_baseline"] = out["round_wall_s"] / base["round_wall_s"]
    stage_keys = sorted({k for k in out if k.endswith("_s") and not k.startswith("baseline_")} - {
        *WALL_KEYS, "flow_s", "train_bare_s", "train_fwd_bwd_s", "collect_ceiling_s", "shape_mcmc_s"})  # MCMC: part of shape
    print(f"\nround {last}{' (of ' + str(a.rounds) + ')' if a.rounds > 1 else ''}: seconds per stage")
    print(f"{'':>16} {'current':>9}" + (f" {'baseline':>9} {'ratio':>6}" if "baseline" in arms else ""))
    for k in [*WALL_KEYS, *stage_keys]:
        if out.get(k) is None:
            continue
        line = f"{k:>16} {out[k]:>9.1f}"
        if "baseline" in arms and out.get(f"baseline_{k}"):
            line += f" {out[f'baseline_{k}']:>9.1f} {out[k] / out[f'baseline_{k}']:>6.2f}"
        print(line)
    peaks = {k.removesuffix("_peak_rss_gib"): v for k, v in out.items()
             if k.endswith("_peak_rss_gib") and not k.startswith(("baseline_", "round_", "children_"))}
    if peaks:
        print("RSS peak per stage (GiB, sampled every 0.2 s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(peaks.items(), key=lambda kv: -kv[1])))
    print(f"peak RSS of the flow process: {out['round_peak_rss_gib']:.2f} GiB"
          + (f" (baseline {out['baseline_round_peak_rss_gib']:.2f})" if "baseline" in arms else "")
          + f"; its children at most {out['children_peak_rss_gib']:.2f} GiB")
    arm_figures = [("current", out)] + [("baseline", {k.removeprefix("baseline_"): v for k, v in out.items()
                                                      if k.startswith("baseline_")})] * ("baseline" in arms)
    for arm, o in arm_figures:
        if "shape_mcmc_s" in o and "shape_s" in o:
            print(f"shape ({arm}): MCMC {o['shape_mcmc_s']:.1f} s of {o['shape_s']:.1f}; {o.get('shape_traces')} "
                  f"traces, {o.get('shape_teacher_calls')} teacher calls, {o.get('shape_cut_proposals')} proposals "
                  f"cut, {o.get('shape_irreversible')} moves irreversible")
    if "train_ratio_vs_bare" in out:
        print(f"train: {out['train_s']:.1f} s vs a bare forward/backward over the same {out['train_tokens']} "
              f"tokens {out['train_bare_s']:.1f} s: ratio {out['train_ratio_vs_bare']:.2f} (the forward/backward "
              f"alone {out['train_fwd_bwd_s']:.1f} s: ratio {out['train_s'] / out['train_fwd_bwd_s']:.2f})")
    if "collect_ratio_vs_ceiling" in out:
        print(f"collect: {out['collect_s']:.1f} s vs {out['collect_generated_tokens']} generated tokens at "
              f"generate's forced-length rate {out['collect_ceiling_s']:.1f} s: ratio "
              f"{out['collect_ratio_vs_ceiling']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, sort_keys=True))
    for arm in arms.values():
        if a.keep:
            print(f"kept store: {arm['store']}")
        else:
            shutil.rmtree(Path(arm["store"]).parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
