"""grpo.envs.judge against a local server that speaks OpenAI chat completions: the score is parsed
and scaled, every failure scores 0 without raising, and CalculatorEnv sends its own rubric."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from grpo.envs import calculator
from grpo.envs.judge import JUDGE_PROMPT, judge_score, judge_scores

pytestmark = pytest.mark.filterwarnings("ignore:LLM judge at:RuntimeWarning")  # the failures warn by design


def serve(reply):
    """A chat-completions server on a free port; reply(body, headers) -> (status, payload text).
    Returns (server, base_url, the request bodies seen)."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/chat/completions" and body["model"] == "judge", (self.path, body)
            seen.append(body | {"authorization": self.headers.get("Authorization")})
            status, payload = reply(body)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload.encode())

        def log_message(self, *args):  # keep pytest's output clean
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/v1", seen


@pytest.fixture
def judge_server():
    servers = []

    def start(reply):
        server, url, seen = serve(reply)
        servers.append(server)
        return url, seen
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def ok(content):
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})


@pytest.mark.parametrize("content, score", [
    ("8", 0.8), ("Score: 7.5", 0.75), ("9/10", 0.9), ("10", 1.0),
    ("12", 1.0), ("-3", 0.0),  # clipped to 0..1
])
def test_score_is_parsed_and_scaled(judge_server, content, score):
    url, seen = judge_server(lambda body: ok(content))
    got = judge_score("2+2?", 4, "Answer: 4", url + "/", "judge", api_key="k", timeout=5)  # trailing / ok
    assert got == pytest.approx(score)
    (body,) = seen
    assert body["temperature"] == 0.0 and body["authorization"] == "Bearer k"
    assert body["messages"] == [{"role": "user", "content": JUDGE_PROMPT.format(
        question="2+2?", answer=4, completion="Answer: 4")}]


@pytest.mark.parametrize("reply", [
    lambda body: (500, "oops"),
    lambda body: (200, "not json"),
    lambda body: (200, json.dumps({"choices": []})),
    lambda body: ok(None),
    lambda body: ok("no score here"),
    lambda body: (time.sleep(1.5), *ok("9"))[1:],  # slower than the timeout
])
def test_failures_score_zero(judge_server, reply):
    url, _ = judge_server(reply)
    assert judge_score("q", 1, "Answer: 1", url, "judge", timeout=0.5) == 0.0


def test_unreachable_server_and_bad_prompt_score_zero():
    assert judge_score("q", 1, "Answer: 1", "http://127.0.0.1:9", "judge", timeout=0.5) == 0.0  # refused
    assert judge_score("q", 1, "a", "http://127.0.0.1:9", "judge", prompt="{missing}") == 0.0
    with pytest.warns(RuntimeWarning, match="LLM judge at http://127.0.0.1:9: URLError; scored 0"):
        judge_score("q", 1, "Answer: 1", "http://127.0.0.1:9", "judge", timeout=0.5)


def test_many_in_threads_keep_their_order_and_take_a_prompt(judge_server):
    url, seen = judge_server(lambda body: ok("8" if "Answer: 4" in body["messages"][0]["content"] else "2"))
    items = [("2+2?", 4, "Answer: 4"), ("2+2?", 4, "Answer: 5")] * 8
    assert judge_scores(items, url, "judge", max_workers=8) == [0.8, 0.2] * 8
    assert judge_scores(items[:1], url, "judge", prompt="Q {question} A {answer} C {completion}") == [0.8]
    assert seen[-1]["messages"][0]["content"] == "Q 2+2? A 4 C Answer: 4"


def test_calculator_env_sends_its_rubric(judge_server):
    url, seen = judge_server(lambda body: ok("8"))
    env = calculator.CalculatorEnv(judge_base_url=url, judge_model="judge", judge_api_key="secret")
    trajectory = SimpleNamespace(text="Answer: 4", turns=["Answer: 4"], observations=[], finish_reason="stop",
                                 num_turns=1)
    assert env.reward({"question": "2+2?", "answer": 4}, trajectory)["judge"] == 0.8
    assert seen[0]["messages"][0]["content"] == calculator.JUDGE_PROMPT.format(
        question="2+2?", answer=4, completion="Answer: 4")
    assert seen[0]["authorization"] == "Bearer secret"
    assert "judge" not in calculator.CalculatorEnv().reward({"question": "2+2?", "answer": 4}, trajectory)
