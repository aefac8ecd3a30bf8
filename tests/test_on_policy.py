"""Exactly on-policy where users run: the update scores the distribution the sampler drew from.

- top-k / top-p / min-p: the sampler's log-probs are of the kept set, renormalised, and the trainer's
  (old, policy, reference) are of the same set, in the fused LM-head path (chunked PyTorch here; the
  Triton kernel under the interpreter in test_kernels_triton.py): with no update between, old = sampler
  within fp32 rounding and the mean ratio is 1, with tool turns and shared prompts too.
- LoRA on a half-precision base: the decode weights apply the adapters unmerged, so an update below
  half a bf16 ulp of W still reaches the sampler (a merge rounded to bf16 drops it).
- LoRA dropout: off in the policy's forward by default (disable_dropout); when a user turns it on, the
  old log-probs come from a pass without it, so the reported gap still compares like with like.
- The gap over a run, mean and max, in summary.json and at the run's end.
The bounds: fp32 log-probs of the same tokens through two op orders (KV-cache decode against a full
forward) differ by a few ulps of |z| ~ 10, ~1e-6; 1e-5 leaves an order of magnitude of headroom."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from toy import make_toy_dir

from grpo.config import TARGETS, Config
from grpo.engine.decode import DecodeWeights, decode
from grpo.engine.kv_cache import KVCache
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.engine.sampling import filter_mask, sample
from grpo.kernels import linear_logprobs
from grpo.kernels.reference import linear_logprobs_ref
from grpo.models import lora
from grpo.models.lora import LoraSettings, add_lora, cast_base
from grpo.models.model import Transformer
from grpo.rollout import Trajectory
from grpo.update import batch_logprobs, update_batches

ROOT = Path(__file__).resolve().parents[1]
FILTERS = {"top_p": dict(top_p=0.8), "top_k": dict(top_k=20), "min_p": dict(min_p=0.1),
           "all": dict(top_p=0.8, top_k=20, min_p=0.1)}


# ----------------------------------------------------------------------------- the kernel and the rule

@pytest.mark.parametrize("name", FILTERS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_set_logprobs_and_gradients_against_float64(name, temperature):
    """linear_logprobs with the sampler's thresholds = log softmax over the kept set (float64 reference),
    forward and gradients, chunked so that some chunks hold nothing of a row's set; -inf rows are the
    whole vocabulary; the sampler's own log-probs are the same numbers."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 41, 33, 1237
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 3 / H**0.5
    tokens, lp, threshold = sample(hidden @ weight.T, torch.arange(N), torch.zeros(N, dtype=torch.long), temperature,
                                   return_threshold=True, **FILTERS[name])
    keep = filter_mask((hidden @ weight.T) / temperature, **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **FILTERS[name]})
    assert torch.equal((hidden @ weight.T) / temperature >= threshold[:, None], keep)  # the threshold is the set
    threshold[::7] = float("-inf")  # unfiltered rows beside filtered ones
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = tokens[::3]
    labels[5] = -100
    up = torch.randn(N, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = linear_logprobs(h, w, labels, temperature, backend="torch", chunk_size=256, threshold=threshold)
    (ours * up).sum().backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = linear_logprobs_ref(h64, w64, labels, temperature, threshold=threshold)
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(ours.double(), ref.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-5, rtol=1e-4)
    whole = linear_logprobs_ref(hidden, weight, labels, temperature)
    plain = linear_logprobs(hidden, weight, labels, temperature, backend="torch", chunk_size=256)
    assert torch.equal(ours.detach()[::7], plain[::7])  # -inf: exactly the unfiltered path
    assert (ours >= whole - 1e-5).all() and (ours - whole).abs().max() > 1e-2  # the filter matters here
    sampled = torch.arange(0, N, 3)[torch.arange(0, N, 3) % 7 != 0]
    torch.testing.assert_close(lp[sampled], ours[sampled].detach(), atol=1e-5, rtol=0)


def test_kept_set_entropy_is_the_kept_distributions():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 16, generator=g), torch.randn(301, 16, generator=g)
    _, _, threshold = sample(hidden @ weight.T, torch.arange(9), torch.zeros(9, dtype=torch.long), 1.0, top_p=0.7,
                             return_threshold=True)
    z = hidden.double() @ weight.double().T
    z = z.masked_fill(z < threshold[:, None].double(), float("-inf"))
    p = z.softmax(-1)
    expected = -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1)
    labels = (hidden @ weight.T).argmax(-1)
    _, entropy = linear_logprobs(hidden, weight, labels, backend="torch", return_entropy=True, chunk_size=64,
                                 threshold=threshold)
    torch.testing.assert_close(entropy.double(), expected, atol=1e-5, rtol=0)


