"""grpo.sampler against TRL's way of using transformers without vLLM, on a GRPO run's rollouts:
calculator prompts (chat template, SHORT_SYSTEM_PROMPT), P prompts x G samples, temperature 1,
stop on EOS, max 224 tokens, tool calls answered by the calculator env.

    python bench/rollout.py                      # CPU: SmolLM2-135M fp32, 4x8 and 8x6, 1 and 3 turns
    python bench/rollout.py --quick              # 2x4, 48 tokens, one tool call (the test's run)
    python bench/rollout.py --checkpoint DIR     # natural lengths: a warm-started model, 3 seeds

Length oracle (the default): random samples would give the two sides different lengths, so
every row gets a seeded plan, the sampled length of each of its assistant turns (most rows
30-90 sampled tokens, a fifth 90-200, at least one filling max_tokens; turns of equal length),
and both sides are made to stop exactly there by the same logits rule, `force_eos`: EOS is
banned before a turn's planned last token and is the only choice at it. The baseline applies
it as a LogitsProcessor; ours through `sample`, patched here in grpo.sampler for the run (its
keys and completion positions name the row and the token). Every turn but the last ends in a
tool call: ours runs with stop_token_ids=[] and tool_stop_token_ids=[EOS], so the forced EOS
calls the tool, which answers with the template's next user turn (a fixed ~25-token calculator
output); max_turns ends the row at its last planned EOS. The baseline (TRL's multi-turn without
vLLM): generate() on the left-padded batch, prompts repeated G times (num_return_sequences);
finished rows are decoded as padding until the last ends; then, for each tool turn, the whole
conversation is rendered with the chat template again and re-prefilled for the rows that go on.
So both sides sample the same number of tokens per row and per turn (checked), and the columns
measure only the work around them. Neither side checks stop strings in this mode.

Columns: useful tokens are the sampled tokens of the final completions (observations not
counted), per second of wall time; prefill = tokens through forwards of T > 1 (padding
included); decode = rows x steps of forwards with T == 1, against the live rows, the decode
steps that produced a useful token (useful tokens minus one per turn, whose first token comes
from the prefill). Natural mode (--checkpoint) runs both with real stopping (EOS and the
</calculator> stop string), 3 seeds summed; the sides then sample different lengths.
"""
import argparse
import random
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import transformers

import grpo.sampler
import grpo.window
from grpo.envs.calculator import SHORT_SYSTEM_PROMPT, CalculatorEnv, generate_questions
from grpo.model import Transformer
from grpo.rollout import continuation_ids, render_prompt, rollout, sampling_params
from grpo.sampler import Sampler, SamplingParams
from grpo.sampling import request_key
sys.path.insert(0, str(Path(__file__).parent))  # bench/table.py, also when loaded from a file path (the test)
from table import print_table  # noqa: E402

# the oracle's tool call: the real calculator answers it with <output>176.3571429</output>,
# 27 tokens as SmolLM2's user turn plus the next assistant header
TOOL_CALL = "<calculator>\noperation: divide\noperands:\n  - 1234.5\n  - 7\n</calculator>"
BANDS = [(0.75, 30, 90), (0.2, 90, 200)]  # (share of rows, sampled tokens) at 224; the rest fill the budget


# ----------------------------------------------------------------------------- the oracle

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


@contextmanager
def planned_sample(plans: list[list[int]], keys: list[int], obs_len: int, eos: int):
    """Ours' half: grpo.sampler's `sample` with force_eos in front. A request's key names its row
    and `step` is the completion position of the token being drawn (observations included)."""
    ends = {}  # key -> completion positions where the row's turns end
    for key, plan in zip(keys, plans):
        pos, ends[key] = -obs_len, set()
        for n in plan:
            pos += obs_len + n
            ends[key].add(pos - 1)
    real = grpo.sampler.sample

    def sample(logits, key, step, *args):
        end = [s in ends.get(k, ()) for k, s in zip(key.tolist(), step.tolist())]  # host sync: CPU bench
        return real(force_eos(logits, torch.tensor(end, device=logits.device), eos), key, step, *args)

    def sample_hidden(hidden, weight, key, step, *args):  # decode steps: the logits, then the rule above
        return sample(torch.nn.functional.linear(hidden.to(weight.dtype), weight), key, step, *args)
    with mock.patch.object(grpo.sampler, "sample", sample), \
            mock.patch.object(grpo.window, "sample_hidden", sample_hidden):  # decode_step's, grpo/window.py
        yield


