"""The arms of a comparison (flows/compare.py runs them; benchmarks/evidence.py makes the evidence pages of them).

An arm is a named list of config overrides (`section.key=value`, as `refinery run --set` takes them) on top
of the shared ones. The built-in arms:
- `uniform`: plain GRPO: uniform selection, no refinement, no shaping, no few-shot context, no LoPE;
- `dapo_filter`: the same, with DAPO's over-sampling and zero-variance filter (discarded rollouts counted);
- `eps`: the same, with EPS-weighted selection in one cluster (`select.k_max=1`); `eps_kmeans`: over k-means;
- `refinery`: the full pipeline, the defaults with shaping on; `no_refine`, `no_shape`, `no_fewshot`, `no_lope`:
  it, one part off (`no_lope` differs only where the shared config turns LoPE on, as benchmarks/evidence.toml does);
- `default`: the shipped defaults (issues 49, 50): the shared config with the fields the design pins away from
  their shipped values (pool, evaluation, arithmetic, budget aside) put back, today LoPE (tests/test_compare.py);
- `default_thompson`, `default_replay`, `default_stratified`, `default_worked`: the default plus one part built
  but off (Thompson selection; replay at a quarter of the rows; refills stratified by pass-rate bin; SFT on the
  worked solutions of the round's unsolved prompts, shaping with no MCMC step nor teacher): issue 50's candidates;
- `oracle_sums`: an oracle, not a curriculum: `uniform` drawing only the design's two-digit sums (`select.strata`).
"""

PLAIN = ["refine.strategies=[]", "shape.enabled=false", "rollout.fewshot_p0=0.0", "rollout.lope_prefixes=0",
         "rollout.screen_samples=0"]  # plain GRPO: G samples per prompt at once (screening is the default's)
TWO_DIGIT_SUMS = "rg:chain_sum{max_digits=2,max_terms=2,min_digits=2,min_terms=2}"  # benchmarks/evidence.toml's
SHAPE = "shape.enabled=true"  # off by default since issue 50's pilots; the full pipeline's arms turn it on
ARMS: dict[str, list[str]] = {
    "uniform": [*PLAIN, "select.selector=uniform"],
    "dapo_filter": [*PLAIN, "select.selector=dapo_filter"],
    "eps": [*PLAIN, "select.selector=kmeans", "select.k_max=1"],
    "eps_kmeans": [*PLAIN, "select.selector=kmeans"],
    "refinery": [SHAPE],
    "no_refine": [SHAPE, "refine.strategies=[]"],
    "no_shape": ["shape.enabled=false"],
    "no_fewshot": [SHAPE, "rollout.fewshot_p0=0.0"],
    "no_lope": [SHAPE, "rollout.lope_prefixes=0"],
    "default": ["rollout.lope_prefixes=0"],  # the shipped value of each non-design pin of benchmarks/evidence.toml
    "default_thompson": ["rollout.lope_prefixes=0", "select.selector=thompson"],
    "default_replay": ["rollout.lope_prefixes=0", "train.replay_share=0.25"],
    "default_stratified": ["rollout.lope_prefixes=0", "rollout.screen_refill=stratified"],
    "default_worked": ["rollout.lope_prefixes=0", SHAPE, "shape.steps=0", "shape.teacher_traces=false",
                       "shape.max_traces=16"],
    "oracle_sums": [*PLAIN, "select.selector=uniform", f'select.strata=["{TWO_DIGIT_SUMS}"]'],
}
SEEDED = ("rollout.seed", "select.seed", "shape.seed", "train.seed")
