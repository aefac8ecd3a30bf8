"""bench/rollout.py: its --quick run (our sampler and the transformers baseline on SmolLM2, one tool
call per row) prints the table and a JSON line in which both sides sampled exactly the planned
tokens per row and turns (the length oracle held), run as a process; and, from the package (grpo.measure.baseline),
the plan has the promised shape and natural mode's baseline ends a row whose tool observation spent its
budget, with a stand-in model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.measure import baseline
from grpo.rollout import render_prompt

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "rollout.py"
COLS = ["case", "mode", "ours_tokens", "hf_tokens", "ours_s", "hf_s", "ours_tps", "hf_tps", "ours_prefill",
        "hf_prefill", "ours_decode", "hf_decode", "ours_live", "hf_live", "x"]


def test_plan_fits_the_budget_and_fills_it_once():
    for R, turns, max_tokens in ((32, 1, 224), (48, 3, 224), (8, 2, 48), (5, 1, 64)):
        plans = baseline.plan_turns(R, turns, max_tokens, obs_len=27, seed=R)
        assert len(plans) == R and all(len(p) == turns and min(p) >= 4 for p in plans), plans
        totals = [sum(p) + (turns - 1) * 27 for p in plans]  # completion tokens: sampled + observations
        assert max(totals) == max_tokens, totals  # at least one row runs to the budget
        assert len(set(totals)) > 2, totals  # and the others do not all stop together


def test_force_eos_bans_eos_before_the_end_and_forces_it_there():
    logits = torch.randn(3, 11)
    logits[:, 4] = 50.0  # EOS would win everywhere
    out = baseline.force_eos(logits.clone(), torch.tensor([False, True, False]), eos=4)
    assert out.argmax(-1)[1] == 4 and (out[1] == float("-inf")).sum() == 10
    assert out[[0, 2], 4].eq(float("-inf")).all() and out[[0, 2]].argmax(-1).ne(4).all()


def test_quick_run_oracle_gives_both_sides_the_same_tokens(smollm2_path):
    # one thread: on a shared 2-core machine much faster than torch's default (conftest.one_thread)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| case |"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == COLS
    table = lines[header + 2:-1]
    assert len(table) == 1 and len(table[0].strip("|").split("|")) == len(COLS), table
    (row,) = json.loads(lines[-1])
    assert (row["case"], row["mode"], row["rows"], row["max_tokens"]) == ("2x4:2", "oracle", 8, 48)
    plan = row["plan_row_tokens"]
    assert len(plan) == 8 and len(set(plan)) > 1, plan
    assert row["ours_row_tokens"] == plan == row["hf_row_tokens"], row
    assert row["ours_row_turns"] == [2] * 8 == row["hf_row_turns"], row
    assert row["ours_tokens"] == row["hf_tokens"] == sum(plan)
    for who in ("ours", "hf"):  # a decode row-step makes at most one useful token
        assert row[f"{who}_decode"] >= row[f"{who}_live"] == sum(plan) - 16 > 0, row
        assert row[f"{who}_prefill"] > 0 and row[f"{who}_tps"] > 0
    assert row["x"] == pytest.approx(row["ours_tps"] / row["hf_tps"])



def test_natural_baseline_ends_a_row_whose_observation_spends_the_budget(smollm2_path):
    # natural mode (--checkpoint): a tool turn whose observation leaves no completion budget ends
    # the row, its turn counted, as grpo.engine.sampler does ("length"), while the other rows of the batch
    # go on; it used to ask generate for max_new_tokens < 0 (or count such a row's tokens wrong)
    import transformers

    from grpo.envs.calculator import SHORT_SYSTEM_PROMPT, CalculatorEnv, generate_questions
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    env = CalculatorEnv(system_prompt=SHORT_SYSTEM_PROMPT)
    eos = tok.eos_token_id
    call = tok.encode(baseline.TOOL_CALL, add_special_tokens=False)
    filler = tok.encode("Let me work this out with the calculator, one step at a time, carefully. ",
                        add_special_tokens=False)[:20]
    answer = tok.encode("Answer: 176.36", add_special_tokens=False)
    # the budget the first turn of a bare call spends (the call, its observation, the next header), + 10
    messages = env.prompt(generate_questions(1, seed=0)[0])
    spent = len(render_prompt(tok, messages + [{"role": "assistant", "content": baseline.TOOL_CALL},
                                               {"role": env.observation_role, "content": env.step(baseline.TOOL_CALL)}]))
    max_tokens = spent - len(render_prompt(tok, messages)) + 10

    class Ref:  # stands for the transformers model: turn 1, even rows a bare call and odd rows 20 tokens
        def __init__(self):  # before it (their observation then spends the budget); turn 2, an answer
            self.asked = []

        def generate(self, input_ids, max_new_tokens, num_return_sequences, **kw):
            self.asked.append(max_new_tokens)
            rows = input_ids.repeat_interleave(num_return_sequences, 0)  # (B * copies, L)
            if len(self.asked) > 1:
                return torch.cat([rows, torch.tensor([answer] * len(rows))], 1)
            new = [call + [eos] * len(filler) if b % 2 == 0 else filler + call for b in range(len(rows))]
            return torch.cat([rows, torch.tensor(new)], 1)

    ref = Ref()
    out = baseline.run_hf(ref, tok, env, generate_questions(1, seed=0), G=4, max_tokens=max_tokens, seed=0)
    assert ref.asked == [max_tokens, 10], ref.asked  # the second turn only for the rows with budget left
    assert out == [(len(call) + len(answer), 2), (len(filler) + len(call), 2)] * 2, out
