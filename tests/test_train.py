"""GRPO: the loss against a hand-computed example, the advantages, a learning test on the tiny model, and
the train stage's rows and checkpoints."""

import math

import pytest
import torch
from conftest import round_ctx

from tasks.core.advantages import group_advantages
from tasks.core.grpo import Sequence, TrainConfig, TrainPlan, grpo_token_terms, train_round


def _example(lope=(False, False)):
    ln = math.log
    logp = torch.tensor([[ln(1.5), ln(0.5)], [ln(0.5), ln(3.0)]], requires_grad=True)
    zeros = torch.zeros(2, 2)
    return logp, zeros, torch.tensor([1.0, -2.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor(lope)


def test_loss_matches_a_hand_computed_example():
    """old = ref = 0, so rho = exp(logp). Row 0 (A = +1): rho 1.5 is clipped to 1.28 (-1.28), rho 0.5 is not
    (-0.5). Row 1 (A = -2): rho 0.5 is clipped to 0.8 (+1.6); its second token is masked out.
    k3 KL: exp(-logp) + logp - 1 = 0.0721318 + 0.3068528 + 0.3068528 over the three live tokens."""
    logp, zeros, adv, mask, lope = _example()
    t = grpo_token_terms(logp, zeros, zeros, adv, mask, lope, 0.2, 0.28, kl_coef=0.01)
    kl = (1 / 1.5 + math.log(1.5) - 1) + 2 * (2 + math.log(0.5) - 1)
    assert float(t["pg"]) == pytest.approx(-1.28 - 0.5 + 1.6)
    assert float(t["kl"]) == pytest.approx(kl)
    assert float(t["loss"]) == pytest.approx(-0.18 + 0.01 * kl)
    assert float(t["clipped"]) == 2
    # gradients: clipped tokens pass none through rho; the masked token gets none at all
    t = grpo_token_terms(logp, zeros, zeros, adv, mask, lope, 0.2, 0.28, kl_coef=0.0)
    t["loss"].backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5, 0.0, 0.0])


def test_lope_rows_get_the_shaped_ratio_not_the_clip():
    logp, zeros, adv, mask, lope = _example(lope=(True, False))
    t = grpo_token_terms(logp, zeros, None, adv, mask, lope, 0.2, 0.28, kl_coef=0.0)
    # row 0: -(rho / (rho + 0.1)) * A for rho 1.5 and 0.5; row 1 unchanged (+1.6)
    assert float(t["pg"]) == pytest.approx(-(1.5 / 1.6) - (0.5 / 0.6) + 1.6)
    assert float(t["clipped"]) == 1  # only row 1's token; shaped rows are never counted as clipped


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0]) is None
    a = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert sum(a) == pytest.approx(0.0) and a[0] > 0 > a[1]
    assert a[0] == pytest.approx(0.75 / math.sqrt(0.1875), rel=1e-5)
    assert group_advantages([1.0, 0.0, 0.0, 0.0], scale_std=False) == pytest.approx([0.75, -0.25, -0.25, -0.25])


CFG = TrainConfig(lr=1e-3, weight_decay=0.0, eps_low=0.2, eps_high=0.28, kl_coef=0.01, sft_weight=0.0,
                  rows_per_step=64, micro_batch=32, max_grad_norm=1.0, micro_tokens=10_000_000)


