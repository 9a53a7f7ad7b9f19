"""models/hf/decode_attention.py: a bf16 decode step's attention computed in float32 equals SDPA's to float rounding,
is taken only where it applies, and a bf16 backend's decode steps run through it."""

import pytest
import torch
import torch.nn.functional as F

from models.hf import decode_attention


def _inputs(rows: int = 5, heads: int = 9, kv: int = 3, width: int = 37, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, dim, generator=gen)
    # keys and values as the decode batch hands them: a view of a buffer with spare columns
    k = torch.randn(rows, kv, width + 8, dim, generator=gen)[:, :, :width]
    v = torch.randn(rows, kv, width + 8, dim, generator=gen)[:, :, :width]
    mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)
    mask[0, ..., :11] = False  # left padding
    mask[2, ..., :3] = False
    return q, k, v, mask


@pytest.fixture
def attend_calls(monkeypatch) -> list:
    """The query shapes of every `decode_attention.attend` call from here on (the real one still runs)."""
    calls = []
    attend = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda *a: calls.append(a[0].shape) or attend(*a))
    return calls


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_attend_equals_sdpa_in_float32(mask_kind):
    q, k, v, mask = _inputs()
    if mask_kind == "none":
        mask = None
    elif mask_kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out = decode_attention.attend(q, k, v, mask, 0.25)
    assert out.shape == (5, 1, 9, 16)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("under_autocast", [False, True])
def test_a_bf16_cache_is_attended_in_float32_within_the_outputs_rounding(under_autocast):
    """bf16 in, bf16 out: the output is the float32 attention over the bf16 values, rounded once to bf16, so it
    lies within bf16's half step of that reference (a bf16 score product would not: its scores are rounded),
    also under the bf16 autocast the decoder runs its steps in."""
    q, k, v, mask = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _inputs(width=300, dim=64))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
        out = decode_attention.attend(q, k, v, mask, 0.125)
    assert out.dtype == torch.bfloat16
    reference = _sdpa(q.float(), k.float(), v.float(), mask, 0.125)
    assert ((out.float() - reference).abs() <= reference.abs() * 2**-8 + 1e-6).all()


def test_values_may_have_their_own_head_size():
    q, k, v, mask = _inputs()
    v = torch.randn(5, 3, 37, 24)  # value heads of 24 dims against 16 for queries and keys
    torch.testing.assert_close(decode_attention.attend(q, k, v, mask, 0.25), _sdpa(q, k, v, mask, 0.25),
                               rtol=1e-5, atol=1e-6)


def test_it_applies_to_half_precision_decode_steps_without_gradients_only():
    q, k, v, mask = _inputs()
    bq, bk = q.to(torch.bfloat16), k.to(torch.bfloat16)
    plain = {"scaling": 0.25, "dropout": 0.0, "position_ids": torch.zeros(5, 1), "use_cache": True}
    with torch.no_grad():
        assert decode_attention.applies(bq, bk, mask, plain)
        assert decode_attention.applies(bq, bk, None, plain)
        assert not decode_attention.applies(q, k, mask, plain)  # float32: SDPA is fast there
        assert not decode_attention.applies(torch.cat([bq, bq], 2), bk, mask, plain)  # two query tokens
        assert not decode_attention.applies(bq, bk, mask, {**plain, "position_bias": torch.zeros(1)})
        assert not decode_attention.applies(bq, bk, mask, {**plain, "dropout": 0.1})
        assert not decode_attention.applies(bq, bk, mask.expand(5, 9, 1, 37), plain)  # a mask per head
        assert not decode_attention.applies(bq, bk[:, :2], mask, plain)  # 9 heads over 2 KV heads
    assert not decode_attention.applies(bq, bk, mask, plain)  # gradients on


