"""The training loop on CPU: it learns a toy task, and its pieces agree with the sampler (a bad config's
errors: tests/test_config.py)."""
import json

import pytest
import torch
from toy import ToyEnv, make_toy_dir

from grpo import sft, shared_prompt, trainer, update
from grpo.config import Config
from grpo.engine.sampler import Sampler
from grpo.engine.sampling import request_key
from grpo.infra import dist
from grpo.loss import LossOptions, group_advantages, policy_loss
from grpo.models.model import Transformer
from grpo.rollout import assign_rewards, rollout, sampling_params
from grpo.trainer import prompt_batch, refill, train
from grpo.update import batch_logprobs, collate, micro_batches, policy_update, update_batches

EXAMPLES = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(40)]


def toy_config(tmp_path, **kw) -> Config:
    base = dict(model_path=make_toy_dir(tmp_path / "model"), output_dir=str(tmp_path / "run"), max_steps=30,
                prompts_per_step=4, num_generations=8, learning_rate=3e-3, temperature=1.0, max_prompt_length=16, max_completion_length=8,
                micro_batch_tokens=256, gen_batch=32, eval_limit=8, eval_n=4, eval_temperature=1.0,
                save_steps=0, export=False, max_grad_norm=1.0, tis_cap=0.0)
    return Config(**{**base, **kw})


def test_it_learns_the_toy_task(tmp_path):
    cfg = toy_config(tmp_path)
    results = train(cfg, ToyEnv(), EXAMPLES, EXAMPLES[:8])
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "reward/mean" in r]
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    print(f"reward first 5 steps {first:.3f} -> last 5 steps {last:.3f}; eval {results['before']['mean']:.3f} -> {results['after']['mean']:.3f}")
    assert last > first + 0.2, f"no clear learning: {first:.3f} -> {last:.3f}"
    assert results["after"]["mean"] > results["before"]["mean"] + 0.15
    assert (tmp_path / "run" / "tb").exists()


class GoldToyEnv(ToyEnv):
    def gold_messages(self, example):  # the warm-start's demonstration: four target words
        return [{"role": "assistant", "content": "w0 w1 w2 w3"}]


def test_warm_start_in_micro_batches_takes_the_same_steps(tmp_path, monkeypatch):
    """The warm-start packs its batch into micro-batches of up to micro_batch_tokens (one at a time
    in memory) and normalizes by the whole batch's tokens: the weights after its steps are those
    of one packed forward, to fp32 summation order."""
    from transformers import AutoTokenizer
    weights, forwards, inner = [], [], sft.pack
    uneven = [{"question": " ".join(f"w{j}" for j in range(i, i + 1 + i % 7)), "answer": ""} for i in range(16)]
    # plain SGD: Adam's first steps are ~lr x sign(gradient), blind to how the micro-batches are weighted
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, **kw: torch.optim.SGD(params, lr=lr))
    for mbt in (4096, 24):  # one pack of the 8 episodes; about one episode each
        cfg = toy_config(tmp_path, sft_steps=3, sft_batch=8, micro_batch_tokens=mbt, sft_learning_rate=0.5)
        model = Transformer.from_pretrained(cfg.model_path)
        calls = []
        monkeypatch.setattr(sft, "pack", lambda trajs, device: calls.append(len(trajs)) or inner(trajs, device))
        sft.warm_start(model, AutoTokenizer.from_pretrained(cfg.model_path), GoldToyEnv(), uneven, cfg,
                       torch.device("cpu"), lambda *a: None)
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        forwards.append(calls)
    assert forwards[0] == [8, 8, 8] and len(forwards[1]) > 3 * 3, forwards
    moved = max((weights[0][k] - Transformer.from_pretrained(cfg.model_path).state_dict()[k]).abs().max()
                for k in weights[0])
    assert moved > 1e-3
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], atol=5e-6, rtol=0, msg=k)  # 9e-7 seen