def _learn(target_rewarded: bool, rounds: int = 2) -> list[float]:
    """Sample 16 prompts x 8 one-token answers at T = 0.3 from a fresh tiny model, reward the answers that are
    (or, when not target_rewarded, are not) token 1866 (the tiny model's likeliest first token, about 20% of
    samples), run a GRPO round at the same T = 0.3, repeat. Returns the share of token 1866 before each round and at the end."""
    from transformers import AutoModelForCausalLM

    from models.backend import Sampling
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    path = resolve("tiny-random")
    backend = TransformersBackend(path, dtype="fp32", batch_size=128)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [backend.render([{"role": "user", "content": f"Question {i}: name a token."}]) for i in range(16)]
    ids = backend.encode(prompts)
    shares = []
    for it in range(rounds + 1):
        out = backend.generate(prompts, 8, Sampling(0.3, 1.0, 1, seed=100 + it))
        hits = [[bool(c.token_ids) and c.token_ids[0] == 1866 for c in g] for g in out]
        shares.append(sum(map(sum, hits)) / 128)
        if it == rounds:
            break
        seqs = []
        for p, g, h in zip(ids, out, hits):
            adv = group_advantages([float(x == target_rewarded) for x in h])
            if adv is not None:
                seqs += [Sequence(p, c.token_ids, a) for c, a in zip(g, adv) if c.token_ids]
        rows = train_round(backend.model, ref, seqs, [], CFG, TrainPlan(temperature=0.3, pad_id=backend.pad_id, seed=it))
        assert len(rows) == -(-len(seqs) // CFG.rows_per_step)  # all groups constant: nothing to train, no step
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    return shares


def test_grpo_learns_a_fixed_token_and_unlearns_it_when_the_sign_flips():
    up = _learn(target_rewarded=True)
    assert 0.1 < up[0] < 0.35 and up[-1] > 0.75  # measured, trainer at T = 0.3: 0.27 -> 0.84 -> 1.0
    down = _learn(target_rewarded=False)
    assert down[0] == up[0] and down[-1] < 0.05


def test_train_stage_lands_steps_and_a_new_checkpoint(store):
    """Round 0 of a run with mixed groups on the tiny model: the stage trains, saves version 1 as a real
    checkpoint whose weights differ from the base, records the chain, and a rerun does nothing."""
    import pyarrow as pa
    from test_curriculum import TINY
    from transformers import AutoModelForCausalLM

    from flows.config import load_config
    from models.checkpoints import checkpoint_dir, policy_for_round
    from models.registry import resolve
    from storage.query import sql
    from tasks.train import train_task

    cfg = load_config(sets=[*TINY, "train.lr=1e-3", "train.rows_per_step=8", "train.micro_batch=4"])
    rows = []
    for p in range(4):
        for j in range(4):
            rows.append({"run_id": "t", "round": 0, "policy_version": 0, "prompt_id": f"p{p}", "sample_idx": j,
                         "prompt_text": f"<|im_start|>user\nQuestion {p}<|im_end|>\n<|im_start|>assistant\n",
                         "completion": ["yes", "no", "maybe so", "fine"][j], "reward": float(j % 2 == p % 2),
                         "correct": j % 2 == p % 2, "n_tokens": 1, "mean_logprob": -1.0,
                         "finish_reason": "stop", "augmentation": None})
    rows += [dict(rows[0], prompt_id="flat", sample_idx=j, reward=0.0, correct=False) for j in range(4)]
    store.commit("collect", {"rollouts": pa.Table.from_pylist(rows)}, run_id="t", round=0)
    out = train_task.fn(round_ctx(store, "t", 0, base="tiny-random", model=cfg.model.model_copy(update={"policy": "tiny-random"})), cfg.train, cfg.rollout)
    assert out["steps"] == 2 and out["sequences"] == 16 and out["zero_variance_groups"] == 1
    steps = sql(store, "SELECT step, loss, kl, grad_norm, n_tokens, policy_version FROM train_steps ORDER BY step"
                ).to_pylist()
    assert [s["step"] for s in steps] == [0, 1] and all(s["policy_version"] == 1 for s in steps)
    assert all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 and s["n_tokens"] > 0 for s in steps)
    assert policy_for_round(store, "t", 1, "tiny-random") == (1, str(checkpoint_dir(store, "t", 1)))
    new = AutoModelForCausalLM.from_pretrained(checkpoint_dir(store, "t", 1))
    old = AutoModelForCausalLM.from_pretrained(resolve("tiny-random"))
    assert not torch.equal(new.lm_head.weight, old.lm_head.weight)
    assert train_task.fn(round_ctx(store, "t", 0, base="tiny-random", model=cfg.model.model_copy(update={"policy": "tiny-random"})), cfg.train, cfg.rollout)["skipped"]


