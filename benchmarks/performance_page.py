"""docs/performance.md is built from data: the current figures of each benchmark per machine kind, as JSON files in
benchmarks/results/, rendered as one table per machine kind under a short hand-written introduction
(benchmarks/results/intro.md: the targets, the decisions, how to reproduce, where the history lives).

    python benchmarks/performance_page.py             # rewrite docs/performance.md from benchmarks/results/
    python benchmarks/performance_page.py --check     # exit 1, one line, if the page differs from what they build
    python benchmarks/performance_page.py --add FIGURES.json --machine-kind KIND --command "CMD" [--note TEXT]

A results file is one benchmark on one machine kind, `benchmarks/results/<benchmark>-<kind>.json`: `benchmark`,
`title`, `machine_kind`, `machine` (cpu, cores, avx512_bf16, amx, memory_gib, dtype, env), the `command` that
reproduces it (from the repository root), the `commit` it measured and the `date`, `runs`, the `baseline` it was
compared with, `figures` (flat keys, the names the benchmark's `--json` writes where it writes one), `headline`
(which figures the page shows: label, key, unit, and optionally baseline_key, min_key, max_key, over) and a one-line
`note`. Only the newest figure of a benchmark per kind is kept; earlier ones are in `git log -p` of the file.

`--add` turns a benchmark's `--json` output into a results file: the benchmark is the script the command names,
the commit is this checkout's HEAD, the date today (UTC), the machine is copied from the kind's other files, and the
title and headline from the file it replaces (or the same benchmark on another kind). Then the page is rewritten.

Targets (TARGETS) are checked from the figures, on the kinds marked targeted in KINDS only: CPUs with native bf16
and the fp32 path on them. The AVX2-only kinds are reported, not targeted (the 8-minute AVX2 demo is retired).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse
import json
import operator
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
INTRO = RESULTS / "intro.md"  # the page's hand-written introduction: targets, decisions, how to reproduce
REQUIRED = ("benchmark", "title", "machine_kind", "machine", "command", "commit", "date", "figures", "headline")
MACHINE_FIELDS = ("cpu", "cores", "avx512_bf16", "amx")

KINDS = {  # kind: (section title, targeted)
    "xeon-amx": ("Intel Xeon with AMX", True),
    "epyc-avx512bf16": ("AMD EPYC with AVX512_BF16, no AMX", True),
    "epyc-avx512bf16-fp32": ("The fp32 path: the AVX512_BF16 EPYC with `model.dtype = \"fp32\"`", True),
    "xeon-amx-avx2-proxy": ("AVX2 by proxy: the AMX Xeon in fp32 with its kernels capped at AVX2", False),
    "epyc-avx2": ("AMD EPYC, AVX2 only", False),
}
ORDER = ["round", "demo", "train", "rollout", "decode_step", "decode_attention", "shape", "kv_memory", "first_step",
         "decode_batch", "prefect_start", "command_start", "make-test"]


class Target(NamedTuple):
    benchmark: str
    key: str
    op: str
    value: float
    text: str
    unit: str = ""


OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}
TARGETS = [
    Target("round", "round_wall_ratio_vs_baseline", "<=", 0.40, "a default round's wall against 4425eb0's"),
    Target("demo", "demo_wall_s", "<", 480, "`make demo` (2 rounds) wall", "min"),
    Target("demo", "demo_peak_rss_gib", "<", 4.0, "`make demo` peak RSS", "GiB"),
    Target("train", "train_prefix_speedup", ">=", 2.5, "`train_prefix_speedup` (G = 8, few-shot prompts)"),
    Target("train", "train_ratio_vs_bare", "<=", 1.15, "a GRPO step against a bare forward/backward/AdamW"),
    Target("rollout", "rollout_ratio_vs_ceiling", ">=", 1.0, "the sampler against `generate`'s forced-length rate"),
    Target("rollout", "rollout_ratio_vs_naive", ">=", 1.5, "the sampler against naive fp32 `generate`"),
    Target("make-test", "make_test_s", "<", 480, "`make test` wall", "min"),
]



def fail(message: str) -> None:
    raise ValueError(message)


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def load(directory: Path = RESULTS) -> list[dict]:
    """Every results file, checked: the fields the page needs, a known kind, and headline keys among the figures."""
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            fail(f"{shown(path)}: not JSON ({e.msg}, line {e.lineno})")
        missing = [k for k in REQUIRED if not r.get(k)] + [f"machine.{k}" for k in MACHINE_FIELDS
                                                           if not isinstance(r.get("machine"), dict)
                                                           or k not in r["machine"]]
        if missing:
            fail(f"{shown(path)}: missing {', '.join(missing)}")
        if r["machine_kind"] not in KINDS:
            fail(f"{shown(path)}: machine_kind {r['machine_kind']!r} is not one of {', '.join(KINDS)}")
        if path.name != f"{r['benchmark']}-{r['machine_kind']}.json":
            fail(f"{shown(path)}: should be named {r['benchmark']}-{r['machine_kind']}.json")
        keys = {item.get(k) for item in r["headline"] for k in ("key", "baseline_key", "min_key", "max_key")}
        if unknown := sorted(k for k in keys - {None} if k not in r["figures"]):
            fail(f"{shown(path)}: headline names figures it does not hold: {', '.join(unknown)}")
        records.append(r)
    return records


def fmt(value, unit: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if unit == "min":
        minutes, seconds = divmod(value, 60)
        return f"{int(minutes)}:{seconds:02d}" if isinstance(value, int) else f"{int(minutes)}:{round(seconds, 2):05.2f}"
    text = f"{value:,}" if isinstance(value, int) and abs(value) >= 10_000 else str(value)
    return {"": text, "x": f"{text}x"}.get(unit, f"{text} {unit}")


def headline(r: dict) -> str:
    f, parts = r["figures"], []
    for item in r["headline"]:
        text = (item["label"] + " " if item["label"] else "") + fmt(f[item["key"]], item["unit"])
        if "baseline_key" in item:
            text += f" (baseline {fmt(f[item['baseline_key']], item['unit'])})"
        if "min_key" in item:
            low = fmt(f[item["min_key"]], "min" if item["unit"] == "min" else "")
            spread = f"{low}-{fmt(f[item['max_key']], item['unit'])}"
            text += f" [{spread}{', ' + item['over'] if item.get('over') else ''}]"
        parts.append(text)
    return (f"against {r['baseline']}: " if r.get("baseline") else "") + "; ".join(parts)


def verdicts(r: dict) -> list[tuple[Target, str]]:
    """(target, 'met'/'missed'/'not targeted') for every target this record's figures bear on."""
    out = []
    for t in TARGETS:
        if t.benchmark == r["benchmark"] and t.key in r["figures"]:
            met = OPS[t.op](r["figures"][t.key], t.value)
            out.append((t, ("met" if met else "missed") if KINDS[r["machine_kind"]][1] else "not targeted"))
    return out


