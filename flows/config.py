"""The one config tree of a curriculum run: a pydantic model with a section per stage.

Bounds live in the schema (`Field(ge=...)`, `Literal`) so the Prefect UI renders them in its parameter form
and rejects bad values before a run starts. Every default is a field here; none is a hidden constant.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(Section):
    """One prompt source of the run's pool."""

    source: str = Field(description="`rg:<reasoning-gym task>`, or a .jsonl/.parquet path")
    size: int = Field(100, ge=1, le=1_000_000, description="rg: how many prompts to generate")
    params: dict[str, Any] = Field(default_factory=dict, description="rg: difficulty fields")


# The embedded-model demo's pool: problems SmolLM2-135M solves about a third of the time, so most groups
# are mixed, plus a few at harder settings so that the too_hard bucket is not empty.
DEFAULT_SOURCES = [
    SourceSpec(source="rg:products", size=20, params={"max_digits": 1}),
    SourceSpec(source="rg:basic_arithmetic", size=20, params={
        "min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
        "allow_parentheses": False, "allow_negation": False}),
    SourceSpec(source="rg:chain_sum", size=16, params={"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    SourceSpec(source="rg:products", size=4, params={"min_digits": 2, "max_digits": 2}),
    SourceSpec(source="rg:chain_sum", size=4, params={"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 2}),
]


class PoolConfig(Section):
    sources: list[SourceSpec] = Field(default_factory=lambda: [s.model_copy() for s in DEFAULT_SOURCES],
                                      description="where the run's prompts come from (at least one)",
                                      json_schema_extra={"minItems": 1})
    seed: int = Field(0, ge=0, description="generator seed for rg: sources")

    @field_validator("sources")
    @classmethod
    def _some_source(cls, v: list[SourceSpec]) -> list[SourceSpec]:
        if not v:
            raise ValueError("is empty: a run needs at least one source (rg:<task> or a .jsonl/.parquet file)")
        return v


class ModelConfig(Section):
    policy: str = Field("default", description="'default' (embedded SmolLM2-135M-Instruct), 'tiny-random', "
                        "a local checkpoint folder, or a Hugging Face id")
    backend: Literal["transformers", "vllm", "scripted"] = Field(
        "transformers", description="vllm needs the gpu extra; scripted is a deterministic test policy that "
        "solves each prompt at a fixed rate, with the policy model's real token log-probs (models/scripted.py)")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?|mps)$", description="cpu, cuda, cuda:N or mps")
    dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto = bf16 where the device has it natively")
    batch_size: int = Field(64, ge=1, le=4096, description="sequences decoded together")

    @field_validator("policy")
    @classmethod
    def _policy_exists(cls, v: str) -> str:
        p = Path(v).expanduser()
        if v.startswith((".", "/", "~")) and not p.exists():
            raise ValueError(f"model path {v!r} does not exist")
        return v


class RolloutConfig(Section):
    group_size: int = Field(8, ge=2, le=256, description="G: samples per prompt")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="sampling temperature of rollouts (0: greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the smallest token set with "
                         "this much probability (1: off)")
    max_new_tokens: int = Field(64, ge=1, le=8192, description="longest completion, in tokens")
    seed: int = Field(0, ge=0, description="sampling seed; round r uses seed * 1000 + r")
    instruction: str = Field("Put your final answer within \\boxed{}.",
                             description="appended to every question before the chat template")
    fewshot_p0: float = Field(0.5, ge=0.0, le=1.0, description="CBRL: p_t = p0 * (1 - t/T) of few-shot context")
    fewshot_k: int = Field(2, ge=0, le=16, description="CBRL: solved sibling demonstrations per prompt (0: off)")
    lope_prefixes: int = Field(6, ge=0, le=64, description="LoPE: Lorem-Ipsum system prefixes per all-fail "
                               "group (0: off)")
    lope_samples: int = Field(4, ge=0, le=64, description="LoPE: resamples per prefix")
    lope_max_groups: int = Field(4, ge=0, le=1_000_000, description="LoPE: all-fail groups resampled per round")
    include_reserve: bool = Field(False, description="reserve prompts are candidates too (default: only the "
                                  "rescore flow re-probes them)")


class SelectConfig(Section):
    """Which prompts a round collects for (docs/algorithms.md §4). 'all' collects the whole pool."""

    selector: Literal["kmeans", "uniform", "dapo_filter", "all"] = Field(
        "kmeans", description="kmeans: EPS-weighted clusters of prompt embeddings; uniform: at random; "
        "dapo_filter: DAPO dynamic sampling (over-sample, drop groups with no reward variance, refill to B; the "
        "discards land in discarded_rollouts); all: the whole active pool")
    batch_size: int = Field(48, ge=1, le=10_000_000, description="B: prompts selected per round")
    k_max: int = Field(64, ge=1, le=4096, description="K = min(k_max, ceil(candidates / 8))")
    temperature: float = Field(0.1, gt=0.0, le=100.0, description="T_sel of the cluster-weight softmax")
    bonus: float = Field(0.1, ge=0.0, le=10.0, description="exploration bonus for never-scored prompts")
    embedder: Literal["minilm", "policy", "hashing"] = Field(
        "minilm", description="kmeans embeddings: minilm (packaged all-MiniLM-L6-v2), policy (the policy's "
        "mean hidden state) or hashing (hashed word n-grams, no model)")
    seed: int = Field(0, ge=0, description="round r uses seed * 1000 + r")
    dapo_oversample: float = Field(3.0, ge=1.0, le=100.0, description="dapo_filter: a generation batch draws "
                                   "ceil(this * the groups still missing) prompts, the first ceil(this * B) "
                                   "(DAPO's recipe: 3)")
    dapo_max_batches: int = Field(10, ge=1, le=1000, description="dapo_filter: generation batches per round at "
                                  "most, the first included; a batch still short then trains on fewer than B "
                                  "groups, and the round's summary says so")


class RefineConfig(Section):
    """Refinement of too-hard, flat and saturated prompts into children (docs/algorithms.md §3)."""

    strategies: list[Literal["ladder", "teacher_scaffold", "hint_prefix", "harden"]] = Field(
        default_factory=lambda: ["ladder", "teacher_scaffold", "hint_prefix", "harden"],
        description="enabled strategies; an empty list turns refinement off")
    max_children: int = Field(24, ge=0, le=100_000, description="refinements per round, all strategies")
    max_per_strategy: int = Field(8, ge=0, le=100_000, description="refinements per round and strategy")
    promote_threshold: float = Field(0.5, ge=0.0, le=1.0, description="ladder promotion when mean reward > this")
    hint_fraction: float = Field(0.3, gt=0.0, lt=1.0, description="f: share of the solution revealed; each "
                                 "promotion of a hint child lowers it by 0.1, down to the open question")
    teacher: str = Field("policy", description="'policy', `openai:<base url>#<model>`, or a model spec")
    teacher_max_new_tokens: int = Field(128, ge=8, le=4096, description="longest teacher answer, in tokens")
    teacher_distractors: bool = Field(True, description="ask the teacher for multiple-choice distractors "
                                      "(programmatic ones fill the rest)")
    teacher_timeout_s: float = Field(60.0, gt=0.0, le=3600.0, description="openai teacher: seconds to connect and "
                                     "to wait for each reply's bytes, per request; also caps a 429's Retry-After")
    teacher_retries: int = Field(3, ge=0, le=20, description="openai teacher: retries of a request after a "
                                 "connection error, timeout, 429 or 5xx; then that prompt falls back "
                                 "('teacher unavailable: ...' in refinements) and the round goes on")
    teacher_backoff_s: float = Field(1.0, ge=0.0, le=600.0, description="openai teacher: wait before the first "
                                     "retry, doubled for each next one (a 429's Retry-After replaces it)")
    teacher_concurrency: int = Field(4, ge=1, le=256, description="openai teacher: requests in flight at once")
    scaffolds_from_policy: bool = Field(False, description="with teacher = 'policy', let the policy write "
                                        "teacher_scaffold rewrites too (off: SmolLM2-135M wrote 0 valid ones in "
                                        "20; configure a stronger teacher instead); distractors are still asked")
    gate_min_similarity: float = Field(0.5, ge=-1.0, le=1.0, description="a rewrite's MiniLM cosine similarity "
                                       "to its parent is at least this, else 'off topic'")
    gate_min_word_share: float = Field(0.75, ge=0.0, le=1.0, description="share of a rewrite's words that are "
                                       "dictionary words, at least; else 'not language'")
    gate_min_function_share: float = Field(0.15, ge=0.0, le=1.0, description="share of English function words "
                                           "(the, of, is...) in a rewrite of 5+ words, at least; else 'not language'")
    gate_max_logprob_drop: float = Field(2.0, ge=0.0, le=100.0, description="a rewrite's mean token log-prob "
                                         "under the base policy (version 0) is at most this many nats below its "
                                         "parent's, else 'not language'")

    def scaffolds_run(self) -> bool:
        """Do teacher_scaffold rewrites run? They are on, and the teacher is not the policy unless
        scaffolds_from_policy is set (a small policy's rewrites of its own failures are noise)."""
        return "teacher_scaffold" in self.strategies and (self.teacher != "policy" or self.scaffolds_from_policy)


class ShapeConfig(Section):
    """MCMC on-policy shaping of off-policy traces (docs/algorithms.md §5)."""

    enabled: bool = Field(True, description="shape traces for prompts the policy cannot solve yet")
    variant: Literal["mh", "greedy"] = Field("mh", description="mh: Metropolis-Hastings acceptance; greedy: "
                                             "accept iff the mean log-prob under the policy rises")
    steps: int = Field(8, ge=0, le=1000, description="S: MCMC steps per trace")
    max_traces: int = Field(8, ge=0, le=1_000_000, description="traces shaped per round")
    max_new_tokens: int = Field(64, ge=1, le=8192, description="longest proposed suffix")
    teacher_traces: bool = Field(True, description="where a prompt has no reference solution, ask the teacher "
                                 "(refine.teacher) for one; only traces that verify are used")
    seed: int = Field(0, ge=0, description="MCMC proposal seed")


class TrainConfig(Section):
    """The GRPO round (docs/algorithms.md §6). Each round that trains writes a new policy version."""

    enabled: bool = Field(True, description="train a new policy version every round")
    mode: Literal["full", "lora"] = Field("full", description="full fine-tune, or LoRA adapters (merged on save)")
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="clip range below 1")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="clip range above 1 (clip-higher)")
    kl_coef: float = Field(0.01, ge=0.0, le=10.0, description="k3 KL to the starting model (0: off)")
    sft_weight: float = Field(0.1, ge=0.0, le=100.0, description="lambda_sft: NLL weight of shaped traces")
    scale_std: bool = Field(True, description="divide advantages by the group std (false: Dr.GRPO)")
    rows_per_step: int = Field(64, ge=1, le=1_000_000, description="sequences per optimizer step")
    micro_batch: int = Field(8, ge=1, le=4096, description="sequences per forward/backward (gradient "
                             "accumulation fills the step)")
    micro_tokens: int = Field(1024, ge=16, le=10_000_000, description="padded tokens per forward/backward at "
                              "most (bounds activation memory; a longer single sequence goes alone)")
    max_grad_norm: float = Field(1.0, gt=0.0, le=1e6, description="gradient clipping by global norm")
    lora_rank: int = Field(16, ge=1, le=1024, description="lora mode: rank of the adapters")
    lora_alpha: int = Field(32, ge=1, le=4096, description="lora mode: adapter scale (alpha / rank)")
    seed: int = Field(0, ge=0, description="round r uses seed * 1000 + r (torch seed, "
                      "micro-batch order)")