def test_lora_mode_trains_adapters_and_saves_a_merged_checkpoint(store):
    import pyarrow as pa
    from test_curriculum import TINY
    from transformers import AutoModelForCausalLM

    from flows.config import load_config
    from models.checkpoints import checkpoint_dir
    from models.registry import resolve
    from tasks.train import train_task

    cfg = load_config(sets=[*TINY, "train.mode=lora", "train.lr=1e-2", "train.lora_rank=4"])
    rows = [{"run_id": "l", "round": 0, "policy_version": 0, "prompt_id": "p", "sample_idx": j,
             "prompt_text": "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", "completion": f"answer {j}",
             "reward": float(j == 0), "correct": j == 0, "n_tokens": 2, "mean_logprob": -1.0,
             "finish_reason": "stop", "augmentation": None} for j in range(4)]
    store.commit("collect", {"rollouts": pa.Table.from_pylist(rows)}, run_id="l", round=0)
    assert train_task.fn(round_ctx(store, "l", 0, base="tiny-random", model=cfg.model.model_copy(update={"policy": "tiny-random"})), cfg.train, cfg.rollout)["steps"] == 1
    folder = checkpoint_dir(store, "l", 1)
    assert not (folder / "adapter_config.json").exists()  # merged: a plain checkpoint every backend loads
    new = AutoModelForCausalLM.from_pretrained(folder)
    old = AutoModelForCausalLM.from_pretrained(resolve("tiny-random"))
    q_new, q_old = new.model.layers[0].self_attn.q_proj.weight, old.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_new, q_old)
    assert torch.equal(new.model.embed_tokens.weight, old.model.embed_tokens.weight)  # LoRA leaves these alone


def test_stage_feeds_lope_behaviour_prompts_and_shaped_traces(store, tiny_backend):
    """A LoPE-replaced rollout trains with its perturbed prompt as the behaviour context; correct shaped
    traces of the round become the SFT term (sft_loss recorded), incorrect ones do not."""
    import json

    import polars as pl
    import pyarrow as pa
    from test_curriculum import TINY

    from flows.config import load_config
    from storage.query import sql
    from tasks.train import rollout_sequences, train_task

    tok = tiny_backend.tokenizer
    plain = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    lope = json.dumps({"lorem_perturb": {"replaced": True, "prefix": 0, "behaviour_prompt": "<|im_start|>system\n"
                                         "Lorem ipsum dolor.<|im_end|>\n" + plain}})
    rows = [{"run_id": "s", "round": 0, "policy_version": 0, "prompt_id": "p", "sample_idx": j, "prompt_text": plain,
             "completion": f"answer {j}", "reward": float(j > 0), "correct": j > 0, "n_tokens": 2,
             "mean_logprob": -1.0, "finish_reason": "stop", "augmentation": lope if j == 3 else None}
            for j in range(4)]
    seqs, used, skipped = rollout_sequences(pl.DataFrame(rows), tok, tok.eos_token_id, True, 16)
    assert (used, skipped) == (1, 0) and [s.behaviour_ids is not None for s in seqs] == [False, False, False, True]
    assert seqs[3].behaviour_ids[: 3] != seqs[3].prompt_ids[: 3] and seqs[3].completion_ids[-1] == tok.eos_token_id
    now = __import__("datetime").datetime(2026, 1, 1, tzinfo=__import__("datetime").UTC)
    store.commit("seed", {"prompts": pa.table({"prompt_id": ["p"], "text": ["Q"], "answer": ["1"],
                                               "source": ["x.jsonl"], "root_id": ["p"], "transform": ["original"],
                                               "created_at": [now]})})
    store.commit("collect", {"rollouts": pa.Table.from_pylist(rows)}, run_id="s", round=0)
    store.commit("shape", {"shaped_traces": pa.Table.from_pylist([
        {"run_id": "s", "round": 0, "prompt_id": "p", "trace_id": t, "origin": "teacher", "text": text,
         "start_logprob": -2.0, "end_logprob": -1.5, "steps": 8, "accept_rate": 0.5, "correct": ok,
         "tokens_changed": 3} for t, text, ok in (("a", "so it is 1", True), ("b", "it is 2", False))])},
        run_id="s", round=0)
    cfg = load_config(sets=[*TINY, "train.sft_weight=0.5"])
    out = train_task.fn(round_ctx(store, "s", 0, base="tiny-random", model=cfg.model.model_copy(update={"policy": "tiny-random"})), cfg.train, cfg.rollout)
    assert out["sft_traces"] == 1 and out["sequences"] == 4
    (step,) = sql(store, "SELECT sft_loss, loss, pg_loss, kl FROM train_steps WHERE run_id = 's'").to_pylist()
    assert step["sft_loss"] > 0 and step["loss"] == pytest.approx(step["pg_loss"] + 0.01 * step["kl"]
                                                                   + 0.5 * step["sft_loss"], rel=1e-4)


