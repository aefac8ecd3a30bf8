"""grpo.process (ProcessGRPO): steps, progress and token credit by hand; the controls; the
Monte Carlo success rates against the exact probabilities of a tiny model; the token budget
and the prefill saved by forking; per-token advantages through the update equal per-sequence
ones when they agree. (Forked continuations equal fresh prefills: tests/test_sampler.py.)"""
import random

import torch
from toy import ToyEnv, make_toy_dir
from transformers import AutoTokenizer

from grpo.engine.sampler import Sampler
from grpo.models.model import Transformer
from grpo.process import ProcessCredit, credit_tokens, shuffled, step_ends, step_progress, within_budget
from grpo.rollout import Trajectory, render_prompt


def test_step_ends_by_hand():
    pieces = ["First", " step", ".\n\n", "Second", ".", "\n\n", "\n\n", "Third", " done", "."]
    assert step_ends(pieces) == [3, 6, 10]          # the repeated blank line ends no empty step
    assert step_ends(["\n\n", "a", "\n\n", "b"]) == [3, 4]   # nothing before the first separator
    assert step_ends(["a", "\n", "b", "\n", "c"]) == [2, 4, 5]   # no blank line: lines
    assert step_ends(["one step only"]) == [1]
    assert step_ends(["a", "\n\n", "b", "\n\n"]) == [2, 4]  # trailing blanks stay with the last step
    assert step_ends(pieces, max_steps=2) == [3, 10]       # later steps merged into the last


def test_progress_telescopes_and_credit_by_hand():
    rates = [0.25, 0.5, 0.375]                      # p_0, p_1, p_2 (exact in binary)
    progress = step_progress(rates, outcome=1.0)
    assert progress == [0.25, -0.125, 0.625] and sum(progress) == 1.0 - rates[0]
    A = credit_tokens(6, [2, 3, 6], outcome_advantage=0.5, progress=progress, weight=3.0)
    assert A.tolist() == [1.25, 1.25, 0.125, 2.375, 2.375, 2.375]
    rng = random.Random(0)
    mixed = shuffled(progress, rng)
    assert sorted(mixed) == sorted(progress) and sum(mixed) == sum(progress)


class LastWordEnv(ToyEnv):
    """correct: the completion's last word is one of the targets (w0..w7)."""
    def reward(self, example, trajectory):
        words = trajectory.text.split()
        return {"correct": float(bool(words) and words[-1] in self.TARGET)}


def test_monte_carlo_rates_converge_to_the_exact_probabilities(tmp_path, one_thread):
    """With one-token continuations the chance of success from a prefix is exact: the sum of
    softmax(logits / T) over the tokens that make the last word a target (or, for the end
    token, leave a target last). The estimates from K = 512 continuations are within 4 sigma."""
    path = make_toy_dir(tmp_path / "toy")
    tok, model = AutoTokenizer.from_pretrained(path), Transformer.from_pretrained(path).eval()
    env = LastWordEnv()
    prompt = render_prompt(tok, env.prompt({"question": "w1 w2"}))
    completion = tok.encode("w3 w9 w4 w12", add_special_tokens=False)  # a word-level vocabulary: steps by hand
    traj = Trajectory(example={}, prompt_index=0, prompt_ids=prompt, completion_ids=completion, loss_mask=[],
                      sampler_logprobs=[], finish_reason="stop", num_turns=1, rewards={"correct": 0.0})
    K = 512
    credit = ProcessCredit(Sampler(model, tok, gen_batch=64), tok, env, num_continuations=K, temperature=1.0,
                           max_continuation_tokens=1, seed=3)
    ends = [2, 3, 4]
    [rates] = credit.success_rates([traj], [ends], step=0)
    eos = model.eos_token_ids()
    for k, boundary in enumerate([0] + ends[:-1]):
        prefix = prompt + completion[:boundary]
        with torch.no_grad():
            p = model(torch.tensor([prefix]))[0, -1].softmax(-1)
        wins = [float(env.reward({}, Trajectory({}, 0, [], [], [], [], "stop", 1,
                                                text=tok.decode(completion[:boundary] + [v], skip_special_tokens=True)))
                      ["correct"]) for v in range(len(p))]
        exact = float((p * torch.tensor(wins)).sum())
        sigma = (exact * (1 - exact) / K) ** 0.5
        assert abs(rates[k] - exact) <= 4 * sigma + 1e-9, (k, rates[k], exact, sigma, eos)


def every_word(pieces, max_steps):  # the toy vocabulary has no blank lines: one step per word
    return list(range(1, len(pieces) + 1))


