"""An optional LLM judge for any env: one request to an OpenAI-compatible chat-completions server
(vLLM, SGLang, llama.cpp, a hosted API), whose 0-10 reply becomes a 0..1 reward term.

    score = judge_score(question, answer, completion, "http://localhost:8000/v1", "Qwen2.5-72B-Instruct")

A judge is one reward term among others, so it never raises: a timeout, an HTTP error, a reply
that is not JSON or holds no number all score 0.0 (with a warning, once per kind of failure), and
one slow server cannot end a run. rollout scores rewards in threads, so requests overlap.
"""
import json
import re
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor

JUDGE_PROMPT = (
    "You grade an assistant's reply to a question.\n\n"
    "Question: {question}\n"
    "Correct answer: {answer}\n\n"
    "The assistant's full reply:\n"
    "{completion}\n\n"
    "Score from 0 to 10: 10 if the reply reaches the correct answer by sound steps and states it clearly, "
    "lower for a wrong or missing answer, a misread question or confusing reasoning. "
    "Reply with the score only.")

_SCORE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")  # the first number of the reply: '8', '8/10', 'Score: 7.5'


def judge_score(question: str, answer, completion: str, base_url: str, model: str, api_key: str | None = None,
                timeout: float = 30.0, prompt: str = JUDGE_PROMPT) -> float:
    """One judge request: the reply's first number (0-10) as 0.0-1.0, clipped; any failure 0.0.
    `base_url` ends before /chat/completions (e.g. http://host:8000/v1); `prompt` takes {question},
    {answer} and {completion}."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        body = {"model": model, "temperature": 0.0, "messages": [{"role": "user", "content": prompt.format(
            question=question, answer=answer, completion=completion)}]}
        request = urllib.request.Request(base_url.rstrip("/") + "/chat/completions",
                                         data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            content = json.loads(response.read())["choices"][0]["message"]["content"]
        match = _SCORE.search(content)
        if match is None:
            raise ValueError("no score in the reply")
        return min(max(float(match.group()) / 10.0, 0.0), 1.0)
    except Exception as e:  # timeout, refused, HTTP error, bad JSON, missing fields, no number
        # the text names the failure's type only, so the default filter shows each kind once
        warnings.warn(f"LLM judge at {base_url}: {type(e).__name__}; scored 0", RuntimeWarning, stacklevel=2)
        return 0.0


def judge_scores(items: list[tuple], base_url: str, model: str, api_key: str | None = None,
                 timeout: float = 30.0, prompt: str = JUDGE_PROMPT, max_workers: int = 16) -> list[float]:
    """judge_score for many (question, answer, completion) items at once, in threads, in order."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda it: judge_score(*it, base_url, model, api_key, timeout, prompt), items))
