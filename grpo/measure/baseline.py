"""The usual way, which bench/rollout.py measures grpo.engine.sampler against: TRL's multi-turn rollouts
without vLLM (`run_hf`: transformers' generate() on the left-padded batch, prompts repeated G times,
then per tool turn the whole conversation rendered again and re-prefilled for the rows that go on),
and the length oracle under which both sides sample the same tokens per row and turn (`plan_turns`:
each row's planned turn lengths; `force_eos`: EOS banned before a turn's planned end and forced at
it; `PlannedEOS`: that rule as the baseline's LogitsProcessor). Imports transformers (the baseline
is its generate()); the bench and its test are its only users.
"""
import random

import torch
import transformers

from grpo.rollout import render_prompt

# the oracle's tool call: the real calculator answers it with <output>176.3571429</output>,
# 27 tokens as SmolLM2's user turn plus the next assistant header
TOOL_CALL = "<calculator>\noperation: divide\noperands:\n  - 1234.5\n  - 7\n</calculator>"
BANDS = [(0.75, 30, 90), (0.2, 90, 200)]  # (share of rows, sampled tokens) at 224; the rest fill the budget



def plan_turns(R: int, turns: int, max_tokens: int, obs_len: int, seed: int) -> list[list[int]]:
    """Per row, the sampled tokens of each assistant turn, each turn ending in its forced EOS.
    Bands scale with max_tokens / 224 (so --quick keeps the mix); a row's sampled tokens plus its
    (turns - 1) observations fit in max_tokens, and the 'max' rows fill it exactly."""
    rng, scale = random.Random(f"rollout-plan-{seed}"), max_tokens / 224
    cap = max_tokens - (turns - 1) * obs_len  # sampled tokens that fit beside the observations
    assert cap >= 4 * turns, f"{max_tokens=} leaves {cap} sampled tokens for {turns} turns"
    counts = [round(share * R) for share, _, _ in BANDS]
    kinds = [k for k, c in enumerate(counts) for _ in range(c)][: R - 1]
    kinds += [None] * (R - len(kinds))  # None: fills the budget (at least one row)
    rng.shuffle(kinds)
    plans = []
    for k in kinds:
        n = cap if k is None else rng.randint(round(BANDS[k][1] * scale), round(BANDS[k][2] * scale))
        n = min(max(n, 4 * turns), cap)
        plans.append([n // turns] * (turns - 1) + [n - (turns - 1) * (n // turns)])
    return plans


def force_eos(logits: torch.Tensor, end: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, V) logits, (B,) bool -> the same logits, in place: EOS is impossible unless the row is
    at its planned end, and there it is the only choice. Both sides sample through this."""
    logits[:, eos] = float("-inf")
    logits.masked_fill_(end[:, None], float("-inf"))
    logits[end, eos] = 0.0
    return logits


class PlannedEOS(transformers.LogitsProcessor):
    """The baseline's half of the oracle, for one generate() call: row b ends at lengths[b]."""
    def __init__(self, lengths: list[int], prompt_len: int, eos: int):
        self.last, self.prompt_len, self.eos = torch.tensor(lengths) - 1, prompt_len, eos

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len  # tokens generated this turn, the same in every row
        return force_eos(scores, self.last == step, self.eos)


@torch.no_grad()
def run_hf(ref, tok, env, examples, G, max_tokens, seed, plans=None) -> list[tuple[int, int]]:
    """TRL without vLLM: generate() on the left-padded batch, then per tool turn the whole
    conversation re-rendered and re-prefilled for the rows that go on. (sampled, turns) per row."""
    torch.manual_seed(seed)
    eos, stop = tok.eos_token_id, env.stop_strings[0]
    messages = [env.prompt(ex) for ex in examples]
    R = len(messages) * G
    convs, sampled, turns = [list(messages[r // G]) for r in range(R)], [0] * R, [0] * R
    first = [render_prompt(tok, m) for m in messages]
    rows, turn = list(range(R)), 0
    while rows:
        # turn 0: each prompt once, G copies made by num_return_sequences; then the conversations
        prompts = first if turn == 0 else [render_prompt(tok, convs[r]) for r in rows]
        if plans:  # each row's planned length for this turn, forced
            cap = [plans[r][turn] for r in rows]
        else:  # the budget left: the completion so far is what the template adds after the first prompt
            cap = [max_tokens - (len(prompts[b]) - len(first[r // G]) if turn else 0)
                   for b, r in enumerate(rows)]
            # a row whose observation used up the budget ends there, its turn counted, as in
            # grpo.engine.sampler ("length"); turn 0 has one prompt per question for G rows and a full budget
            if turn:
                for r, c in zip(rows, cap):
                    turns[r] += c <= 0
                kept = [(r, p, c) for r, p, c in zip(rows, prompts, cap) if c > 0]
                if not kept:
                    break
                rows, prompts, cap = map(list, zip(*kept))
        L = max(map(len, prompts))  # left padding, as generate wants for batches
        ids = torch.tensor([[eos] * (L - len(p)) + p for p in prompts])  # (B, L)
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
        kw = (dict(logits_processor=transformers.LogitsProcessorList([PlannedEOS(cap, L, eos)])) if plans
              else dict(stop_strings=env.stop_strings, tokenizer=tok))
        out = ref.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=max(cap), num_return_sequences=G if turn == 0 else 1,
                           eos_token_id=eos, pad_token_id=eos, **kw)  # (B * copies, L + new)
        go_on = []
        for b, r in enumerate(rows):
            gen = out[b, L:].tolist()
            n = min(gen.index(eos) + 1 if eos in gen else len(gen), cap[b])
            text = tok.decode(gen[:n - (gen[n - 1] == eos)])
            if not plans and stop in text and gen[n - 1] == eos:
                n -= 1  # the stop string ended the row: that EOS is padding
            sampled[r], turns[r] = sampled[r] + n, turn + 1
            more = turn + 1 < len(plans[r]) if plans else (
                stop in text and turn + 1 < env.max_turns and n < cap[b])
            if more:
                obs = env.step(TOOL_CALL if plans else text)
                convs[r] += [{"role": "assistant", "content": text},
                             {"role": env.observation_role, "content": obs}]
                go_on.append(r)
        rows, turn = go_on, turn + 1
    return list(zip(sampled, turns))
