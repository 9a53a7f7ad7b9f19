"""OpenAI-compatible HTTP teacher (vLLM, llama.cpp's server, or any compatible API), through httpx.

Endpoints. A teacher's questions are chat messages and go to /v1/chat/completions, so the server applies its
own chat template. A server without a chat endpoint (it answers 404 or 405) is found by the first question
asked, one probe made while the others wait; from then on this backend renders messages with `template` and
uses the legacy /v1/completions. `generate` and `score` (the backend protocol: already rendered prompt text,
token log-probabilities) use /v1/completions directly.

Faults. Connection errors, timeouts, 429 and 5xx are retried `retries` times, waiting `backoff_s`, then twice
as long each time; a 429's Retry-After (seconds or an HTTP date) replaces that wait, capped at `timeout_s`
(a longer wait than one call's timeout is not worth holding a stage for). `timeout_s` bounds connecting and
each wait for bytes of one request. Other 4xx and malformed replies (not JSON, no choices) are not retried:
the same request would get the same answer. Every failure is one line naming the URL and what went wrong.

Concurrency. `ask` keeps up to `concurrency` requests in flight (threads sharing one connection pool) and
hands each result back in the calling thread as it completes, so the caller can land answers as they come.
A question that still fails comes back as a one-line reason, never as an exception. Once the endpoint itself
is found down (transport errors or 5xx after the retries, or 401/403/404), questions not yet sent fail at once
with that reason instead of each paying the retries again; the next `ask` tries the endpoint afresh.

API key: `api_key`, else $REFINERY_TEACHER_API_KEY, else $OPENAI_API_KEY, sent as a Bearer token. It never
appears in the backend's name or in an error.
"""

from __future__ import annotations

import email.utils
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import UTC, datetime

import httpx

from models.backend import Completion, Sampling

API_KEY_VARS = ("REFINERY_TEACHER_API_KEY", "OPENAI_API_KEY")
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


class EndpointError(RuntimeError):
    """A request that failed for good. `down`: the endpoint as a whole failed, not just this request."""

    def __init__(self, message: str, status: int | None = None, down: bool = False):
        super().__init__(message)
        self.status, self.down = status, down