def test_k3_kl_is_clamped_at_10():
    logp = torch.tensor([[-20.0]], requires_grad=True)  # a token the policy pushed far below the reference
    t = grpo_token_terms(logp, logp.detach(), torch.tensor([[0.0]]), torch.tensor([0.0]), torch.ones(1, 1),
                         torch.tensor([False]), kl_coef=1.0)
    assert float(t["kl"]) == 10.0  # unclamped: exp(20) - 21 ~ 4.9e8


# ---- log-probs at the sampling temperature (issue 12 item 3) ---------------------------------------------
def _direct_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a full forward pass, gathered at the completion's tokens: the reference the
    trainer's log-probs are checked against."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp[len(prompt) - 1 : len(prompt) + len(completion) - 1].gather(1, torch.tensor(completion)[:, None])[:, 0]


def _direct_entropy(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : len(prompt) + len(completion) - 1]
    return -(logp.exp() * logp).sum(-1)


def test_completion_logprobs_divide_the_logits_by_the_sampling_temperature(tiny_backend):
    """The trainer's per-token log-probs at T = 0.7 equal log_softmax(logits / 0.7) gathered, from a plain full
    forward pass; at T = 0 (greedy) they are defined as the unmodified model's (T = 1), never a division by 0."""
    from tasks.core.passes import completion_logprobs

    b = tiny_backend
    prompts = b.encode([b.render([{"role": "user", "content": q}]) for q in ("What is 2 + 3?", "Hi")])
    comps = b.encode(["The answer is 5.", "Hello there, how are you?"])
    for temperature, direct_t in ((0.7, 0.7), (1.3, 1.3), (0.0, 1.0)):
        lp, mask, _ = completion_logprobs(b.model, prompts, comps, b.pad_id, temperature=temperature)
        for r, (p, c) in enumerate(zip(prompts, comps)):
            direct = _direct_logprobs(b.model, p, c, direct_t)
            assert int(mask[r].sum()) == len(c)
            assert torch.allclose(lp[r, : len(c)], direct, atol=1e-5), temperature
    at_1 = completion_logprobs(b.model, prompts, comps, b.pad_id, temperature=1.0)[0]
    at_07 = completion_logprobs(b.model, prompts, comps, b.pad_id, temperature=0.7)[0]
    assert (at_1 - at_07).abs().max() > 0.01  # the temperature makes a difference the check above can see
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(b.model, prompts, comps, b.pad_id, temperature=-0.5)