def test_a_resumed_run_does_not_redo_the_warm_start(tmp_path, monkeypatch, capsys):
    kw = dict(sft_steps=2, sft_batch=4, save_steps=5)
    first = train(toy_config(tmp_path, max_steps=0, **kw), GoldToyEnv(), EXAMPLES, EXAMPLES[:8])
    assert (tmp_path / "run" / "checkpoints" / "step_000000").exists()  # written right after the warm-start
    monkeypatch.setattr(trainer, "warm_start", lambda *a, **k: pytest.fail("the warm-start ran again"))
    second = train(toy_config(tmp_path, max_steps=1, resume=True, **kw), GoldToyEnv(), EXAMPLES, EXAMPLES[:8])
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_000000'} at step 0" in capsys.readouterr().out
    assert second["before"] == first["before"] and second["warmstart"] == first["warmstart"]
    assert "after" in second and (tmp_path / "run" / "checkpoints" / "step_000001").exists()


def test_old_logprobs_equal_the_samplers(tmp_path):
    cfg = toy_config(tmp_path)
    from transformers import AutoTokenizer
    model = Transformer.from_pretrained(cfg.model_path)
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    for temperature in (1.0, 0.7):
        params = sampling_params(ToyEnv(), tok, 4, temperature, 8, seed=3)
        trajs = rollout(Sampler(model, tok, gen_batch=8), tok, ToyEnv(), EXAMPLES[:5], params)
        lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajs]
        batches = [collate([trajs[i] for i in mb], "cpu") for mb in micro_batches(lengths, 64)]
        for b, lp in zip(batches, batch_logprobs(model, batches, temperature)):
            torch.testing.assert_close(lp * b["loss_mask"], b["sampler_logprobs"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("loss_type,share_prompt", [("dr_grpo", False), ("dapo", False), ("bnpo", False),
                                                    ("dr_grpo", True), ("bnpo", True)])
def test_update_leaves_out_flat_groups_and_pads_micro_batches(tmp_path, monkeypatch, loss_type, share_prompt):
    """Leaving out the zero-advantage groups (and the masked truncated sequences) changes no
    gradient, nor do the fully masked micro-batches a rank short of the global count runs, nor
    rows that compute each group's prompt once (share_prompt): one SGD step at lr 1 through
    policy_update moves the weights by exactly minus the gradient of the whole batch in one
    plain micro-batch."""
    cfg = toy_config(tmp_path, loss_type=loss_type, num_generations=4, micro_batch_tokens=48, max_grad_norm=0.0,
                     mask_truncated_completions=True, temperature=0.7, share_prompt=share_prompt)
    from transformers import AutoTokenizer
    model = Transformer.from_pretrained(cfg.model_path)
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    params = sampling_params(ToyEnv(), tok, 4, cfg.temperature, cfg.max_completion_length, seed=1)
    trajs = assign_rewards(ToyEnv(), rollout(Sampler(model, tok, gen_batch=16), tok, ToyEnv(), EXAMPLES[:4], params))
    for t in trajs[4:8]:  # one flat group: reward 0.5 four times, mean exact, advantages exactly 0
        t.reward = 0.5
    truncated = [t.finish_reason == "length" for t in trajs]
    assert 0 < sum(truncated) < len(trajs), "the sample should hold truncated and finished sequences"
    adv = group_advantages(torch.tensor([t.reward for t in trajs]), 4)
    assert (adv[4:8] == 0).all() and (adv != 0).sum() >= 8

    # reference: every sequence in one micro-batch, the truncated ones masked
    b = collate(trajs, "cpu")
    b["loss_mask"][torch.tensor(truncated)] = 0
    logprobs = model(b["input_ids"], labels=b["labels"], temperature=cfg.temperature)
    opts = LossOptions(loss_type=loss_type, max_completion_length=cfg.max_completion_length)
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, b["loss_mask"], opts, num_sequences=len(trajs),
                          num_tokens=int(b["loss_mask"].sum()), sampler_logprobs=b["sampler_logprobs"])
    grads = torch.autograd.grad(loss, list(model.parameters()))

    batches = update_batches(trajs, adv, cfg, "cpu")
    kept = sum(len(b["input_ids"]) for b in batches)
    trained = 12 - sum(truncated[:4] + truncated[8:])  # the informative groups' finished sequences
    assert kept == (len(trajs) if loss_type == "bnpo" else trained)
    pad = 2
    monkeypatch.setattr(dist, "all_max", lambda n: n + pad)  # as if another rank had 2 more micro-batches
    padded = update_batches(trajs, adv, cfg, "cpu")
    assert len(padded) == len(batches) + pad and all(p["loss_mask"].sum() == 0 for p in padded[-pad:])
    if loss_type == "bnpo":  # its per-micro-batch mean depends on the grouping: compare without padding
        monkeypatch.setattr(dist, "all_max", lambda n: n)
        cfg.micro_batch_tokens = 10_000  # one micro-batch, as the reference
    if share_prompt:  # the update forwards rows of one prompt each, some of them split by the budget
        batches = [b for b in update_batches(trajs, adv, cfg, "cpu") if "prompt_rows" in b]  # padding aside
        shared_rows = sum(len(b["prompt_rows"]["input_ids"]) for b in batches)
        sequences = sum(len(b["input_ids"]) for b in batches)
        assert sum(len(b["prompt_rows"]["index"]) for b in batches) == sequences and shared_rows < sequences
    rows = []  # rows the update runs forward on, padding micro-batches aside
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, *a, **k: rows.append(len(ids)) or forward(ids, *a, **k))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    policy_update(model, None, optimizer, scheduler, trajs, adv, cfg, "cpu")
    for p, p0, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p0 - p.detach(), g, atol=1e-6, rtol=1e-4)
    # the left-out sequences were not trained on: a zero-advantage sequence adds no gradient, so
    # only counting the rows forwarded can tell
    expected = shared_rows if share_prompt else (len(trajs) if loss_type == "bnpo" else trained)
    assert sum(rows) - pad * (loss_type != "bnpo") == expected, rows


