"""What a resumed run may change, and what it keeps: the curriculum flow and the sampler both resume by these.

A run's stored config (its latest `runs` row) is read through today's RunConfig, so a field added since takes
its default (or what the section's `absent_means` says the old run ran with) instead of reading as a change.
`check_resume` refuses a changed field that decides landed data, naming it, and returns the line a resume
records for the fields it may change (_RESUMABLE). `keep_stored` keeps the run's stored value wherever a config
holds today's default: a changed default (a new strategy in the default list) never blocks a resume.
"""

from __future__ import annotations

from flows.config import RunConfig, stored_base

# Fields (dotted paths) a resumed run may change: none changes what already landed or makes it wrong. The
# teacher and how it is reached (timeouts, retries, concurrency) only decide how later stages ask it, and
# teacher answers are keyed by the teacher's name, so a new teacher never reuses the old one's answers;
# model.batch_size and kv_cache_gib only decide how many sequences decode together, and train.shared_prefix,
# micro_batch, micro_tokens, lean_activations and grads_in_place only how the same loss is computed and split
# into passes (equal to float tolerance). A change is recorded on the resumed row.
_RESUMABLE = {"rounds", "max_generated_tokens", "run_id", "store", "model.batch_size", "model.kv_cache_gib",
              "teacher.model", "teacher.timeout_s", "teacher.retries", "teacher.backoff_s", "teacher.concurrency",
              "train.shared_prefix", "train.micro_batch", "train.micro_tokens", "train.lean_activations",
              "train.grads_in_place",
              # where generation runs does not change the rows (keyed sampling, models/sharded.py)
              "scale.rollout_workers", "scale.ray_address", "scale.cpus_per_worker", "scale.gpus_per_worker",
              # the governor decides each round before it generates, from rounds that landed: its landed
              # decisions stay, and a run it started without (an older one) may take it up
              "governor.enabled", "governor.patience"}
_UNRECORDED = {"run_id", "store"}  # where the run lives, not how it runs


def _leaves(tree: dict, prefix: str = "") -> dict:
    """A config tree as {dotted path: value}; lists (pool.sources, strategies) are single values."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def stored_fields(previous: dict) -> dict:
    """The stored config as a tree read through RunConfig when it still validates, so a field added since the
    run started takes its default (or its section's `absent_means`) instead of reading as a change; one that no
    longer validates is returned as stored. Fields this version no longer has are dropped."""
    base, _ = stored_base(previous)
    try:
        return RunConfig.model_validate(base).model_dump(mode="json")
    except ValueError:  # pydantic's ValidationError is a ValueError
        return base


def _before(previous: dict) -> tuple[dict, list[str]]:
    """The stored config as leaves to compare with, and the fields it holds that this version no longer has."""
    return _leaves(stored_fields(previous)), stored_base(previous)[1]


def check_resume(config: RunConfig, previous: dict) -> str | None:
    """Refuse resuming with a changed field that decides landed data (naming it); for changed fields in
    _RESUMABLE, and stored fields this version no longer has (dropped: nothing can honour them), return the
    line recorded on the resumed row ("resumed with changed teacher.model: a -> b")."""
    before, gone = _before(previous)
    now = _leaves(config.model_dump(mode="json"))
    changed = sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
    refused = [k for k in changed if k not in _RESUMABLE]
    if refused:
        raise ValueError(f"run {config.run_id} already exists with a different config (differs in: "
                         f"{', '.join(refused)}); resume it with the same config, or choose a new --run-id")
    noted = [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed if k not in _UNRECORDED]
    parts = ([f"with changed {'; '.join(noted)}"] if noted else []) + \
        ([f"without {', '.join(gone)} (no longer a config field)"] if gone else [])
    return f"resumed {', and '.join(parts)}" if parts else None


def keep_stored(config: RunConfig, previous: dict) -> RunConfig:
    """`config` with the run's stored value wherever it holds today's default and the run stored another value
    in a field that decides landed data: a changed default never blocks a resume. The CLI already resumes from
    the stored config (flows/config.py `load_config(stored=...)`), and refuses a field the user gives with
    another value; this is for runs started from the UI form or a deployment, which pass every field, so a
    value equal to the default cannot be told from one left alone."""
    before, _ = _before(previous)
    now = _leaves(config.model_dump(mode="json"))
    defaults = _leaves(RunConfig().model_dump(mode="json"))
    keep = {k: before[k] for k in now.keys() & before.keys()
            if k not in _RESUMABLE and now[k] != before[k] and now[k] == defaults.get(k)}
    if not keep:
        return config
    tree = config.model_dump(mode="json")
    for path, value in keep.items():
        *sections, leaf = path.split(".")
        node = tree
        for name in sections:
            node = node[name]
        node[leaf] = value
    try:
        return RunConfig.model_validate(tree)
    except ValueError:  # a stored value today's schema refuses: check_resume names the field
        return config
