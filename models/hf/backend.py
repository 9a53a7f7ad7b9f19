"""transformers backend (CPU or GPU): a hand-written, batched KV-cache decode loop.

Why not `model.generate`: it keeps finished rows in the batch until the longest one ends and pads every
batch to its longest prompt. Here
- prompts are admitted longest first, so rows decoding together have similar lengths;
- each prompt is prefilled once and its KV cache repeated for its n samples;
- a row that emits end-of-sequence leaves the batch (its KV-cache row is dropped), so it stops costing,
  and waiting prompts are prefilled into the freed slots (continuous batching), so the batch stays full;
- the KV cache is bounded (`kv_cache_gib`, 1 GiB by default): fewer than `batch_size` rows decode together
  when rows as wide as the widest waiting prompt, plus the `max_new_tokens` columns each may still add, would
  hold more. LoPE's prompts carry 100-300 words of Lorem Ipsum (up to ~700 tokens): 64 such rows held about
  2.3 GiB of fp32 cache, and collect peaked at 4.5 GiB on a CPU without bf16;
- bf16 *weights* where the device computes bf16 natively (dtype="auto"), or when asked ("bf16"): autocast over
  fp32 weights would cast every weight matrix again at every decode step; fp32 elsewhere. The choice is logged
  once per backend. A model handed in (shared with a trainer or the scripted policy) keeps its own dtype, and
  runs under bf16 autocast when bf16 is chosen;
- grouped-query attention without repeating K and V: SmolLM2 has 9 query heads over 3 KV heads, and with an
  attention mask (every batched call here has one) transformers' SDPA path repeats K and V to 9 heads, a copy
  of the whole KV cache at every decode step. On CPU, torch's SDPA takes the mask with `enable_gqa`, so
  `sdpa_native_gqa` tells transformers to pass it (its TRANSFORMERS_SDPA_FORCE_GQA switch; on CUDA a mask
  with GQA falls back to the math kernel, so it stays off there). Same results to bf16 rounding (sampled-token
  log-probs against an fp32 forward: median error 0.009 either way); decode ~1.5x faster on 2 cores;
- decode steps on the CPU multiply their few rows by weights that oneDNN reordered once into its blocked
  layout (models/hf/packed.py; fp32, and bf16 where native), 1.15-1.6x faster per fp32 step than MKL's GEMM from
  1 to 64 rows on 2 AVX2 cores; prefill and scoring stay on MKL;
- a bf16 decode step's attention runs in float32 (models/hf/decode_attention.py) on a CPU without AMX: there
  torch's CPU SDPA over a bf16 cache is 1.8-4.2x slower than the cast for one query token per row. With the
  packed bf16 linears a decode step over 300 tokens of context took 1.6x, 1.8x and 2.8x less time at 1, 8 and
  32 rows on 2 AVX512_BF16 cores (benchmarks/decode_step.py). With AMX it is the other way round (SDPA 3-4x
  faster than the cast on 2 cores), so a bf16 decoder there keeps SDPA, and no cascade (below) either;
- the KV cache lives in preallocated buffers with spare columns (models/hf/decoding.py BufferedLayer): a decode
  step writes its column in place, where transformers' DynamicCache copies the whole cache at every step;
- sampling inverts each row's cumulative distribution with one uniform (models/hf/decoding.py draw), one
  exponential pass over the logits that also yields the token's log-prob (torch.multinomial drew exponential
  noise over the whole vocabulary from one thread, a quarter of decode time);
- decode steps of a prompt's n > 1 samples attend to the prompt once per group (models/hf/cascade.py: 1.20x
  faster `generate` over 388-token few-shot prompts on 2 AVX2 cores, 1.46x on 2 AVX512_BF16 cores over a bf16
  cache) where that pays; SDPA or the float32 decode attention elsewhere;
- `stream_from_states` (MCMC shaping's chains) hands each finished row to its caller inside the decode loop,
  and the caller's next requests join the running batch: a chain proposes again as soon as its own move is
  decided, instead of every chain waiting for the longest proposal of the step;
- `score` runs the decoder once and applies the 49k-wide output layer in chunks, so logits never
  materialise for a whole batch at once;
- `generate_and_score_ids` (MCMC shaping) runs each prompt's given continuation in the prompt's own prefill,
  reads its log-probs and crops its columns from the cache before sampling: the prompt is computed once for
  the proposal and the reverse move's score.
It runs over 300 lines because the decode loop, its prefill and scoring share one loaded model's state.
Log-probs (models/backend.py): `generate` reports log_softmax(logits / T) of each sampled token at the
sampling temperature (T = 1 for greedy, top-p not applied), the distribution the trainer's ratios need;
`score`/`score_ids` default to the unmodified model (T = 1), and `score_ids(temperature=T)` scores at T.
Sampling is reproducible for a fixed seed, inputs and batch size (one torch.Generator per call).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.backend import Completion, Sampling, end_ids, logprob_temperature
from models.cache import model_identity
from models.devices import amx_bf16, bf16_chosen, native_bf16
from models.hf import cascade, packed
from models.hf.cascade import FLOAT32_KWARG, SHARED_KWARG, SharedPrompts
from models.hf.decoding import M32, DecodeBatch, cache_kwarg, draw, keyed_uniforms
from models.hf.states import SeqState, check_cuts, last_hidden, left_padded, split_rows
from models.training.autocast import autocast, no_autocast

log = logging.getLogger("refinery.models")


def sdpa_native_gqa(device: str) -> None:
    """On CPU, let transformers' SDPA attention hand grouped-query K/V to torch with `enable_gqa` even under an
    attention mask, instead of repeating them per query head (see the module docstring). Process-wide, set
    once; an explicit TRANSFORMERS_SDPA_FORCE_GQA in the environment wins."""
    if device.split(":")[0] == "cpu" and "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ:
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
        log.info("SDPA: grouped-query attention without repeating K/V on cpu")


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of KV cache one token of one row holds: layers x (keys, values) x KV heads x head size, at the
    weights' element size (an upper bound when bf16 autocast runs over fp32 weights)."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * heads * head_dim * next(model.parameters()).element_size()


def decode_attention_paths(device: str, bf16: bool, sdpa: bool = True) -> tuple[bool, bool]:
    """(the cascade over shared prompts, the float32 decode attention) for a decoder on `device` with a bf16
    (`bf16`) or fp32 cache whose model attends through SDPA (`sdpa`; both wrap it). With AMX, torch's SDPA over
    a bf16 cache beats both (2 cores: `generate` 1.09-1.14x faster on SDPA alone than on both, benchmarks/
    decode_attention.py --generate), so a bf16 decoder there takes neither; an fp32 one keeps the cascade. The
    float32 attention is the CPU's only."""
    bf16_sdpa = bf16 and amx_bf16(device)
    return sdpa and not bf16_sdpa, sdpa and bf16 and device.split(":")[0] == "cpu" and not bf16_sdpa


