"""An LLM judge for any env: a rubric sent to an OpenAI-compatible chat-completions server (vLLM,
SGLang, llama.cpp, a hosted API), whose 0-10 reply becomes a 0..1 reward term.

    judge = Judge("http://localhost:8000/v1", "Qwen2.5-72B-Instruct")
    score = judge(rubric.format(...))      # 0..1, or None when the server gave no score

A judge serves many reward threads at once (grpo.rollout scores trajectories concurrently), so:
- at most `max_concurrency` requests are in flight from this process (a semaphore; the others wait
  their turn; each rank has its own judge, so a server sees up to ranks x max_concurrency);
- a 429 or 5xx reply is retried `retries` times, after Retry-After or 0.5, 1, 2 ... s;
- a request takes at most `timeout` s (a stalled server costs that once: a timeout is not retried;
  a call that is retried can take (retries + 1) x timeout plus the waits);
- a score is cached per (model, filled-in rubric), the last `cache_size` of them: a group's
  identical trajectories, and a step's repeats, cost one request (a thread that asks for a rubric
  already being asked waits for that answer);
- a failure (timeout, refused, HTTP error, a reply with no score) is never a silent 0: the call
  returns None, `failures` counts it, and a warning names its kind once. The env decides what a
  missing score means (grpo.envs.calculator: the row is scored on verification alone, and the
  failure is logged as the `judge_failed` reward term).
`judge_score` is the one-shot form that scores a failure 0.0 (with the warning).
"""
import email.utils
import hashlib
import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

JUDGE_PROMPT = (
    "You grade an assistant's reply to a question.\n\n"
    "Question: {question}\n"
    "Correct answer: {answer}\n\n"
    "The assistant's full reply:\n"
    "{completion}\n\n"
    "Score from 0 to 10: 10 if the reply reaches the correct answer by sound steps and states it clearly, "
    "lower for a wrong or missing answer, a misread question or confusing reasoning. "
    "Reply with the score only.")

_SCORE_LINE = re.compile(r"score\s*[:=]\s*(-?[0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)  # 'Score: 7', the last one
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")  # else the reply's first number: '8', '8/10'


def parse_score(content: str) -> float:
    """A reply's score out of 10 as 0..1, clipped: the last 'score: N', else the first number."""
    lines = _SCORE_LINE.findall(content)
    if lines:
        return min(max(float(lines[-1]) / 10.0, 0.0), 1.0)
    match = _NUMBER.search(content)
    if match is None:
        raise ValueError("no score in the reply")
    return min(max(float(match.group()) / 10.0, 0.0), 1.0)


class Judge:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 30.0,
                 max_concurrency: int = 16, retries: int = 3, backoff_s: float = 0.5, cache_size: int = 4096):
        self.url = base_url.rstrip("/") + "/chat/completions"  # base_url ends before it: http://host:8000/v1
        self.base_url, self.model, self.api_key, self.timeout = base_url, model, api_key, timeout
        self.retries, self.backoff_s, self.cache_size = retries, backoff_s, cache_size
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self.lock = threading.Lock()
        if max_concurrency < 1 or retries < 0 or cache_size < 0:
            raise ValueError(f"Judge needs max_concurrency >= 1, retries >= 0, cache_size >= 0: got "
                             f"{max_concurrency}, {retries}, {cache_size}")
        self.cache: OrderedDict[str, float] = OrderedDict()
        self.inflight: dict[str, threading.Event] = {}  # key -> set when its one request has answered
        self.requests = self.failures = 0  # HTTP requests sent (retries included); calls with no score

    def __call__(self, prompt: str) -> float | None:
        """The score of one filled-in rubric, 0..1; None when the server gave none (counted)."""
        key = hashlib.sha256(f"{self.model}\0{prompt}".encode()).hexdigest()
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            asking = self.inflight.get(key)  # the same rubric asked by another thread right now: wait for it
            if asking is None:
                self.inflight[key] = threading.Event()
        if asking is not None:
            asking.wait()
            with self.lock:
                score = self.cache.get(key)
                self.failures += score is None
                return score
        score = None
        try:
            with self.slots:
                score = self._ask(prompt)
        finally:
            with self.lock:
                if score is None:
                    self.failures += 1
                else:
                    self.cache[key] = score
                    while len(self.cache) > self.cache_size:
                        self.cache.popitem(last=False)
                self.inflight.pop(key).set()
        return score

    def _ask(self, prompt: str) -> float | None:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = json.dumps({"model": self.model, "temperature": 0.0,
                           "messages": [{"role": "user", "content": prompt}]}).encode()
        for attempt in range(self.retries + 1):
            with self.lock:
                self.requests += 1
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return parse_score(json.loads(response.read())["choices"][0]["message"]["content"])
            except urllib.error.HTTPError as e:  # busy (429) or failing (5xx): wait, then ask again
                if (e.code == 429 or e.code >= 500) and attempt < self.retries:
                    wait = _retry_after(e)
                    time.sleep(self.backoff_s * 2 ** attempt if wait is None else wait)
                    continue
                self._warn(f"HTTP {e.code}")
                return None
            except Exception as e:  # timeout, refused, bad JSON, missing fields, no number
                self._warn(type(e).__name__)
                return None

    def _warn(self, kind: str):
        # the text names the failure's kind only, so the default filter shows each kind once
        warnings.warn(f"LLM judge at {self.base_url}: {kind}; no score", RuntimeWarning, stacklevel=4)


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    """The server's Retry-After in seconds, at most 30: a number of seconds or an HTTP date; None when
    it sent neither, or a time past or nonsense (negative, non-finite): then the backoff's wait."""
    value = e.headers.get("Retry-After") if e.headers is not None else None
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = (email.utils.parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds()
        except (TypeError, ValueError):
            return None
    return min(seconds, 30.0) if math.isfinite(seconds) and seconds >= 0 else None


def judge_score(question: str, answer, completion: str, base_url: str, model: str, api_key: str | None = None,
                timeout: float = 30.0, prompt: str = JUDGE_PROMPT) -> float:
    """One request, no retry: the reply's score (0-10) as 0.0-1.0, clipped; any failure 0.0 (warned).
    `prompt` takes {question}, {answer} and {completion}."""
    try:
        text = prompt.format(question=question, answer=answer, completion=completion)
    except (KeyError, IndexError, ValueError) as e:  # a brace the prompt did not mean as a field
        warnings.warn(f"LLM judge at {base_url}: {type(e).__name__}; no score", RuntimeWarning, stacklevel=2)
        return 0.0
    score = Judge(base_url, model, api_key, timeout, retries=0)(text)
    return 0.0 if score is None else score


def judge_scores(items: list[tuple], base_url: str, model: str, api_key: str | None = None,
                 timeout: float = 30.0, prompt: str = JUDGE_PROMPT, max_workers: int = 16) -> list[float]:
    """judge_score for many (question, answer, completion) items at once, in threads, in order."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda it: judge_score(*it, base_url, model, api_key, timeout, prompt), items))
