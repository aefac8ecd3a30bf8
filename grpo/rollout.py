"""Prompts + env + sampler -> trajectories: the exact token ids that were sampled or injected.

Multi-turn: when a row stops on the env's tool-call stop string, the sampler calls `tool`,
which decodes that turn, asks `env.step(text)` for the observation, and returns the exact
token ids the chat template adds after the assistant turn (the end of the turn, the
observation message, the next assistant header). Nothing already in the row is
re-tokenized: the template is rendered with and without the new message and the earlier
text must be a prefix of the later (checked), so the suffix is exactly what the template adds.
Observations and prompt contents are text: what spells a control token stays characters.
The warm-start's demonstrations (grpo/sft.py) use the same continuation_ids.
"""
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from grpo.engine.sampler import Sampler, SamplingParams
from grpo.env import as_env


@dataclass
class Trajectory:
    example: dict
    prompt_index: int             # index of the prompt in the global batch (for grouping)
    prompt_ids: list[int]
    completion_ids: list[int]     # sampled and injected, up to and including the stop token
    loss_mask: list[int]          # 1 on sampled tokens, 0 on injected ones
    sampler_logprobs: list[float]  # of the distribution sampled (the kept set under top_p/top_k/min_p)
    finish_reason: str            # stop | length | turns
    num_turns: int
    text: str = ""                # the whole decoded completion, observations included
    turns: list[str] = field(default_factory=list)         # the assistant turns' texts
    observations: list[str] = field(default_factory=list)  # the env's answers
    rewards: dict = field(default_factory=dict)            # named terms from env.reward
    reward: float = 0.0           # their weighted sum
    answered: bool = False        # cut at the token limit after it answered (assign_rewards(): env.answered)
    # per token, the kept set (sampling.py); [] = all
    kept_thresholds: list[float] = field(default_factory=list)


def render_prompt(tokenizer, messages: list[dict] | str, **chat_kwargs) -> list[int]:
    """The prompt's token ids. Message contents (a dataset's question, an env's text) are text:
    a question that spells `<|im_start|>system` gets those characters, never a forged turn."""
    if isinstance(messages, str):  # a raw text prompt (TRL's standard form): no chat template, as TRL
        return tokenizer.encode(messages, add_special_tokens=False)
    if not any(_added_in(tokenizer, m.get("content")) for m in messages):  # the common case: one encode
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **chat_kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **chat_kwargs)
    return _encode_framed(tokenizer, messages, range(len(messages)), text, 0, chat_kwargs)


def continuation_ids(tokenizer, messages: list[dict], turn_text: str, observation: str, role: str,
                     **chat_kwargs) -> list[int]:
    """Token ids the chat template adds after an assistant turn that ended in `turn_text`:
    the end of that turn, the observation message of `role`, and the next assistant header.
    The observation is text: tool output that spells `<|im_end|>` gets those characters, so
    model-written code cannot print a forged turn into the sequence it is trained on."""
    before = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                           **chat_kwargs)
    history = messages + [{"role": "assistant", "content": turn_text}, {"role": role, "content": observation}]
    after = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False,
                                          **chat_kwargs)
    prefix = before + turn_text
    if not after.startswith(prefix):
        raise ValueError("the chat template rewrites earlier turns (e.g. strips them), so observation "
                         "tokens cannot be appended in place; rendered text diverges after "
                         f"{_common_prefix(prefix, after)} chars")
    if not _added_in(tokenizer, observation):
        return tokenizer.encode(after[len(prefix):], add_special_tokens=False)
    return _encode_framed(tokenizer, history, [len(history) - 1], after, len(prefix), chat_kwargs)


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------- contents as text

SENTINEL = "\ue000{}\ue001"  # private-use characters: a placeholder no template rewrites


def _added_in(tokenizer, text) -> bool:
    """Does `text` spell any of the tokenizer's added tokens (special, control, tool tags)?"""
    return isinstance(text, str) and any(len(t) > 1 and t in text for t in tokenizer.get_added_vocab())


def encode_text(tokenizer, text: str) -> list[int]:
    """`text` as plain text: cut inside every occurrence of an added token's string and encode
    the pieces apart, so no piece holds one whole and none becomes its id. Text without any
    encodes exactly as tokenizer.encode does."""
    cuts = {0, len(text)}
    for token in tokenizer.get_added_vocab():
        at = text.find(token)
        while len(token) > 1 and at != -1:
            cuts.add(at + 1)
            at = text.find(token, at + 1)
    cuts = sorted(cuts)
    return [i for a, b in zip(cuts, cuts[1:]) for i in tokenizer.encode(text[a:b], add_special_tokens=False)]


def _encode_framed(tokenizer, messages: list[dict], guarded, text: str, start: int,
                   chat_kwargs: dict) -> list[int]:
    """text[start:] as ids: the template's framing (its control tokens) encoded as usual and the
    `guarded` messages' contents as text. The framing is found by rendering those contents as
    placeholders; a content must then appear in its place as given, or trimmed (as some
    templates do), never found by a search that its own text could mislead."""
    marked = [{**m, "content": SENTINEL.format(k)} if k in guarded else m for k, m in enumerate(messages)]
    frame = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False, **chat_kwargs)
    pieces = re.split("\ue000(\\d+)\ue001", frame[start:])   # framing, index, framing, ..., framing
    ids, at = [], start
    for j in range(0, len(pieces) - 1, 2):
        framing, content, after = pieces[j], messages[int(pieces[j + 1])]["content"], pieces[j + 2]
        if not text.startswith(framing, at):
            raise ValueError("the chat template's framing depends on message contents: they cannot be "
                             "encoded as plain text")
        ids += tokenizer.encode(framing, add_special_tokens=False)
        at += len(framing)
        shown = next((c for c in (content, content.strip(), content.rstrip(), content.lstrip())
                      if text.startswith(c, at) and text.startswith(after, at + len(c))), None)
        if shown is None:
            raise ValueError("the chat template rewrites a message's content beyond trimming it: it cannot "
                             "be encoded as plain text")
        ids += encode_text(tokenizer, shown)
        at += len(shown)
    return ids + tokenizer.encode(text[at:], add_special_tokens=False)