class TransformersBackend:
    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", batch_size: int = 32,
                 score_chunk_tokens: int = 1024, model=None, tokenizer=None, kv_cache_gib: float = 1.0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bf16 or fp32, got {dtype!r}")
        self.name = f"transformers:{model_identity(model_path)}"  # the same wherever the weights are (models/cache.py)
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self.decode_steps = 0  # decode forwards run so far (one token per row): what a step of the loop costs
        self.score_chunk_tokens = score_chunk_tokens
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_path)
        self.bf16 = bf16_chosen(device, dtype)
        sdpa_native_gqa(device)
        weights = torch.bfloat16 if self.bf16 else torch.float32
        own = model is None
        self.model = model or AutoModelForCausalLM.from_pretrained(model_path, dtype=weights).to(device)
        self.model.eval()
        # decode steps on the CPU through oneDNN's packed weights (models/hf/packed.py: fp32, or bf16 where native); a
        # model handed in is shared with a trainer, whose weights should not gain a second copy
        self.packed_decode = own and packed.install(self.model, device)
        log.info("transformers backend %s on %s: %s weights (%s)", model_path, device,
                 str(next(self.model.parameters()).dtype).removeprefix("torch."),
                 "native bf16" if self.bf16 and native_bf16(device) else "bf16 asked" if self.bf16 else "fp32")
        self.eos_ids = end_ids(self.model.generation_config.eos_token_id, self.tokenizer)
        self.cache_kwarg = cache_kwarg(self.model)  # `cache` or `past_key_values`, by transformers version
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {kv_cache_gib}")
        self.kv_cache_bytes = kv_cache_gib * 2**30
        self.kv_bytes_per_token = kv_bytes_per_token(self.model)
        # the cascade over shared prompts (models/hf/cascade.py) and a bf16 decode step's float32 attention
        # (models/hf/decode_attention.py) wrap SDPA, where they pay (decode_attention_paths); False: SDPA
        sdpa = self.model.config._attn_implementation == "sdpa"
        paths = decode_attention_paths(device, self.bf16, sdpa)
        self.shared_prompt_attention, self.float32_decode_attention = paths
        if sdpa:
            cascade.install()
        if self.bf16 and sdpa and device.split(":")[0] == "cpu":
            log.info("bf16 decode attention: %s", "in float32, and the cascade over shared prompts"
                     if self.float32_decode_attention else "SDPA over the bf16 cache (AMX)")

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    # ---- generation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, sampling: Sampling,
                 progress: Callable[[int], None] | None = None,
                 row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """n samples for each prompt, by continuous batching: up to `batch_size` rows decode together, and
        as rows finish, waiting prompts are prefilled and merged into the running batch, so the batch stays
        full instead of idling on its longest row. `progress(k)` is called as k rows finish. `row_seeds`:
        keyed sampling, as in `generate_ids`."""
        return self.generate_ids(self.encode(prompts), n, sampling, progress, row_seeds)

    def generate_ids(self, ids: list[list[int]], n: int, sampling: Sampling,
                     progress: Callable[[int], None] | None = None,
                     row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """`generate` on token ids. With `row_seeds` (one per prompt), sample j of prompt i draws its noise
        from (row_seeds[i], j, position) alone, so its tokens do not depend on what else is in the batch:
        the same draws batched or one at a time (MCMC shaping relies on this)."""
        return self._generate(ids, n, sampling, progress, row_seeds)[0]

    def generate_and_score_ids(self, ids: list[list[int]], after: list[list[int]], sampling: Sampling,
                               row_seeds: list[int] | None = None) -> tuple[list[list[Completion]], list[list[float]]]:
        """`generate_ids(ids, 1, ...)` and `score_ids(ids, after)` in one: each prompt's prefill also runs its
        `after` tokens (teacher-forced) and reads their log-probs at T = 1, then drops their columns from the
        KV cache before sampling, so the prompt is computed once for both (MCMC's proposal and the reverse
        move's q(s | c, y_<i) share it)."""
        if len(after) != len(ids):
            raise ValueError(f"generate_and_score: {len(ids)} prompts but {len(after)} continuations to score")
        return self._generate(ids, 1, sampling, None, row_seeds, after)

    @torch.no_grad()
    def _generate(self, ids: list[list[int]], n: int, sampling: Sampling, progress: Callable[[int], None] | None,
                  row_seeds: list[int] | None, after: list[list[int]] | None = None,
                  prefill: Callable[[list[int]], DecodeBatch] | None = None,
                  more: Callable[[list[tuple[int, Completion]]], int] | None = None,
                  ) -> tuple[list[list[Completion]], list[list[float]]]:
        """The decode loop. `prefill(batch)`: the prompts' states computed before (`stream_from_states`), else
        they are prefilled here. `more(finished)`: called with each decode step's finished rows as (prompt,
        Completion) (n = 1); it may append prompts to `ids` (and `row_seeds`), returns how many, and those join
        the queue."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if row_seeds is not None and len(row_seeds) != len(ids):
            raise ValueError("row_seeds needs one seed per prompt")
        if more is not None and (n != 1 or after is not None):
            raise ValueError("a decode loop that takes more prompts samples one row each, with nothing to score")
        prompts = ids
        queue = sorted(range(len(prompts)), key=lambda i: len(ids[i]), reverse=True)
        gen = torch.Generator().manual_seed(sampling.seed)
        tokens: dict[tuple[int, int], list[int]] = {}
        lps: dict[tuple[int, int], list[float]] = {}
        finish: dict[tuple[int, int], str] = {}
        stops: dict[tuple[int, int], tuple[int, float]] = {}  # the end token a row stopped on, and its log-prob
        after_lp: dict[int, list[float]] = {}
        share = self.shared_prompt_attention and n > 1  # the rows of a prompt share its cache (models/hf/cascade.py)
        run = DecodeBatch(spare=min(sampling.max_new_tokens, 128), shared=SharedPrompts(n) if share else None)
        step_kwargs = ({SHARED_KWARG: run.shared} if share else {}) | (
            {FLOAT32_KWARG: True} if self.float32_decode_attention else {})
        eos = torch.tensor(self.eos_ids)

        def completion(key: tuple[int, int]) -> Completion:
            toks = tokens.get(key, [])
            return Completion(self.tokenizer.decode(toks, skip_special_tokens=True), toks, lps.get(key, []),
                              finish[key], *stops.get(key, (None, None)))

        while queue or run.size:
            # rows the KV budget allows once the widest waiting prompt joins (queue[0]: longest first)
            limit = self.rows_within(max(run.width, len(ids[queue[0]])), sampling.max_new_tokens) if queue else 0
            free = limit - run.size
            admit_at = max(n, (limit // 4) // n * n)  # prefill several prompts at once, not one by one
            if queue and (free >= admit_at or run.size == 0):
                take = max(1, free // n)  # an empty batch takes a prompt's n samples even over the budget
                batch, queue = queue[:take], queue[take:]
                if prefill is not None:  # the prompts' states were computed before (stream_from_states)
                    new, scored = prefill(batch), []
                else:
                    new, scored = self._prefill([ids[i] for i in batch], n, [after[i] for i in batch] if after else None)
                after_lp.update(zip(batch, scored))
                run.merge(new, [(i, j) for i in batch for j in range(n)])
            if row_seeds is None:
                u = torch.rand(run.size, generator=gen, dtype=torch.float64)
            else:
                u = keyed_uniforms(torch.tensor([[row_seeds[i] & M32, j, len(tokens.get((i, j), []))]
                                                 for i, j in run.rows]))
            tok, tok_lp_t = draw(run.logits, sampling.temperature, sampling.top_p, u)
            tok_lp = tok_lp_t.tolist()
            done = torch.isin(tok, eos).tolist()
            ended = []
            for k, key in enumerate(run.rows):
                if done[k]:
                    finish[key] = "stop"
                    stops[key] = (tok[k].item(), tok_lp[k])
                    ended.append(key)
                    continue
                tokens.setdefault(key, []).append(tok[k].item())
                lps.setdefault(key, []).append(tok_lp[k])
                if len(tokens[key]) >= sampling.max_new_tokens:
                    done[k] = True
                    finish[key] = "length"
                    ended.append(key)
            keep = [k for k, d in enumerate(done) if not d]
            if progress and len(keep) < run.size:
                progress(run.size - len(keep))
            run.select(keep, tok)
            if more is not None and ended:
                added = more([(i, completion((i, j))) for i, j in ended])
                if added:
                    queue = sorted(queue + list(range(len(ids) - added, len(ids))), key=lambda i: len(ids[i]),
                                   reverse=True)
            if run.size:
                self.decode_steps += 1
                with autocast(self.device, self.dtype):
                    run.logits = self.model(input_ids=run.last[:, None].to(self.device),
                                            attention_mask=run.mask.to(self.device),
                                            position_ids=run.next_pos.to(self.device),
                                            use_cache=True, **{self.cache_kwarg: run.cache},
                                            **step_kwargs).logits[:, -1].float()
                run.next_pos = run.next_pos + 1
        out = []
        for i in range(len(prompts)):
            toks = [tokens.get((i, j), []) for j in range(n)]
            texts = self.tokenizer.batch_decode(toks, skip_special_tokens=True)
            out.append([Completion(texts[j], toks[j], lps.get((i, j), []), finish[(i, j)], *stops.get((i, j), (None, None)))
                        for j in range(n)])
        return out, [after_lp.get(i, []) for i in range(len(prompts))]

    def generate_from_states(self, states: list[SeqState], cuts: list[int], sampling: Sampling,
                             row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """`generate_ids([s.ids[:cut] ...], 1, ...)` from states (models/hf/states.py) of longer sequences: each
        row's prompt is its state's first `cuts` tokens, whose keys, values and last hidden state are taken from
        the state instead of a prefill (MCMC's proposals start inside a trace whose context the chain keeps)."""
        if row_seeds is not None and len(row_seeds) != len(states):
            raise ValueError("row_seeds needs one seed per prompt")
        check_cuts(states, cuts)
        seeds = row_seeds if row_seeds is not None else [None] * len(states)
        return [[c] for c in self.stream_from_states(list(zip(states, cuts, seeds)), sampling, lambda done: [])]

    def stream_from_states(self, requests: list[tuple[SeqState, int, int | None]], sampling: Sampling,
                           on_done: Callable[[list[tuple[int, Completion]]], list[tuple[SeqState, int, int | None]]]
                           ) -> list[Completion]:
        """One sample after each request's state prefix, as `generate_from_states` draws it, where finishing
        rows make new requests: `requests` are (state, cut, row seed or None), numbered in the order given;
        `on_done` gets each decode step's finished ones as (number, Completion) and returns the requests that
        follow (numbered on), which join the running batch. Returns every request's Completion, by number.
        Seeds are all given or all None (then one generator per call, as `generate_ids`)."""
        states: list[SeqState | None] = []  # each dropped once its row is prefilled
        cuts: list[int] = []
        seeds: list[int] = []
        ids: list[list[int]] = []

        keyed = bool(requests) and requests[0][2] is not None  # row seeds given (all requests) or none

        def add(new: list[tuple[SeqState, int, int | None]]) -> int:
            check_cuts([st for st, _, _ in new], [cut for _, cut, _ in new])
            if any(cut < 1 for _, cut, _ in new):
                raise ValueError("stream_from_states: every prompt needs at least one token of its state")
            if any((seed is not None) != keyed for _, _, seed in new):
                raise ValueError("stream_from_states: give a row seed for every request or for none")
            for st, cut, seed in new:
                states.append(st)
                cuts.append(cut)
                seeds.append(seed)
                ids.append(st.ids[:cut])
            return len(new)

        add(requests)

        def prefill(batch: list[int]) -> DecodeBatch:
            picked, at = [states[i] for i in batch], [cuts[i] for i in batch]
            b = DecodeBatch()
            b.cache, b.mask = self._cache_of(picked, at)
            b.next_pos = torch.tensor(at)[:, None]
            with autocast(self.device, self.dtype):  # as `generate_ids`' prefill computes its first logits
                b.logits = self._head(last_hidden(picked, at).to(self.device)).float()
            for i in batch:  # copied into the batch: the caller's later states need not wait for the stream's end
                states[i] = None
            return b

        out = self._generate(ids, 1, sampling, None, seeds if keyed else None, prefill=prefill,
                             more=lambda done: add(on_done(done)))[0]
        return [g[0] for g in out]

    def rows_within(self, width: int, max_new_tokens: int) -> int:
        """Rows that may decode together: `batch_size`, fewer when rows `width` columns wide, plus the
        `max_new_tokens` columns each may still grow, would hold more KV cache than `kv_cache_gib`."""
        return min(self.batch_size, int(self.kv_cache_bytes // ((width + max_new_tokens) * self.kv_bytes_per_token)))

    def _prefill(self, prompt_ids: list[list[int]], n: int,
                 after: list[list[int]] | None = None) -> tuple[DecodeBatch, list[list[float]]]:
        """Run the prompts once (left-padded); each one's KV cache is shared out to its n samples on merging.
        With `after`: each prompt's continuation runs in the same forward (right-padded after the prompt,
        which stays in the last prompt column), its tokens' log-probs at T = 1 are read, and its columns are
        cropped from the cache, so sampling starts after the prompt as without it."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompt_ids)
        extra = max((len(a) for a in after), default=0) if after else 0
        input_ids = torch.full((len(prompt_ids), width + extra), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for r, p in enumerate(prompt_ids):  # left padding: every row's next token goes in the last column
            input_ids[r, width - len(p):width] = torch.tensor(p)
            mask[r, width - len(p):width] = 1
            if extra and after[r]:
                input_ids[r, width:width + len(after[r])] = torch.tensor(after[r])
                mask[r, width:width + len(after[r])] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        scored: list[list[float]] = [[] for _ in prompt_ids] if after else []
        with autocast(self.device, self.dtype):
            if extra:
                hidden = self.model.get_decoder()(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                                  position_ids=pos.to(self.device), use_cache=True,
                                                  **{self.cache_kwarg: cache}).last_hidden_state
                logits = self._head(hidden[:, width - 1]).float()  # under autocast, as `generate_ids`' prefill
                with no_autocast(self.device):  # scores in full precision, as `score_ids`
                    scored = self._continuation_log_probs(hidden, [width - 1] * len(after), after, 1.0)
                cache.crop(-extra)
                mask, pos = mask[:, :width], pos[:, :width]
            else:
                logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                    position_ids=pos.to(self.device), use_cache=True, logits_to_keep=1,
                                    **{self.cache_kwarg: cache}).logits[:, -1].float()
        b = DecodeBatch()
        b.cache, b.mask, b.next_pos, b.logits, b.repeat = cache, mask, pos[:, -1:] + 1, logits, n
        if n > 1:  # the cache is repeated when it is merged into the running batch (one copy)
            b.logits, b.mask, b.next_pos = (t.repeat_interleave(n, 0) for t in (b.logits, b.mask, b.next_pos))
        return b, scored

    # ---- scoring -------------------------------------------------------------------------------------------
    def score(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """Per-token log-probs under the unmodified model (T = 1): the gate's fluency and MCMC's pi_ref."""
        if len(prompts) != len(completions):
            raise ValueError(f"score: {len(prompts)} prompts but {len(completions)} completions")
        return self.score_ids(self.encode(prompts), self.encode(completions))

    @torch.no_grad()
    def score_ids(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                  temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of each completion given its prompt (full-precision output layer), at
        `temperature` (the default 1 is the unmodified model; 0 means 1, as for greedy samples)."""
        temperature = logprob_temperature(temperature)
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            if c and not p:  # its first token would be read off position -1, the row's last (padding)
                raise ValueError(f"score: prompt {i} is empty, so its completion's first token has no context")
        out: list[list[float]] = [[] for _ in prompt_ids]
        order = sorted((i for i in range(len(prompt_ids)) if completion_ids[i]),  # nothing to score: no forward
                       key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, lp in zip(chunk, self._score_batch([prompt_ids[i] for i in chunk],
                                                      [completion_ids[i] for i in chunk], temperature)):
                out[i] = lp
        return out

    def _score_batch(self, prompts: list[list[int]], comps: list[list[int]], temperature: float) -> list[list[float]]:
        seqs = [p + c for p, c in zip(prompts, comps)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        with autocast(self.device, self.dtype):
            hidden = self.model.get_decoder()(input_ids=ids.to(self.device),
                                              attention_mask=mask.to(self.device)).last_hidden_state
        return self._continuation_log_probs(hidden, [len(p) - 1 for p in prompts], comps, temperature)

    # ---- sequence states (models/hf/states.py) ---------------------------------------------------------------
    @torch.no_grad()
    def open_states(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]
                    ) -> tuple[list[SeqState], list[list[float]]]:
        """`score_ids` (T = 1) that also keeps what it computed: each prompt + completion's state, and the
        completion's per-token log-probs."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"open_states: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        if any(not p for p in prompt_ids):
            raise ValueError("open_states: an empty prompt leaves its completion's first token without context")
        n = len(prompt_ids)
        return self._run_states([None] * n, [0] * n, [p + c for p, c in zip(prompt_ids, completion_ids)],
                                [len(p) for p in prompt_ids])

    @torch.no_grad()
    def extend_states(self, states: list[SeqState], cuts: list[int], conts: list[list[int]]
                      ) -> tuple[list[SeqState], list[list[float]]]:
        """The states of states[r].ids[:cuts[r]] + conts[r], with the continuations' per-token log-probs (T = 1):
        `score_ids` of the same rows, computing only the continuations (their prefixes come from the states)."""
        check_cuts(states, cuts)
        if len(conts) != len(states) or any(cut < 1 for cut in cuts):
            raise ValueError("extend_states: one continuation per state, after a prefix of at least one token")
        return self._run_states(states, cuts, conts, [0] * len(states))

    def _cache_of(self, states: list[SeqState | None], cuts: list[int]):
        """A DynamicCache of the prefixes, left-padded (models/hf/states.py left_padded), and its mask."""
        from transformers import DynamicCache

        cache = DynamicCache()
        layer_kv, mask = left_padded(states, cuts)
        for layer, (k, v) in enumerate(layer_kv):
            cache.update(k.to(self.device), v.to(self.device), layer)
        return cache, mask

    def _run_states(self, states: list[SeqState | None], cuts: list[int], conts: list[list[int]],
                    scored_from: list[int]) -> tuple[list[SeqState], list[list[float]]]:
        """One forward per chunk of rows over each continuation after its state's prefix: the new states, and
        the log-probs of conts[r][scored_from[r]:] (token 0 is predicted by the prefix's last hidden state)."""
        new: list[SeqState | None] = [None] * len(conts)
        scored: list[list[float]] = [[] for _ in conts]
        order = sorted(range(len(conts)), key=lambda r: cuts[r] + len(conts[r]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ss, cs, ts = [states[r] for r in chunk], [cuts[r] for r in chunk], [conts[r] for r in chunk]
            cache, pmask = self._cache_of(ss, cs)
            extra = max(len(t) for t in ts)
            ids = torch.full((len(chunk), extra), self.pad_id, dtype=torch.long)
            cmask = torch.zeros_like(ids)
            for r, t in enumerate(ts):  # right padding after each row's prefix, which ends in the last prefix column
                ids[r, : len(t)] = torch.tensor(t, dtype=torch.long)
                cmask[r, : len(t)] = 1
            pos = torch.tensor(cs)[:, None] + torch.arange(extra)
            with autocast(self.device, self.dtype):
                hidden = self.model.get_decoder()(input_ids=ids.to(self.device),
                                                  attention_mask=torch.cat([pmask, cmask], 1).to(self.device),
                                                  position_ids=pos.to(self.device), use_cache=True,
                                                  **{self.cache_kwarg: cache}).last_hidden_state
            first = torch.stack([s.hidden[cut - 1] if cut else hidden.new_zeros(hidden.shape[-1])
                                 for s, cut in zip(ss, cs)]).to(hidden)
            prev = torch.cat([first[:, None], hidden], 1)  # column j predicts continuation token j
            lps = self._continuation_log_probs(prev, [scored_from[r] for r in chunk],
                                               [conts[r][scored_from[r]:] for r in chunk], 1.0)
            rows = split_rows(ss, cs, ts, pmask.shape[1], [(layer.keys, layer.values) for layer in cache.layers],
                              hidden)
            for r, state, lp in zip(chunk, rows, lps):
                new[r], scored[r] = state, lp
            del cache, hidden, prev
        return new, scored

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The output layer in full precision (fp32 hidden states into an fp32 layer, or cast to its dtype)."""
        head = self.model.get_output_embeddings()
        return head(h.float()).float() if head.weight.dtype == torch.float32 else head(h.to(head.weight.dtype)).float()

    def _continuation_log_probs(self, hidden: torch.Tensor, last_prompt_cols: list[int], conts: list[list[int]],
                                temperature: float) -> list[list[float]]:
        """Per-token log-probs at T of each row's continuation `conts[r]`, whose prompt ends in column
        `last_prompt_cols[r]` of `hidden`: token k is predicted at column last_prompt_cols[r] + k. The output
        layer is applied `score_chunk_tokens` positions at a time, so logits never materialise for a whole batch."""
        rows = torch.tensor([r for r, c in enumerate(conts) for _ in c], dtype=torch.long)
        cols = torch.tensor([last + k for last, c in zip(last_prompt_cols, conts) for k in range(len(c))], dtype=torch.long)
        tgt = torch.tensor([t for c in conts for t in c], dtype=torch.long)
        flat = []
        for k in range(0, len(rows), self.score_chunk_tokens):
            logits = self._head(hidden[rows[k : k + self.score_chunk_tokens], cols[k : k + self.score_chunk_tokens]])
            flat.append(F.log_softmax(logits / temperature, -1)
                        .gather(1, tgt[k : k + self.score_chunk_tokens, None].to(logits.device))[:, 0])
        flat_t = torch.cat(flat).cpu().tolist() if flat else []
        out, at = [], 0
        for c in conts:
            out.append(flat_t[at : at + len(c)])
            at += len(c)
        return out