def test_a_bf16_backends_decode_steps_take_it_and_report_the_scored_log_probs(monkeypatch, attend_calls):
    import models.hf.backend
    from models.backend import Sampling
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    monkeypatch.setattr(models.hf.backend, "amx_bf16", lambda device: False)  # a CPU without AMX, whatever runs this
    backend = TransformersBackend(resolve("tiny-random"), dtype="bf16")
    assert backend.float32_decode_attention and backend.shared_prompt_attention
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    out = backend.generate_ids(prompts, 2, Sampling(1.0, 1.0, 8, 3), row_seeds=[1, 2])
    assert attend_calls and all(shape[2] == 1 for shape in attend_calls)
    rows = [(p, c) for p, g in zip(prompts, out) for c in g]
    scored = backend.score_ids([p for p, _ in rows], [c.token_ids for _, c in rows])
    for (_, c), lp in zip(rows, scored):  # scoring runs SDPA over the whole sequence, in bf16 with autocast
        assert c.logprobs == pytest.approx(lp, abs=0.05)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_with_amx_a_bf16_decoder_keeps_sdpa_and_an_fp32_one_the_cascade(monkeypatch, caplog, dtype, attend_calls):
    """On a CPU with AMX, torch's SDPA over a bf16 cache beat the float32 cast and the float32 cascade (models/
    backend.py): a bf16 decoder's steps take neither, whatever the mask or the number of samples; fp32 changes nothing."""
    import models.hf.backend
    import models.hf.cascade as cascade
    from models.backend import Sampling
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    monkeypatch.setattr(cascade, "MIN_ROWS", 1)  # every step with shared prompts would take the cascade
    monkeypatch.setattr(cascade, "MIN_ROWS_PER_PROMPT", 1)
    monkeypatch.setattr(cascade, "MIN_PROMPT_TOKENS", 1)
    cascaded = []
    real = cascade.SharedPrompts.attend
    monkeypatch.setattr(cascade.SharedPrompts, "attend", lambda self, *a: cascaded.append(1) or real(self, *a))
    monkeypatch.setattr(models.hf.backend, "amx_bf16", lambda device: device == "cpu")
    with caplog.at_level("INFO", logger="refinery.models"):
        backend = TransformersBackend(resolve("tiny-random"), dtype=dtype)
    out = backend.generate_ids([[5, 6, 7, 8, 9], [10, 11, 12]], 3, Sampling(1.0, 1.0, 8, 3), row_seeds=[1, 2])
    assert all(len(c.token_ids) for g in out for c in g)
    assert not attend_calls and not backend.float32_decode_attention
    if dtype == "bf16":
        assert not cascaded and not backend.shared_prompt_attention
        assert "bf16 decode attention: SDPA over the bf16 cache (AMX)" in caplog.text
    else:
        assert cascaded and backend.shared_prompt_attention


def test_the_paths_follow_the_cpus_amx_flag(monkeypatch):
    """models.devices reads AMX from the CPU's flags, and models/hf/backend.py's choice follows it: without AMX a bf16
    decoder takes both float32 paths, with AMX neither; fp32 keeps the cascade; a GPU never takes the float32
    attention."""
    from models import devices
    from models.hf import backend as hf

    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert devices.native_bf16("cpu") and not devices.amx_bf16("cpu")
    assert hf.decode_attention_paths("cpu", bf16=True) == (True, True)
    assert hf.decode_attention_paths("cpu", bf16=False) == (True, False)
    assert hf.decode_attention_paths("cuda:0", bf16=True) == (True, False)
    assert hf.decode_attention_paths("cpu", bf16=True, sdpa=False) == (False, False)  # eager attention: no wrapper
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16", "amx_bf16", "amx_tile"}))
    monkeypatch.setattr(devices, "amx_granted", lambda: True)
    assert devices.amx_bf16("cpu") and not devices.amx_bf16("cuda:0")
    assert hf.decode_attention_paths("cpu", bf16=True) == (False, False)
    assert hf.decode_attention_paths("cpu", bf16=False) == (True, False)
    monkeypatch.setattr(devices, "amx_granted", lambda: False)  # the OS refused the tiles: as without AMX
    assert not devices.amx_bf16("cpu") and hf.decode_attention_paths("cpu", bf16=True) == (True, True)
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))  # no native bf16
    assert not devices.native_bf16("cpu") and not devices.amx_bf16("cpu")


def test_generate_without_the_keyword_attends_as_asked(attend_calls):
    """transformers' own `generate` cannot pass the keyword (it refuses unknown ones): its bf16 decode steps stay
    on SDPA unless a block asks for the float32 path (benchmarks/rollout.py's ceilings, as the sampler runs)."""
    from transformers import AutoModelForCausalLM

    from models.hf import cascade
    from models.registry import resolve

    cascade.install()
    model = AutoModelForCausalLM.from_pretrained(resolve("tiny-random"), dtype=torch.bfloat16).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])

    def generate():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                  min_new_tokens=4, do_sample=False)

    generate()
    assert not attend_calls
    with cascade.float32_decode_steps(True):
        generate()
    assert len(attend_calls) == 3 * model.config.num_hidden_layers  # the 3 decode steps after the prefill, every layer
    attend_calls.clear()
    generate()
    assert not attend_calls  # the block's choice ended with it