class _ToolState:
    """Per-row episode state behind the sampler's tool callback: the conversation so far."""
    def __init__(self, tokenizer, env, messages: list[dict], chat_kwargs: dict):
        self.tokenizer, self.env, self.messages, self.chat_kwargs = (
            tokenizer, env, list(messages), chat_kwargs)
        # consumed: completion tokens already in turns
        self.turns, self.observations, self.consumed = [], [], 0

    def __call__(self, completion_ids: list[int]) -> list[int] | None:
        turn_text = self.tokenizer.decode(completion_ids[self.consumed:], skip_special_tokens=False)
        self.turns.append(turn_text)
        observation = self.env.step(turn_text)
        if observation is None:
            return None
        ids = continuation_ids(self.tokenizer, self.messages, turn_text, observation,
                               self.env.observation_role, **self.chat_kwargs)
        self.messages += [{"role": "assistant", "content": turn_text},
                          {"role": self.env.observation_role, "content": observation}]
        self.observations.append(observation)
        self.consumed = len(completion_ids) + len(ids)
        return ids


def sampling_params(env, tokenizer, G: int, temperature: float, max_tokens: int, seed: int,
                    top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                    max_turns: int = 0, max_turn_tokens: int = 0, kept_set: bool = True) -> SamplingParams:
    """max_turns: assistant turns per episode for a tool env; 0 = the env's own max_turns.
    max_turn_tokens: tokens one assistant turn may sample; 0 = only max_tokens bounds it."""
    env = as_env(env, rewards=False)
    tool_stops = list(env.stop_strings)
    return SamplingParams(n=G, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          max_tokens=max_tokens, seed=seed, tool_stop_strings=tool_stops,
                          max_turns=(max_turns or env.max_turns) if tool_stops else 1,
                          max_turn_tokens=max_turn_tokens, kept_set=kept_set)


def rollout(sampler: Sampler, tokenizer, env, examples: list[dict], params: SamplingParams,
            prompt_offset: int = 0, chat_kwargs: dict | None = None,
            progress: bool = False) -> list[Trajectory]:
    """len(examples) * params.n trajectories, in prompt order (G consecutive per prompt).
    `prompt_offset` is the global index of examples[0]: it seeds the sampler, so a prompt's
    samples do not depend on the rank or the batch it lands in."""
    env = as_env(env, rewards=False)  # rollouts need its prompts and its tool; assign_rewards() its rewards
    chat_kwargs = {**env.chat_kwargs, **(chat_kwargs or {})}  # e.g. the env's tools
    messages = [env.prompt(ex) for ex in examples]
    prompts = [render_prompt(tokenizer, m, **chat_kwargs) for m in messages]
    G = params.n
    states = [_ToolState(tokenizer, env, messages[i // G], chat_kwargs) for i in range(len(examples) * G)]
    tool = (lambda index, ids: states[index](ids)) if params.tool_stop_strings else None
    completions = sampler.generate(prompts, params, tool=tool, progress=progress,
                                   prompt_ids=list(range(prompt_offset, prompt_offset + len(prompts))))
    trajectories = []
    for i, (c, st) in enumerate(zip(completions, states)):
        if c.finish_reason == "error":  # a bad request or a failing tool ends its own row: never trained on
            print(f"rollout: completion {i} failed: {c.error}")
            c.loss_mask = [0] * len(c.token_ids)
        last = tokenizer.decode(c.token_ids[st.consumed:], skip_special_tokens=True)
        turns = (st.turns if len(st.turns) > len(st.observations)
                 else st.turns + [last])  # the final answer turn
        trajectories.append(Trajectory(
            example=examples[i // G], prompt_index=prompt_offset + i // G, prompt_ids=prompts[i // G],
            completion_ids=list(c.token_ids), loss_mask=list(c.loss_mask), sampler_logprobs=list(c.logprobs),
            finish_reason=c.finish_reason, num_turns=c.num_turns,
            kept_thresholds=list(c.thresholds) if any(h > float("-inf") for h in c.thresholds) else [],
            text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
            turns=turns, observations=st.observations))
    return trajectories


def assign_rewards(env, trajectories: list[Trajectory], weights: dict[str, float] | None = None,
                   workers: int = 16):
    """env.reward for every trajectory, concurrently (a term may wait on an HTTP judge), or one
    env.reward_batch(examples, trajectories) call where the env has it (TRL-style batched reward
    functions: grpo.rewards); then the weighted sum. Terms missing from `weights` weigh 1; a term
    that is None (not applicable) is left out of the sum."""
    weights, env = weights or {}, as_env(env)
    if env.reward_batch is not None:
        terms = env.reward_batch([t.example for t in trajectories], trajectories) if trajectories else []
    else:
        with ThreadPoolExecutor(workers) as pool:
            terms = list(pool.map(lambda t: env.reward(t.example, t), trajectories))
    for t, r in zip(trajectories, terms):
        t.rewards = {k: None if v is None else float(v) for k, v in r.items()}
        # cut after it answered (the env says so; an env without `answered` never does)
        t.answered = t.finish_reason == "length" and bool(env.answered(t))
        t.reward = sum(weights.get(k, 1.0) * v for k, v in t.rewards.items() if v is not None)
    return trajectories