def test_truncated_answers_stay_in_the_loss_when_kept():
    """mask_truncated_completions leaves out every completion cut at the token limit;
    keep_truncated_answers keeps those cut after they answered (the env reads an answer), so
    that repeating an answer line to the limit is not a free way out of a wrong answer."""
    from grpo.envs.calculator import CalculatorEnv
    from grpo.rollout import Trajectory
    example = {"question": "2 + 3?", "expression": "2 + 3", "answer": 5.0}
    call = "<calculator>\noperation: add\noperands:\n  - 2\n  - 3\n</calculator>"
    cases = {  # last turn, finish_reason -> answered
        "rambles": ([call, "Answer: 5\nAnswer: 5\nAnsw"], "length", True),
        "cut in a call": ([call, "<calculator>\noperation: add\noperands:\n  - 2"], "length", False),
        "cut in prose": ([call, "The calculator gives 5, so the sum of 2 and"], "length", False),
        "stopped": ([call, "Answer: 5"], "stop", False),
    }
    trajs = [Trajectory(example, 0, [1], [5] * 4, [1] * 4, [0.0] * 4, reason, 2, turns=turns,
                        observations=["<output>5</output>"]) for turns, reason, _ in cases.values()]
    assign_rewards(CalculatorEnv(), trajs)
    assert [t.answered for t in trajs] == [answered for _, _, answered in cases.values()]
    masked = lambda **kw: [update.masked_out(t, Config(**kw)) for t in trajs]  # noqa: E731
    assert masked() == [False, False, False, False]
    assert masked(mask_truncated_completions=True) == [True, True, True, False]
    assert masked(mask_truncated_completions=True, keep_truncated_answers=True) == [False, True, True, False]
    assign_rewards(ToyEnv(), trajs)  # an env that cannot tell an answer keeps every cut completion masked
    assert not any(t.answered for t in trajs)