class EvalConfig(Section):
    """Held-out evaluation of every checkpoint."""

    enabled: bool = Field(True, description="score every new checkpoint on the held-out prompts")
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of the round-0 pool's root "
                                    "prompts held out; never selected, refined or trained on")
    n_samples: int = Field(4, ge=1, le=1024, description="samples per held-out prompt")
    k: int = Field(4, ge=1, le=1024, description="pass@k (k <= n_samples)")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="sampling temperature of the evaluation")
    seed: int = Field(0, ge=0, description="evaluation sampling seed; also picks the held-out prompts")


class RewardConfig(Section):
    verifier: Literal["auto", "rg", "math", "exact"] = Field("auto", description="auto: rg for rg: sources, else math")
    strict: bool = Field(False, description="only \\boxed{} or `<answer>` tags count as an answer")
    format_weight: float = Field(0.0, ge=0.0, le=1.0, description="weight of the format reward")


class UtilityConfig(Section):
    beta: float = Field(0.5, gt=0.0, le=100.0, description="EPS temperature: small favours hard-but-solvable")
    tau: float = Field(0.0, ge=0.0, le=1.0, description="EPS threshold for 'informative' and reactivation")
    eps: float = Field(1e-6, gt=0.0, le=0.1, description="tolerance for constant groups")


