"""The first optimizer step on policy: a round's whole `train_round` with `first_step_on_policy` true (the
default: the first step's rows take their old log-probs from that step's own forward) against false (an old
pass over every row), side by side on a real round's rollouts.

Input: a store a run has written (`refinery run` or `make demo`); the round's rollouts become training
sequences exactly as the train stage builds them (tasks/train.py rollout_sequences), and its policy (--model,
default the embedded base, round 0's policy) trains from the same weights in every repeat, at the default
TrainConfig (round 0's setting: the KL reference is the starting policy, `reference_is_policy`). A warm-up
round on the first 64 sequences runs first; the arms then alternate their order repeat by repeat, so load
that drifts over the run does not favour one. Both arms must land the same step losses (checked).

    python benchmarks/first_step.py --store PATH [--run-id demo] [--round 0] [--model default] [--repeats 2]
        [--json PATH]

Figures (--json, flat keys): first_step_on_s and first_step_off_s (medians), their min and max,
train_first_step_speedup (off / on, the median of the repeats' ratios), train_rows, train_steps, train_tokens.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True, help="a store a run has written")
    ap.add_argument("--run-id", default="demo")
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--model", default="default", help="the round's policy spec (round 0: the base)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write the figures here as flat keys")
    a = ap.parse_args()
    from flows.config import RolloutConfig
    from models.registry import resolve
    from models.threads import claim
    from storage.rounds import this_round
    from storage.store import Store
    from tasks.core.grpo import TrainConfig, TrainPlan, train_round
    from tasks.train import load_trainable, rollout_sequences

    claim()
    store = Store(a.store)
    rollouts = this_round(store, "rollouts", a.run_id, a.round).select(
        "prompt_id", "sample_idx", "prompt_text", "completion", "reward", "finish_reason", "augmentation").collect()
    if rollouts.height == 0:
        sys.exit(f"first_step: no rollouts of run {a.run_id!r} round {a.round} in {a.store}")
    cfg, rollout_cfg = TrainConfig(), RolloutConfig()
    base, tok = load_trainable(resolve(a.model), cfg, "cpu")
    seqs = rollout_sequences(rollouts, tok, tok.eos_token_id, cfg.scale_std, rollout_cfg.max_new_tokens)[0]
    tokens = sum(len(s.completion_ids) for s in seqs)
    steps = -(-len(seqs) // cfg.rows_per_step)
    print(f"{len(seqs)} sequences ({tokens} completion tokens), {steps} steps of {cfg.rows_per_step} rows")

    def run(on: bool, rows) -> tuple[float, list[float]]:
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        out = train_round(model, None, rows, [], cfg, TrainPlan(rollout_cfg.temperature, tok.pad_token_id, "cpu", "auto",
                                                           reference_is_policy=True, first_step_on_policy=on))
        return time.perf_counter() - t0, [r["loss"] for r in out]

    run(True, seqs[:64])  # warm-up: oneDNN's primitives, the allocator's first growth
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {}
    for rep in range(a.repeats):
        for on in ((False, True) if rep % 2 == 0 else (True, False)):
            seconds, losses[on] = run(on, seqs)
            times[on].append(seconds)
        print(f"repeat {rep}: on {times[True][-1]:.1f} s, off {times[False][-1]:.1f} s")
    if any(abs(x - y) > 1e-3 * max(1.0, abs(y)) for x, y in zip(losses[True], losses[False])):
        sys.exit(f"first_step: the arms' step losses differ: {losses[True]} vs {losses[False]}")
    ratios = [off / on for on, off in zip(times[True], times[False])]
    figures = {"train_first_step_speedup": statistics.median(ratios), "train_rows": len(seqs), "train_steps": steps,
               "train_tokens": tokens}
    for on, name in ((True, "on"), (False, "off")):
        v = times[on]
        figures |= {f"first_step_{name}_s": statistics.median(v), f"first_step_{name}_min_s": min(v),
                    f"first_step_{name}_max_s": max(v)}
        print(f"first step {name}: median {statistics.median(v):.1f} s (min {min(v):.1f}, max {max(v):.1f})")
    print(f"train_first_step_speedup (off / on, median of the repeats' ratios) = {figures['train_first_step_speedup']:.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