def test_shared_prompt_rows_equal_one_row_per_sequence(tmp_path):
    """shared_prompt.shared_prompt_batch: G sequences of one prompt in one row (the prompt computed once,
    each completion attending to it and to itself) give every position of collate's layout the
    log-prob and entropy of one row per sequence, and a loss over them the same gradient; the
    completions hold injected tokens (loss mask 0), as tool observations are, and a row split by
    the token budget repeats the prompt."""
    from grpo.rollout import Trajectory
    model = Transformer.from_pretrained(make_toy_dir(tmp_path / "model"))
    V = model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, V, (n,), generator=g).tolist()  # noqa: E731
    prompts, trajs = [ids(9), ids(5)], []
    for k, prompt in enumerate(prompts):
        for j in range(3 + k):
            C = 4 + 3 * j
            mask = [0 if 2 <= c < 4 else 1 for c in range(C)]  # two injected tokens after the first turn
            trajs.append(Trajectory({}, k, prompt, ids(C), mask, [0.0] * C, "stop", 2))
    keep = list(range(len(trajs)))
    rows = shared_prompt.prompt_rows(trajs, keep, budget=40)
    assert [idx for idx, _ in rows] == [[0, 1, 2], [3, 4, 5], [6]]  # prompt 1's fourth sequence: a new row
    assert all(n <= 40 for _, n in rows) and rows[0][1] == 8 + 5 + 8 + 11
    order = [i for idx, _ in rows for i in idx]
    plain = collate([trajs[i] for i in order], "cpu")
    shared = shared_prompt.shared_prompt_batch([[trajs[i] for i in idx] for idx, _ in rows], "cpu")
    assert shared["input_ids"].numel() < plain["input_ids"].numel()
    weights = torch.randn(plain["labels"].shape, generator=g) * plain["loss_mask"]
    outs = []
    for b in (plain, {**plain, "prompt_rows": shared}):
        model.zero_grad()
        lp, ent = update.sequence_logprobs(model, b, temperature=0.8, return_entropy=True)
        (lp * weights).sum().backward()
        outs.append((lp * b["loss_mask"], ent * b["loss_mask"], [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = outs
    assert (lp_a != 0).sum() == sum(sum(t.loss_mask) for t in trajs)
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_first_of_mu_iterations_has_ratio_exactly_one(tmp_path, monkeypatch):
    """mu = 2: the old log-probs come from the policy before this batch's updates, so the first
    iteration's ratio is exactly 1 on every token, and the second's is not."""
    cfg = toy_config(tmp_path, num_iterations=2, num_generations=4, learning_rate=3e-2)
    from transformers import AutoTokenizer
    model = Transformer.from_pretrained(cfg.model_path)
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    params = sampling_params(ToyEnv(), tok, 4, cfg.temperature, cfg.max_completion_length, seed=2)
    trajs = assign_rewards(ToyEnv(), rollout(Sampler(model, tok, gen_batch=16), tok, ToyEnv(), EXAMPLES[:4], params))
    adv = group_advantages(torch.tensor([t.reward for t in trajs]), 4)
    assert (adv != 0).any()
    ratios = []  # (iteration-ordered) rho of every mask token, per policy_loss call
    real = update.policy_loss

    def spy(logprobs, old_logprobs, advantages, loss_mask, *a, **k):
        ratios.append(torch.exp(logprobs - old_logprobs).detach()[loss_mask.bool()])
        return real(logprobs, old_logprobs, advantages, loss_mask, *a, **k)
    monkeypatch.setattr(update, "policy_loss", spy)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    m = policy_update(model, None, optimizer, scheduler, trajs, adv, cfg, "cpu")
    first, second = torch.cat(ratios[:len(ratios) // 2]), torch.cat(ratios[len(ratios) // 2:])
    assert len(first) > 0 and (first == 1).all(), first
    assert (second - 1).abs().max() > 1e-3, "the second iteration should see the first's update"
    assert m["ratio"] != 1.0


def test_a_step_where_every_group_is_flat_changes_nothing(tmp_path):
    cfg = toy_config(tmp_path, loss_type="dr_grpo", num_generations=4)
    from transformers import AutoTokenizer
    model = Transformer.from_pretrained(cfg.model_path)
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    params = sampling_params(ToyEnv(), tok, 4, 1.0, 8, seed=1)
    trajs = rollout(Sampler(model, tok, gen_batch=8), tok, ToyEnv(), EXAMPLES[:2], params)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    m = policy_update(model, None, optimizer, scheduler, trajs, torch.zeros(len(trajs)), cfg, "cpu")
    assert m["sequences"] == 0 and m["tokens"] == 0 and m["grad_norm"] == 0
    assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))


def test_kernels_torch_and_cuda_graphs_false_reach_the_run(tmp_path, monkeypatch):
    # every grpo.kernels call of the run takes its reference (a CPU takes them anyway: what is
    # checked is that the run is inside references(), and that it is left after); the sampler
    # is built without graphs
    from grpo.fit import build as setup
    from grpo.kernels import target
    seen = {}
    real_build, real_sampler = trainer.build, setup.Sampler

    def build(cfg, device, *extra):
        seen["references"] = target._references
        return real_build(cfg, device, *extra)

    def sampler(*args, **kwargs):
        seen["cuda_graphs"] = kwargs.get("cuda_graphs")
        return real_sampler(*args, **kwargs)
    monkeypatch.setattr(trainer, "build", build)
    monkeypatch.setattr(setup, "Sampler", sampler)
    train(toy_config(tmp_path, max_steps=1, kernels="torch", cuda_graphs=False), ToyEnv(), EXAMPLES, [])
    assert seen == {"references": True, "cuda_graphs": False} and target._references is False
    train(toy_config(tmp_path, max_steps=1, output_dir=str(tmp_path / "run2")), ToyEnv(), EXAMPLES, [])
    assert seen == {"references": False, "cuda_graphs": True}


def raised_in(filename: str, cause: Exception | None = None) -> Exception:
    """An exception whose traceback passes through `filename` (raised from `cause`, if given)."""
    try:
        exec(compile("raise RuntimeError('out of resources') from cause", filename, "exec"), {"cause": cause})
    except RuntimeError as e:
        return e


def test_a_failure_inside_triton_or_graph_capture_names_the_way_around(tmp_path, monkeypatch):
    import importlib.util
    import os

    from grpo.fit import fallback
    pytest.importorskip("triton")
    triton_dir = os.path.dirname(importlib.util.find_spec("triton").origin)
    in_triton = raised_in(os.path.join(triton_dir, "runtime", "jit.py"))
    assert "--kernels torch" in fallback.way_around(in_triton)
    assert "--kernels torch" in fallback.way_around(raised_in(str(tmp_path / "ours.py"), cause=in_triton))  # re-raised
    graphs = os.path.join(os.path.dirname(torch.__file__), "cuda", "graphs.py")
    assert "--cuda_graphs false" in fallback.way_around(raised_in(graphs))
    assert fallback.way_around(raised_in(str(tmp_path / "recipe.py"))) is None
    assert fallback.way_around(raised_in(triton_dir + "_not_it/jit.py")) is None  # a sibling folder is not triton's

    def fails(cfg, device, *extra):
        raise raised_in(os.path.join(triton_dir, "compiler", "compiler.py"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "build", fails)
        with pytest.raises(RuntimeError, match="out of resources") as info:
            train(toy_config(tmp_path, max_steps=1), ToyEnv(), EXAMPLES, [])
    assert any("--kernels torch" in n for n in info.value.__notes__)
    # without triton installed, any failure comes out as itself, with no note (and no error of the hint's)
    monkeypatch.setattr(fallback, "HAS_TRITON", False)
    assert fallback.way_around(in_triton) is None
    with pytest.raises(ValueError, match="bad config: num_generations") as info:
        train(toy_config(tmp_path, max_steps=1, num_generations=1), ToyEnv(), EXAMPLES, [])
    assert not getattr(info.value, "__notes__", None)


def test_micro_batches_respect_the_budget():
    lengths = [5, 30, 7, 12, 30, 1, 9]
    mbs = micro_batches(lengths, 40)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:
        assert max(lengths[i] for i in mb) * len(mb) <= 40


def test_prompt_batch_is_a_function_of_the_step():
    a, _ = prompt_batch(EXAMPLES, 7, 4, seed=1)
    b, _ = prompt_batch(EXAMPLES, 7, 4, seed=1)
    assert a == b
    epoch = [q["question"] for s in range(10) for q in prompt_batch(EXAMPLES, s, 4, seed=1)[0]]
    assert sorted(epoch) == sorted(q["question"] for q in EXAMPLES)  # one epoch covers every prompt once


def test_refill_replaces_flat_groups():
    from types import SimpleNamespace as T
    cfg = Config(seed=0, max_refills=2)
    group = lambda r, q: [T(reward=x, q=q, completion_ids=[0] * 5) for x in r]  # noqa: E731
    trajs = group([1, 1], "a") + group([0, 1], "b") + group([0, 0], "c")  # groups a and c teach nothing
    calls = []

    def sample(exs, offset):
        calls.append((len(exs), offset))
        return [t for ex in exs for t in group([0, 1], ex["question"])]
    out = refill(trajs, 3, 2, step=5, cfg=cfg, sample=sample, examples=EXAMPLES)
    assert len(out) == 6 and all(len({t.reward for t in out[i:i + 2]}) == 2 for i in range(0, 6, 2))
    assert calls[0][0] == 2 and len(calls) == 1  # one refill of the two missing groups
    assert [t.q for t in out[:2]] == ["b", "b"] and {t.q for t in out[2:]} <= {e["question"] for e in EXAMPLES}
    # the refill's sampler seeds are not any regular prompt's (prompt ids past 2^32 once collided)
    ids = [calls[0][1] + i for i in range(2)]
    assert min(ids) >= 1 << 32  # past any epoch's prompt ids, and past 32 bits: the low bits must not decide
    regular = {request_key(cfg.seed, i & 0xFFFFFFFF, j) for i in ids for j in range(8)}
    assert not regular & {request_key(cfg.seed, i, j) for i in ids for j in range(8)}
    again = refill(trajs, 3, 2, step=5, cfg=cfg, sample=sample, examples=EXAMPLES)
    assert [t.q for t in again] == [t.q for t in out]
    # nothing informative comes back: the batch is topped up with the original flat groups
    out = refill(trajs, 3, 2, step=5, cfg=cfg, sample=lambda exs, off: [t for ex in exs for t in group([1, 1], "x")],
                 examples=EXAMPLES)
    assert len(out) == 6 and [t.q for t in out[:2]] == ["b", "b"]


def test_refill_judges_the_final_rewards():
    """With DAPO's overlong penalty, equal env rewards of unequal lengths are not flat: refill
    keeps such a group, as the update trains on it."""
    from types import SimpleNamespace as T
    cfg = Config(seed=0, max_refills=2, max_completion_length=10, overlong_buffer=4)
    trajs = [T(reward=1.0, completion_ids=[0] * n, q="a") for n in (4, 9)]  # penalties 0 and -0.75
    trajs += [T(reward=1.0, completion_ids=[0] * 4, q="b") for _ in range(2)]  # flat: same length
    out = refill(trajs, 2, 2, step=0, cfg=cfg, sample=lambda exs, off: [T(reward=r, completion_ids=[0], q="new")
                                                                         for ex in exs for r in (0.0, 1.0)],
                 examples=EXAMPLES)
    assert [t.q for t in out] == ["a", "a", "new", "new"]


def test_dynamic_sampling_runs_in_the_loop(tmp_path, monkeypatch):
    cfg = toy_config(tmp_path, max_steps=3, drop_flat_groups=True, num_iterations=2, loss_type="dapo",
                     num_generations=2, temperature=0.3)  # G=2 at a low temperature: flat groups are common
    refills = []
    real = trainer.refill

    def spy(trajs, *a, **k):
        out = real(trajs, *a, **k)
        refills.append(sum(x is not y for x, y in zip(out, trajs)))  # trajectories replaced
        return out
    monkeypatch.setattr(trainer, "refill", spy)
    train(cfg, ToyEnv(), EXAMPLES, [])
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "reward/mean" in r]
    assert len(rows) == 3 and all(r["skipped_updates"] == 0 for r in rows)
    assert len(refills) == 3 and sum(refills) > 0, f"no refill happened: {refills}"
    assert all(r["flat_groups"] < 1 for r in rows)


def test_rollout_records(tmp_path):
    """Every --log_completions_steps: rollouts/step_N.jsonl with each trajectory's prompt,
    completion, reward terms, reward, advantage, finish reason and turns."""
    cfg = toy_config(tmp_path, max_steps=3, log_completions_steps=2, num_generations=4)
    train(cfg, ToyEnv(), EXAMPLES, [])
    files = sorted(p.name for p in (tmp_path / "run" / "rollouts").iterdir())
    assert files == ["step_000002.jsonl"]                          # every 2 steps: step 2 of 3
    records = [json.loads(line) for line in open(tmp_path / "run" / "rollouts" / "step_000002.jsonl")]
    assert len(records) == cfg.prompts_per_step * cfg.num_generations
    first = EXAMPLES.index(prompt_batch(EXAMPLES, 1, cfg.prompts_per_step, cfg.seed)[0][0])
    assert first >= 0 and records[0]["prompt"].startswith("<user> " + EXAMPLES[first]["question"])
    rewards = torch.tensor([r["reward"] for r in records])
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in records]), group_advantages(rewards, 4))
    assert all(abs(r["rewards"]["correct"] - r["reward"]) < 1e-6 for r in records)   # fp32 reward tensor
    assert all(r["finish_reason"] in ("stop", "length") and r["turns"] == 1 for r in records)


