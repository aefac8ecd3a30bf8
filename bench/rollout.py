"""grpo.engine.sampler against TRL's way of using transformers without vLLM, on a GRPO run's rollouts:
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
it as a LogitsProcessor; ours through `sample`, patched here in grpo.engine.runner for the run (its
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
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import transformers

import grpo.engine.runner
import grpo.engine.window
from grpo.measure.baseline import TOOL_CALL, force_eos, plan_turns, run_hf  # the baseline and the oracle's rule
from grpo.envs.calculator import SHORT_SYSTEM_PROMPT, CalculatorEnv, generate_questions
from grpo.models.model import Transformer
from grpo.rollout import continuation_ids, render_prompt, rollout, sampling_params
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.engine.sampling import request_key
sys.path.insert(0, str(Path(__file__).parent))  # bench/table.py
from table import print_table  # noqa: E402


# ----------------------------------------------------------------------------- the oracle: ours' half

@contextmanager
def planned_sample(plans: list[list[int]], keys: list[int], obs_len: int, eos: int):
    """Ours' half: grpo.engine.runner's `sample` with force_eos in front. A request's key names its row
    and `step` is the completion position of the token being drawn (observations included)."""
    ends = {}  # key -> completion positions where the row's turns end
    for key, plan in zip(keys, plans):
        pos, ends[key] = -obs_len, set()
        for n in plan:
            pos += obs_len + n
            ends[key].add(pos - 1)
    real = grpo.engine.runner.sample

    def sample(logits, key, step, *args, **kw):
        end = [s in ends.get(k, ()) for k, s in zip(key.tolist(), step.tolist())]  # host sync: CPU bench
        return real(force_eos(logits, torch.tensor(end, device=logits.device), eos), key, step, *args, **kw)

    def sample_hidden(hidden, weight, key, step, *args, packed=None, **kw):  # decode steps: the logits, the rule above
        return sample(torch.nn.functional.linear(hidden.to(weight.dtype), weight), key, step, *args, **kw)
    with mock.patch.object(grpo.engine.runner, "sample", sample), \
            mock.patch.object(grpo.engine.window, "sample_hidden", sample_hidden):  # decode_step's, grpo/engine/window.py
        yield


# ----------------------------------------------------------------------------- counting forwards

@contextmanager
def counting(model):
    """Tokens through prefill forwards (B*T, T > 1) and rows of decode forwards (T == 1): a
    pre-hook on the top module, which sees (B, T) input ids on both sides, and our sampler's
    decode steps (grpo.engine.decode.decode_hidden over its resident weights, not the module: wrapped here)."""
    import grpo.engine.window as window  # where the sampler's decode_step calls it
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
    from grpo.models.smollm2 import local_path
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
