"""A math-verify check that hangs costs only itself, through the collect and evaluate stages.

The policy here says a fixed script of answers (rendered with the tiny model's real chat template): per
prompt, one answer that makes sympy compute 10^(10^10) exactly (minutes of big-integer arithmetic), then
answers that math-verify must itself prove equal to the reference (no exact-string match), then a wrong one.
Before the fix the hanging check held the GIL on a worker thread and the stage never returned.
"""

import logging

import pytest
from conftest import land_pool, prompt_rows, round_ctx

from flows.config import EvalConfig, ModelConfig, RewardConfig, RolloutConfig, SelectConfig
from models.backend import Completion
from storage.query import sql

HANG = r"10^{10^{10}}"


class ScriptBackend:
    """Says the script above for each rendered prompt, by the question it contains."""

    name = "script"

    def __init__(self, render_with, answers: dict[str, str]):
        self.render = render_with.render
        self.answers = answers  # question text -> reference answer

    def generate(self, prompts, n, sampling, progress=None, row_seeds=None):
        groups = []
        for prompt in prompts:
            a = int(next(ans for q, ans in self.answers.items() if q in prompt))
            texts = [rf"so \boxed{{{HANG}}}", rf"so \boxed{{\frac{{{2 * a}}}{{2}}}}", rf"thus \boxed{{{a}.0 + 0}}",
                     rf"\boxed{{{a + 1}}}"]
            groups.append([Completion(texts[j % 4], [1, 2], [-0.5, -0.5]) for j in range(n)])
        if progress:
            progress(len(prompts) * n)
        return groups


@pytest.fixture
def two_prompts(store, monkeypatch):
    """Two prompts whose first sample hangs math-verify, with its timeout cut to 0.5 s."""
    import tasks.core.math_verify_worker

    monkeypatch.setattr(tasks.core.math_verify_worker, "MATH_VERIFY_TIMEOUT_S", 0.5)
    rows = prompt_rows(2, offset=3)
    store.commit("ingest-t", {"prompts": rows})
    return dict(zip(rows["text"].to_pylist(), rows["answer"].to_pylist())), rows["prompt_id"].to_pylist()


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_collect_flags_counts_and_logs_timeouts_and_scores_the_rest(store, two_prompts, tiny_backend, monkeypatch):
    import tasks.collect

    answers, ids = two_prompts
    land_pool(store, "t", 0, ids)
    monkeypatch.setattr(tasks.collect, "load_generator", lambda *a, **k: ScriptBackend(tiny_backend, answers))
    cfg = RolloutConfig(group_size=4, fewshot_k=0, lope_prefixes=0)
    logged = Lines()  # on the logger itself: Prefect's logging set-up replaces the root handlers caplog uses
    logging.getLogger("refinery.verify").addHandler(logged)
    try:
        out = tasks.collect.collect_task.fn(round_ctx(store, "t", 0, model=ModelConfig(policy="tiny-random")), cfg,
                                            RewardConfig(), SelectConfig())
    finally:
        logging.getLogger("refinery.verify").removeHandler(logged)
    assert out["verify_timeouts"] == 2
    rows = sql(store, "SELECT sample_idx, reward, correct, verify_timeout FROM rollouts ORDER BY prompt_id, sample_idx"
               ).to_pylist()
    expected = [(0, 0.0, False, True), (1, 1.0, True, False), (2, 1.0, True, False), (3, 0.0, False, False)]
    assert [tuple(r.values()) for r in rows] == expected * 2
    assert sum(line.startswith("math-verify timed out after 0.5 s on answer '10^{10^{10}}'") for line in logged.lines) == 2
    assert "collect round 0: 2 math-verify check(s) timed out and scored 0" in logged.lines


def test_evaluate_counts_timeouts_and_scores_the_rest(store, two_prompts, tiny_backend, monkeypatch):
    import models.registry
    from tasks.evaluate import evaluate_versions

    answers, ids = two_prompts
    land_pool(store, "e", 0, ids, status="heldout")
    monkeypatch.setattr(models.registry, "load_backend", lambda *a, **k: ScriptBackend(tiny_backend, answers))
    out = evaluate_versions(store, round_ctx(store, "e", 0), [(0, "tiny-random")], EvalConfig(n_samples=4, k=2, decoding="sampled"),
                            RolloutConfig(), RewardConfig())
    assert out["verify_timeouts"] == 2
    assert out["versions"][0]["pass_at_1"] == 0.5  # 2 of 4 right per prompt: the timed-out one cost only itself
