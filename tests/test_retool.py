"""grpo.envs.retool: Qwen3-style native tool calls to the code interpreter. Parsing and
errors by hand; a multi-turn rollout on SmolLM2 with a stand-in of Qwen3-2507's tool template
(tools block in the system turn, <tool_call> JSON, tool responses wrapped as <tool_response>
in a user turn), where the observation tokens are exactly the template's and masked, and the
sampler's log-probs equal a full forward."""
import pytest
import torch
from transformers import AutoTokenizer

from grpo.engine.sampler import Sampler
from grpo.envs.retool import CODE_INTERPRETER, REWARD_WEIGHTS, ReToolEnv, parse_calls
from grpo.envs.retool_small import QWEN3_TOOLS_TEMPLATE, TwoShotReTool, tool_call
from grpo.models.model import Transformer
from grpo.rollout import Trajectory, assign_rewards, continuation_ids, render_prompt, rollout, sampling_params


def test_parse_calls_and_error_observations():
    assert parse_calls("Let me compute. " + tool_call("print(1)")) == [("print(1)", None)]
    assert parse_calls("no call, the answer is \\boxed{3}") == []
    two = parse_calls(tool_call("print(1)") + " and " + tool_call("print(2)"))
    assert [c for c, _ in two] == ["print(1)", "print(2)"]
    assert parse_calls('<tool_call>{"name": "code_interpreter", "arguments": "{\\"code\\": \\"x=1\\"}"}</tool_call>') \
        == [("x=1", None)]                                      # arguments as a JSON string
    for bad, message in [("<tool_call>{not json</tool_call>", "not valid JSON"),
                         ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
                         ('<tool_call>{"name": "code_interpreter", "arguments": {}}</tool_call>', "needs arguments"),
                         ("<tool_call>[1, 2]</tool_call>", "unknown tool None")]:
        [(code, error)] = parse_calls(bad)
        assert code is None and message in error, error
    ran = []
    env = ReToolEnv(run_code=lambda code, timeout: ran.append(code) or f"ran {code}\n")
    assert env.step(tool_call("print(1)")) == "ran print(1)\n" and ran == ["print(1)"]
    assert env.step("<tool_call>{oops</tool_call>").startswith("error: tool call is not valid JSON")
    both = env.step(tool_call("a") + tool_call("b"))
    assert both == "[call 1]\nran a\n\n[call 2]\nran b\n" and ran[-2:] == ["a", "b"]   # in order
    assert env.step("The answer is \\boxed{2}.") is None


def test_reward_is_plus_minus_one_on_the_boxed_answer():
    env = ReToolEnv(run_code=lambda code, timeout: "")
    def traj(turns, observations=(), finish="stop"):
        return Trajectory(example={}, prompt_index=0, prompt_ids=[], completion_ids=[], loss_mask=[],
                          sampler_logprobs=[], finish_reason=finish, num_turns=len(turns), text="".join(turns),
                          turns=list(turns), observations=list(observations))
    ex = {"question": "2^10?", "answer": "1024"}
    right = traj([tool_call("print(2**10)"), "So \\boxed{1024}."], ["1024\n"])
    wrong = traj(["<tool_call>{bad</tool_call>", "\\boxed{1000}"], ["error: tool call is not valid JSON"])
    cut = traj(["\\boxed{1024} and then"], finish="length")
    total = lambda r: sum(REWARD_WEIGHTS[k] * v for k, v in r.items())   # noqa: E731
    assert env.reward(ex, right)["correct"] == 1 and total(env.reward(ex, right)) == 1.0
    assert env.reward(ex, wrong)["correct"] == 0 and total(env.reward(ex, wrong)) == -1.0
    assert env.reward(ex, wrong)["tool_errors"] == 2 and env.reward(ex, right)["tool_calls"] == 1
    assert env.reward(ex, cut)["correct"] == 0        # a truncated answer is not a final answer


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_rollout_with_real_sandbox_calls(smollm2_path):
    from grpo.envs.sandbox import run_code
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = QWEN3_TOOLS_TEMPLATE
    model = Transformer.from_pretrained(smollm2_path).eval()
    env = TwoShotReTool(run_code=run_code, timeout=10.0)
    example = {"question": "What is 3 to the power 4?", "answer": "81"}
    params = sampling_params(env, tok, 8, 0.7, 160, seed=0, max_turns=3)
    trajs = assign_rewards(env, rollout(Sampler(model, tok, gen_batch=8), tok, env, [example], params))
    prompt = render_prompt(tok, env.prompt(example), tools=[CODE_INTERPRETER])
    assert '"name": "code_interpreter"' in tok.decode(prompt)            # the tools block, from the template
    called = [t for t in trajs if t.observations]
    assert called, [t.text for t in trajs]
    for t in called:
        first_turn_len = t.loss_mask.index(0)
        obs = continuation_ids(tok, env.prompt(example), t.turns[0], t.observations[0], "tool",
                               tools=[CODE_INTERPRETER])
        injected = t.completion_ids[first_turn_len:first_turn_len + len(obs)]
        assert injected == obs[:len(injected)]                                        # the template's own tokens
        assert t.loss_mask[first_turn_len:first_turn_len + len(injected)] == [0] * len(injected)
        # the whole observation, unless the row's token budget ended inside it
        assert len(injected) == len(obs) or (t.finish_reason == "length" and len(t.completion_ids) == 160)
        assert "<tool_response>" in tok.decode(obs) and t.observations[0] == run_code(parse_calls(t.turns[0])[0][0])
        # the sampler's log-probs are the full forward's at T 0.7 on sampled tokens, 0 on injected ones
        ids = torch.tensor([t.prompt_ids + t.completion_ids])
        with torch.no_grad():
            logp = (model(ids)[0, len(t.prompt_ids) - 1:-1] / 0.7).log_softmax(-1)
        full = logp.gather(-1, torch.tensor(t.completion_ids)[:, None])[:, 0] * torch.tensor(t.loss_mask)
        torch.testing.assert_close(torch.tensor(t.sampler_logprobs), full, atol=2e-4, rtol=0)


def test_dapo_rows_lose_the_answer_line_instruction():
    """open-r1/DAPO-Math-17k-Processed's prompt column holds DAPO's own instruction to end on an
    "Answer: $Answer" line (it fights the \\boxed{} reward): stripped; a row without it unchanged."""
    from grpo.envs.retool import dapo_example
    problem = "Find the number of ordered pairs $(a, b)$ with $a + b = 10$."
    wrapped = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n" + problem +
               '\n\nRemember to put your answer on its own line after "Answer:".')
    assert dapo_example({"question": wrapped, "answer": "11"}) == {"question": problem, "answer": "11"}
    assert dapo_example({"question": problem, "answer": "11"})["question"] == problem
    assert "Answer:" not in dapo_example({"question": wrapped.replace("\n\n", "\n"), "answer": "11"})["question"]
