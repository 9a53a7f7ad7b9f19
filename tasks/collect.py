"""Collect stage: G samples per pool prompt from the current policy, verified and stored as `rollouts`.

Each prompt is the question plus the configured instruction, rendered with the model's chat template,
optionally after few-shot demonstrations (tasks/core/fewshot.py, recorded in `augmentation`). All-fail groups
are then resampled under Lorem-Ipsum prefixes (tasks/core/lope.py), and correct resamples replace up to G - 1
failures, also recorded in `augmentation`.
By default the round screens, then tops up (tasks/sampling/screening.py, tasks/core/screening.py): each
selected prompt gets `screen_samples` samples first, and only a mixed screen, or a unanimous one the pass-rate
posterior still finds likely informative, is completed to G; the screened-out prompts' samples land in
`discarded_rollouts` and the tokens they freed go to refills from the round's further candidates, ordered by a
Thompson prediction. With `screen_samples = 0` (and for runs stored before it existed) every prompt gets its G
samples at once.
With a selector that `generates` (tasks/selectors/base.py; dapo_filter) the round over-samples instead (DAPO
dynamic sampling, tasks/core/dapo.py, driven by tasks/sampling/dynamic.py): groups are generated batch by batch
until B of them have reward variance; only those land as `rollouts`, every other group generated lands in
`discarded_rollouts`, and the refill prompts are added to `selections`.
The whole round lands as one atomic stage; a crash mid-collection leaves nothing, and the rerun collects
the round again with the same seed (so exactly one set of rollouts per prompt and round exists).
"""

from __future__ import annotations

import time

from models.sharded import load_generator
from storage.store import Store
from tasks.core.lope import Rescue, is_lope_replaced, lope_rescue
from tasks.core.rewards import RewardConfig, Verdict
from tasks.core.verdicts import verify_row
from tasks.reporting.progress import report_timeouts, sig4
from tasks.sampling.demonstrations import demonstrations
from tasks.sampling.dynamic import dynamic_round
from tasks.sampling.rollouts import RolloutConfig, rollout_table, round_prompts, sample
from tasks.sampling.screening import screened_round, screening_applies
from tasks.sampling.verified import config_sampling
from tasks.select import SelectConfig
from tasks.selectors import selector
from tasks.stage import RoundContext, stage


@stage("collect")
def collect_task(ctx: RoundContext, store: Store, cfg: RolloutConfig, reward_cfg: RewardConfig,
                 select_cfg: SelectConfig, use_selection: bool = False) -> dict:
    """Generate, verify and land the round's rollouts. Returns a small summary. Screening then top-up
    (tasks/sampling/screening.py), or with a selector that `generates` (dapo_filter) DAPO dynamic sampling
    (tasks/sampling/dynamic.py), decides which groups are the round's rollouts."""
    prompts = round_prompts(store, ctx.run_id, ctx.round, use_selection, cfg.include_reserve, select_cfg.strata)
    if prompts.height == 0:
        raise ValueError(f"run {ctx.run_id} round {ctx.round}: the pool has no prompt to collect for")
    backend = load_generator(ctx.model, ctx.scale)  # sharded over Ray workers if [scale] says so
    demos = demonstrations(store, ctx.run_id, ctx.round) if cfg.fewshot_k else None
    sampling = config_sampling(cfg, ctx.round)
    dapo, screening, landed_too = None, None, {}
    if selector(select_cfg.selector).generates:
        got, dapo, landed_too = dynamic_round(store, ctx, prompts, backend, demos, cfg, reward_cfg, select_cfg,
                                              sampling)
    elif use_selection and screening_applies(cfg, select_cfg.selector):
        got, screening, landed_too = screened_round(store, ctx, prompts, backend, demos, cfg, reward_cfg,
                                                    select_cfg, sampling)
    else:
        # n_tokens: the sampling pass's own tokens (LoPE reported apart)
        got = sample(backend, prompts, demos, ctx, cfg, reward_cfg, sampling, f"round {ctx.round}: rollouts")
    prompts, groups, checked = got.prompts, got.groups, got.checked
    timeouts = got.timeouts
    augs = [[a] * len(g) for a, g in zip(got.augmentation, groups)]
    rescue = Rescue()
    if cfg.lope_prefixes and cfg.lope_samples:
        rows = prompts.to_dicts()
        seen: dict[tuple[int, str], Verdict] = {}  # each resample's verdict, reused for the ones that replace

        def verify_one(i: int, text: str) -> tuple[float, bool]:
            v = seen[(i, text)] = verify_row(rows[i], text, reward_cfg)
            return v.reward, v.correct

        correct = [[v.correct for v in vs] for vs in checked]
        t1 = time.perf_counter()
        rescue = lope_rescue(backend, got.messages, correct, groups, augs, sampling, verify_one,
                             cfg.lope_prefixes, cfg.lope_samples, cfg.lope_max_groups,
                             own_rewards=[[v.reward for v in vs] for vs in checked],  # scoring reads these
                             keys=prompts["prompt_id"].to_list())
        rescue.seconds = time.perf_counter() - t1
        for i, group in enumerate(groups):  # the replaced slots take their resample's verdict
            for j, c in enumerate(group):
                if (i, c.text) in seen and is_lope_replaced(augs[i][j]):
                    checked[i][j] = seen[(i, c.text)]
        timeouts += sum(v.timed_out for v in seen.values())
    table = rollout_table(prompts, groups, got.rendered, augs, checked, ctx.run_id, ctx.round, ctx.policy_version)
    store.commit("collect", {"rollouts": table, **landed_too}, run_id=ctx.run_id, round=ctx.round)
    report_timeouts("collect", ctx.round, timeouts)
    return {"prompts": prompts.height, "rollouts": table.num_rows,
            "tokens": got.n_tokens, "seconds": sig4(got.seconds),
            "tokens_per_s": sig4(got.n_tokens / max(got.seconds, 1e-9)),
            "pass_rate": sig4(sum(table["correct"].to_pylist()) / max(table.num_rows, 1)),
            "verify_timeouts": timeouts,
            "lope": {"groups": rescue.groups, "rescued": rescue.rescued, "replaced": rescue.replaced,
                     "resamples": rescue.resamples, "seconds": sig4(rescue.seconds)},
            **({"dapo": dapo} if dapo is not None else {}),
            **({"screening": screening} if screening is not None else {})}
