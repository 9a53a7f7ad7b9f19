"""vLLM backend (the `gpu` extra): the same protocol as the transformers backend, on CUDA.

Log-probs of the sampled tokens are vLLM's processed log-probs (`logprobs_mode="processed_logprobs"`): after
the temperature, so log_softmax(logits / T) as the transformers backend and the trainer compute them, and at
T = 0 the unmodified model's (vLLM skips the temperature for greedy rows), matching models/backend.py. One
difference: vLLM applies top-p before it takes them, so with top_p < 1 they are renormalised over the
nucleus, above the transformers backend's by log(nucleus mass). The trainer recomputes its own log-probs,
so only the stored `mean_logprob` is affected; the default top_p is 1, where they agree. `score` asks for
prompt log-probs at temperature 1 (the unmodified model). vLLM does not reliably free GPU memory inside a long-lived process, so at scale the
collect stage should run in its own process.
"""

from __future__ import annotations

from models.backend import Completion, Sampling


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "the vllm backend needs vLLM, which is CUDA-only: pip install 'curriculum-refinery[gpu]' on a "
            f"machine with an NVIDIA GPU, or set model.backend = 'transformers' ({e})"
        ) from None
    return vllm


class VLLMBackend:
    def __init__(self, model_path: str, dtype: str = "auto", gpu_memory_utilization: float = 0.85):
        vllm = _import_vllm()
        self.name = f"vllm:{model_path}"
        self._vllm = vllm
        self.llm = vllm.LLM(model=model_path, dtype="bfloat16" if dtype in ("auto", "bf16") else "float32",
                            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs")
        self.tokenizer = self.llm.get_tokenizer()

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate(self, prompts: list[str], n: int, sampling: Sampling, progress=None,
                 row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """With `row_seeds`, each prompt's request carries its own seed (vLLM seeds a request's sampler per
        request, so its samples do not depend on the batch), as keyed sampling does on the other backends."""
        seeds = row_seeds if row_seeds is not None else [sampling.seed] * len(prompts)
        params = [self._vllm.SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                                            max_tokens=sampling.max_new_tokens, seed=sd, logprobs=0) for sd in seeds]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for o in outs:
            group = []
            for c in o.outputs:
                lps = [next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])]
                group.append(Completion(c.text, list(c.token_ids), lps, "length" if c.finish_reason == "length" else "stop"))
            result.append(group)
            if progress:
                progress(n)
        return result

    def score(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        full = [p + c for p, c in zip(prompts, completions)]
        outs = self.llm.generate(full, params, use_tqdm=False)
        res = []
        for p, o in zip(prompts, outs):
            n_prompt = len(self.tokenizer(p, add_special_tokens=False)["input_ids"])
            lps = [next(iter(d.values())).logprob for d in o.prompt_logprobs[n_prompt:] if d]
            res.append(lps)
        return res
