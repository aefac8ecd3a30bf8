"""ReTool: math with a sandboxed Python code interpreter, in Qwen3's native tool-call format.

The prompt is rendered by the tokenizer's own chat template with `tools=[CODE_INTERPRETER]`
(the env's `chat_kwargs`), so the model sees the tools block its template writes and calls
the tool the way it was instruction-tuned to, no custom tags:

    <tool_call>
    {"name": "code_interpreter", "arguments": {"code": "print(2**10)"}}
    </tool_call>

A turn ends on `</tool_call>`; `step` runs each call of the turn in order in the sandbox
(grpo.envs.sandbox.run_code: a fresh interpreter per call) and returns what they printed as
one tool message, which the template wraps in <tool_response> (rollout.py appends exactly
those tokens, checking that the template did not rewrite the earlier turns). A turn without
a call is the final answer. Malformed JSON, another tool's name or a missing `code` is an
error observation the model can read and correct, never an exception.

Reward (the reference's, from the model card of BillyWang1/qwen3-4b-instruct-2507-retool-grpo):
+1 for a correct final \\boxed{} answer (math-verify), -1 otherwise. Returned as `correct` in
{0, 1} with the recipe weighing it 2 and a constant -1 (`bias`), so eval scores accuracy and
training sees +-1.
`tool_calls` and `tool_errors` per trajectory are logged (weight 0).
"""
import json
import re

from grpo.envs.math import is_equiv, last_boxed

SYSTEM_PROMPT = ("You are a helpful assistant that solves math problems step by step. You may call the "
                 "code_interpreter tool to execute Python code whenever it helps your reasoning; use "
                 "complete scripts including any imports. End your solution with the final answer in "
                 "\\boxed{...}.")

CODE_INTERPRETER = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run a complete Python script in a fresh interpreter and return what it prints "
                       "(stdout, then stderr). Nothing persists between calls.",
        "parameters": {"type": "object", "required": ["code"],
                       "properties": {"code": {"type": "string", "description": "the script"}}},
    },
}

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)   # non-greedy, no nested quantifier: linear


def parse_calls(turn: str) -> list[tuple[str | None, str | None]]:
    """Each <tool_call> block of a turn -> (code, None) or (None, error message)."""
    out = []
    for body in CALL.findall(turn):
        try:
            call = json.loads(body.strip())
        except ValueError as e:
            out.append((None, f"tool call is not valid JSON ({e.msg} at char {e.pos}); write "
                              '{"name": "code_interpreter", "arguments": {"code": "..."}}'))
            continue
        if not isinstance(call, dict) or call.get("name") != "code_interpreter":
            name = call.get("name") if isinstance(call, dict) else None
            out.append((None, f"unknown tool {name!r}: the only tool is code_interpreter"))
            continue
        args = call.get("arguments")
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        code = args.get("code") if isinstance(args, dict) else None
        if not isinstance(code, str) or not code.strip():
            out.append((None, 'code_interpreter needs arguments {"code": "<a complete Python script>"}'))
            continue
        out.append((code, None))
    return out


class ReToolEnv:
    stop_strings = ["</tool_call>"]   # a turn that ends here is a tool call
    observation_role = "tool"         # the template wraps it in <tool_response>
    chat_kwargs = {"tools": [CODE_INTERPRETER]}

    def __init__(self, run_code=None, timeout: float = 10.0, max_turns: int = 16,
                 system_prompt: str = SYSTEM_PROMPT):
        if run_code is None:
            from grpo.envs.sandbox import run_code   # isolated workers; see its header for what it stops
        self.run_code, self.timeout = run_code, timeout
        self.max_turns, self.system_prompt = max_turns, system_prompt

    def prompt(self, example: dict) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": example["question"]}]

    def step(self, turn: str) -> str | None:
        """The observation for a turn: what its calls printed; None when it has no call (the answer)."""
        calls = parse_calls(turn)
        if not calls:
            return None
        outputs = [self.run_code(code, timeout=self.timeout) if code is not None else f"error: {error}"
                   for code, error in calls]
        if len(outputs) == 1:
            return outputs[0]
        return "\n".join(f"[call {i + 1}]\n{o}" for i, o in enumerate(outputs))

    def extract(self, trajectory) -> str | None:  # for eval records
        return last_boxed(trajectory.turns[-1] if trajectory.turns else trajectory.text)

    def reward(self, example: dict, trajectory) -> dict[str, float]:
        answer = self.extract(trajectory)
        calls = [c for turn in trajectory.turns for c in parse_calls(turn)]
        errors = sum(e is not None for _, e in calls)
        errors += sum(o.startswith("error:") for o in trajectory.observations)
        final = answer is not None and trajectory.finish_reason == "stop"   # a cut answer is not final
        correct = final and is_equiv(answer, str(example["answer"]))
        return {"correct": float(correct), "bias": 1.0, "tool_calls": float(len(calls)),
                "tool_errors": float(errors)}


# the recipe's weights: reward = 2 correct - 1 (+-1, as the reference), tool counts logged only
REWARD_WEIGHTS = {"correct": 2.0, "bias": -1.0, "tool_calls": 0.0, "tool_errors": 0.0}


# DAPO-Math-17k's prompts (open-r1/DAPO-Math-17k-Processed keeps them in its `prompt` column: its
# create_dataset.py takes the original source_prompt's content) wrap each problem in the DAPO
# instruction to end on an "Answer: $Answer" line, which fights this env's \boxed{} reward.
DAPO_HEAD = re.compile(r"^\s*Solve the following math problem step by step\.\s*The last line of your response "
                       r"should be of the form Answer: \$Answer \(without quotes\) where \$Answer is the answer "
                       r"to the problem\.\s*", re.I)
DAPO_TAIL = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"[^\n]*$", re.I)


def dapo_example(example: dict) -> dict:
    """A DAPO-Math-17k row with the problem alone as its question: the "Answer: $Answer"
    instruction around it stripped (a row without it is left as it is)."""
    question = DAPO_TAIL.sub("", DAPO_HEAD.sub("", example["question"]))
    return {**example, "question": question.strip() or example["question"]}