# ----------------------------------------------------------------------------- counting forwards

@contextmanager
def counting(model):
    """Tokens through prefill forwards (B*T, T > 1) and rows of decode forwards (T == 1): a
    pre-hook on the top module, which sees (B, T) input ids on both sides, and our sampler's
    decode steps (grpo.decode.decode_hidden over its resident weights, not the module: wrapped here)."""
    import grpo.window as window  # where the sampler's decode_step calls it
    count, inner = {"prefill": 0, "decode": 0}, window.decode_hidden

    def hook(module, args, kwargs):
        B, T = (args[0] if args else kwargs["input_ids"]).shape
        count["decode" if T == 1 else "prefill"] += B if T == 1 else B * T

    def decode(w, cache, tok, pos, n, span, *rest, **kw):
        count["decode"] += n
        return inner(w, cache, tok, pos, n, span, *rest, **kw)
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with mock.patch.object(window, "decode_hidden", decode):
            yield count
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- the two sides

def run_ours(sampler, tok, env, examples, G, max_tokens, seed, plans=None) -> list[tuple[int, int]]:
    """(sampled tokens, assistant turns) per row (prompt i's samples at i*G .. i*G+G-1)."""
    if plans is None:  # natural: exactly the recipes' call
        params = sampling_params(env, tok, G, temperature=1.0, max_tokens=max_tokens, seed=seed)
        return [(sum(t.loss_mask), t.num_turns) for t in rollout(sampler, tok, env, examples, params)]
    eos, turns = tok.eos_token_id, len(plans[0])
    messages = [env.prompt(ex) for ex in examples]
    convs, start = [list(messages[r // G]) for r in range(len(plans))], [0] * len(plans)

    def tool(r: int, ids: list[int]) -> list[int]:  # ids: row r's completion, ending in its forced EOS
        turn = tok.decode(ids[start[r]:-1])  # as rollout's tool state does: decode the turn, render what follows
        obs = env.step(TOOL_CALL)  # the real calculator, on a fixed call: oracle turns are random text
        cont = continuation_ids(tok, convs[r], turn, obs, env.observation_role)
        assert cont[0] == eos, f"the template's end of turn {cont[0]} is not the sampled EOS {eos}"
        convs[r] += [{"role": "assistant", "content": turn}, {"role": env.observation_role, "content": obs}]
        start[r] = len(ids) + len(cont) - 1
        return cont[1:]
    params = SamplingParams(n=G, temperature=1.0, max_tokens=max_tokens, stop_token_ids=[],
                            tool_stop_token_ids=[eos], max_turns=turns, seed=seed)
    keys = [request_key(seed, r // G, r % G) for r in range(len(plans))]
    obs_len = len(observation_ids(tok, env)) - 1
    with planned_sample(plans, keys, obs_len, eos):
        out = sampler.generate([render_prompt(tok, m) for m in messages], params, tool if turns > 1 else None)
    assert all(c.finish_reason != "error" for c in out), [c.error for c in out if c.error]
    return [(sum(c.loss_mask), c.num_turns) for c in out]


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
            cap = [max_tokens - (len(prompts[b]) - len(first[r // G]) if turn else 0) for b, r in enumerate(rows)]
            # a row whose observation used up the budget ends there, its turn counted, as in grpo.sampler
            # ("length"); turn 0 has one prompt per question for G rows and a full budget
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
        out = ref.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=max(cap), num_return_sequences=G if turn == 0 else 1,
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
                convs[r] += [{"role": "assistant", "content": text}, {"role": env.observation_role, "content": obs}]
                go_on.append(r)
        rows, turn = go_on, turn + 1
    return list(zip(sampled, turns))


def observation_ids(tok, env) -> list[int]:
    m = env.prompt({"question": "?"})
    return continuation_ids(tok, m, "x", env.step(TOOL_CALL), env.observation_role)


# ----------------------------------------------------------------------------- cases and table

def run_case(side, model, P: int, G: int, max_tokens: int, plans, seeds: list[int]) -> dict:
    """One side (run_ours or run_hf with its model, tokenizer and env bound) over P questions x G per
    seed: wall time, per-row sampled tokens and turns, and the forwards of `model`."""
    rows, t = [], time.perf_counter()
    with counting(model) as count:
        for seed in seeds:
            rows += side(generate_questions(P, seed=seed), G, max_tokens, seed, plans)
    return dict(seconds=time.perf_counter() - t, tokens=[n for n, _ in rows], turns=[k for _, k in rows], **count)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny: 2x4, 48 tokens, one tool call")
    ap.add_argument("--cases", default="", help="PxG:turns,... (default 4x8:1,4x8:3,8x6:1,8x6:3; turns: the oracle's, "
                    "assistant turns per row, tool calls + 1)")
    ap.add_argument("--max_tokens", type=int, default=0, help="completion budget (default 224; --quick 48)")
    ap.add_argument("--checkpoint", default="", help="natural lengths: this (warm-started) model, 3 seeds")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    max_tokens = args.max_tokens or (48 if args.quick else 224)
    cases = args.cases or ("2x4:2" if args.quick else "4x8:1,4x8:3,8x6:1,8x6:3")
    natural = bool(args.checkpoint)
    from grpo.smollm2 import local_path
    path = args.checkpoint or local_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    env = CalculatorEnv(system_prompt=SHORT_SYSTEM_PROMPT)
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sampler = Sampler(model, tok, gen_batch=128)  # as the CPU recipe's gen_batch; the cache is sized per call
    ours, hf = partial(run_ours, sampler, tok, env), partial(run_hf, ref, tok, env)
    obs_len = len(observation_ids(tok, env)) - 1
    warm = plan_turns(2, 2, 48, obs_len, 99)  # first calls allocate and fault pages in: not timed
    run_case(ours, model, 1, 2, 48, warm, [99])
    run_case(hf, ref, 1, 2, 48, warm, [99])
    rows = []
    for case in cases.split(","):
        P, G = map(int, case.split(":")[0].split("x"))
        turns = int(case.split(":")[1])
        plans = None if natural else plan_turns(P * G, turns, max_tokens, obs_len, seed=0)
        seeds = [0, 1, 2] if natural else [0]
        a = run_case(ours, model, P, G, max_tokens, plans, seeds)
        b = run_case(hf, ref, P, G, max_tokens, plans, seeds)
        if plans:  # the oracle held: the same sampled tokens and turns per row on both sides, as planned
            planned = [sum(p) for p in plans]
            assert a["tokens"] == planned == b["tokens"], f"{case}: {planned=} ours={a['tokens']} hf={b['tokens']}"
            assert a["turns"] == [turns] * P * G == b["turns"], f"{case}: ours={a['turns']} hf={b['turns']}"
        r = dict(case=case, mode="natural" if natural else "oracle", rows=P * G, turns=turns, max_tokens=max_tokens)
        for who, x in (("ours", a), ("hf", b)):
            useful = sum(x["tokens"])
            live = useful - sum(x["turns"])  # a turn's first token comes from its prefill, not a decode step
            r.update({f"{who}_s": x["seconds"], f"{who}_tokens": useful, f"{who}_tps": useful / x["seconds"],
                      f"{who}_prefill": x["prefill"], f"{who}_decode": x["decode"], f"{who}_live": live,
                      f"{who}_row_tokens": x["tokens"], f"{who}_row_turns": x["turns"]})
        r["plan_row_tokens"] = [sum(p) for p in plans] if plans else None
        r["x"] = r["ours_tps"] / r["hf_tps"]
        rows.append(r)
    cols = ["case", "mode", "ours_tokens", "hf_tokens", "ours_s", "hf_s", "ours_tps", "hf_tps", "ours_prefill",
            "hf_prefill", "ours_decode", "hf_decode", "ours_live", "hf_live", "x"]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