def test_kept_set_off_scores_the_full_vocabulary():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * 3
    key, step = torch.arange(6), torch.zeros(6, dtype=torch.long)
    tok, lp, thr = sample(logits, key, step, 1.0, top_p=0.5, kept_set=False, return_threshold=True)
    torch.testing.assert_close(lp, logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0])
    assert torch.isinf(thr).all()
    tok2, lp2 = sample(logits, key, step, 1.0, top_p=0.5)
    assert torch.equal(tok, tok2) and (lp2 > lp).all()  # the same draw; its kept set's log-prob is higher


# ----------------------------------------------------------------------------- sampler vs trainer

TOOLS = list(range(0, 131, 5))  # tool-call stop ids of the tiny vocabulary: a fifth of it, so that calls happen


def trajectories(out, prompts) -> list[Trajectory]:
    return [Trajectory(example={}, prompt_index=c.prompt_index, prompt_ids=prompts[c.prompt_index],
                       completion_ids=c.token_ids, loss_mask=c.loss_mask, sampler_logprobs=c.logprobs,
                       finish_reason=c.finish_reason, num_turns=c.num_turns, kept_thresholds=c.thresholds)
            for c in out]


def old_and_sampler(model, trajs, share_prompt=False):
    """The update's old log-probs (its no-grad pass) and the sampler's, on every sampled token."""
    cfg = Config(num_generations=4, beta=0.01, micro_batch_tokens=96, share_prompt=share_prompt, temperature=0.9)
    advantages = torch.randn(len(trajs))
    batches = update_batches(trajs, advantages, cfg, "cpu")
    old = batch_logprobs(model, batches, cfg.temperature)
    m = [b["loss_mask"].bool() for b in batches]
    return (torch.cat([o[k] for o, k in zip(old, m)]), torch.cat([b["sampler_logprobs"][k] for b, k in zip(batches, m)]))


