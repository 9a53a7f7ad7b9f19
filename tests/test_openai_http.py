"""The OpenAI-compatible teacher client against a real HTTP server on 127.0.0.1 that is healthy, chat-less,
slow, rate-limiting, failing or answering garbage. Every test counts the requests the server received."""

import json
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from models.backend import Sampling
from models.openai_http import CHAT_PATH, COMPLETIONS_PATH, EndpointError, OpenAIBackend, retry_after_s


def teacher_reply(content: str) -> str:
    """What a helpful teacher says to each of the pipeline's prompts (distractors, solutions, scaffolds)."""
    if m := re.search(r"Correct answer: (-?\d+)", content):
        n = int(m.group(1))
        return "\n".join(str(n + d) for d in (1, -1, 10, 2, -2, 11, -10, 3, 20))
    if m := re.search(r"Its correct final answer is (.+?); end with", content):
        return f"Work it out step by step. The answer is \\boxed{{{m.group(1)}}}."
    if m := re.search(r"Problem:\n(.+?)\n\n", content, re.S):
        return f"{m.group(1)} Work through it one step at a time."
    return "an answer"


class TeacherServer(ThreadingHTTPServer):
    """A small OpenAI-compatible server in a thread. `script(server, path, body)` may return
    (status, body bytes, headers) to override the normal answer; `delay_s` holds each reply (until closed)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, script=None, delay_s: float = 0.0, chat: bool = True):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script, self.delay_s, self.chat = script, delay_s, chat
        self.requests: list[tuple[str, dict, str | None]] = []  # (path, body, Authorization header)
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.closing = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, path: str | None = None) -> int:
        with self.lock:
            return sum(1 for p, _, _ in self.requests if path is None or p == path)

    def asked(self) -> Counter:
        """How often each question (its last message, or its prompt text) was received."""
        with self.lock:
            return Counter(b["messages"][-1]["content"] if "messages" in b else b["prompt"] for _, b, _ in self.requests)

    def __enter__(self):
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()  # shutdown waits a poll
        return self

    def __exit__(self, *exc):
        self.closing.set()  # slow replies stop waiting
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: TeacherServer

    def log_message(self, *a):
        pass

    def _done(self) -> None:
        """This request stops counting as in flight (once): before its reply is written, since the client may
        send its next request as soon as it has read the reply, before this thread runs on."""
        if getattr(self, "_counted", False):
            with self.server.lock:
                self.server.in_flight -= 1
            self._counted = False

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self._done()
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.requests.append((self.path, body, self.headers.get("Authorization")))
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        self._counted = True
        try:
            if srv.delay_s and srv.closing.wait(srv.delay_s):
                return
            scripted = srv.script(srv, self.path, body) if srv.script else None
            if scripted == "drop":  # promise a body, send a few bytes of it, hang up
                self._done()
                self.send_response(200)
                self.send_header("Content-Length", "500")
                self.end_headers()
                self.wfile.write(b'{"choi')
                self.close_connection = True
                return
            if scripted is not None:
                return self._send(*scripted)
            if self.path == CHAT_PATH and srv.chat:
                reply = teacher_reply(body["messages"][-1]["content"])
                choice = {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
            elif self.path == COMPLETIONS_PATH and body.get("echo"):
                text = body["prompt"]
                choice = {"text": text, "logprobs": {"token_logprobs": [None, -1.0, -2.0, -0.5],
                                                     "text_offset": [0, 3, len(text) - 2, len(text) - 1]}}
            elif self.path == COMPLETIONS_PATH:
                choice = {"text": " 42", "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1, -0.2]}}
            else:
                return self._send(404, b'{"detail": "Not Found"}')
            out = {"choices": [dict(choice, index=i) for i in range(body.get("n", 1))]}
            self._send(200, json.dumps(out).encode(), {"Content-Type": "application/json"})
        finally:
            self._done()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def ask_all(backend: OpenAIBackend, contents: list[str]) -> dict[str, tuple[str | None, str | None]]:
    results = {}
    backend.ask({f"q{i}": ([{"role": "user", "content": c}], Sampling(max_new_tokens=16, seed=i))
                 for i, c in enumerate(contents)}, lambda k, text, err: results.__setitem__(k, (text, err)))
    return results


QUESTIONS = [f"Write wrong answers.\n\nProblem:\nWhat is {i} * 7?\n\nCorrect answer: {7 * i}" for i in range(6)]


def test_chat_endpoint_gets_messages_and_the_api_key(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("REFINERY_TEACHER_API_KEY", "sk-refinery")
    with TeacherServer() as srv:
        out = ask_all(OpenAIBackend(srv.url, "teacher", concurrency=3), QUESTIONS)
        assert {k: v[0].splitlines()[0] for k, v in out.items()} == {f"q{i}": str(7 * i + 1) for i in range(6)}
        assert srv.count(CHAT_PATH) == 6 and srv.count() == 6  # no legacy request at all
        bodies = [b for _, b, _ in srv.requests]
        assert all(b["messages"][0]["role"] == "user" and b["model"] == "teacher" for b in bodies)
        assert sorted(b["seed"] for b in bodies) == list(range(6)) and {b["max_tokens"] for b in bodies} == {16}
        assert {auth for _, _, auth in srv.requests} == {"Bearer sk-refinery"}
    # OPENAI_API_KEY is the fallback, and the key never shows in the backend's name
    monkeypatch.delenv("REFINERY_TEACHER_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    with TeacherServer() as srv:
        backend = OpenAIBackend(srv.url, "teacher")
        ask_all(backend, QUESTIONS[:1])
        assert srv.requests[0][2] == "Bearer sk-openai" and "sk-" not in backend.name


def test_concurrency_is_bounded():
    with TeacherServer(delay_s=0.3) as srv:
        out = ask_all(OpenAIBackend(srv.url, "t", concurrency=3), QUESTIONS)
        assert all(text for text, _ in out.values()) and srv.count() == 6
        assert srv.max_in_flight == 3  # the first question probes the chat endpoint alone, then 3 at a time


def test_chatless_server_probes_chat_once_then_uses_completions():
    with TeacherServer(chat=False) as srv:
        backend = OpenAIBackend(srv.url, "t", concurrency=4, template=lambda ms: f"<s>{ms[-1]['content']}</s>")
        out = ask_all(backend, QUESTIONS)
        assert {text for text, _ in out.values()} == {" 42"} and not any(err for _, err in out.values())
        assert srv.count(CHAT_PATH) == 1 and srv.count(COMPLETIONS_PATH) == 6
        prompts = [b["prompt"] for p, b, _ in srv.requests if p == COMPLETIONS_PATH]
        assert sorted(prompts) == sorted(f"<s>{q}</s>" for q in QUESTIONS)  # rendered by the template
        ask_all(backend, QUESTIONS[:2])  # the backend remembers: no second probe
        assert srv.count(CHAT_PATH) == 1 and srv.count(COMPLETIONS_PATH) == 8


def test_rate_limit_honours_retry_after():
    def limit_first(srv, path, body):
        if srv.count() == 1:
            return 429, b'{"error": "slow down"}', {"Retry-After": "1"}
        return None

    with TeacherServer(script=limit_first) as srv:
        t0 = time.perf_counter()
        out = ask_all(OpenAIBackend(srv.url, "t", retries=2, backoff_s=0.01), QUESTIONS[:1])
        waited = time.perf_counter() - t0
        assert out["q0"][0] and out["q0"][1] is None
        assert srv.count() == 2 and waited >= 1.0  # Retry-After's second, not the 0.01 s backoff


def test_rate_limited_past_the_retries_is_a_per_question_reason():
    with TeacherServer(script=lambda srv, p, b: (429, b"busy", {})) as srv:
        out = ask_all(OpenAIBackend(srv.url, "t", retries=2, backoff_s=0.01, concurrency=2), QUESTIONS[:2])
        assert all(text is None and "failed 3 times, last: HTTP 429: 'busy'" in err for text, err in out.values())
        assert srv.count() == 6  # a rate limit is not "down": each question pays its own retries


def test_server_errors_are_retried_then_answered():
    fails = iter([503, 502])

    def flaky(srv, path, body):
        code = next(fails, None)
        return (code, b"upstream busy", {}) if code else None

    with TeacherServer(script=flaky) as srv:
        b = OpenAIBackend(srv.url, "teacher", retries=3, backoff_s=0.01)
        out = b.generate(["Q: 6*7?"], 2, Sampling(max_new_tokens=5, seed=3))
        assert [c.text for c in out[0]] == [" 42", " 42"] and out[0][0].logprobs == [-0.1, -0.2]
        assert srv.count(COMPLETIONS_PATH) == 3 and srv.requests[-1][1]["n"] == 2 and srv.requests[-1][1]["seed"] == 3


def test_a_reply_cut_off_midway_is_retried():
    with TeacherServer(script=lambda srv, p, b: "drop" if srv.count() == 1 else None) as srv:
        out = ask_all(OpenAIBackend(srv.url, "t", retries=2, backoff_s=0.01), QUESTIONS[:1])
        assert out["q0"][1] is None and out["q0"][0].startswith("1\n") and srv.count() == 2


def test_slow_server_times_out_and_the_rest_are_not_asked():
    with TeacherServer(delay_s=30) as srv:
        t0 = time.perf_counter()
        out = ask_all(OpenAIBackend(srv.url, "t", timeout_s=0.3, retries=1, backoff_s=0.01, concurrency=3), QUESTIONS)
        took = time.perf_counter() - t0
        reasons = [err for _, err in out.values()]
        assert all(text is None for text, _ in out.values())
        assert sum(r == f"{srv.url}{CHAT_PATH} failed 2 times, last: no answer within 0.3 s" for r in reasons) == 1
        assert sum(r.endswith("(not asked: the endpoint is down)") for r in reasons) == 5
        assert srv.count() == 2 and took < 5  # one question's 2 attempts; the other 5 fail at once


def test_down_endpoint_fails_every_question_fast_naming_the_url():
    url = f"http://127.0.0.1:{closed_port()}"
    t0 = time.perf_counter()
    out = ask_all(OpenAIBackend(url, "t", retries=2, backoff_s=0.01), QUESTIONS)
    assert all(text is None and err.startswith(f"{url}{CHAT_PATH} failed") for text, err in out.values())
    assert "refused" in out["q0"][1].lower() or "connect" in out["q0"][1].lower()
    assert time.perf_counter() - t0 < 5
    with pytest.raises(EndpointError, match=f"{url}{COMPLETIONS_PATH} failed 2 times"):
        OpenAIBackend(url, "t", retries=1, backoff_s=0.01).generate(["x"], 1, Sampling())


@pytest.mark.parametrize("reply, reason", [
    ((200, b"<html>Bad Gateway</html>", {}), "answered HTTP 200 with a body that is not JSON: '<html>Bad Gateway</html>'"),
    ((200, b'{"object": "error"}', {}), "answered without choices: '{\"object\": \"error\"}'"),
    ((200, b'{"choices": [{"index": 0}]}', {}), "answered a choice without message content"),
    ((400, b'{"error": "context too long"}', {}), "answered HTTP 400: '{\"error\": \"context too long\"}'"),
])
def test_garbage_is_a_reason_and_not_retried(reply, reason):
    with TeacherServer(script=lambda srv, p, b: reply) as srv:
        out = ask_all(OpenAIBackend(srv.url, "t", retries=3, backoff_s=0.01), QUESTIONS[:3])
        assert all(text is None and err.startswith(f"{srv.url}{CHAT_PATH} ") and reason in err
                   for text, err in out.values())
        assert srv.count() == 3  # one request per question: the same request would get the same reply


def test_score_keeps_only_completion_tokens():
    with TeacherServer() as srv:
        assert OpenAIBackend(srv.url, "teacher").score(["abcdef"], ["gh"]) == [[-2.0, -0.5]]


def test_retry_after_forms():
    from datetime import UTC, datetime, timedelta
    from email.utils import format_datetime

    soon = format_datetime(datetime.now(UTC) + timedelta(seconds=5), usegmt=True)
    assert 3.5 < retry_after_s(soon, 0.1, 60) <= 5
    assert retry_after_s("1.5", 0.1, 60) == 1.5 and retry_after_s("-4", 0.1, 60) == 0.0
    assert retry_after_s("90", 0.1, 60) == 60 and retry_after_s("whenever", 0.1, 60) == 0.1


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        OpenAIBackend("127.0.0.1:8000", "t")
    with pytest.raises(ValueError, match=r"concurrency=0 \(>= 1\)"):
        OpenAIBackend("http://127.0.0.1:8000", "t", concurrency=0)
