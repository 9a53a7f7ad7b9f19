"""The one config tree of a curriculum run: `RunConfig` composes the sections, each defined beside the code that
uses it (models/config.py, tasks/*.py), plus the TOML loader, `--set` overrides and the checks across sections.

Bounds live in the schema (`Field(ge=...)`, `Literal`) so the Prefect UI renders them in its parameter form
and rejects bad values before a run starts. Every default is a field; none is a hidden constant, and every
field has a description (tests/test_config.py), which the UI form shows.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from models.config import ModelConfig, Section
from models.sharded import ScaleConfig
from tasks.core.governor import GovernorConfig
from tasks.core.grpo import TrainConfig
from tasks.core.heldout import stratum_name
from tasks.core.rewards import RewardConfig
from tasks.evaluate import EvalConfig
from tasks.pool import DEFAULT_SOURCES, PoolConfig, SourceSpec  # noqa: F401 (names users import from here)
from tasks.refine import RefineConfig
from tasks.sampling.rollouts import RolloutConfig
from tasks.score import UtilityConfig
from tasks.select import SelectConfig
from tasks.shape import ShapeConfig
from tasks.strategies.teacher_calls import TeacherConfig

RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"  # a run id names folders: no separators, no leading dot


class RunConfig(Section):
    """A curriculum run. Rerunning the same run_id resumes at the first stage that has not landed."""

    run_id: str | None = Field(None, pattern=RUN_ID,
                               description="default: `run-<UTC timestamp>`")
    rounds: int = Field(2, ge=1, le=10_000, description="rounds of pool -> select -> collect -> score -> "
                        "refine -> shape -> train -> evaluate; a resumed run may raise it to extend the run")
    store: str | None = Field(None, description="store root; default $REFINERY_STORE or ./refinery-store")
    max_generated_tokens: int | None = Field(None, ge=1, description="token budget: no round starts once the "
                                             "run's generated tokens (rollouts, discarded ones, LoPE, teacher "
                                             "answers, MCMC proposals; evaluation not counted) reach this, and "
                                             "the round that would cross it selects only the prompts that fit "
                                             "(tasks/core/budget.py); `rounds` stays the upper bound")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="the prompt sources of round 0")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model and where it runs")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="sampling of the G rollouts per "
                                   "prompt, few-shot context and LoPE rescue")
    select: SelectConfig = Field(default_factory=SelectConfig, description="which prompts each round collects for")
    refine: RefineConfig = Field(default_factory=RefineConfig, description="children of too-hard, flat and "
                                 "saturated prompts, behind the validity gate")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="the teacher refine and shape ask, "
                                   "and how it is reached")
    shape: ShapeConfig = Field(default_factory=ShapeConfig, description="MCMC shaping of off-policy traces")
    train: TrainConfig = Field(default_factory=TrainConfig, description="the GRPO update of each round")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out pass@1 / pass@k of each checkpoint")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="how answers are verified and scored")
    governor: GovernorConfig = Field(default_factory=GovernorConfig, description="the budget governor: LoPE, "
                                     "shaping and refinement earn their generated tokens round by round")
    utility: UtilityConfig = Field(default_factory=UtilityConfig, description="EPS, the prompt utility that "
                                   "buckets and weights prompts")
    scale: ScaleConfig = Field(default_factory=ScaleConfig, description="where collect, LoPE, evaluate and "
                               "rescore generate: this process, or sharded over Ray workers (same rows)")

    @model_validator(mode="after")
    def _gpu_workers_get_gpus(self) -> RunConfig:
        if self.scale.rollout_workers > 1 and self.model.device.startswith("cuda") and self.scale.gpus_per_worker == 0:
            raise ValueError(f"model.device is {self.model.device} but scale.gpus_per_worker is 0: Ray would hide "
                             "the GPUs from the rollout workers; set scale.gpus_per_worker (e.g. 1)")
        return self

    @model_validator(mode="after")
    def _strata_in_pool(self) -> RunConfig:
        known = [stratum_name(s.source, dict(s.params)) for s in self.pool.sources]
        if missing := [s for s in self.select.strata if s not in known]:
            raise ValueError(f"select.strata names {missing[0]!r}, no pool source entry (its strata: "
                             f"{', '.join(known)})")
        if self.select.strata and self.eval.heldout_split != "stratified":
            raise ValueError("select.strata needs eval.heldout_split = 'stratified', which records each prompt's "
                             "stratum")
        return self

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


def stored_base(stored: dict, model: type[Section] | None = None, prefix: str = "") -> tuple[dict, list[str]]:
    """A run's stored config as the base tree of its resume, and the dotted paths of the fields it holds that
    this version no longer has (dropped: the code cannot honour them; the resume records them). Fields added
    since are absent from it, so they take today's defaults, except where a section's `absent_means` says what
    a config stored without them ran with (eval.decoding: 'sampled')."""
    if model is None:
        model, stored = RunConfig, renamed(stored)
    tree, gone = {k: v for k, v in getattr(model, "absent_means", {}).items() if k not in stored}, []
    for key, value in stored.items():
        info = model.model_fields.get(key)
        if info is None:
            gone.append(f"{prefix}{key}")
            continue
        sub = info.annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, Section):
            tree[key], more = stored_base(value, sub, f"{prefix}{key}.")
            gone += more
        else:
            tree[key] = value
    return tree, gone


def renames() -> dict[str, str]:
    """{old dotted path: new dotted path} of every field moved since, from each section's `renamed_from`
    (refine.teacher -> teacher.model, ...)."""
    out = {}
    for name, info in RunConfig.model_fields.items():
        for field, old in getattr(info.annotation, "renamed_from", {}).items():
            out[old] = f"{name}.{field}"
    return out


def renamed(tree: dict) -> dict:
    """`tree` (a stored config, or a TOML file) with each moved field at its new path: a run started before a
    move resumes with its own values, and an old config file still reads. One tree holding both paths with
    different values is an error naming them. (`--set` keys are moved one by one: `load_config`.)"""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}  # sections copied, not mutated
    for old, new in renames().items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        target = out.setdefault(new_section, {})
        if not isinstance(target, dict):
            raise ValueError(f"{new_section}: expected a section (it holds {old})")
        if new_key in target and target[new_key] != value:
            raise ValueError(f"{old} ({value!r}) and {new} ({target[new_key]!r}) both given: {old} is now {new}; "
                             f"give {new} only")
        target.setdefault(new_key, value)
    return out


def resumed_config(store_uri: str, run_id: str | None) -> dict | None:
    """The stored config of run `run_id` when it exists in the store at `store_uri` (a resume takes it as its
    base: `load_config(stored=...)`), else None."""
    if not run_id:
        return None
    from storage.runs import stored_config
    from storage.store import Store

    return stored_config(Store(store_uri), run_id)


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (a list or a value replaces the stored one whole)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | None = None, sets: list[str] = (), stored: dict | None = None,
                **overrides: Any) -> RunConfig:
    """A RunConfig from an optional TOML file, `section.key=value` overrides and keyword overrides, over
    `stored` (a resumed run's stored config: what the user does not give keeps the run's own value, so a
    default changed since the run started never reads as a change; `stored_base`), else over the defaults.
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
        tree = renamed(tree)  # old keys (refine.teacher, ...) read as their new ones, silently
    moved = renames()
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        dotted, raw = item.split("=", 1)
        _set(tree, moved.get(dotted, dotted), raw)  # an old key sets its new one: a later --set still wins
    tree.update({k: v for k, v in overrides.items() if v is not None})
    if stored is not None:
        tree = _merge(stored_base(stored)[0], tree)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        where = f"run {tree.get('run_id')}'s stored config with the given changes" if stored is not None else "config"
        raise ValueError(f"invalid {where}: {validation_problems(e)}") from None


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
                     + _got(err) for err in e.errors())


def _got(err: dict) -> str:
    """`, got 'x'` for a rejected scalar (a misspelt choice is then visible in the line), else nothing."""
    value = err.get("input")
    if err["type"] in ("missing", "extra_forbidden") or not isinstance(value, str | int | float | bool):
        return ""
    shown = repr(value)
    return f", got {shown}" if len(shown) <= 60 and "got" not in err["msg"] else ""
