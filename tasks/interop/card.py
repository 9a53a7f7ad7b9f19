"""A Hugging Face dataset card for every `refinery export`: Markdown with YAML front matter.

The front matter follows the Hub's dataset card metadata (https://huggingface.co/docs/hub/datasets-cards):
- `license`: `--license` (default `other`: the card says that the user sets it, since the prompts' own terms
  come from the sources the run ingested, which Refinery does not know);
- `tags`: `refinery`, `curriculum` and the export format;
- `configs`: one config per exported table with its `data_files` (split and path, relative to the card);
- `dataset_info`: `features` read from the written Arrow schema (string, int32/int64, float64, bool; a struct
  as `struct:`, a list of structs as `list:` of its fields, a list of scalars as `list: <dtype>`), and
  `splits` with their example counts;
- `refinery`: the run's provenance: run id, format, round, row counts, the commit and dirty flag of the code
  that last wrote the run's `runs` row (storage/provenance.py; null for a run stored before they were
  recorded) and a config digest (SHA-256 of the run's stored config as canonical JSON: sorted keys, no spaces).
The body repeats the provenance in prose, so a reader of the Hub page sees where the data came from.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import yaml

from storage.runs import run_rows
from storage.store import Store

LICENSE_NOTE = ("The license field is `{license}`{default}: set it (`refinery export --license ID`) to the terms "
                "of the prompt sources this run ingested before publishing the dataset.")


def dtype(t: pa.DataType) -> object:
    """The card's feature type of an Arrow type (datasets' YAML form)."""
    if pa.types.is_struct(t):
        return {"struct": [feature(t.field(i).name, t.field(i).type) for i in range(t.num_fields)]}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        inner = t.value_type
        if pa.types.is_struct(inner):
            return {"list": [feature(inner.field(i).name, inner.field(i).type) for i in range(inner.num_fields)]}
        return {"list": dtype(inner)}
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_floating(t):
        return f"float{t.bit_width}"
    if pa.types.is_integer(t):
        return str(t)  # int8 ... uint64, as datasets names them
    return str(t)


def feature(name: str, t: pa.DataType) -> dict:
    kind = dtype(t)
    return {"name": name, **(kind if isinstance(kind, dict) else {"dtype": kind})}


def features(schema: pa.Schema) -> list[dict]:
    """`dataset_info.features` of a table schema."""
    return [feature(f.name, f.type) for f in schema]


def provenance(store: Store, run_id: str, config: dict) -> dict:
    """The run's commit and dirty flag (its latest `runs` row) and its config digest: of the config as that row
    records it (`config` only where there is no row), so a moved store's card keeps its digest."""
    rows = run_rows(store, run_id)
    last = rows.row(-1, named=True) if rows.height else {}
    recorded = json.loads(last["config"]) if last.get("config") else config
    canonical = json.dumps(recorded, sort_keys=True, separators=(",", ":"), default=str)
    return {"commit": last.get("commit"), "dirty": last.get("dirty"),
            "config_digest": "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()}


def card(tables: dict[str, tuple[str, str, pa.Schema, int]], info: dict, license: str, fmt: str,
         summary: str) -> str:
    """The card's text. `tables`: config name -> (split, data path relative to the card, schema, rows);
    `info`: the provenance fields (run_id, format, round, counts, commit, dirty, config_digest); `summary`: the
    body's first sentence (what was exported)."""
    first = next(iter(tables.values()))
    meta = {
        "license": license,
        "tags": ["refinery", "curriculum", fmt],
        "configs": [{"config_name": name, "data_files": [{"split": split, "path": path}],
                     **({"default": True} if len(tables) > 1 and i == 0 else {})}
                    for i, (name, (split, path, _, _)) in enumerate(tables.items())],
        "dataset_info": ([{"config_name": name, "features": features(schema),
                           "splits": [{"name": split, "num_examples": rows}]}
                          for name, (split, _, schema, rows) in tables.items()] if len(tables) > 1 else
                         {"features": features(first[2]), "splits": [{"name": first[0], "num_examples": first[3]}]}),
        "refinery": info,
    }
    dirty = {True: "with uncommitted changes", False: "clean", None: "dirtiness unknown"}[info.get("dirty")]
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=1000).rstrip(), "---", "",
        f"# Refinery export of run `{info['run_id']}` ({fmt})", "",
        f"{summary}: " + ", ".join(f"{name} = {rows} rows ({path})" for name, (_, path, _, rows) in tables.items()) + ".", "",
        "## Provenance", "",
        f"- code: commit `{info.get('commit') or 'unknown'}` ({dirty}), the code that last wrote the run",
        f"- config digest: `{info['config_digest']}` (SHA-256 of the run's stored config, canonical JSON)",
        *(f"- {k}: {v}" for k, v in info.items() if k not in ("run_id", "format", "commit", "dirty", "config_digest")),
        "", "## License", "",
        LICENSE_NOTE.format(license=license, default=" (the default)" if license == "other" else ""), "",
    ]
    return "\n".join(lines)
