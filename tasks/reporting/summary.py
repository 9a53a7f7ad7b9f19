"""A round's stage summaries in words: the one renderer behind what `refinery run` prints when a run ends
(flows/cli/run_summary.py) and the markdown summary each round publishes as a Prefect artifact (tasks/report.py).

Each stage's summary is the dict its Prefect task returned (flows/curriculum.py collects them). `stage_lines`
turns one into lines without a round prefix: a stage with a sentence of its own (collect, score, select,
shape, train, evaluate, refine) gets that sentence; with `every`, any other stage gets its numbers listed
(`k v; ...`) and a skipped one says so. A summary that lacks what its sentence reads (an older or partial
one) is listed by its numbers: a report never fails on its input. The terminal asks only for the sentences (a run's end stays short);
the artifact asks for every stage.
"""

from __future__ import annotations

from collections.abc import Callable


def teacher_unavailable(stage: dict, what: str) -> str:
    """The tail of a stage's line when its teacher could not answer some prompts (they fell back)."""
    n = stage.get("teacher_unavailable") or 0
    return f"; teacher unavailable for {n} prompt{'s' * (n != 1)} ({what})" if n else ""


def short_batch(dapo: dict) -> str:
    """The tail of a dapo_filter round's line when its batch came up short, and why."""
    if not dapo["short"]:
        return ""
    why = (f"the cap of {dapo['max_batches']} generation batch{'es' * (dapo['max_batches'] != 1)} was hit"
           if dapo["cap_hit"]
           else "every candidate was generated")
    return f"; the batch is SHORT by {dapo['short']} groups ({why})"


def _collect(s: dict) -> list[str]:
    out = [f"{s['rollouts']} rollouts over {s['prompts']} prompts, pass rate {s['pass_rate']:.1%}, "
           f"{s['tokens_per_s']:.0f} tokens/s"]
    lope = s.get("lope") or {}
    if lope.get("groups"):
        out.append(f"LoPE resampled {lope['groups']} all-fail groups ({lope['resamples']} samples, "
                   f"{lope.get('seconds', 0):.0f} s), rescued {lope['rescued']}, replaced {lope['replaced']} rollouts")
    if s.get("verify_timeouts"):
        out.append(f"{s['verify_timeouts']} math-verify checks timed out and scored 0 (rollouts.verify_timeout)")
    if d := s.get("dapo"):
        out.append(f"dapo_filter kept {d['kept']} of B = {d['batch_size']} groups from {d['groups_generated']} "
                   f"generated in {d['generation_batches']} generation batch{'es' * (d['generation_batches'] != 1)}; "
                   f"discarded {d['zero_variance']} zero-variance + {d['surplus']} surplus groups "
                   f"({d['discarded_rollouts']} rollouts, {d['discarded_tokens']} tokens; see discarded_rollouts)"
                   + short_batch(d))
    if c := s.get("screening"):
        out.append(f"screening kept {c['kept']} of B = {c['batch_size']} groups: screened {c['screened']} prompts "
                   f"with {c['screen_samples']} samples each in {c['generation_batches']} generation "
                   f"batch{'es' * (c['generation_batches'] != 1)}, topped up {c['topped_up_mixed']} mixed + "
                   f"{c['topped_up_posterior']} by the posterior; {c['screened_out']} screened out, "
                   f"{c['zero_variance']} zero-variance after top-up; {c['screen_tokens']} screening + "
                   f"{c['topup_tokens']} top-up tokens, informative ratio {c['informative_ratio']}"
                   + short_batch(c))
    return out


def _score(s: dict) -> list[str]:  # rescued groups apart: their replacements train, the buckets are the policy's
    rescued = dict(s.get("rescued") or {})
    n = rescued.pop("groups", 0)
    own = ", ".join(f"{k} {v}" for k, v in sorted(rescued.items()))
    return [f"{s['buckets'].get('informative', 0)} of {s['prompts']} groups informative; {n} rescued by LoPE "
            "(training only; scored on the policy's own samples" + (f": {own})" if n else ")")]


def _select(s: dict) -> list[str]:
    if "clusters" not in s:
        return []
    return [f"selected {s['selected']} of {s['candidates']} over {s['clusters']} clusters ({s['selected_unscored']} "
            f"never scored; scored ones: mean EPS {s['mean_eps_selected']:.3f} vs {s['mean_eps_pool']:.3f} over "
            "the candidates)"]


def _shape(s: dict) -> list[str]:
    accept = s["accept_rate"] if s["accept_rate"] is not None else "-"
    gain = s["logprob_gain"] if s["logprob_gain"] is not None else "-"
    return [f"shaped {s['in_c']} of {s['traces']} off-policy traces (acceptance {accept}, mean log-prob gain "
            f"{gain})" + teacher_unavailable(s, "skipped")]


def _train(s: dict) -> list[str]:
    return [f"trained v{s['policy_version']} in {s['steps']} steps on {s['sequences']} sequences "
            f"({s['zero_variance_groups']} zero-variance groups skipped, {s['sft_traces']} SFT traces), loss "
            f"{s['first_loss']} -> {s['last_loss']}, {s['tokens_per_s']:.0f} tokens/s"]


def _evaluate(s: dict) -> list[str]:
    return [f"held-out v{v}: " + ", ".join(f"{k} {x:.3f}" for k, x in m.items())
            for v, m in sorted(s["versions"].items())]


def _refine(s: dict) -> list[str]:
    detail = ", ".join(f"{k} {v}" for k, v in sorted(s["by_strategy"].items()))
    out = [f"refine made {s['children']} children ({detail})"
           + teacher_unavailable(s, "fell back; see refinements.reason")]
    if s.get("rejections"):
        why = ", ".join(f"{k} {v}" for k, v in sorted(s["rejections"].items()))
        out.append(f"rejected {sum(s['rejections'].values())} children ({why}; see refinements.reason)")
    return out


SENTENCES: dict[str, Callable[[dict], list[str]]] = {
    "collect": _collect, "score": _score, "select": _select, "shape": _shape, "train": _train,
    "evaluate": _evaluate, "refine": _refine}


def numbers(stage: dict) -> str:
    """A stage's numbers as `k v; ...` (nested numbers one level down; flags, round and timing left out)."""
    parts = []
    for k, v in stage.items():
        if k in ("stage", "round", "timing") or isinstance(v, bool):
            continue
        if isinstance(v, int | float):
            parts.append(f"{k} {v:.4g}")
        elif isinstance(v, dict) and v and all(isinstance(x, int | float) for x in v.values()):
            parts.append(f"{k} " + ", ".join(f"{a} {x:.4g}" for a, x in v.items()))
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):  # e.g. evaluate's versions
            parts += [f"{k} {a}: " + ", ".join(f"{m} {x:.4g}" for m, x in d.items() if isinstance(x, int | float))
                      for a, d in v.items()]
    return "; ".join(parts) or "done"


def stage_lines(stage: dict, every: bool = False) -> list[str]:
    """What one stage's summary says, as lines without a round prefix: its sentences; with `every`, a stage
    without one gets its numbers, and a skipped stage `skipped (why)` (without `every`: nothing)."""
    if "skipped" in stage:
        why = stage.get("skipped")
        return ["skipped" + (f" ({why})" if isinstance(why, str) else "")] if every else []
    try:
        lines = SENTENCES.get(str(stage.get("stage")), lambda s: [])(stage)
    except (KeyError, TypeError, ValueError):  # a summary without what its sentence reads: its numbers instead
        lines = [numbers(stage)]
    return lines or ([numbers(stage)] if every else [])