def test_first_step_ratio_kl_and_entropy_use_the_sampling_temperature(tiny_backend):
    """One GRPO step at T = 0.7 on a group of four rollouts, one of them LoPE-replaced (sampled under a Lorem
    prefix). Before the update, the new log-probs equal the recomputed old ones, so plain rows have rho = 1 and
    contribute -A per token; the LoPE row has rho = exp(logp(plain prompt) - logp(behaviour prompt)), shaped
    rho / (rho + 0.1). The step's pg loss, k3 KL against a perturbed reference, and entropy all match a direct
    computation at T = 0.7, and differ from the one at T = 1."""
    import copy

    b = tiny_backend
    model = copy.deepcopy(b.model)
    ref = copy.deepcopy(b.model).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    plain = b.encode([b.render([{"role": "user", "content": "What is 7 * 8?"}])])[0]
    lorem = b.encode([b.render([{"role": "system", "content": "Lorem ipsum dolor sit amet, consectetur."},
                                {"role": "user", "content": "What is 7 * 8?"}])])[0]
    comps = b.encode(["It is 54.", "Maybe 55", "7 * 8 = 56, so \\boxed{56}", "The answer is \\boxed{56}."])
    adv = group_advantages([0.0, 0.0, 1.0, 1.0])
    seqs = [Sequence(plain, c, a, lorem if j == 3 else None) for j, (c, a) in enumerate(zip(comps, adv))]
    cfg = CFG.model_copy(update={"rows_per_step": 8, "kl_coef": 0.05})
    t = 0.7

    def expected(temperature):
        pg = kl = ent = 0.0
        for s in seqs:
            new = _direct_logprobs(b.model, s.prompt_ids, s.completion_ids, temperature)
            if s.behaviour_ids is not None:
                rho = torch.exp(new - _direct_logprobs(b.model, s.behaviour_ids, s.completion_ids, temperature))
                pg += float((-(rho / (rho + 0.1)) * s.advantage).sum())
            else:
                pg += -s.advantage * len(s.completion_ids)
            d = _direct_logprobs(ref, s.prompt_ids, s.completion_ids, temperature) - new
            kl += float(torch.clamp(torch.exp(d) - d - 1, max=10.0).sum())
            ent += float(_direct_entropy(b.model, s.prompt_ids, s.completion_ids, temperature).sum())
        n = sum(len(c) for c in comps)
        return pg / n, kl / n, ent / n

    (row,) = train_round(model, ref, seqs, [], cfg, TrainPlan(temperature=t, pad_id=b.pad_id, seed=0))
    pg, kl, ent = expected(t)
    assert row["pg_loss"] == pytest.approx(pg, abs=1e-5)
    assert row["kl"] == pytest.approx(kl, rel=1e-4)
    assert row["entropy"] == pytest.approx(ent, rel=1e-5)
    assert row["loss"] == pytest.approx(pg + cfg.kl_coef * kl, abs=1e-5)
    pg1, kl1, ent1 = expected(1.0)  # the check can tell the two temperatures apart
    assert abs(pg1 - pg) > 1e-3 and abs(kl1 - kl) > 1e-3 * kl and abs(ent1 - ent) > 1e-2


def test_train_round_requires_the_sampling_temperature(tiny_backend):
    """No silent default: every caller states the temperature its rollouts were sampled at."""
    with pytest.raises(TypeError, match="temperature"):
        train_round(tiny_backend.model, None, [Sequence([1, 2], [3], 1.0)], [], CFG, TrainPlan(pad_id=tiny_backend.pad_id))