@pytest.mark.parametrize("name", FILTERS)
@pytest.mark.parametrize("share_prompt", [False, True])
def test_old_logprobs_equal_the_samplers_under_filters(tiny_dir, name, share_prompt):
    """No update between sampling and scoring, fp32: old = sampler within 1e-5 a token and the mean
    importance ratio 1 within 1e-4, with tool turns (observations injected mid-completion). Scoring the
    full vocabulary instead (the rule before) misses by far more: the bias the kept set removes."""
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path).eval()
    prompts = [[5, 17, 99, 3], [11, 12], [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(n=4, temperature=0.9, max_tokens=20, stop_token_ids=[], tool_stop_token_ids=TOOLS,
                            max_turns=3, seed=5, **FILTERS[name])
    out = Sampler(model).generate(prompts, params, tool=lambda i, ids: [21, 22, 23])
    assert any(c.num_turns > 1 for c in out), "no tool turn: the test would not cover observations"
    trajs = trajectories(out, prompts)
    old, smp = old_and_sampler(model, trajs, share_prompt)
    assert (old - smp).abs().max() < 1e-5
    assert abs(torch.exp(old - smp).mean().item() - 1) < 1e-4
    for t in trajs:
        t.kept_thresholds = []  # the full vocabulary's log-probs in the trainer: what it scored before
    full, _ = old_and_sampler(model, trajs, share_prompt)
    assert torch.exp(full - smp).mean().item() < 1 - 1e-3


# ----------------------------------------------------------------------------- LoRA in decode

def sub_ulp_adapters(model, seed=3):
    """Adapters whose merged update s B A is below half a bf16 ulp of every entry of W (W first moved
    to |W| >= 1/16 so that the bound is not set by a weight near 0): round_bf16(W + s B A) = W."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.adapters(model):
            w = m.weight.float()
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g))
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g))
            delta = m.scale * m.lora_B @ m.lora_A
            half_ulp = 2.0 ** (torch.floor(torch.log2(w.abs())) - 9)  # of the interval below, at a power of two
            m.lora_B.mul_(0.9 * (half_ulp / delta.abs()).min())
            assert torch.equal((w + m.scale * m.lora_B @ m.lora_A).bfloat16().float(), w)


def bf16_lora_model(path, mode):
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    with torch.no_grad():
        for parent, name in lora.block_linears(model):
            w = getattr(parent, name).weight
            w.copy_(torch.sign(w) * w.abs().clamp(min=1 / 16))
    add_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0, targets=TARGETS))  # all seven: every GEMM
    if mode == "autocast":  # a CPU under autocast_bf16: the base stored in bf16, the adapters fp32
        cast_base(model, torch.bfloat16)
        model.autocast_bf16 = True
    sub_ulp_adapters(model)
    return model.eval()


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_decode_applies_sub_ulp_adapters_as_the_trainer_does(tiny_dir, mode):
    """Each of decode's four GEMMs a layer over a half-precision copy equals the trainer's LoRALinear
    outputs (the same bf16 operations: to bf16 rounding of the sum) and differs from the base's, which a
    merged bf16 copy would reproduce exactly."""
    path, _ = tiny_dir("qwen2")
    model = bf16_lora_model(path, mode)
    w = DecodeWeights(model)
    assert w.mode == "copy"
    w.refresh(model)
    x = torch.randn(5, model.args.dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    b = model.layers[1]
    gemms = {"qkv": (w.qkv, (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj)),
             "gate_up": (w.gate_up, (b.mlp.gate_proj, b.mlp.up_proj))}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=model.autocast_bf16):
        for name, (fn, mods) in gemms.items():
            ours = fn(1, x).float()
            trainer = torch.cat([m(x) for m in mods], -1).float()
            with lora.adapters_off(model):
                base = torch.cat([m(x) for m in mods], -1).float()
            ulp = 2.0 ** (torch.floor(torch.log2(trainer.abs().clamp(min=1e-30))) - 7)  # one bf16 ulp of the output
            assert ((ours - trainer).abs() <= ulp).all(), name
            # the adapters reach decode: outputs they move past a rounding boundary differ from the base's
            assert (ours != base).any() and (ours - trainer).abs().sum() < (base - trainer).abs().sum(), name


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_decode_steps_follow_sub_ulp_adapters(tiny_dir, mode):
    """One decode step over the same cache (prefilled by the base) with the decode weights refreshed from
    the adapted model and from the base: the adapters change decode's logits (a merge rounded to bf16
    left them bitwise the base's), and the adapted step stays within bf16 rounding of the model's own
    forward with its adapters (tests/test_decode.py's tolerance for bf16 copies)."""
    path, _ = tiny_dir("qwen2")
    model = bf16_lora_model(path, mode)
    prompts = [[5, 17, 99, 3], [11, 12, 13], [40, 41, 42, 43, 44]]
    n, S, dtype = len(prompts), 12, next(model.parameters()).dtype
    cache = KVCache(model.args, n, S, dtype, torch.device("cpu"))
    tok, pos = torch.tensor([x[-1] for x in prompts]), torch.tensor([len(x) - 1 for x in prompts])
    with torch.no_grad(), lora.adapters_off(model):
        for i, x in enumerate(prompts):  # the prompts' keys and values, the base's: the same for both steps
            cache.packed(torch.full((len(x),), i), torch.arange(len(x)))
            model(torch.tensor([x]), torch.arange(len(x))[None], cache=cache)
    w = DecodeWeights(model)
    with torch.no_grad():
        w.refresh(model)
        adapted = decode(w, cache, tok, pos, n, 6).float()
        with lora.adapters_off(model):
            w.refresh(model)
        base = decode(w, cache, tok, pos, n, 6).float()
        cache.rows(slice(0, n), pos, 1, 6)
        forward = model(tok[:, None], pos[:, None], cache=cache)[:, 0].float()  # the trainer's blocks, adapted
    assert not torch.equal(adapted, base)
    torch.testing.assert_close(adapted, forward, atol=3e-2 * forward.abs().max().item(), rtol=0)


@pytest.mark.parametrize("mode", ["autocast", "lora-bf16", "lora-autocast"])
def test_the_gap_of_bf16_matmuls_is_bf16_rounding(tiny_dir, mode):
    """Half-precision matmuls (a GPU; a CPU under autocast_bf16), with and without LoRA on a bf16 base
    (sub-ulp adapters, top_p 0.8 and tool turns): the sampler's log-probs against the update's differ by
    what bf16 rounding leaves. Each GEMM output is rounded to 8 significant bits (2^-9 relative), so a
    logit of |z| ~ 5 moves by ~1e-2 and a log-prob by about as much; decode and the full forward fuse and
    round differently. Measured on an AMD EPYC over 3 seeds: mean 5.4-6.5e-3, max 2.2-3.1e-2 with an fp32
    residual stream (autocast), mean 1.1-1.2e-2, max 4.2-5.5e-2 with a bf16 one (a bf16 base). The bounds
    (mean 3e-2, max 0.15) hold a regression to that order, far below the ~3 nats of a corrupted cache."""
    path, _ = tiny_dir("qwen2")
    if mode == "autocast":
        model = Transformer.from_pretrained(path)
        model.autocast_bf16 = True
    else:
        model = bf16_lora_model(path, "bf16" if mode == "lora-bf16" else "autocast")
    model.eval()
    prompts = [[5, 17, 99, 3], [11, 12], [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(n=4, temperature=0.9, top_p=0.8, max_tokens=20, stop_token_ids=[],
                            tool_stop_token_ids=TOOLS, max_turns=3, seed=5)
    out = Sampler(model).generate(prompts, params, tool=lambda i, ids: [21, 22, 23])
    old, smp = old_and_sampler(model, trajectories(out, prompts))
    gap = (old - smp).abs()
    assert gap.mean() < 3e-2 and gap.max() < 0.15, (gap.mean().item(), gap.max().item())


# ----------------------------------------------------------------------------- dropout and whole runs

def test_dropout_defaults_and_the_old_logprobs_without_it(tiny_dir):
    """disable_dropout (default) turns lora_dropout off in the policy's forward; with it on, the update's
    old log-probs come from a no-grad pass in eval mode, so they are the sampler's policy's."""
    assert Config().disable_dropout and Config().lora_dropout == 0.05
    path, _ = tiny_dir("qwen2")
    model = add_lora(Transformer.from_pretrained(path), LoraSettings(r=4, dropout=0.3, targets=TARGETS))
    with torch.no_grad():
        for m in lora.adapters(model):
            m.lora_B.normal_(0, 0.3)
    assert lora.has_dropout(model)
    prompts = [[5, 17, 99, 3], [11, 12]]
    out = Sampler(model.eval()).generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=10,
                                                                 stop_token_ids=[], seed=1))
    from grpo.update import policy_update
    trajs = trajectories(out, prompts)
    cfg = Config(num_generations=4, micro_batch_tokens=256, learning_rate=0.0, max_grad_norm=0.0)
    opt = torch.optim.SGD(lora.trainable(model), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model.train()
    metrics = policy_update(model, None, opt, sched, trajs, torch.randn(len(trajs)), cfg, "cpu")
    assert metrics["sampler_gap"] < 1e-5 and metrics["sampler_gap_max"] < 1e-5
    assert abs(metrics["ratio"] - 1) > 1e-3  # the dropped forward is another policy: the ratio shows it


def run_custom_task(tmp_path, *extra):
    model = make_toy_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}", "solution": "w3"}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    flags = [f"--model_path={model}", f"--output_dir={out}", f"--train_data={data}", "--question_field=prompt",
             "--answer_field=solution", "--system_prompt=", "--reward_funcs=toy:target_words", "--max_steps=3",
             "--prompts_per_step=2", "--num_generations=4", "--max_prompt_length=16", "--max_completion_length=8",
             "--micro_batch_tokens=256", "--gen_batch=8", "--eval_limit=0", "--profile=none", "--save_steps=0",
             "--autocast_bf16=false", "--export=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "recipes/custom_task.py", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [row for row in steps if "sampler_gap" in row]
    return steps, json.loads((out / "summary.json").read_text()), r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--top_p=0.8", "--top_k=20"),
                                   ("--use_peft", "--learning_rate=0.05", "--lr_scheduler_type=constant")],
                         ids=["top_p-top_k", "peft-defaults"])
def test_a_run_stays_on_policy_and_reports_its_gap(tmp_path, flags):
    """recipes/custom_task.py on the toy model, fp32: the gap stays below 1e-4 every step (LoRA: after
    the adapters moved, with TRL's lora_dropout 0.05 left at its default) and summary.json reports it."""
    steps, summary, stdout = run_custom_task(tmp_path, *flags)
    assert len(steps) == 3 and all(row["sampler_gap"] < 1e-4 for row in steps), [r["sampler_gap"] for r in steps]
    if "--use_peft" in flags:
        assert steps[-1]["grad_norm"] > 0 and "lora_dropout 0.05 not applied" in stdout
    gap = summary["sampler_gap"]
    assert gap["tokens"] > 0 and 0 < gap["max"] < 1e-4 and gap["mean"] <= gap["max"]
    assert "sampler-trainer gap: mean" in stdout
