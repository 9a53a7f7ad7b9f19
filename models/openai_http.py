"""OpenAI-compatible HTTP backend, for teachers served by vLLM or any compatible API.

Uses the legacy /v1/completions endpoint (it takes rendered prompt text and returns token log-probs), with
retries and exponential backoff on connection errors, 429 and 5xx. An unreachable endpoint fails with a
message naming it. Rendering uses /v1/chat/completions-style messages only to build text: pass `render`
a tokenizer-backed function, or the default plain template is used.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from models.backend import Completion, Sampling


class EndpointError(RuntimeError):
    """The endpoint could not be reached or kept failing after the retries."""


def _plain_template(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class OpenAIBackend:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, retries: int = 4,
                 backoff_s: float = 0.5, timeout_s: float = 120.0,
                 template: Callable[[list[dict]], str] = _plain_template):
        self.base_url = base_url.rstrip("/")
        self.model, self.api_key = model, api_key
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.template = template
        self.name = f"openai:{self.base_url}/{model}"

    def render(self, messages: list[dict]) -> str:
        return self.template(messages)

    def _post(self, path: str, payload: dict) -> dict:
        url = f"{self.base_url}{path}"
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            try:
                req = urllib.request.Request(url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code != 429 and e.code < 500:
                    raise EndpointError(f"{url} answered HTTP {e.code}: {detail}") from None
                last = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                last = str(getattr(e, "reason", e))
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise EndpointError(f"endpoint {url} unreachable after {self.retries + 1} attempts: {last}")

    def generate(self, prompts: list[str], n: int, sampling: Sampling, progress=None) -> list[list[Completion]]:
        out = []
        for p in prompts:
            data = self._post("/v1/completions", {
                "model": self.model, "prompt": p, "n": n, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens, "seed": sampling.seed,
                "logprobs": 0,
            })
            group = []
            for ch in sorted(data["choices"], key=lambda c: c.get("index", 0)):
                lps = [x for x in ((ch.get("logprobs") or {}).get("token_logprobs") or []) if x is not None]
                group.append(Completion(ch["text"], [], lps, "length" if ch.get("finish_reason") == "length" else "stop"))
            out.append(group)
            if progress:
                progress(n)
        return out

    def score(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """Via echo=True: the completion's tokens are those after the prompt's character offset."""
        res = []
        for p, c in zip(prompts, completions):
            data = self._post("/v1/completions", {"model": self.model, "prompt": p + c, "max_tokens": 0,
                                                  "echo": True, "logprobs": 0})
            lp = data["choices"][0]["logprobs"]
            res.append([x for x, off in zip(lp["token_logprobs"], lp["text_offset"]) if off >= len(p) and x is not None])
        return res