def test_train_stage_trains_at_the_rollout_temperature(store, tiny_backend):
    """The stage hands `rollout.temperature` to the trainer: with one optimizer step, the recorded entropy is the
    base model's mean entropy of softmax(logits / 0.5) over the trained tokens (and not that at T = 1)."""
    import polars as pl
    import pyarrow as pa
    from test_curriculum import TINY

    from flows.config import load_config
    from storage.query import sql
    from tasks.train import rollout_sequences, train_task

    cfg = load_config(sets=[*TINY, "rollout.temperature=0.5", "train.kl_coef=0", "train.rows_per_step=64"])
    rows = [{"run_id": "temp", "round": 0, "policy_version": 0, "prompt_id": "p", "sample_idx": j,
             "prompt_text": "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
             "completion": ["4", "It is 5", "2 + 2 = 4", "three"][j], "reward": float(j in (0, 2)),
             "correct": j in (0, 2), "n_tokens": 1, "mean_logprob": -1.0, "finish_reason": "stop",
             "augmentation": None} for j in range(4)]
    store.commit("collect", {"rollouts": pa.Table.from_pylist(rows)}, run_id="temp", round=0)
    assert train_task.fn(round_ctx(store, "temp", 0, base="tiny-random", model=cfg.model.model_copy(update={"policy": "tiny-random"})), cfg.train, cfg.rollout)["steps"] == 1
    (entropy,) = sql(store, "SELECT entropy FROM train_steps WHERE run_id = 'temp'").to_pylist()
    tok = tiny_backend.tokenizer
    seqs, _, _ = rollout_sequences(pl.DataFrame(rows), tok, tok.eos_token_id, True, cfg.rollout.max_new_tokens)
    n = sum(len(s.completion_ids) for s in seqs)

    def mean_entropy(t):
        return sum(float(_direct_entropy(tiny_backend.model, s.prompt_ids, s.completion_ids, t).sum())
                   for s in seqs) / n

    assert entropy["entropy"] == pytest.approx(mean_entropy(0.5), rel=1e-5)
    assert abs(mean_entropy(1.0) - mean_entropy(0.5)) > 0.1


def test_a_rollout_trains_on_its_sampled_ids_and_their_log_probs(tiny_backend):
    """A row with `token_ids` trains on them as sampled (here ids its text would not encode to) and, when the
    sampler computed as the trainer does, takes `token_logprobs` as its old log-probs; a row without them
    encodes its text again and gets an old pass. Which samplers compute as the trainer: fp32 transformers or
    scripted, not vLLM or bf16."""
    import polars as pl

    from tasks.train import rollout_sequences, sampler_computes_as_trainer

    tok = tiny_backend.tokenizer
    plain = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    sampled = [[72, 33, 2], [5, 6, 7, 8]]  # a stop (end token 2) and a length cut
    rows = [{"prompt_id": "p", "sample_idx": j, "prompt_text": plain, "completion": f"answer {j}",
             "reward": float(j), "finish_reason": "stop" if j != 1 else "length", "augmentation": None,
             "token_ids": sampled[j] if j < 2 else None, "token_logprobs": [-0.5] * len(sampled[j]) if j < 2 else None}
            for j in range(3)]
    frame = pl.DataFrame(rows, schema_overrides={"token_ids": pl.List(pl.Int32), "token_logprobs": pl.List(pl.Float32)})
    seqs, used, _ = rollout_sequences(frame, tok, tok.eos_token_id, True, 16, sampler_logprobs=True)
    assert used == 1 and [s.completion_ids for s in seqs[:2]] == sampled
    assert seqs[2].completion_ids == tok("answer 2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [s.sampled_logprobs for s in seqs] == [[-0.5] * 3, [-0.5] * 4, None]
    seqs, _, _ = rollout_sequences(frame, tok, tok.eos_token_id, True, 16)  # a sampler that computes otherwise
    assert [s.completion_ids for s in seqs[:2]] == sampled and all(s.sampled_logprobs is None for s in seqs)
    assert sampler_computes_as_trainer("transformers", "fp32", "cpu")
    assert sampler_computes_as_trainer("scripted", "fp32", "cpu")
    assert not sampler_computes_as_trainer("vllm", "fp32", "cuda")
    assert not sampler_computes_as_trainer("transformers", "bf16", "cpu")
    # Ray rollout workers may sit on CPUs where "auto" picks bf16: only an explicit fp32 counts there
    assert not sampler_computes_as_trainer("transformers", "auto", "cpu", remote_workers=True)
    assert sampler_computes_as_trainer("transformers", "fp32", "cpu", remote_workers=True)
