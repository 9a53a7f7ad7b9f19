"""The OpenAI-compatible backend against a real HTTP server on 127.0.0.1 (bounded, stops by itself)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from models.backend import Sampling
from models.openai_http import EndpointError, OpenAIBackend


class _Handler(BaseHTTPRequestHandler):
    failures_left = 0
    requests: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if type(self).failures_left > 0:
            type(self).failures_left -= 1
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"busy")
            return
        if body.get("echo"):
            text = body["prompt"]
            choice = {"text": text, "logprobs": {"token_logprobs": [None, -1.0, -2.0, -0.5],
                                                  "text_offset": [0, 3, len(text) - 2, len(text) - 1]}}
        else:
            choice = {"text": " 42", "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1, -0.2]}}
        out = {"choices": [dict(choice, index=i) for i in range(body.get("n", 1))]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    _Handler.requests, _Handler.failures_left = [], 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_generate_retries_through_transient_failures(server):
    _Handler.failures_left = 2
    b = OpenAIBackend(server, "teacher", retries=3, backoff_s=0.01)
    out = b.generate(["Q: 6*7?"], 2, Sampling(max_new_tokens=5, seed=3))
    assert [c.text for c in out[0]] == [" 42", " 42"] and out[0][0].logprobs == [-0.1, -0.2]
    assert len(_Handler.requests) == 3 and _Handler.requests[-1]["n"] == 2 and _Handler.requests[-1]["seed"] == 3


def test_score_keeps_only_completion_tokens(server):
    b = OpenAIBackend(server, "teacher")
    assert b.score(["abcdef"], ["gh"]) == [[-2.0, -0.5]]


def test_gives_up_with_a_clear_error(server):
    _Handler.failures_left = 10
    with pytest.raises(EndpointError, match="unreachable after 2 attempts: HTTP 503"):
        OpenAIBackend(server, "t", retries=1, backoff_s=0.01).generate(["x"], 1, Sampling())


def test_unreachable_endpoint_is_named():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(EndpointError, match=f"127.0.0.1:{port}/v1/completions unreachable"):
        OpenAIBackend(f"http://127.0.0.1:{port}", "t", retries=1, backoff_s=0.01).generate(["x"], 1, Sampling())
