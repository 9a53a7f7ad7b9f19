"""Screening then top-up against full groups (docs/algorithms.md §4.2), side by side in one run: round 0's collect
on the same pool and selection, once with `rollout.screen_samples=0` (the baseline: G samples per selected
prompt) and once per screening threshold, each in a store of its own.

Figure of merit: informative groups (groups of G whose rewards differ) per 1,000 collect tokens, and its ratio
to the baseline's; beside it the tokens, the groups kept, and screening's own counts (topped up because mixed,
topped up by the posterior, of those still all-equal, screened out, short). Round 0 is the base policy: what a
threshold does before any history exists, which is where the pooled posterior is broadest.

    python benchmarks/screening.py [--config benchmarks/evidence.toml] [--thresholds 0.5,0.7] [--seed 0]
                                   [--model default] [--set KEY=VALUE ...] [--json PATH]

--json PATH writes flat keys: informative_per_1k_off, and per threshold t (written t0p7 for 0.7)
informative_per_1k_t0p7, ratio_t0p7, tokens_t0p7, kept_t0p7, topped_up_posterior_t0p7, zero_variance_t0p7,
plus tokens_off and kept_off.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def collect_round0(root: str, run: str, config: str, sets: list[str]) -> dict:
    """Pool, select and collect round 0 of a fresh store; the collect summary plus the informative groups."""
    from flows.config import load_config
    from storage.query import scan
    from storage.store import Store
    from tasks.collect import collect_task
    from tasks.pool import pool_task
    from tasks.select import select_task
    from tasks.stage import RoundContext

    cfg = load_config(config, sets=sets)
    store = Store(root)
    ctx = RoundContext(store=store.uri, run_id=run, round=0, model=cfg.model)
    pool_task.fn(ctx, cfg.pool, cfg.eval.heldout_fraction, cfg.eval.seed, cfg.eval.heldout_split)
    select_task.fn(ctx, cfg.select, cfg.rollout.include_reserve)
    t0 = time.perf_counter()
    out = collect_task.fn(ctx, cfg.rollout, cfg.reward, cfg.select, use_selection=True)
    import polars as pl

    groups = (scan(store, "rollouts").filter(pl.col("run_id") == run).group_by("prompt_id")
              .agg(mixed=pl.col("reward").std(ddof=0) > 1e-6).collect())
    return {"tokens": int(out["tokens"]), "kept": groups.height, "informative": int(groups["mixed"].sum()),
            "seconds": time.perf_counter() - t0, "screening": out.get("screening") or {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "benchmarks" / "evidence.toml"), help="run config (TOML)")
    p.add_argument("--thresholds", default="0.5,0.7", help="screening thresholds to run beside the baseline")
    p.add_argument("--seed", type=int, default=0, help="rollout and select seed")
    p.add_argument("--model", default="default", help="policy (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="more config overrides")
    p.add_argument("--json", help="write the figures as flat JSON keys to this path")
    a = p.parse_args(argv)
    base = [f"model.policy={a.model}", "rollout.lope_prefixes=0", "select.selector=uniform",
            f"rollout.seed={a.seed}", f"select.seed={a.seed}", *a.sets]
    arms = [("off", ["rollout.screen_samples=0"])]
    arms += [("t" + t.replace(".", "p"), ["rollout.screen_samples=2", f"rollout.screen_topup_threshold={t}"])
             for t in a.thresholds.split(",") if t]
    figures: dict[str, float | int] = {}
    with tempfile.TemporaryDirectory(prefix="refinery-screening-") as tmp:
        for name, extra in arms:
            got = collect_round0(f"{tmp}/{name}", f"screen-{name}", a.config, base + extra)
            per_1k = 1000 * got["informative"] / max(got["tokens"], 1)
            s = got["screening"]
            figures |= {f"informative_per_1k_{name}": round(per_1k, 4), f"tokens_{name}": got["tokens"],
                        f"kept_{name}": got["kept"]}
            if name != "off":
                figures |= {f"ratio_{name}": round(per_1k / max(figures["informative_per_1k_off"], 1e-9), 4),
                            f"topped_up_posterior_{name}": s.get("topped_up_posterior", 0),
                            f"zero_variance_{name}": s.get("zero_variance", 0)}
            print(f"{name:>5}: {per_1k:6.3f} informative groups per 1k collect tokens ({got['informative']} of "
                  f"{got['kept']} groups kept, {got['tokens']} tokens, {got['seconds']:.0f} s)"
                  + (f"; screened {s['screened']}, topped up {s['topped_up_mixed']} mixed + "
                     f"{s['topped_up_posterior']} by the posterior ({s['zero_variance']} still all-equal), "
                     f"screened out {s['screened_out']}, short {s['short']}" if s else ""), flush=True)
    for name, _ in arms[1:]:
        print(f"{name} / off: {figures[f'ratio_{name}']:.2f}x informative groups per token")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