def test_packed_warm_start_batch_equals_the_padded_one(tmp_path):
    """sft.pack (one row, positions restarting per sequence, no padding) gives every scored
    token the log-prob, and the loss the gradient, of the right-padded batch."""
    from transformers import AutoTokenizer
    model = Transformer.from_pretrained(make_toy_dir(tmp_path / "model"))
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    params = sampling_params(ToyEnv(), tok, 3, 1.0, 8, seed=3)
    trajs = rollout(Sampler(model, tok), tok, ToyEnv(), EXAMPLES[:4], params)
    assert len({len(t.prompt_ids) + len(t.completion_ids) for t in trajs}) > 1, "lengths should differ"
    padded, packed = collate(trajs, "cpu"), sft.pack(trajs, "cpu")
    assert packed["input_ids"].shape == (1, sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs))
    sums = []
    for b, args in ((padded, ()), (packed, (packed["position_ids"],))):
        model.zero_grad()
        lp = model(b["input_ids"], *args, labels=b["labels"])
        nll = -(lp * b["loss_mask"]).sum()
        nll.backward()
        sums.append((lp[b["loss_mask"] > 0], nll, [p.grad.clone() for p in model.parameters()]))
    (lp_a, nll_a, g_a), (lp_b, nll_b, g_b) = sums
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)  # same tokens, in the same order
    torch.testing.assert_close(nll_b, nll_a, atol=1e-4, rtol=1e-6)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def rollout_batch(tmp_path, **kw):
    """A toy model, its config and 4 prompts x G=4 scored rollouts with informative advantages."""
    from transformers import AutoTokenizer
    cfg = toy_config(tmp_path, num_generations=4, max_grad_norm=0.0, loss_type="dr_grpo", temperature=0.7, **kw)
    model, tok = Transformer.from_pretrained(cfg.model_path), AutoTokenizer.from_pretrained(cfg.model_path)
    params = sampling_params(ToyEnv(), tok, 4, cfg.temperature, cfg.max_completion_length, seed=3)
    trajs = assign_rewards(ToyEnv(), rollout(Sampler(model, tok, gen_batch=16), tok, ToyEnv(), EXAMPLES[:4], params))
    adv = group_advantages(torch.tensor([t.reward for t in trajs]), 4)
    assert (adv[:8] != 0).any() and (adv[8:] != 0).any()
    return cfg, model, trajs, adv


