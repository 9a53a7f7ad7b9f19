"""Screening, then top-up: the collect stage's default dynamic sampling (issue 50 item 2; the decisions and their
defaults: tasks/core/screening.py; the loop: tasks/core/dapo.py `dynamic_sampling`; docs/algorithms.md §4.2).

Method. Generation batch 1 is the select stage's picks (B of them). Every prompt of a batch first gets
`screen_samples` (k_s) samples; the prompt's pass-rate posterior (tasks/core/passrate.py: bins, a Beta prior per
bin) is updated with the run's earlier groups and every screen of the round so far, this batch's included; a mixed
screen, or a unanimous one whose posterior still gives P(the full group is mixed) >= `screen_topup_threshold`,
is topped up to G with G − k_s more samples (its screening samples are samples 0..k_s−1 of the group). The
loop then keeps the topped-up groups whose rewards differ, up to B, and refills: it screens further candidates
from the round's candidates (never the ones already generated for), about twice the groups still missing
(`SCREEN_OVERSAMPLE`: a screen costs k_s/G of a group, so over-screening is cheap), best first by a Thompson
prediction that costs no tokens (tasks/core/screening.py `refill_order`; with `screen_refill = "stratified"`,
best first inside each pass-rate bin, the bins at their share of the candidates), until B groups are kept or
`screen_max_batches` generation batches ran. A batch tops up every mixed screen, past B if need be (its k_s
samples are paid, and G − k_s more make an informative group for sure: the cheapest one there is), and
posterior-worthy unanimous screens, in queue order, only while groups are missing, so no top-up is generated
only to be thrown away as surplus. (Before, a mixed screen past B was left as `surplus`: 8% of the evidence
runs' tokens.)

What lands where (one atomic collect commit, as dynamic sampling's):
- `rollouts`: the kept groups, G rows each, sample_idx 0..G−1;
- `discarded_rollouts` (with `gen_batch`): a screened-out screen's k_s rows (reason `screened_out`), a topped-up
  group whose G rewards are still all equal (`zero_variance`: no gradient, as DAPO drops it), a top-up-worthy
  unanimous screen left unfinished because the batch was full (`surplus`, k_s rows);
- `selections`: the refill prompts (reason "...: screening refill, generation batch k"), so `selections` names
  every prompt generated for and each has its group in exactly one of the two tables;
- `generated_tokens`: screening samples under purpose `screen`, top-ups under `rollout`; the round's collect
  tokens equal the n_tokens of its rollouts plus its discarded_rollouts (LoPE's resamples apart);
- `predictions` (selector `screening`): for every prompt screened, what the pass-rate model said before the
  round generated anything (the posterior of the run's earlier groups: its mean, and P(a group of G is mixed)),
  so `refinery sql` and the report set the model's calibration beside what the screen and top-up then showed
  (tasks/reporting/plots.py `calibration`), with the default pipeline as with the `thompson` selector.

Keyed sampling: screens draw with the round's row seeds (tasks/core/seeds.py `row_seeds` of the round seed, the
seeds a plain round uses); top-ups with row seeds of round seed + `TOPUP_SEED_STRIDE`, so they are fresh draws,
not the screen's again, and a resumed round reproduces both exactly. Refill prompts are never in an earlier
batch of the round, so their screens need no stride.

Where it does not apply: `dapo_filter` (it generates full groups: it is the baseline screening is compared with)
and a `whole_pool` selector (`all`: its point is a full group for every active prompt, so every one is scored),
and with `screen_samples` 0 or >= G (nothing to screen). Then collect samples G per prompt at once, as before.
"""

from __future__ import annotations

import time
from dataclasses import replace

import polars as pl
import pyarrow as pa

from models.backend import Backend, Sampling
from storage.schemas import TABLES
from storage.store import Store, fault_point
from tasks.core.dapo import SCREENED_OUT, SURPLUS, ZERO_VARIANCE, dynamic_sampling, has_variance
from tasks.core.fewshot import fewshot_messages
from tasks.core.passrate import p_informative, pass_counts, posterior, predicted_pass_rate
from tasks.core.rewards import RewardConfig
from tasks.core.screening import MIXED, POSTERIOR, SCREENED, refill_order, screen_decisions
from tasks.reporting.progress import sig4
from tasks.sampling.dynamic import Group, in_order, landed
from tasks.sampling.rollouts import RolloutConfig, Sampled, round_prompts
from tasks.sampling.verified import generate_verified
from tasks.select import SelectConfig
from tasks.selectors import selector
from tasks.selectors.base import RoundView
from tasks.selectors.thompson import PRIOR_STRENGTH, bins_of, run_history
from tasks.stage import RoundContext