def test_controls_and_assembly(tmp_path, one_thread):
    """outcome: the advantages untouched (the plain GRPO path, bit for bit); process: each token
    gets A + 3 x its step's progress from the frozen model's rates; shuffled: the same progress
    values per solution, permuted over its steps."""
    path = make_toy_dir(tmp_path / "toy")
    tok, model = AutoTokenizer.from_pretrained(path), Transformer.from_pretrained(path).eval()
    env = LastWordEnv()
    prompt = render_prompt(tok, env.prompt({"question": "w1 w2"}))
    trajs = [Trajectory(example={}, prompt_index=0, prompt_ids=prompt,
                        completion_ids=tok.encode(text, add_special_tokens=False), loss_mask=[], sampler_logprobs=[],
                        finish_reason="stop", num_turns=1, rewards={"correct": r})
             for text, r in [("w3 w4 w5", 1.0), ("w9 w20", 0.0)]]
    A = torch.tensor([0.7, -0.7])
    sampler = Sampler(model, tok, gen_batch=32)
    make = lambda mode: ProcessCredit(sampler, tok, env, num_continuations=8, mode=mode, seed=1,  # noqa: E731
                                      split=every_word)
    assert make("outcome")(trajs, A) is A
    process, mixed = make("process")(trajs, A), make("shuffled")(trajs, A)
    ends = [every_word(t.completion_ids, 0) for t in trajs]
    rates = make("process").success_rates(trajs, ends, step=0)      # the same seed: the same rates
    assert any(0 < r < 1 for rs in rates for r in rs), rates          # the rates are not trivial
    for i, t in enumerate(trajs):
        C = len(t.completion_ids)
        progress = step_progress(rates[i], t.rewards["correct"])
        torch.testing.assert_close(process[i, :C], credit_tokens(C, ends[i], float(A[i]), progress, 3.0))
        assert (process[i, C:] == 0).all() and (mixed[i, C:] == 0).all()
        per_step = ((mixed[i, :C] - A[i]) / 3).tolist()                # one token per step here
        assert sorted(round(x, 5) for x in per_step) == sorted(round(x, 5) for x in progress)
        assert abs(sum(progress) - (t.rewards["correct"] - rates[i][0])) < 1e-9   # telescoping


def test_budget_by_hand():
    # worst case 10 per boundary: 20 + 30 + 30 = 80 > 60, so the longest (9 tokens) goes: 50
    assert within_budget([5, 9, 7], [2, 3, 3], cost=10, max_total=60) == [True, False, True]
    assert within_budget([5, 9, 7], [2, 3, 3], cost=10, max_total=49) == [True, False, False]
    assert within_budget([4, 4], [1, 1], cost=1, max_total=1) == [True, False]     # ties: the later one
    assert within_budget([5, 9], [2, 3], cost=10, max_total=0) == [True, True]     # 0: no cap


def test_forked_prefill_costs_and_budget(tmp_path, one_thread):
    """Each solution is prefilled once, up to its last boundary (enough slots for every row),
    not once per prefix; a solution over max_total_tokens gets the outcome advantage only, and
    the others keep the rates they get without a cap (one random stream per solution and boundary)."""
    path = make_toy_dir(tmp_path / "toy")
    tok, model = AutoTokenizer.from_pretrained(path), Transformer.from_pretrained(path).eval()
    env = LastWordEnv()
    prompt = render_prompt(tok, env.prompt({"question": "w1 w2"}))
    trajs = [Trajectory(example={}, prompt_index=0, prompt_ids=prompt,
                        completion_ids=tok.encode(text, add_special_tokens=False), loss_mask=[],
                        sampler_logprobs=[], finish_reason="stop", num_turns=1, rewards={"correct": r})
             for text, r in [("w3 w4 w5", 1.0), ("w9 w20 w1 w30 w2", 1.0), ("w11 w12", 0.0)]]
    A = torch.tensor([0.7, 0.7, -1.4])
    ends = [every_word(t.completion_ids, 0) for t in trajs]
    def make(cap):
        return ProcessCredit(Sampler(model, tok, gen_batch=64), tok, env, num_continuations=4,
                             max_continuation_tokens=3, max_total_tokens=cap, seed=2, split=every_word)

    free = make(0)
    rates = free.success_rates(trajs, ends, step=1)
    P = len(prompt)
    assert free.stats["prefill_tokens"] == sum(P + e[-2] for e in ends)      # one pass per solution
    # one per prefix, and the prompt alone once: the three solutions share their prompt
    assert free.stats["prefix_tokens"] == P + sum(P + b for e in ends for b in e[:-1])
    saved = free.stats["prefix_tokens"] - free.stats["prefill_tokens"]
    assert free.stats["prefill_tokens_saved"] == saved > 0
    assert free.stats["boundaries"] == 10 - 2 and free.stats["continuations"] == 8 * 4
    capped = make(4 * 3 * 5)                      # worst case 4 x 3 per boundary: 10 boundaries > 5
    out = capped(trajs, A, step=1)
    assert capped.stats["dropped_solutions"] == 1                       # the 5-word solution: 3 + 2 = 5 left
    C = len(trajs[1].completion_ids)
    assert (out[1, :C] == A[1]).all() and (out[1, C:] == 0).all()       # outcome advantage only
    for i in (0, 2):
        C = len(trajs[i].completion_ids)
        progress = step_progress(rates[i], trajs[i].rewards["correct"])
        torch.testing.assert_close(out[i, :C], credit_tokens(C, ends[i], float(A[i]), progress, 3.0))
    lengths = torch.tensor([len(t.completion_ids) for t in trajs])
    assert make(1)(trajs, A).equal(A[:, None] * (torch.arange(5) < lengths[:, None]))   # all dropped