def _plain_template(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def _snippet(text: str, limit: int = 120) -> str:
    """A reply body as a short single line for an error message."""
    flat = " ".join(text.split())
    return repr(flat[:limit] + ("..." if len(flat) > limit else ""))


def retry_after_s(header: str | None, default: float, cap: float) -> float:
    """Seconds to wait after a 429: its Retry-After (delta seconds or an HTTP date), else `default`; at most `cap`.

    >>> retry_after_s("2", 0.5, 10), retry_after_s(None, 0.5, 10), retry_after_s("3600", 0.5, 10)
    (2.0, 0.5, 10)
    >>> retry_after_s("soon", 0.5, 10)
    0.5
    """
    if not header:
        return min(default, cap)
    try:
        wait = float(header)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(header)
        except (TypeError, ValueError):
            return min(default, cap)
        wait = (when - datetime.now(UTC)).total_seconds() if when.tzinfo else default
    return min(max(wait, 0.0), cap)


class OpenAIBackend:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, retries: int = 3,
                 backoff_s: float = 1.0, timeout_s: float = 60.0, concurrency: int = 4,
                 template: Callable[[list[dict]], str] = _plain_template):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"teacher base URL {base_url!r} must start with http:// or https://")
        if retries < 0 or backoff_s < 0 or timeout_s <= 0 or concurrency < 1:
            raise ValueError(f"teacher endpoint options out of range: retries={retries} (>= 0), backoff_s="
                             f"{backoff_s} (>= 0), timeout_s={timeout_s} (> 0), concurrency={concurrency} (>= 1)")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else next(
            (os.environ[v] for v in API_KEY_VARS if os.environ.get(v)), None)
        self.retries, self.backoff_s, self.timeout_s, self.concurrency = retries, backoff_s, timeout_s, concurrency
        self.template = template
        self.name = f"openai:{self.base_url}/{model}"
        self._chat: bool | None = None  # has the server a chat endpoint? None until a question finds out
        self._probe = threading.Lock()
        self._down: str | None = None  # why the endpoint is down, once found so during an `ask`

    def render(self, messages: list[dict]) -> str:
        return self.template(messages)

    def _client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(timeout=self.timeout_s, headers=headers,
                            limits=httpx.Limits(max_connections=self.concurrency))

    def _post(self, client: httpx.Client, path: str, payload: dict) -> dict:
        url = f"{self.base_url}{path}"
        last, attempts = "", 0
        for attempt in range(self.retries + 1):
            attempts += 1
            wait = self.backoff_s * 2**attempt
            try:
                resp = client.post(url, json=payload)
            except httpx.TimeoutException:
                last = f"no answer within {self.timeout_s:g} s"
            except httpx.HTTPError as e:  # refused, reset, protocol or decoding errors: worth another try
                last = " ".join(str(e).split()) or type(e).__name__
            else:
                if resp.is_success:
                    try:
                        data = resp.json()
                    except ValueError:
                        raise EndpointError(f"{url} answered HTTP {resp.status_code} with a body that is not JSON: "
                                            f"{_snippet(resp.text)}", resp.status_code) from None
                    if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
                        raise EndpointError(f"{url} answered without choices: {_snippet(resp.text)}",
                                            resp.status_code)
                    return data
                code = resp.status_code
                last = f"HTTP {code}: {_snippet(resp.text)}"
                if code != 429 and code < 500:
                    raise EndpointError(f"{url} answered {last}", code, down=code in (401, 403, 404))
                if code == 429:
                    wait = retry_after_s(resp.headers.get("retry-after"), wait, self.timeout_s)
            if attempt == self.retries or self._down is not None:  # no point retrying once the endpoint is down
                break
            time.sleep(wait)
        rate_limited = last.startswith("HTTP 429")
        raise EndpointError(f"{url} failed {attempts} time{'s' * (attempts > 1)}, last: {last}",
                            down=not rate_limited)

    def _via_chat(self, client: httpx.Client, messages: list[dict], sampling: Sampling) -> str:
        data = self._post(client, CHAT_PATH, {
            "model": self.model, "messages": messages, "n": 1, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens, "seed": sampling.seed})
        choice = data["choices"][0]
        content = (choice.get("message") or {}).get("content") if isinstance(choice, dict) else None
        if not isinstance(content, str):
            raise EndpointError(f"{self.base_url}{CHAT_PATH} answered a choice without message content: "
                                f"{_snippet(str(data['choices'][0]))}")
        return content

    def _via_completions(self, client: httpx.Client, messages: list[dict], sampling: Sampling) -> str:
        data = self._post(client, COMPLETIONS_PATH, {
            "model": self.model, "prompt": self.render(messages), "n": 1, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens, "seed": sampling.seed})
        text = data["choices"][0].get("text") if isinstance(data["choices"][0], dict) else None
        if not isinstance(text, str):
            raise EndpointError(f"{self.base_url}{COMPLETIONS_PATH} answered a choice without text: "
                                f"{_snippet(str(data['choices'][0]))}")
        return text

    def chat(self, client: httpx.Client, messages: list[dict], sampling: Sampling) -> str:
        """One answer to chat `messages`: the chat endpoint, or the legacy one on a server without it."""
        if self._chat is None:
            with self._probe:  # one probe at a time: a chat-less server sees exactly one chat request
                if self._down is not None:
                    raise EndpointError(f"{self._down} (not asked: the endpoint is down)", down=True)
                if self._chat is None:
                    try:
                        answer = self._via_chat(client, messages, sampling)
                    except EndpointError as e:
                        if e.down and e.status not in (404, 405):
                            self._down = self._down or str(e)  # before the next thread takes the probe lock
                        if e.status not in (404, 405):
                            raise
                        self._chat = False
                        return self._via_completions(client, messages, sampling)
                    self._chat = True
                    return answer
        if self._chat:
            return self._via_chat(client, messages, sampling)
        return self._via_completions(client, messages, sampling)

    def ask(self, questions: Mapping[str, tuple[list[dict], Sampling]],
            on_answer: Callable[[str, str | None, str | None], None]) -> None:
        """Answer every question ({key: (chat messages, sampling)}) with up to `concurrency` requests in
        flight. `on_answer(key, text, None)` or `on_answer(key, None, one-line reason)` runs in the calling
        thread as each question completes."""
        self._down = None  # each `ask` tries the endpoint afresh

        def one(messages: list[dict], sampling: Sampling) -> tuple[str | None, str | None]:
            if self._down is not None:
                return None, f"{self._down} (not asked: the endpoint is down)"
            try:
                return self.chat(client, messages, sampling), None
            except EndpointError as e:
                if e.down and self._down is None:
                    self._down = str(e)  # before this thread takes the next question, so that one is skipped
                return None, str(e)

        with self._client() as client, ThreadPoolExecutor(self.concurrency, "teacher") as pool:
            futures = {pool.submit(one, *questions[k]): k for k in questions}
            try:
                for done in as_completed(futures):
                    on_answer(futures[done], *done.result())
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            finally:
                self._down = None  # `generate` and `score` outside an `ask` retry in full

    def generate(self, prompts: list[str], n: int, sampling: Sampling, progress=None,
                 row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """The backend protocol on rendered prompt text (legacy endpoint); raises EndpointError on failure.
        `row_seeds`: one request seed per prompt (what the server does with a seed is up to the server)."""
        out = []
        seeds = row_seeds if row_seeds is not None else [sampling.seed] * len(prompts)
        with self._client() as client:
            for p, seed in zip(prompts, seeds):
                data = self._post(client, COMPLETIONS_PATH, {
                    "model": self.model, "prompt": p, "n": n, "temperature": sampling.temperature,
                    "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens, "seed": seed,
                    "logprobs": 0,
                })
                group = []
                for ch in sorted(data["choices"], key=lambda c: c.get("index", 0)):
                    lps = [x for x in ((ch.get("logprobs") or {}).get("token_logprobs") or []) if x is not None]
                    group.append(Completion(ch["text"], [], lps,
                                            "length" if ch.get("finish_reason") == "length" else "stop"))
                out.append(group)
                if progress:
                    progress(n)
        return out

    def score(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """Via echo=True: the completion's tokens are those after the prompt's character offset."""
        res = []
        with self._client() as client:
            for p, c in zip(prompts, completions):
                data = self._post(client, COMPLETIONS_PATH, {"model": self.model, "prompt": p + c, "max_tokens": 0,
                                                             "echo": True, "logprobs": 0})
                lp = data["choices"][0]["logprobs"]
                res.append([x for x, off in zip(lp["token_logprobs"], lp["text_offset"])
                            if off >= len(p) and x is not None])
        return res
