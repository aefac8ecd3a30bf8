"""grpo.envs.judge against a local server that speaks OpenAI chat completions: the score is parsed
and scaled; judge_score scores a failure 0 without raising; a Judge bounds its requests, retries
429/5xx with backoff, caches, counts its failures; CalculatorEnv sends its rubric over the whole
trajectory and weighs it as the reference did."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from grpo.envs import calculator
from grpo.envs.judge import JUDGE_PROMPT, Judge, judge_score, judge_scores

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
    with pytest.warns(RuntimeWarning, match="LLM judge at http://127.0.0.1:9: URLError; no score"):
        judge_score("q", 1, "Answer: 1", "http://127.0.0.1:9", "judge", timeout=0.5)


def test_many_in_threads_keep_their_order_and_take_a_prompt(judge_server):
    url, seen = judge_server(lambda body: ok("8" if "Answer: 4" in body["messages"][0]["content"] else "2"))
    items = [("2+2?", 4, "Answer: 4"), ("2+2?", 4, "Answer: 5")] * 8
    assert judge_scores(items, url, "judge", max_workers=8) == [0.8, 0.2] * 8
    assert judge_scores(items[:1], url, "judge", prompt="Q {question} A {answer} C {completion}") == [0.8]
    assert seen[-1]["messages"][0]["content"] == "Q 2+2? A 4 C Answer: 4"


def trajectory(turns, observations):
    text = "".join(t + o for t, o in zip(turns, observations + [""]))
    return SimpleNamespace(text=text, turns=turns, observations=observations, finish_reason="stop",
                           num_turns=len(turns))


CALL = "<calculator>\noperation: add\noperands:\n  - 2\n  - 2\n</calculator>"


def test_calculator_env_sends_its_rubric_over_the_trajectory(judge_server):
    """The request holds the rubric with the question, each call, each calculator output and the
    final answer, in order; the reward is the reference's: judge 0.8, verification (within an
    absolute 0.1) 0.2; a key from the env, never a flag."""
    from grpo.rollout import Trajectory  # noqa: F401  (the fields the env reads: turns, observations)
    url, seen = judge_server(lambda body: ok("The call was fine.\nScore: 8"))
    env = calculator.CalculatorEnv(judge_base_url=url, judge_model="judge", judge_api_key="secret", rel_tol=0.0,
                                   abs_tol=0.1)
    t = trajectory([CALL, "The sum is 4.\nAnswer: 4.05"], ["<output>4</output>"])
    r = env.reward({"question": "What is 2+2?", "answer": 4}, t)
    assert r["judge"] == 0.8 and r["correct"] == 1.0 and r["judge_failed"] == 0.0  # 4.05 is within 0.1
    (body,) = seen
    content = body["messages"][0]["content"]
    assert content == calculator.JUDGE_RUBRIC.format(transcript=calculator.transcript("What is 2+2?", t))
    at = [content.index(x) for x in ("User: What is 2+2?", "Assistant: <calculator>", "Calculator: <output>4</output>",
                                      "Assistant: The sum is 4.\nAnswer: 4.05", "Score: N")]
    assert at == sorted(at) and body["authorization"] == "Bearer secret" and body["temperature"] == 0.0
    w = calculator.JUDGE_WEIGHTS
    assert sum(w[k] * r[k] for k in r) == pytest.approx(0.8 * 0.8 + 0.2 * 1.0)
    assert calculator.CalculatorEnv(rel_tol=0.0, abs_tol=0.1).reward({"question": "q", "answer": 4.2}, t)["correct"] == 0.0
    assert "judge" not in calculator.CalculatorEnv().reward({"question": "q", "answer": 4}, t)


@pytest.mark.parametrize("codes", [[429], [503, 500], [429, 502, 504]])
def test_busy_or_failing_server_is_retried_with_backoff(judge_server, codes):
    replies = list(codes)
    url, seen = judge_server(lambda body: (replies.pop(0), "busy") if replies else ok("Score: 7"))
    judge = Judge(url, "judge", retries=3, backoff_s=0.05)
    t0 = time.perf_counter()
    assert judge("rubric") == 0.7
    waited = time.perf_counter() - t0
    assert len(seen) == len(codes) + 1 and judge.requests == len(codes) + 1 and judge.failures == 0
    assert waited >= sum(0.05 * 2 ** i for i in range(len(codes)))  # 0.05, 0.1, 0.2 s: doubling


def test_failures_are_counted_not_scored(judge_server):
    """Out of retries, a client error, a stalled server (bounded by its timeout, not retried) or a
    reply with no score: None, counted; the env scores that row on verification and says so."""
    url, seen = judge_server(lambda body: (503, "down"))
    judge = Judge(url, "judge", retries=2, backoff_s=0.01)
    assert judge("a") is None and len(seen) == 3 and judge.failures == 1
    url, _ = judge_server(lambda body: (400, "bad request"))
    assert Judge(url, "judge", retries=3)("a") is None
    url, seen = judge_server(lambda body: (time.sleep(2.0), *ok("9"))[1:])
    stalled = Judge(url, "judge", timeout=0.3, retries=3)
    t0 = time.perf_counter()
    assert stalled("a") is None and time.perf_counter() - t0 < 1.5 and stalled.failures == 1
    env = calculator.CalculatorEnv(judge=stalled, rel_tol=0.0, abs_tol=0.1)
    t = trajectory([CALL, "Answer: 4"], ["<output>4</output>"])
    r = env.reward({"question": "2+2?", "answer": 4}, t)
    assert r["judge_failed"] == 1.0 and r["judge"] == r["correct"] == 1.0 and stalled.failures == 2


def test_concurrency_is_bounded_and_scores_are_cached(judge_server):
    """16 threads, at most 3 requests in flight; a repeated (model, rubric) is not asked again, even
    while its first request is in flight."""
    lock, live, most = threading.Lock(), [0], [0]

    def reply(body):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return ok("Score: " + body["messages"][0]["content"][-1])

    url, seen = judge_server(reply)
    judge = Judge(url, "judge", max_concurrency=3)
    prompts = [f"rubric {i % 8}" for i in range(32)]
    with ThreadPoolExecutor(16) as pool:
        scores = list(pool.map(judge, prompts))
    assert scores == [int(p[-1]) / 10 for p in prompts]
    assert most[0] <= 3 and len(seen) == 8  # one request a rubric: a thread asking for one in flight waits
    asked = len(seen)
    assert judge("rubric 5") == 0.5 and len(seen) == asked  # cached


def test_recipe_weights_and_the_message_without_a_judge(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "recipes" / "calculator_qwen25_3b.py"
    spec = importlib.util.spec_from_file_location("calculator_qwen25_3b", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg = recipe.CalculatorQwen()
    assert recipe.reward_weights(cfg) == calculator.DEFAULT_WEIGHTS
    out = capsys.readouterr().out
    assert "no LLM judge" in out and "verification" in out
    cfg.judge_base_url, cfg.judge_model = "http://judge/v1", "m"
    assert recipe.reward_weights(cfg) == calculator.JUDGE_WEIGHTS


@pytest.mark.parametrize("header, wait", [("2", 2.0), ("-1", None), ("nan", None), ("soon", None), ("600", 30.0)])
def test_retry_after_values(header, wait):
    """Retry-After as seconds or an HTTP date, clamped to [0, 30]; nonsense falls back to the backoff
    (a negative value used to reach time.sleep and raise out of the reward)."""
    import email.utils
    import urllib.error
    from email.message import Message

    from grpo.envs.judge import _retry_after
    headers = Message()
    headers["Retry-After"] = header
    assert _retry_after(urllib.error.HTTPError("u", 429, "busy", headers, None)) == wait
    headers = Message()
    headers["Retry-After"] = email.utils.formatdate(time.time() + 5, usegmt=True)
    assert 3.0 <= _retry_after(urllib.error.HTTPError("u", 429, "busy", headers, None)) <= 5.0
    with pytest.raises(ValueError, match="max_concurrency"):
        Judge("http://x/v1", "m", max_concurrency=0)