class RunConfig(Section):
    """A curriculum run. Rerunning the same run_id resumes at the first stage that has not landed."""

    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
                               description="default: `run-<UTC timestamp>`")
    rounds: int = Field(2, ge=1, le=10_000, description="rounds of pool -> select -> collect -> score -> "
                        "refine -> shape -> train -> evaluate; a resumed run may raise it to extend the run")
    store: str | None = Field(None, description="store root; default $REFINERY_STORE or ./refinery-store")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="the prompt sources of round 0")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model and where it runs")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="sampling of the G rollouts per "
                                   "prompt, few-shot context and LoPE rescue")
    select: SelectConfig = Field(default_factory=SelectConfig, description="which prompts each round collects for")
    refine: RefineConfig = Field(default_factory=RefineConfig, description="children of too-hard, flat and "
                                 "saturated prompts, behind the validity gate")
    shape: ShapeConfig = Field(default_factory=ShapeConfig, description="MCMC shaping of off-policy traces")
    train: TrainConfig = Field(default_factory=TrainConfig, description="the GRPO update of each round")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out pass@1 / pass@k of each checkpoint")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="how answers are verified and scored")
    utility: UtilityConfig = Field(default_factory=UtilityConfig, description="EPS, the prompt utility that "
                                   "buckets and weights prompts")

    @model_validator(mode="after")
    def _k_within_samples(self) -> RunConfig:
        if self.eval.k > self.eval.n_samples:
            raise ValueError(f"eval.k ({self.eval.k}) must be <= eval.n_samples ({self.eval.n_samples})")
        return self