def sgd_step(model, cfg, trajs, adv, old_logprobs=None):
    """One SGD step at lr 1 on the Dr. GRPO loss of `trajs` alone (their own normalizers); the old
    log-probs default to the current ones (rho = 1). Returns those current log-probs, detached."""
    b = collate(trajs, "cpu")
    logprobs = model(b["input_ids"], labels=b["labels"], temperature=cfg.temperature)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    opts = LossOptions(loss_type="dr_grpo", max_completion_length=cfg.max_completion_length)
    loss, _ = policy_loss(logprobs, old, adv, b["loss_mask"], opts, num_sequences=len(trajs),
                          num_tokens=int(b["loss_mask"].sum()), sampler_logprobs=b["sampler_logprobs"])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= g
    return logprobs.detach()


def test_steps_per_generation_2_is_two_optimizer_steps_on_halves(tmp_path):
    """steps_per_generation = 2 (TRL's name): the first half of the groups is one SGD step, the
    second half another, from the moved weights, its ratio against the rollout policy's log-probs
    (computed before the first step); by hand, step by step, against policy_update."""
    cfg, model, trajs, adv = rollout_batch(tmp_path, steps_per_generation=2)
    import copy
    by_hand = copy.deepcopy(model)
    with torch.no_grad():
        rollout_logprobs = by_hand(collate(trajs[8:], "cpu")["input_ids"], labels=collate(trajs[8:], "cpu")["labels"],
                                   temperature=cfg.temperature)
    sgd_step(by_hand, cfg, trajs[:8], adv[:8])
    sgd_step(by_hand, cfg, trajs[8:], adv[8:], old_logprobs=rollout_logprobs)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    m = policy_update(model, None, optimizer, scheduler, trajs, adv, cfg, "cpu")
    for p, q in zip(model.parameters(), by_hand.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-4)
    assert scheduler.last_epoch == 2 and m["ratio"] != 1.0   # two optimizer steps; the second saw the first


