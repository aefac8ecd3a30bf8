"""ReTool on a small model without Qwen3's own tool template (SmolLM2 on a CPU: the tests and
bench/e2e_retool_smollm2.py): a stand-in of Qwen3-2507's tool layout as a chat template (tools block in
the system turn, <tool_call> JSON, tool responses wrapped as <tool_response> in a user turn), and an env
that puts two solved tool episodes before the question, since a 135M model never writes the format from
the tools block alone."""
import json

from grpo.envs.retool import ReToolEnv

# Qwen3-2507's tool layout (its real template is not available offline)
QWEN3_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")


def tool_call(code: str) -> str:
    """A code_interpreter call as Qwen3-2507 writes it."""
    return "<tool_call>\n" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "\n</tool_call>"


SHOTS = [("What is 2 to the power 10?", "print(2**10)", "1024"), ("What is 5 to the power 3?", "print(5**3)", "125")]


class TwoShotReTool(ReToolEnv):
    """SmolLM2 never writes the format from the tools block alone: two solved episodes first."""
    def prompt(self, example):
        shots = []
        for q, code, out in SHOTS:
            shots += [{"role": "user", "content": q}, {"role": "assistant", "content": tool_call(code)},
                      {"role": "tool", "content": out}, {"role": "assistant", "content": f"\\boxed{{{out}}}"}]
        return [{"role": "system", "content": "Use the code_interpreter tool."}] + shots + \
            [{"role": "user", "content": example["question"]}]
