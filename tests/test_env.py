"""The env contract (grpo/env.py) against every env the package ships, and what as_env gives a plain class."""
import inspect

import pytest

from grpo.env import OPTIONAL, REQUIRED, Env, EnvView, as_env
from grpo.envs.calculator import CalculatorEnv
from grpo.envs.gsm8k import GSM8KEnv
from grpo.envs.math import MathEnv
from grpo.envs.processgrpo import OneShotMathEnv
from grpo.envs.retool import ReToolEnv
from grpo.envs.retool_small import TwoShotReTool
from grpo.rewards import RewardFunctionsEnv

ENVS = [CalculatorEnv, GSM8KEnv, MathEnv, OneShotMathEnv, ReToolEnv, TwoShotReTool]
TYPES = {"stop_strings": (list, tuple), "max_turns": int, "observation_role": str, "chat_kwargs": dict,
         "score_term": str}
ARITY = {"prompt": 1, "reward": 2, "step": 1, "answered": 1, "extract": 1, "gold_messages": 1, "reward_batch": 2}


def test_the_contract_lists_every_member_once():
    assert set(REQUIRED) | set(OPTIONAL) == set(TYPES) | set(ARITY)
    assert not set(REQUIRED) & set(OPTIONAL)


@pytest.mark.parametrize("cls", ENVS, ids=lambda c: c.__name__)
def test_every_shipped_env_keeps_the_contract(cls):
    """Each env's members, where it defines them, have the contract's types and arities; the required
    ones exist. A renamed member (stop_string, max_turn) would not be read and fails here instead."""
    for name in REQUIRED:
        assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name}"
    own = {k for c in cls.__mro__ if c is not object for k in vars(c) if not k.startswith("_")}
    for name in own & set(TYPES):
        assert isinstance(getattr(cls, name), TYPES[name]), f"{cls.__name__}.{name}"
    for name in own & set(ARITY):
        member = getattr(cls, name)
        if callable(member):
            params = [p for p in inspect.signature(member).parameters.values() if p.name != "self"]
            assert len([p for p in params if p.default is inspect.Parameter.empty]) == ARITY[name], name
    near = {k for k in own if k not in REQUIRED + OPTIONAL for m in REQUIRED + OPTIONAL
            if k != m and k.rstrip("s") == m.rstrip("s")}
    assert not near, f"{cls.__name__}: {near} looks like a misspelled contract member"


def test_as_env_fills_a_plain_class_and_refuses_a_non_env():
    class Plain:
        max_turns = 3

        def prompt(self, example):
            return [{"role": "user", "content": example["question"]}]

        def reward(self, example, trajectory):
            return {"correct": 1.0}

    env = as_env(Plain())
    assert isinstance(env, EnvView) and as_env(env) is env
    assert env.max_turns == 3 and env.stop_strings == () and env.score_term == "correct"
    assert env.step("x") is None and env.answered(None) is False and env.extract(None) is None
    assert env.reward_batch is None and env.gold_messages is None
    assert env.prompt({"question": "q"})[0]["content"] == "q"
    with pytest.raises(AttributeError):
        env.not_a_member
    with pytest.raises(TypeError, match="needs reward()"):
        as_env(type("PromptsOnly", (), {"prompt": lambda self, e: "p"})())
    tool_only = as_env(type("PromptsOnly", (), {"prompt": lambda self, e: "p"})(), rewards=False)
    assert tool_only.reward({}, None) == {}
    calc = CalculatorEnv()
    assert as_env(calc).extract is not None and as_env(calc).stop_strings == ["</calculator>"]


def test_reward_functions_take_the_base_envs_protocol():
    env = RewardFunctionsEnv({}, base=CalculatorEnv())
    assert isinstance(env, Env) and env.stop_strings == ["</calculator>"] and env.max_turns == 4
    plain = RewardFunctionsEnv({"f": lambda prompts, completions, **kw: [1.0] * len(completions)})
    assert plain.stop_strings == () and plain.score_term == "f" and plain.step("x") is None


def test_an_env_subclass_without_reward_gives_prompts_and_a_tool_only():
    class ToolOnly(Env):
        stop_strings = ("</call>",)

        def prompt(self, example):
            return "p"

    env = RewardFunctionsEnv({"f": lambda prompts, completions, **kw: [0.5] * len(completions)}, base=ToolOnly())
    from types import SimpleNamespace
    row = SimpleNamespace(text="done", completion_ids=[1, 2])
    assert env.stop_strings == ("</call>",) and env.reward_batch([{}], [row]) == [{"f": 0.5}]