def test_token_advantages_equal_sequence_advantages_when_they_agree(tmp_path, one_thread):
    """policy_update with (N, C) advantages, every token of a sequence equal to its (N,) value,
    moves the weights exactly as the per-sequence update; a sequence is left out only when all
    its token advantages are zero."""
    from grpo.config import Config
    from grpo.rollout import rollout, sampling_params
    from grpo.update import policy_update, update_batches
    path = make_toy_dir(tmp_path / "toy")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = Config(model_path=path, num_generations=4, max_completion_length=8, micro_batch_tokens=64,
                 loss_type="dr_grpo", learning_rate=1.0, max_grad_norm=0.0)
    model = Transformer.from_pretrained(path)
    params = sampling_params(ToyEnv(), tok, 4, 1.0, 8, seed=5)
    trajs = rollout(Sampler(model, tok, gen_batch=16), tok, ToyEnv(), [{"question": "w1 w2"}, {"question": "w3"}],
                    params)
    A = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])      # the second group flat
    C = max(len(t.completion_ids) for t in trajs)
    per_token = torch.zeros(len(trajs), C)
    for i, t in enumerate(trajs):
        per_token[i, :len(t.completion_ids)] = A[i]
    per_token[5, 0] = 0.25       # one token of a flat-group sequence gets credit: that sequence is trained on
    moved = []
    for adv in (A, per_token):
        m = Transformer.from_pretrained(path)
        before = [p.detach().clone() for p in m.parameters()]
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        policy_update(m, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), trajs, adv, cfg, "cpu")
        moved.append([p0 - p.detach() for p, p0 in zip(m.parameters(), before)])
    kept = sum(len(b["input_ids"]) for b in update_batches(trajs, per_token, cfg, "cpu"))
    assert kept == 5                                              # 4 informative + the one credited sequence
    per_token[5, 0] = 0.0
    m = Transformer.from_pretrained(path)
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    policy_update(m, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), trajs, per_token, cfg, "cpu")
    for p, p0, g in zip(m.parameters(), before, moved[0]):
        torch.testing.assert_close(p0 - p.detach(), g, atol=1e-7, rtol=1e-5)
    assert any((a - b).abs().max() > 0 for a, b in zip(moved[0], moved[1])), "the credited token should count"


def test_p0_is_estimated_once_per_prompt(tmp_path, one_thread):
    """The prompt alone is one prefix however many solutions a prompt has: its K continuations are
    sampled once per prompt and every solution of it starts from the same p_0 (two prompts, two
    solutions each: 2 boundary-0 estimates, not 4), drawn from the prompt's own random stream,
    so it does not change with which solution carries it."""
    path = make_toy_dir(tmp_path / "toy")
    tok, model = AutoTokenizer.from_pretrained(path), Transformer.from_pretrained(path).eval()
    env = LastWordEnv()
    prompts = [render_prompt(tok, env.prompt({"question": q})) for q in ("w1 w2", "w5 w6")]
    trajs = [Trajectory(example={}, prompt_index=pi, prompt_ids=prompts[pi],
                        completion_ids=tok.encode(text, add_special_tokens=False), loss_mask=[],
                        sampler_logprobs=[], finish_reason="stop", num_turns=1, rewards={"correct": 0.0})
             for pi, text in [(0, "w3 w4 w5"), (0, "w9 w20"), (1, "w11 w12 w13"), (1, "w7")]]
    ends = [every_word(t.completion_ids, 0) for t in trajs]
    credit = ProcessCredit(Sampler(model, tok, gen_batch=64), tok, env, num_continuations=16,
                           max_continuation_tokens=3, seed=5, split=every_word)
    rates = credit.success_rates(trajs, ends, step=0)
    assert credit.stats["boundaries"] == sum(len(e) for e in ends) - 2     # 2 prompts, 4 solutions
    assert rates[0][0] == rates[1][0] and rates[2][0] == rates[3][0]
    assert [len(r) for r in rates] == [len(e) for e in ends]
    # the second solution alone (the first dropped) samples the same p_0 from the prompt's stream
    alone = credit.success_rates(trajs[1:2], ends[1:2], step=0)
    assert alone[0][0] == rates[1][0]


def test_steps_come_from_the_text_the_model_wrote(smollm2_path):
    """A solution ending in a blank line and the end token has its paragraphs as steps, not one
    more step made of <|im_end|> alone (decoded with special tokens, it was one)."""
    from grpo.process import step_pieces
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok.encode("First, 2 + 3 = 5.\n\nSo the answer is 5.\n\n", add_special_tokens=False)
    ids += [tok.convert_tokens_to_ids("<|im_end|>")]
    assert len(step_ends(step_pieces(tok, ids))) == 2