def machine_line(m: dict) -> str:
    yes = {True: "yes", False: "no"}
    memory = f"{m['memory_gib']} GiB" if m.get("memory_gib") else "memory not recorded"
    line = (f"{m['cores']} cores of an {m['cpu']}; avx512_bf16 {yes[m['avx512_bf16']]}, amx {yes[m['amx']]}; "
            f"{memory}; computes {m.get('dtype', 'as the CPU allows')}")
    return line + (f"; environment `{m['env']}`" if m.get("env") else "") + "."


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def glance(records: list[dict]) -> list[str]:
    by = {(r["benchmark"], r["machine_kind"]): r for r in records}
    kinds = [k for k in KINDS if any(r["machine_kind"] == k for r in records)]
    lines = ["## The targets at a glance", "", "| target | " + " | ".join(f"`{k}`" for k in kinds) + " |",
             "|---|" + "---|" * len(kinds)]
    for t in TARGETS:
        row = []
        for k in kinds:
            r = by.get((t.benchmark, k))
            if r is None or t.key not in r["figures"]:
                row.append("not measured")
                continue
            verdict = dict((v.key, s) for v, s in verdicts(r))[t.key]
            row.append(f"{fmt(r['figures'][t.key], t.unit)} "
                       + (f"**{verdict}**" if verdict != "not targeted" else "(not targeted)"))
        lines.append(f"| {cell(t.text)}: {t.op} {fmt(t.value, t.unit)} | " + " | ".join(row) + " |")
    return lines


def section(kind: str, records: list[dict]) -> list[str]:
    title, targeted = KINDS[kind]
    records = sorted(records, key=lambda r: (ORDER.index(r["benchmark"]) if r["benchmark"] in ORDER else len(ORDER),
                                             r["benchmark"]))
    machines = {json.dumps(r["machine"], sort_keys=True) for r in records}
    if len(machines) > 1:
        fail(f"machine kind {kind}: its results files describe different machines")
    lines = [f"## {title} (`{kind}`)", "", machine_line(records[0]["machine"])
             + f" Newest figure: {max(r['date'] for r in records)}."
             + ("" if targeted else " Reported, not targeted."), "",
             "| benchmark | figures | targets | commit | date | command |", "|---|---|---|---|---|---|"]
    for r in records:
        targets = "; ".join(f"{t.op} {fmt(t.value, t.unit)}: {v}" for t, v in verdicts(r))
        lines.append(f"| {r['benchmark']} | {cell(headline(r))} | {targets} | {r['commit']} | {r['date']} | "
                     f"`{cell(r['command'])}` |")
    lines.append("")
    for r in records:
        extra = " ".join(x for x in (r.get("note", ""), f"Commit: {r['commit_note']}." if r.get("commit_note") else "")
                         if x)
        lines.append(f"- {r['benchmark']}: {r['title']}.{' ' + extra if extra else ''}")
    return lines