def _set(tree: dict, dotted: str, raw: str) -> None:
    import json

    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {k!r} is not a section")
    try:
        node[keys[-1]] = json.loads(raw)
    except json.JSONDecodeError:
        node[keys[-1]] = raw


def new_run_id() -> str:
    from datetime import UTC, datetime

    return "run-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")


def placed(config: RunConfig) -> RunConfig:
    """`config` with its run id (a new one if unset) and store (the default root if unset) filled in: the
    config the curriculum flow runs. The CLI validates this one, so the flow's own check of the same config
    is a memo hit (flows/preflight.py) and the sources and the Hub are not consulted twice."""
    if config.run_id and config.store:
        return config
    from storage.store import default_root

    return config.model_copy(update={"run_id": config.run_id or new_run_id(), "store": config.store or default_root()})


def load_config(path: str | None = None, sets: list[str] = (), **overrides: Any) -> RunConfig:
    """A RunConfig from an optional TOML file, `section.key=value` overrides and keyword overrides.
    Raises ValueError naming each bad field."""
    tree: dict = {}
    if path:
        file = Path(path).expanduser()
        if file.is_dir():
            raise ValueError(f"config file {path!r} is a folder, not a TOML file")
        try:
            tree = tomllib.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"config file {path!r} does not exist") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {path!r} is not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise ValueError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path!r}: {e}") from None
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        _set(tree, *item.split("=", 1))
    tree.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ValueError(f"invalid config: {validation_problems(e)}") from None


def field_path(loc: tuple) -> str:
    """A pydantic error location as the config's own notation: ('pool', 'sources', 0, 'size') ->
    'pool.sources[0].size'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_problems(e: ValidationError) -> str:
    """Every error of `e` on one line, each naming its field."""
    return "; ".join((f"{field_path(err['loc'])}: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
                     for err in e.errors())