def test_steps_per_generation_1_is_the_one_step_update(tmp_path):
    """steps_per_generation = 1: one SGD step on the whole batch, exactly as before the option."""
    cfg, model, trajs, adv = rollout_batch(tmp_path, steps_per_generation=1)
    import copy
    by_hand = copy.deepcopy(model)
    sgd_step(by_hand, cfg, trajs, adv)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    policy_update(model, None, optimizer, scheduler, trajs, adv, cfg, "cpu")
    for p, q in zip(model.parameters(), by_hand.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-4)
    assert scheduler.last_epoch == 1


@pytest.mark.parametrize("graphs,keep,grows,released", [
    (False, True, False, 2),   # a CPU (no graphs): freed before and after, the eval sized to itself
    (True, False, False, 2),   # graphs not kept between steps: the same
    (True, True, False, 0),    # kept graphs: the eval decodes in the rollouts' cache, nothing freed
    (True, True, True, 1),     # ... unless its rows did not fit: the grown cache is freed after it
])
def test_eval_keeps_the_rollouts_graphs_where_they_are_kept(monkeypatch, graphs, keep, grows, released):
    """Each eval used to free the sampler before and after it, so every CUDA graph was captured
    again after each eval; with keep_kv_cache they stay, and the eval replays them."""
    import types
    calls = []
    sampler = types.SimpleNamespace(runner=types.SimpleNamespace(use_graphs=graphs),
                                    cache=types.SimpleNamespace(max_seq_len=512),
                                    release=lambda: calls.append("release"))

    def evaluate(model, tokenizer, env, examples, sampler=None, **kw):
        calls.append("eval")
        if grows:
            sampler.cache = types.SimpleNamespace(max_seq_len=1024)
        return {"records": [{"correct": 1.0}] * len(examples)}

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    cfg = Config(keep_kv_cache=keep)
    r = trainer.evaluate_on_ranks(torch.nn.Linear(1, 1), None, None, [{}] * 3, cfg, sampler=sampler)
    assert calls.count("release") == released and len(r["records"]) == 3
    assert calls.index("eval") == (1 if released == 2 else 0)
