"""Multi-turn rollouts on the real SmolLM2 with the calculator tool: a trajectory is the
exact token ids that were sampled or injected, in the chat template's own layout, and the gold
demonstrations of the warm-start use that very layout.

SmolLM2 untrained never writes the tool format from the system prompt alone (0 of 32 samples), so the
prompt carries a one-shot episode (question, tool call, observation, answer) before the real
question: greedy, it then calls the calculator, reads the observation and answers.
"""
import pytest
import torch
from transformers import AutoTokenizer

from grpo.engine.sampler import Sampler
from grpo.envs.calculator import (BAD_NAMES, SYSTEM_PROMPT, CalculatorEnv, generate_questions, gold_call,
                                  gold_messages, mistaken_call, run_tool)
from grpo.envs.calculator_phrasing import HELDOUT, RL, TRAIN
from grpo.models.model import Transformer
from grpo.rollout import Trajectory, continuation_ids, render_prompt, rollout, sampling_params
from grpo.sft import gold_trajectory

SHOT = {"question": "What is 2 plus 3?", "expression": "2 + 3", "answer": 5.0}


class OneShotCalculatorEnv(CalculatorEnv):
    def prompt(self, example: dict) -> list[dict]:
        return ([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": SHOT["question"]}]
                + gold_messages(SHOT) + [{"role": "user", "content": example["question"]}])


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return Transformer.from_pretrained(smollm2_path).eval(), AutoTokenizer.from_pretrained(smollm2_path)


def test_multi_turn_rollout_is_exactly_what_was_sampled_and_injected(smollm2):
    model, tok = smollm2
    env = OneShotCalculatorEnv()
    example = {"question": "What is 4 plus 7?", "answer": 11.0}
    params = sampling_params(env, tok, G=1, temperature=0.0, max_tokens=64, seed=0, max_turns=3)
    [t] = rollout(Sampler(model, tok, gen_batch=2), tok, env, [example], params)
    eos = model.eos_token_ids()[0]
    assert t.num_turns >= 2 and t.finish_reason == "stop", f"no tool call: {tok.decode(t.completion_ids)!r}"
    assert t.completion_ids[-1] == eos and t.loss_mask[-1] == 1
    assert len(t.completion_ids) == len(t.loss_mask) == len(t.sampler_logprobs)

    # 1. the layout: sampled turn, injected observation, sampled turn, ...; each injected run is
    # exactly what the template adds after that turn, for the observation the tool gave
    segments = runs(t.loss_mask)
    assert [m for m, _, _ in segments] == [1, 0] * (t.num_turns - 1) + [1]
    messages = env.prompt(example)
    assert t.prompt_ids == render_prompt(tok, messages)
    for k, (_, start, end) in enumerate(segments[:-1:2]):
        turn = tok.decode(t.completion_ids[start:end])
        assert turn == t.turns[k] and "</calculator>" in turn
        assert t.observations[k] == run_tool(turn)
        injected = t.completion_ids[end:segments[2 * k + 1][2]]
        assert injected == continuation_ids(tok, messages, turn, t.observations[k], "user")
        messages = messages + [{"role": "assistant", "content": turn}, {"role": "user", "content": t.observations[k]}]
    final = tok.decode(t.completion_ids[segments[-1][1]:-1])  # the answer turn, without its EOS
    assert t.turns[-1] == final

    # 2. re-render: prompt + completion is the template's rendering of the whole conversation
    # (the template ends each turn with "<|im_end|>\n"; the episode stops at the EOS)
    conversation = messages + [{"role": "assistant", "content": final}]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(t.prompt_ids + t.completion_ids) == rendered.removesuffix("\n")

    # 3. masks and log-probs: sampled tokens carry their (nonzero) log-prob, injected ones 0
    for lp, m in zip(t.sampler_logprobs, t.loss_mask):
        assert (lp < 0) if m else (lp == 0.0), (lp, m)

    # 4. the cache after each injection was right: a plain forward over the whole sequence gives
    # the same log-probs at sampled positions, and greedy picked its argmax there
    ids = torch.tensor([t.prompt_ids + t.completion_ids])
    P = len(t.prompt_ids)
    with torch.no_grad():
        logp = model(ids)[0, P - 1:-1].float().log_softmax(-1)  # (C, V): position P-1+j predicts completion j
    sampled = torch.tensor(t.loss_mask, dtype=torch.bool)
    target = torch.tensor(t.completion_ids)
    assert (logp.argmax(-1)[sampled] == target[sampled]).all()
    # fp32, cached decode vs one full forward: summation order differs, ~1e-5
    torch.testing.assert_close(logp.gather(-1, target[:, None])[:, 0][sampled],
                               torch.tensor(t.sampler_logprobs)[sampled], atol=2e-3, rtol=0)

    # 5. the gold renderer gives the same layout for the same turns: same masks, same injected ids,
    # same text (ids equal too wherever the model sampled the tokenizer's own split of its text)
    class Replay(OneShotCalculatorEnv):
        def gold_messages(self, ex):
            out = []
            for turn, obs in zip(t.turns, t.observations):
                out += [{"role": "assistant", "content": turn}, {"role": "user", "content": obs}]
            return out + [{"role": "assistant", "content": final}]

    gold = gold_trajectory(tok, Replay(), example, eos)
    assert gold.prompt_ids == t.prompt_ids and gold.num_turns == t.num_turns
    assert tok.decode(gold.completion_ids) == tok.decode(t.completion_ids)
    if all(tok.encode(tok.decode(t.completion_ids[s:e]), add_special_tokens=False) == t.completion_ids[s:e]
           for m, s, e in segments if m == 1):
        assert gold.completion_ids[:-1] == t.completion_ids[:-1] and gold.loss_mask == t.loss_mask


def test_gold_trajectory_layout(smollm2_path):
    """Warm-start data, rendered in the rollout layout: turns (mask 1), the template's own
    observation tokens (mask 0), the final EOS (mask 1); decoded, the chat template's rendering."""
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    env = CalculatorEnv()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for example in generate_questions(3, seed=0, split="train"):
        gold = gold_messages(example)
        t = gold_trajectory(tok, env, example, eos)
        assert t.prompt_ids == render_prompt(tok, env.prompt(example))
        segments = runs(t.loss_mask)
        assert [m for m, _, _ in segments] == [1, 0, 1] and t.num_turns == 2
        (_, a, b), (_, _, c), (_, _, d) = segments
        assert t.completion_ids[a:b] == tok.encode(gold[0]["content"], add_special_tokens=False)
        observation = continuation_ids(tok, env.prompt(example), gold[0]["content"], gold[1]["content"], "user")
        assert t.completion_ids[b:c] == observation
        assert t.completion_ids[c:d - 1] == tok.encode(gold[2]["content"], add_special_tokens=False)
        assert t.completion_ids[-1] == eos
        rendered = tok.apply_chat_template(env.prompt(example) + gold, tokenize=False)
        assert tok.decode(t.prompt_ids + t.completion_ids) == rendered.removesuffix("\n")


@pytest.mark.parametrize("mistake", ["one_operand", "bad_name"])
def test_gold_trajectory_with_a_corrected_mistake(smollm2_path, mistake):
    """A gold episode that opens with a mistaken call: its tokens are context (mask 0), the tool's
    error follows, then the correction and the answer are learned (mask 1), and the episode
    scores as correct; rendered, it is the chat template's rendering of all five messages."""
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    env = CalculatorEnv()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    example = {**generate_questions(1, seed=4, min_ops=2)[0], "mistake": mistake}
    gold = gold_messages(example)
    assert gold[0]["learn"] is False and gold[1]["content"].startswith("<output>Error: ")
    t = gold_trajectory(tok, env, example, eos)
    segments = runs(t.loss_mask)
    assert [m for m, _, _ in segments] == [0, 1, 0, 1] and t.num_turns == 3
    (_, _, a), (_, _, b) = segments[0], segments[1]  # [0, a): the mistake and its error; [a, b): the fix
    wrong = tok.encode(gold[0]["content"], add_special_tokens=False)
    assert t.completion_ids[:len(wrong)] == wrong and "Error" in tok.decode(t.completion_ids[len(wrong):a])
    assert t.completion_ids[a:b] == tok.encode(gold[2]["content"], add_special_tokens=False)
    assert env.reward(example, t)["correct"] == 1.0 and t.observations[0] == gold[1]["content"]
    rendered = tok.apply_chat_template(env.prompt(example) + gold, tokenize=False)
    assert tok.decode(t.prompt_ids + t.completion_ids) == rendered.removesuffix("\n")


@pytest.mark.parametrize("mistake", ["one_operand", "bad_name"])
def test_a_grpo_prompt_can_open_with_the_warm_starts_mistake(smollm2_path, mistake):
    """`opening_mistake` puts a mistaken call and its error in the prompt, so GRPO samples the
    correction: the prompt's text is the warm-start's episode up to its correction (the template
    tokenizes it whole, so the ids may split differently), and a right correction scores 1."""
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    env = CalculatorEnv()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    example = generate_questions(1, seed=4, min_ops=2)[0]
    gold = gold_trajectory(tok, env, {**example, "mistake": mistake}, eos)
    context = runs(gold.loss_mask)[0][2]  # the mistake, its error and the next assistant header
    prompt = render_prompt(tok, env.prompt({**example, "opening_mistake": mistake}))
    assert prompt != render_prompt(tok, env.prompt(example))
    assert tok.decode(prompt) == tok.decode(gold.prompt_ids + gold.completion_ids[:context])
    fix = Trajectory({}, 0, prompt, [], [], [], "stop", 2, turns=[gold_call(example), f"Answer: {example['answer']}"],
                     observations=[run_tool(gold_call(example))])
    assert env.reward({**example, "opening_mistake": mistake}, fix)["correct"] == 1.0


def test_bad_names_vary_and_avoid_the_held_out_words():
    """The misnamed calls use words of the TRAIN and RL books only, several per operation, and the
    tool refuses each of them."""
    heldout = " ".join(str(v) for v in HELDOUT.values()).lower()
    training = " ".join(str(v) for book in (TRAIN, RL) for v in book.values()).lower()
    words = [w for names in BAD_NAMES.values() for w in names]
    assert not [w for w in words if w in heldout] and not [w for w in words if w not in training]
    names = set()
    for example in generate_questions(60, seed=1):
        call = mistaken_call(example, "bad_name")
        names.add(call.split("operation: ")[1].split("\n")[0])
        assert run_tool(call).startswith("<output>Error: unknown operation")
    assert len(names) >= 12, names


def test_continuation_ids_refuse_a_template_that_rewrites_history(smollm2_path):
    """Appending observation tokens in place is only right if earlier turns render unchanged;
    a template that rewrites them (here: drops earlier assistant turns) must be an error."""
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        continuation_ids(tok, [{"role": "user", "content": "2+3?"}], "<calculator>x</calculator>", "<output>5</output>", "user")


def test_max_turns_of_the_config_wins_over_the_envs():
    env = CalculatorEnv()  # max_turns 4
    turns = lambda n: sampling_params(env, None, G=2, temperature=1.0, max_tokens=8, seed=0, max_turns=n).max_turns
    assert (turns(0), turns(2), turns(6)) == (env.max_turns, 2, 6)
    env.stop_strings = []  # no tool: one turn whatever is asked
    assert turns(3) == 1