def build(records: list[dict], intro: Path = INTRO) -> str:
    lines = [intro.read_text().rstrip("\n"), "", *glance(records)]
    for kind in KINDS:
        mine = [r for r in records if r["machine_kind"] == kind]
        if mine:
            lines += ["", *section(kind, mine)]
    measured = {r["benchmark"] for r in records}
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != Path(__file__).stem)
    if rest := [s for s in scripts if s not in measured]:
        lines += ["", "## Benchmarks without a figure here", "",
                  ", ".join(f"`benchmarks/{s}.py`" for s in rest) + ": run them for a figure and `--add` it "
                  "(benchmarks/evidence.py writes docs/evidence.md itself)."]
    return "\n".join(lines) + "\n"


def add(figures_path: Path, kind: str, command: str, note: str, records: list[dict], results: Path = RESULTS) -> Path:
    """Write benchmarks/results/<benchmark>-<kind>.json from a benchmark's --json output; return its path."""
    try:
        figures = json.loads(figures_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"--add {figures_path}: cannot read its figures ({e})")
    if not isinstance(figures, dict) or not all(isinstance(v, int | float | str | bool) or v is None
                                                for v in figures.values()):
        fail(f"--add {figures_path}: not a benchmark's --json output (a flat object of numbers and strings)")
    if kind not in KINDS:
        fail(f"--machine-kind {kind!r} is not one of {', '.join(KINDS)}")
    match = re.search(r"benchmarks/([\w-]+)\.py", command)
    if not match:
        fail(f"--command {command!r} names no benchmarks/<script>.py")
    benchmark = match.group(1)
    same_kind = [r for r in records if r["machine_kind"] == kind]
    if not same_kind:
        fail(f"--machine-kind {kind}: no results file describes that machine yet; copy one and edit its machine")
    previous = next((r for r in records if r["benchmark"] == benchmark and r["machine_kind"] == kind),
                    next((r for r in records if r["benchmark"] == benchmark), {}))
    keep = [item for item in previous.get("headline", []) if all(
        item.get(k) is None or item[k] in figures for k in ("key", "baseline_key", "min_key", "max_key"))]
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    record = {"benchmark": benchmark, "title": previous.get("title", benchmark), "machine_kind": kind,
              "machine": same_kind[0]["machine"], "command": command, "commit": commit,
              "date": datetime.now(UTC).date().isoformat(), "runs": 1,
              "headline": keep or [{"label": k, "key": k, "unit": ""} for k in list(figures)[:4]],
              "figures": figures, "note": note}
    path = results / f"{benchmark}-{kind}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md differs from the data")
    ap.add_argument("--add", type=Path, metavar="FIGURES", help="a benchmark's --json output to record")
    ap.add_argument("--machine-kind", choices=list(KINDS), help="with --add: the machine it ran on")
    ap.add_argument("--command", help="with --add: the command that wrote FIGURES, as run from the repository root")
    ap.add_argument("--note", default="", help="with --add: one line on how to read the figure")
    ap.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)  # tests: another folder
    ap.add_argument("--page", type=Path, default=PAGE, help=argparse.SUPPRESS)  # tests: another page
    a = ap.parse_args(argv)
    try:
        records = load(a.results)
        if a.add:
            if not (a.machine_kind and a.command):
                fail("--add needs --machine-kind and --command")
            print(f"wrote {shown(add(a.add, a.machine_kind, a.command, a.note, records, a.results))}")
            records = load(a.results)
        page = build(records, a.results / INTRO.name)
    except ValueError as e:
        print(f"performance_page.py: {e}", file=sys.stderr)
        return 1
    if a.check:
        if not a.page.exists() or a.page.read_text() != page:
            print(f"performance_page.py: {shown(a.page)} differs from what {shown(a.results)}/ builds "
                  "(run python benchmarks/performance_page.py)", file=sys.stderr)
            return 1
        return 0
    a.page.write_text(page)
    print(f"wrote {shown(a.page)} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