SCREEN_OVERSAMPLE = 2.0  # a refill screens ceil(this * the groups still missing) candidates
TOPUP_SEED_STRIDE = 1_000_000_007  # top-ups sample with row seeds of round seed + this: fresh, and no round's seed
NOT_NEEDED = "not_needed"  # a top-up-worthy screen left unfinished: the batch already had its groups


def screening_applies(cfg: RolloutConfig, selector_name: str) -> bool:
    """Whether this round screens (see the module docstring for where it does not)."""
    return screening_applies_to(cfg.screen_samples, cfg.group_size, selector_name)


def screening_applies_to(screen_samples: int, group_size: int, selector_name: str) -> bool:
    """`screening_applies` on the fields alone (a stored config's, tasks/reporting/page.py)."""
    chosen = selector(selector_name)
    return 0 < screen_samples < group_size and not chosen.generates and not chosen.whole_pool


def summed(*counts: pl.DataFrame) -> pl.DataFrame:
    return pl.concat(counts).group_by("prompt_id").agg(pl.col("successes", "failures").sum())


def screened_round(store: Store, ctx: RoundContext, first: pl.DataFrame, backend: Backend,
                   demos: pl.DataFrame | None, cfg: RolloutConfig, reward_cfg: RewardConfig,
                   select_cfg: SelectConfig, sampling: Sampling) -> tuple[Sampled, dict, dict[str, pa.Table]]:
    """(the kept groups, the summary, the extra tables to land with the rollouts) of a screened round."""
    g, ks = cfg.group_size, cfg.screen_samples
    pool = round_prompts(store, ctx.run_id, ctx.round, False, cfg.include_reserve, select_cfg.strata)
    chosen = first["prompt_id"].to_list()
    candidates = pl.concat([first, pool.filter(~pl.col("prompt_id").is_in(chosen))]).sort("prompt_id")
    history, _ = run_history(RoundView(ctx, store, 0))  # the run's groups before this round, as pass counts
    bins = bins_of(store, set(candidates["prompt_id"].to_list()) | set(history["prompt_id"].to_list()))
    taken = set(chosen)
    rest = [i for i in candidates["prompt_id"].to_list() if i not in taken]
    kind = select_cfg.pass_rate_prior
    prior = posterior(bins, history, PRIOR_STRENGTH, kind)  # before the round generated anything: refills, predictions
    before = in_order(prior, rest)
    strata = in_order(bins, rest)["bin"].to_list() if cfg.screen_refill == "stratified" else None
    queue = chosen + refill_order(rest, before["alpha"].to_numpy(), before["beta"].to_numpy(), select_cfg.seed,
                                  ctx.round, g, strata)
    screens: list[pl.DataFrame] = []  # this round's screens so far, as pass counts
    screened: list[str] = []  # every prompt screened, in order
    allowance = [cfg.screen_posterior_topups]  # posterior top-ups left this round (the governor may hold it at 1)
    kept = [0]  # topped-up groups with varied rewards so far (the loop keeps them, up to B)
    batch = len(chosen)
    top_sampling = replace(sampling, seed=sampling.seed + TOPUP_SEED_STRIDE)

    def hook(k: int) -> None:
        fault_point("collect:mid")  # test hook: a fault test kills the process here, mid-collection

    def generate(ids: list[str], k: int) -> list[Group]:
        t0 = time.perf_counter()
        rows = in_order(candidates, ids)
        screened.extend(ids)
        messages, augmentation = fewshot_messages(
            rows, demos if demos is not None else pl.DataFrame(), cfg.seed, ctx.round, ctx.rounds, cfg.fewshot_p0,
            cfg.fewshot_k, cfg.instruction, spent=ctx.tokens_spent, budget=ctx.token_budget)
        label = f"round {ctx.round}: screening" + (f" (refill {k})" if k else "")
        screen = generate_verified(backend, rows, messages, ks, sampling, reward_cfg, "screen", label, hook)
        rendered, first_draws, first_checked = screen.rendered, screen.groups, screen.checked
        screens.append(pass_counts(pl.DataFrame({
            "prompt_id": [i for i, vs in zip(ids, first_checked) for _ in vs],
            "reward": [v.reward for vs in first_checked for v in vs],
            "correct": [v.correct for vs in first_checked for v in vs],
            "augmentation": [a for a, vs in zip(augmentation, first_checked) for _ in vs]},
            schema={"prompt_id": pl.String, "reward": pl.Float64, "correct": pl.Boolean, "augmentation": pl.String})))
        post = in_order(posterior(bins, summed(history, *screens), PRIOR_STRENGTH, kind), ids)
        decisions = screen_decisions([has_variance([v.reward for v in vs]) for vs in first_checked],
                                     [all(v.correct for v in vs) for vs in first_checked],
                                     post["alpha"].to_numpy(), post["beta"].to_numpy(), g - ks,
                                     cfg.screen_topup_threshold)
        # every mixed screen is topped up, past B if need be: its 2 samples are paid and G - k_s more make an
        # informative group for sure, the cheapest there is (leaving it `surplus` threw both away)
        up = [i for i, d in enumerate(decisions) if d.topup and d.why == MIXED]
        room = max(batch - kept[0] - len(up), 0)
        for i in (i for i, d in enumerate(decisions) if d.topup and d.why == POSTERIOR):  # in queue order
            if room == 0:
                break  # the rest stay top-up-worthy: `surplus`
            if allowance[0] <= 0:  # only while the round's allowance lasts; else screened out
                decisions[i] = replace(decisions[i], why=SCREENED)
                continue
            allowance[0] -= 1
            up.append(i)
            room -= 1
        up.sort()
        top_ids = [ids[i] for i in up]
        tops, top_checked = [], []
        if up:
            top = generate_verified(backend, in_order(rows, top_ids), [messages[i] for i in up], g - ks,
                                    top_sampling, reward_cfg, "rollout",
                                    f"round {ctx.round}: top-up" + (f" (refill {k})" if k else ""), hook)
            tops, top_checked = top.groups, top.checked
        extra = {i: (c, v) for i, c, v in zip(up, tops, top_checked)}
        out = []
        for i, d in enumerate(decisions):
            more, more_checked = extra.get(i, ([], []))
            status = d.why if i in extra else (NOT_NEEDED if d.topup else SCREENED)
            screen_tokens = sum(c.n_tokens for c in first_draws[i])
            out.append(Group(messages[i], augmentation[i], rendered[i], first_draws[i] + more,
                             first_checked[i] + more_checked, 0.0, screen_tokens + sum(c.n_tokens for c in more),
                             status, screen_tokens))
        kept[0] += sum(has_variance(out[i].rewards) for i in up)
        if out:
            out[0].seconds = time.perf_counter() - t0  # a batch's seconds ride on its first group
        return out

    def verdict(group: Group) -> str | None:
        return {SCREENED: SCREENED_OUT, NOT_NEEDED: SURPLUS}.get(group.status)

    out = dynamic_sampling(queue, batch, SCREEN_OVERSAMPLE, cfg.screen_max_batches, generate,
                           rewards=lambda grp: grp.rewards, first_size=batch, verdict=verdict, overflow=True)
    got, table, extra = landed(ctx, candidates, out, select_cfg.selector,
                               lambda b: f"{select_cfg.selector}: screening refill, generation batch {b + 1}")
    extra["predictions"] = predictions_table(ctx, in_order(prior, screened), g)
    drawn = [d.group for d in out.kept + out.discarded]
    screen_tokens = sum(grp.screen_tokens for grp in drawn)
    reasons = [d.reason for d in out.discarded]
    summary = {"batch_size": batch, "screen_samples": ks, "threshold": cfg.screen_topup_threshold,
               "generation_batches": out.batches, "screened": out.generated,
               "topped_up_mixed": sum(grp.status == MIXED for grp in drawn),
               "topped_up_posterior": sum(grp.status == POSTERIOR for grp in drawn),
               "screened_out": reasons.count(SCREENED_OUT), "zero_variance": reasons.count(ZERO_VARIANCE),
               "surplus": reasons.count(SURPLUS), "kept": len(out.kept),
               "screen_tokens": screen_tokens, "topup_tokens": sum(grp.n_tokens for grp in drawn) - screen_tokens,
               "discarded_rollouts": table.num_rows, "discarded_tokens": int(sum(table["n_tokens"].to_pylist())),
               "informative_ratio": sig4(len(out.kept) / max(out.generated, 1)),
               "short": out.short, "cap_hit": out.cap_hit, "exhausted": out.exhausted,
               "max_batches": cfg.screen_max_batches}
    return got, summary, extra


def predictions_table(ctx: RoundContext, prior: pl.DataFrame, group_size: int) -> pa.Table:
    """`predictions` rows (selector `screening`) of the prompts of `prior` (prompt_id, bin, alpha, beta: the
    posterior before the round generated anything)."""
    alpha, beta = prior["alpha"].to_numpy(), prior["beta"].to_numpy()
    n = prior.height
    return pa.Table.from_pydict({
        "run_id": [ctx.run_id] * n, "round": [ctx.round] * n, "prompt_id": prior["prompt_id"].to_list(),
        "selector": ["screening"] * n, "bin": prior["bin"].to_list(), "alpha": alpha, "beta": beta,
        "predicted_pass_rate": predicted_pass_rate(alpha, beta),
        "predicted_informative": p_informative(alpha, beta, group_size), "draw": [None] * n, "picked": [True] * n,
    }, schema=TABLES["predictions"])
