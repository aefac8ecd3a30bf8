"""One command that proves the CUDA paths: parity checks, and the figures of the GPU goals.

    python bench/gpu_check.py                    # one GPU of 80 GB or more, under 8 minutes; each part
                                                 # in its own process under --part-timeout (a hang or
                                                 # a poisoned CUDA context costs one part, not the run)
    python bench/gpu_check.py --only rollout_figures,attention_sweep   # some parts again (names: --help)
    python bench/gpu_check.py --dry-run          # CPU (automatic without CUDA): the same code, tiny sizes
    TRITON_INTERPRET=1 python bench/gpu_check.py --dry-run   # ...with the Triton kernels interpreted

On a bare GPU box with torch and triton only, offline: `pip install --no-deps --no-build-isolation .` in the
clone (not `-e`: offline its build asks the network for setuptools), then the first command.
Nothing on its path imports transformers, tokenizers, safetensors or the rest at module level
(tests/test_gpu_check.py runs it with them blocked).

Random weights of the Qwen2.5-0.5B and 3B shapes, initialized as transformers does (std 0.02), no download.
Parity, each against a reference defined here (any failure, or any part that raises, exits 1):
  kernels  fused log-probs (Triton) -> advantages -> GRPO loss with every option on, values and gradients
           w.r.t. hidden states and LM head, bf16 inputs, T 1 and 0.9; reference: the naive functions
           (grpo.kernels.reference, grpo.loss's torch path) on the same values upcast to fp32.
  sampler  greedy tokens of the FSDP2 model under dist.gathered() (as the trainer samples) with CUDA
           graphs, with flash-attn, and with both; reference: eager decode with SDPA, same model. Random
           logits have near-ties that rounding may flip, so a row may part from the reference only
           where both tokens are within TIE_REL (grpo/parity.py) of the top logit of a full forward of the
           common prefix.
           Checked in fp32 compute, where only summation order differs; bf16 (the trainer's dtype) is
           reported beside it with the gaps at which its rows parted.
  update   two GRPO steps (grpo.update.policy_update, micro-batched) under FSDP2 with bf16 compute on fp32
           master weights, one process (world size 1); reference: the same two steps on an unsharded fp32
           copy of the initial weights in plain eager PyTorch with the torch log-prob and loss paths (no
           Triton, no flash-attn). Compared: log-probs before and after, each step's grad norm, the
           weight change. SGD, not AdamW: Adam's first step is lr * sign(g), where bf16 noise on near-zero
           gradients flips whole steps; SGD's change is linear in the gradients, so it compares them.
Figures, reported against the goals (never failing): sampled decode ms per step with graphs warm (0.5B
at batch 256, 3B at batch 64; the first call's graph capture reported apart), kernels per decode step,
tokens/s and the share of the bandwidth roofline (weight + KV bytes read per step over the GPU's spec
bandwidth), the share of
a GRPO step spent generating and the update MFU (bench/step.py), fused log-probs' peak memory and time
against naive at N = 32768, V = 151936, forward + backward (bench/logprobs.py), each decode kernel against
its eager reference at both decode shapes and the decode attention's launch alternatives against the
shipped one (bench/decode_kernels.py, --sweep).
The calculator 0.5B recipe's rollout shape (8 rows in 256 slots, tool turns of random length) on random
weights: its time and, per decode step, the rows decoding, the rows decoded (the batch bucket) and the slots.
--preflight (grpo/preflight.py) of each shape's step (bench/step.py's) sized by the memory plan for this GPU:
the measured peaks of a worst-case step's rollouts and update against the plan's (it should not be exceeded).
The dry run maps each part onto the CPU: the tiny model for both shapes, the torch kernels (Triton under
TRITON_INTERPRET=1), eager decode (the sampler has no graphs on CPU), FSDP2 over gloo. Without flash-attn
its parts are skipped with a message. --perturb breaks one side of every parity check (for the test).
The JSON report is rewritten after each isolated part ("partial": true until the end), so a run killed
from outside keeps what it measured.
"""
import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).parent))  # the other benches, reused
import decode_kernels as bench_decode_kernels  # noqa: E402
import logprobs as bench_logprobs  # noqa: E402
import sampler as bench_sampler  # noqa: E402
import step as bench_step  # noqa: E402

from grpo import dist  # noqa: E402
from grpo import model as model_module  # noqa: E402
from grpo.config import Config  # noqa: E402
from grpo.kernels import linear_logprobs  # noqa: E402
from grpo.kernels.reference import entropy_ref, linear_logprobs_ref  # noqa: E402
from grpo.loss import LossOptions, group_advantages, policy_loss  # noqa: E402
from grpo.model import Transformer  # noqa: E402
from grpo.rollout import Trajectory  # noqa: E402
from grpo.sampler import Sampler, SamplingParams  # noqa: E402
from grpo.memory import GIB, memory_plan  # noqa: E402
from grpo.parity import greedy_rows  # noqa: E402  (the near-tie rule, TIE_REL)
from grpo.preflight import preflight  # noqa: E402
from grpo.update import batch_logprobs, loss_options, policy_update, update_batches  # noqa: E402

decode_module = importlib.import_module("grpo.decode")
kernels_module = importlib.import_module("grpo.kernels")

# ----------------------------------------------------------------------------- shapes, sizes, tolerances

QWEN = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)
SHAPES = {"qwen2.5-0.5b": bench_step.QWEN25_05B,
          "qwen2.5-3b": dict(QWEN, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                             num_attention_heads=16, num_key_value_heads=2),
          "tiny": dict(QWEN, vocab_size=131, max_position_embeddings=512, hidden_size=64, num_hidden_layers=2,
                       intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)}
SIZES = {  # the GPU run, and the dry run's stand-ins for the same code
    "gpu": dict(models=["qwen2.5-0.5b", "qwen2.5-3b"], kernels=(16, 250, 151936, (896, 2048)),
                fused=(32768, 151936, (896, 2048)), greedy=(32, 96), update=(16, 4, 128, 256, 1024),
                decode={"qwen2.5-0.5b": (256, 256, 512), "qwen2.5-3b": (64, 256, 512)},
                rollout=(8, 128, 4, 500, 25, 100, 256),
                step={"qwen2.5-0.5b": (16, 8, 256, 512), "qwen2.5-3b": (8, 8, 256, 512)}),
    "dry": dict(models=["tiny"], kernels=(4, 9, 301, (40,)), fused=(256, 2048, (64,)), greedy=(6, 12),
                update=(8, 4, 12, 16, 64), decode={"tiny": (8, 16, 8)}, rollout=(4, 8, 3, 24, 3, 6, 16),
                step={"tiny": (2, 2, 8, 4)}),
}
# spec HBM bytes/s by substrings of the device name, first match; another GPU gets no roofline share
BANDWIDTH = [(("H200",), 4.8e12), (("H100", "PCIe"), 2.0e12), (("H100", "NVL"), 3.9e12), (("H100",), 3.35e12),
             (("A100", "80GB"), 2.0e12), (("B200",), 8.0e12)]
# kernels: max |err| (lp, entropy, advantages), else relative norm error. Log-probs: bf16 products are
# exact in fp32, so only the summation order differs (~1e-5), far under a bf16 step at |log p| ~ 12
# (0.06). Gradients: dz and the gradient itself are rounded to bf16 (2^-9 relative each).
KERNEL_TOL = dict(lp=2e-3, entropy=2e-3, adv=1e-4, loss=1e-3, grad_hidden=2e-2, grad_weight=2e-2)
# update: bf16 compute against fp32; mean |log-prob error| in nats, else relative errors. With the CPU's
# bf16 at the 0.5B shape: 0.010 and 0.018 nats, 0.0008, 0.029 (the GRPO gradient sums +-A terms that
# mostly cancel, so bf16 rounding shows more in it than in one sequence's gradient)
UPDATE_TOL = dict(lp=0.05, grad_norm=0.01, weight_change=0.08)
LR = 0.5  # SGD, grad norm clipped to 1: each step moves the weights by ~1e-3 of their norm


def build(name: str, device) -> Transformer:
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer({"model_type": "qwen2", **SHAPES[name]})  # fp32, as the trainer's master copy
    with torch.no_grad():  # transformers' init: logits of a real checkpoint's scale (std ~0.6)
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
            elif n.endswith("bias"):
                p.zero_()
    return model


def row(part, model, what, value, target="", status="info", note="", **extra) -> dict:
    return dict(part=part, model=model, what=what, value=value, target=target, status=status, note=note,
                **extra)


def parity(part, model, what, err, tol, note="", **extra) -> dict:  # NaN fails too
    return row(part, model, what, err, f"<= {tol:g}", "pass" if err <= tol else "fail", note, **extra)


def goal(part, model, what, value, shown: str, met: bool, target: str, note="", **extra) -> dict:
    return row(part, model, what, value, target, "met" if met else "not met", note, shown=shown, **extra)


@contextlib.contextmanager
def fused_paths(kernels: bool = True, flash: bool = True):
    """Switch fused kernels off for a reference: without `kernels`, every grpo.kernels call that
    names no backend (log-probs, loss, the decode step's layers, sampling) takes its PyTorch
    reference (grpo.kernels.references); without `flash`, the model's prefill and the decode step
    do not take flash-attn (a module global each, set at import, so cleared meanwhile)."""
    mods = [(model_module, "flash_attn_varlen_func"), (decode_module, "flash_attn_with_kvcache")]
    saved = [getattr(m, name) for m, name in mods]
    for m, name in mods:
        setattr(m, name, getattr(m, name) if flash else None)
    try:
        with contextlib.nullcontext() if kernels else kernels_module.references():
            yield
    finally:
        for (m, name), value in zip(mods, saved):
            setattr(m, name, value)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()

# ----------------------------------------------------------------------------- parity


def kernel_parity(device, backend: str, sizes: dict, perturb: bool) -> list[dict]:
    B, T, V, Hs = sizes["kernels"]
    rows = []
    for H, temp in [(H, temp) for H in Hs for temp in (1.0, 0.9)]:
        g = torch.Generator(device).manual_seed(H)
        hidden = torch.randn(B, T, H, generator=g, device=device).bfloat16()
        weight = (torch.randn(V, H, generator=g, device=device) * H**-0.5).bfloat16()  # logits std ~1
        labels = torch.randint(0, V, (B, T), generator=g, device=device)
        labels[:, ::7] = -100  # ignored positions (prompt, injected tokens)
        mask, rewards = (labels >= 0).float(), torch.rand(B, generator=g, device=device)
        noise = torch.randn(3, B, T, generator=g, device=device)
        with torch.no_grad():  # ratios spread over the clip range, so every branch of the loss is taken
            old = linear_logprobs_ref(hidden, weight, labels, temp) + 0.3 * noise[0]
        out = {}
        for side, bk in (("fused", backend), ("ref", "torch")):
            h, w = (x.clone() if side == "fused" else x.float() for x in (hidden, weight))
            h.requires_grad_()
            w.requires_grad_()
            if side == "fused":
                lp, ent = linear_logprobs(h, w, labels, temp, backend=bk, return_entropy=True)
                lp = lp + 0.1 if perturb else lp  # a known-bad kernel, for the test of this check
            else:
                lp = linear_logprobs_ref(h, w, labels, temp)
                with torch.no_grad():
                    ent = torch.where(labels >= 0, entropy_ref(h, w, temp), 0.0)  # ignored positions: 0
            adv = group_advantages(rewards, 4, "group", backend=bk)
            opts = LossOptions(eps_high=0.28, delta=4.0, dual_clip=3.0, beta=0.04, tis_cap=2.0, backend=bk)
            loss, _ = policy_loss(lp, old, adv, mask, opts, num_sequences=B, num_tokens=mask.sum().item(),
                                  ref_logprobs=old + 0.2 * noise[1], sampler_logprobs=old + 0.1 * noise[2])
            loss.backward()
            out[side] = dict(lp=lp.detach(), entropy=ent, adv=adv, loss=loss.detach(), gh=h.grad, gw=w.grad)
        f, r = out["fused"], out["ref"]
        err = {k: (f[k] - r[k]).abs().max().item() for k in ("lp", "entropy", "adv")}
        err |= dict(loss=rel(f["loss"], r["loss"]), grad_hidden=rel(f["gh"], r["gh"]),
                    grad_weight=rel(f["gw"], r["gw"]))
        rows.append(parity("kernels", f"H={H}", f"{backend} log-probs+loss T={temp}: worst err/tol",
                           max(err[k] / KERNEL_TOL[k] for k in err), 1.0,
                           " ".join(f"{k} {v:.1e}" for k, v in err.items()), errors=err))
    return rows


def greedy_parity(name: str, device, sizes: dict, perturb: bool) -> list[dict]:
    """fp32 compute is the check: graphs and eager decode then differ in summation order alone (other
    batch shapes), so only exact near-ties may flip. bf16, the trainer's dtype, is reported beside it
    with the gaps at which rows parted: bf16 noise through 36 random layers can exceed TIE_REL."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += greedy_case(name, device, sizes, perturb, dtype)
        gc.collect()
    return rows


def greedy_case(name: str, device, sizes: dict, perturb: bool, dtype) -> list[dict]:
    P, new = sizes["greedy"]
    model = dist.shard(build(name, device), dtype)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 8 + 2 * new, (P,), generator=g).tolist()
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=new, stop_token_ids=[])

    def run(graphs: bool, flash: bool, prompts: list, kernels: bool = True) -> list:
        with dist.gathered(model), fused_paths(kernels=kernels, flash=flash):
            sampler = Sampler(model, gen_batch=P, max_seq_len=max(lengths) + new, cuda_graphs=graphs)
            out = [c.token_ids for c in sampler.generate(prompts, params)]
            sampler.pool.shutdown()
            return out

    ref = run(False, False, prompts, kernels=False)  # eager decode, PyTorch ops and SDPA: the path CI runs on the CPU
    # perturbed: another last prompt token on the tested side, which the check must catch
    tested = [p[:-1] + [(p[-1] + 1) % model.args.vocab_size] for p in prompts] if perturb else prompts
    rows, cases = [], [("cuda graphs", True, False)]
    dt = str(dtype).removeprefix("torch.")
    if decode_module.flash_attn_with_kvcache is None:
        rows.append(row("sampler", name, f"greedy {dt} with flash-attn", None, status="skip",
                        note="flash_attn does not import"))
    else:
        cases += [("flash-attn", False, True), ("graphs + flash-attn", True, True)]
    for what, graphs, flash in cases:
        out = run(graphs, flash, tested)
        gaps = []
        with dist.gathered(model):
            equal, ties, bad = greedy_rows(model, prompts, ref, out, gaps)
        note = (f"{equal} equal, {ties} parted at a near-tie, {bad} elsewhere, of {P} rows x {new} tokens"
                + (f"; gaps / |top logit|: max {max(gaps):.3g}, median {sorted(gaps)[len(gaps) // 2]:.3g}"
                   if gaps else "") + (" (CPU: no graphs)" if device.type != "cuda" and graphs else ""))
        what = f"greedy {dt}, {what} vs eager SDPA: rows parted off a tie"
        if dtype == torch.float32:
            rows.append(parity("sampler", name, what, bad, 0, note))
        else:
            rows.append(row("sampler", name, what, bad, note=note))
    return rows


def synthetic_batch(V: int, rows: int, G: int, plen: int, clen: int, seed: int):
    """Random prompts and completions (a few injected tokens masked out), and group advantages."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(rows):
        P, C = (int(torch.randint(n // 2, n + 1, (), generator=g)) for n in (plen, clen))
        ids = torch.randint(0, V, (P + C,), generator=g).tolist()
        trajs.append(Trajectory(example={}, prompt_index=i // G, prompt_ids=ids[:P], completion_ids=ids[P:],
                                loss_mask=[int(j % 11 != 5) for j in range(C)], sampler_logprobs=[0.0] * C,
                                finish_reason="length", num_turns=1))
    return trajs, group_advantages(torch.rand(rows, generator=g), G)


def update_parity(name: str, device, sizes: dict, perturb: bool) -> list[dict]:
    n, G, plen, clen, mbt = sizes["update"]
    model = build(name, device)
    ref = copy.deepcopy(model)  # the reference: unsharded fp32, eager, torch kernels
    w0 = {k: p.detach().clone() for k, p in model.named_parameters()}
    dist.shard(model, torch.bfloat16)  # on the CPU too: FSDP2 over gloo with bf16 compute
    # tis_cap 0: the synthetic sampler log-probs are not the policy's
    cfg = Config(num_generations=G, prompts_per_step=n // G, max_prompt_length=plen,
                 max_completion_length=clen, micro_batch_tokens=mbt, learning_rate=LR, max_grad_norm=1.0,
                 tis_cap=0.0).check()
    batches = [synthetic_batch(model.args.vocab_size, n, G, plen, clen, seed) for seed in (1, 2)]

    def logprobs(m) -> torch.Tensor:  # (mask tokens,) of the first batch, in update_batches' order
        mbs = update_batches(*batches[0], cfg, device)
        # gathered, so resharded after: a forward without backward leaves the FSDP root unsharded, and
        # its parameters would then read as the bf16 copies, not the fp32 master weights
        with dist.gathered(m):
            return torch.cat([lp[b["loss_mask"] > 0] for lp, b in zip(batch_logprobs(m, mbs, 1.0), mbs)])

    res = {}
    for side, m in (("fsdp", model), ("ref", ref)):
        opt = torch.optim.SGD(m.parameters(), lr=LR * (1.25 if perturb and side == "fsdp" else 1.0))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        opts = dataclasses.replace(loss_options(cfg), backend="torch" if side == "ref" else None)
        with fused_paths(kernels=side == "fsdp", flash=side == "fsdp"):
            before = logprobs(m)
            norms = [policy_update(m, None, opt, sched, *batch, cfg, device, opts)["grad_norm"]
                     for batch in batches]
            res[side] = dict(before=before, after=logprobs(m), norms=norms)
    num = den = 0.0
    ref_params = dict(ref.named_parameters())
    for k, p in model.named_parameters():  # the weight change, one tensor at a time
        d_fsdp = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float() - w0[k]
        d_ref = ref_params[k].detach().float() - w0[k]
        num, den = num + (d_fsdp - d_ref).pow(2).sum().item(), den + d_ref.pow(2).sum().item()
    f, r = res["fsdp"], res["ref"]
    lp_err = lambda key: (f[key] - r[key]).abs().mean().item()  # noqa: E731
    return [parity("update", name, "FSDP2 bf16 vs fp32 eager: log-probs before, mean abs err",
                   lp_err("before"), UPDATE_TOL["lp"]),
            parity("update", name, "...each step's grad norm, relative err",
                   max(abs(a - b) / b for a, b in zip(f["norms"], r["norms"])), UPDATE_TOL["grad_norm"],
                   " ".join(f"{a:.4g}/{b:.4g}" for a, b in zip(f["norms"], r["norms"]))),
            parity("update", name, "...weight change after 2 SGD steps, relative err", math.sqrt(num / den),
                   UPDATE_TOL["weight_change"]),
            parity("update", name, "...log-probs after step 2, mean abs err", lp_err("after"),
                   UPDATE_TOL["lp"])]

# ----------------------------------------------------------------------------- figures


def fused_figures(device, sizes: dict) -> list[dict]:
    N, V, Hs = sizes["fused"]
    rows = []
    for H in Hs:
        case = dict(N=N, V=V, H=H, dtype="bfloat16", mode="fwd+bwd", device=device.type)
        ours = bench_logprobs.one_case({**case, "method": "ours"})
        what = f"fused log-probs N={N} fwd+bwd"
        try:
            naive = bench_logprobs.one_case({**case, "method": "naive"})
        except torch.cuda.OutOfMemoryError:  # naive holds (N, V) fp32 logits and their copies: 4 x 20 GB
            rows.append(row("figures", f"H={H}", f"{what}: naive ran out of memory", ours["peak_mib"],
                            note=f"ours {ours['ms']:.0f} ms, {ours['peak_mib']:.0f} MiB"))
            continue
        # a CPU's peak is resident memory's growth, which can be 0 when the allocator reuses freed pages
        ratio = lambda a, b: a / b if b > 0 else float("nan")  # noqa: E731
        mem, t = ratio(ours["peak_mib"], naive["peak_mib"]), ratio(ours["ms"], naive["ms"])
        note = (f"ours {ours['ms']:.0f} ms {ours['peak_mib']:.0f} MiB, "
                f"naive {naive['ms']:.0f} ms {naive['peak_mib']:.0f} MiB")
        rows += [goal("figures", f"H={H}", f"{what}: peak memory / naive", mem, f"{mem:.1%}", mem <= 0.1,
                      "<= 10%", note),
                 goal("figures", f"H={H}", f"{what}: time / naive", t, f"{t:.2f}x", t <= 1.0, "<= 1x")]
    return rows


def kernel_figures(device) -> list[dict]:
    """Each decode kernel against its eager reference at both decode shapes (bench/decode_kernels.py)."""
    if device.type != "cuda":
        return [row("figures", "", "decode kernels' times", None, status="skip", note="CUDA only")]
    return [row("figures", r["model"], f"{r['kernel']} {r['shape']}: us, Triton (eager)", r["triton_us"],
                shown=f"{r['triton_us']:.1f} ({r['torch_us']:.1f}, {r['x']:.1f}x)")
            for r in bench_decode_kernels.measure(torch.bfloat16, iters=50, reps=3)]


def attention_sweep(device) -> list[dict]:
    """The decode attention's launch alternatives against the shipped one (bench/decode_kernels.py --sweep)."""
    if device.type != "cuda":
        return [row("figures", "", "decode attention launches", None, status="skip", note="CUDA only")]
    rows = []
    for r in bench_decode_kernels.sweep(torch.bfloat16, iters=50, reps=3):
        what = f"decode attention launch (keys, warps, stages) {r['keys_warps_stages']}" + (" shipped" * r["shipped"])
        shown = r["error"] or f"{r['us']:.1f} us, {r['speed']:.2f}x the shipped launch's speed"
        rows.append(row("figures", r["model"], what, r["us"], shown=shown))
    return rows


# the decode goals: ms per step (sampled, T 1, graphs warm) and kernels per step, per shape
DECODE_GOALS = {"qwen2.5-0.5b": (2.0, 350), "qwen2.5-3b": (3.0, None)}


def decode_figures(name: str, device, sizes: dict) -> list[dict]:
    """Sampled decode (T 1) at the shape's batch, graphs warm: a first call captures them (its time
    is reported apart), the next ones are timed. Kernels per step: one decode step profiled alone."""
    B, plen, new = sizes["decode"][name]
    model = build(name, device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)  # no FSDP
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, model.args.vocab_size, (B, plen), generator=g).tolist()
    sampler = Sampler(model, gen_batch=B, max_seq_len=plen + new)
    go = lambda k: sampler.generate(prompts, SamplingParams(temperature=1.0, max_tokens=k, stop_token_ids=[], seed=1))
    cold = bench_sampler.timed(lambda: go(new), device)  # captures every (bucket, cache bucket) it meets
    capture = sampler.capture_seconds
    t_prefill, t_all = bench_sampler.best(lambda: go(1), device, 2), bench_sampler.best(lambda: go(new), device, 2)
    ms = 1e3 * (t_all - t_prefill) / (new - 1)
    tps = B * (new - 1) / (t_all - t_prefill)
    target_ms, target_kernels = DECODE_GOALS.get(name, (None, None))
    what = f"decode ms/step, batch {B}, {plen} + {new} tokens, T 1"
    note = f"{tps:,.0f} tok/s; first call {cold:.1f} s with {capture:.1f} s of graph capture"
    rows = [goal("figures", name, what, ms, f"{ms:.2f}", ms <= target_ms, f"<= {target_ms}", note)
            if target_ms else row("figures", name, what, ms, shown=f"{ms:.2f}", note=note),
            row("figures", name, f"decode tokens/s, batch {B}, {plen} + {new} tokens", tps, shown=f"{tps:,.0f}")]
    kernels = kernels_per_step(sampler, B, plen) if device.type == "cuda" else None
    if kernels is not None:
        rows.append(goal("figures", name, "kernels per decode step", kernels, f"{kernels}",
                         target_kernels is None or kernels <= target_kernels,
                         f"<= {target_kernels}" if target_kernels else "", "device kernels and copies, eager"))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = next((bw for keys, bw in BANDWIDTH if all(k in gpu for k in keys)), None)
    if bw is None:
        return rows + [row("figures", name, "decode share of the bandwidth roofline", None, "", "skip",
                           f"no known bandwidth for {gpu}")]
    share = tps / bench_sampler.roofline_tps(model, B, plen, new, bw)
    return rows + [row("figures", name, "decode share of the bandwidth roofline", share, shown=f"{share:.1%}",
                       note=f"{gpu}: {bw / 1e12:.2f} TB/s")]


def preflight_figures(name: str, device, sizes: dict) -> list[dict]:
    """--preflight of a run of the step's shape (bench/step.py's) sized by the memory plan for this GPU, as
    the trainer builds it: fp32 master weights under FSDP2 with bf16 compute, the sampler over the gathered
    weights, AdamW. One worst-case step (every row at full length, the largest micro-batch): the measured
    peaks of the rollouts and the update against the plan's (grpo/preflight.py says what each counts)."""
    B, G, plen, new = sizes["step"][name]
    model = build(name, device)
    shape = Config(prompts_per_step=B, num_generations=G, max_prompt_length=plen, max_completion_length=new,
                   eval_limit=0, beta=0.0)
    cfg = dataclasses.replace(shape, **bench_step.sizes_on_this_gpu(model.args, B, G, plen, new, device)).check()
    model.activation_checkpointing = cfg.gradient_checkpointing
    dist.shard(model, torch.bfloat16 if device.type == "cuda" else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with dist.gathered(model):
        sampler = Sampler(model, None, gen_batch=cfg.gen_batch, kv_budget_bytes=int(cfg.kv_budget_gb * GIB) or None)
    plan = memory_plan(model.args, cfg, 1, device.type)
    out = preflight(cfg, model, sampler, optimizer, device, plan)
    sampler.pool.shutdown()
    sized = (f"gen_batch {cfg.gen_batch}, kv_budget_gb {cfg.kv_budget_gb:g}, micro_batch_tokens "
             f"{cfg.micro_batch_tokens}, checkpointing {cfg.gradient_checkpointing}; {B} x {G} rows of {plen} + {new}")
    return [goal("figures", name, f"preflight {phase}: measured peak / planned", got / want, f"{got / want:.0%}",
                 got <= want, "<= 100%", f"measured {got / GIB:.2f} GiB, planned {want / GIB:.2f} GiB; {sized}")
            for phase, (want, got) in out.items()]


def rollout_figures(name: str, device, sizes: dict) -> list[dict]:
    """The calculator 0.5B recipe's rollout on one rank, without its tokenizer: G 8 rows of one
    prompt in 256 slots (a large GPU's gen_batch), up to 4 assistant turns and 500 tokens, T 0.9. A turn ends
    at any of V / 100 random tool-stop tokens (random weights sample nearly uniformly: turns of
    ~100 tokens, geometric), and each tool call is answered by 25 tokens. Reported: the call's
    time with graphs warm (a first call captures them), and per decode step the rows decoding, the
    rows decoded (the bucket) and the slots: the goal's "live rows vs slots"."""
    R, plen, turns, max_tokens, obs, mean_turn, slots = sizes["rollout"]
    model = build(name, device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)  # no FSDP
    V = model.args.vocab_size
    g = torch.Generator().manual_seed(3)
    stops = torch.randperm(V, generator=g)[: max(1, V // mean_turn)].tolist()
    prompt = torch.randint(0, V, (plen,), generator=g).tolist()
    answer = torch.randint(0, V, (obs,), generator=g).tolist()  # the calculator's reply, as template tokens
    sampler = Sampler(model, gen_batch=slots, max_seq_len=plen + max_tokens, buckets=True)
    params = SamplingParams(n=R, temperature=0.9, max_tokens=max_tokens, stop_token_ids=[], tool_stop_token_ids=stops,
                            max_turns=turns, seed=4)
    go = lambda: sampler.generate([prompt], params, tool=lambda index, ids: answer)  # noqa: E731
    cold = bench_sampler.timed(go, device)
    before = sampler.decode_steps, sampler.rows_decoded, sampler.rows_live
    out = []
    seconds = bench_sampler.timed(lambda: out.append(go()), device)
    steps, decoded, live = (a - b for a, b in zip((sampler.decode_steps, sampler.rows_decoded, sampler.rows_live), before))
    sampler.pool.shutdown()
    done = out[0]
    sampled = sum(len(c.token_ids) for c in done)
    calls = sum(c.num_turns - 1 for c in done)
    note = (f"{R} rows, {sampled} completion tokens (observations in), {calls} tool calls, {steps} decode steps; "
            f"first call {cold:.2f} s with {sampler.capture_seconds:.1f} s of graph capture"
            + (" (CPU: no graphs; buckets forced)" if device.type != "cuda" else ""))
    return [row("figures", name, f"rollout of the calculator 0.5B recipe's shape: seconds, {R} rows, graphs warm",
                seconds, shown=f"{seconds:.2f}", note=note),
            row("figures", name, "...per decode step: rows decoding / rows decoded / slots", decoded / max(steps, 1),
                shown=f"{live / max(steps, 1):.1f} / {decoded / max(steps, 1):.1f} / {slots}")]


def kernels_per_step(sampler, B: int, plen: int) -> int:
    """Device activities (kernels, copies, memsets) of one eager decode step over B rows at
    position plen: what one step of a replayed graph launches."""
    from grpo.sampler import decode_step
    st = sampler.state
    st.pos[:B], st.active[:B] = plen, True
    step = lambda: decode_step(sampler.weights, sampler.cache, st, SamplingParams(temperature=1.0), B, plen + 1, 0)
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    st.active.zero_()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def step_figures(name: str, device, sizes: dict) -> list[dict]:
    B, G, plen, new = sizes["step"][name]
    model = build(name, device)
    profile = bench_step.sizes_on_this_gpu(model.args, B, G, plen, new, device)  # as a run sizes itself here
    r = bench_step.bench(name, model, B, G, plen, new, device, 1, profile)
    note = f"{B} x {G} rows, {plen} + {new} tokens, step {r['step_s']:.2f} s"
    return [goal("figures", name, "generation share of a GRPO step", r["gen_share"], f"{r['gen_share']:.0%}",
                 r["gen_share"] < 0.5, "< 50%", note, step=r),
            goal("figures", name, "update MFU", r["update_mfu"], f"{r['update_mfu']:.1%}",
                 r["update_mfu"] >= 0.4, ">= 40%", f"{r['update_tflops']:.1f} TFLOP/s against {r['peak']}")]

# ----------------------------------------------------------------------------- main


def parts_of(device, backend: str, sizes: dict, perturb: bool) -> list[tuple]:
    """(part, function, args), in the order they run."""
    parts = [("kernels", kernel_parity, (device, backend, sizes, perturb)),
             ("figures", fused_figures, (device, sizes)),
             ("figures", kernel_figures, (device,)),
             ("figures", attention_sweep, (device,))]
    for i, name in enumerate(sizes["models"]):
        if i == 0:  # one shape shows FSDP's arithmetic; the smaller leaves room for both fp32 copies
            parts.append(("update", update_parity, (name, device, sizes, perturb)))
        parts += [("sampler", greedy_parity, (name, device, sizes, perturb)),
                  ("figures", decode_figures, (name, device, sizes))]
        if i == 0:  # the calculator 0.5B recipe's rollout: the first (smaller) shape
            parts.append(("figures", rollout_figures, (name, device, sizes)))
        parts.append(("figures", preflight_figures, (name, device, sizes)))  # the plan checked, each shape
        parts.append(("figures", step_figures, (name, device, sizes)))
    return parts


def raised(name: str, a: tuple, note: str) -> list[dict]:
    """The one row of a part that did not finish; its model is its first argument when that names one."""
    return [row(name, a[0] if isinstance(a[0], str) else "", "raised", None, status="error", note=note)]


def run_part(name: str, fn, a: tuple, device) -> list[dict]:
    t = time.perf_counter()
    try:
        out = fn(*a)
    except Exception as e:  # reported, and fails the run; the other parts still run
        traceback.print_exc()
        out = raised(name, a, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [dict(r, seconds=round(time.perf_counter() - t, 1)) for r in out]


def isolated(args, parts: list[tuple], device) -> list[dict]:
    """Each part in its own process, under a time limit: a hang (a graph capture, a collective) or an
    error that poisons the CUDA context then costs one part, not the rest of the run."""
    rows = []
    for i, (name, _, a) in enumerate(parts):
        tmp = Path(f"{args.out}.part{i}")
        cmd = [sys.executable, __file__, "--part", str(i), "--out", str(tmp)]
        cmd += ["--dry-run"] * args.dry_run + ["--perturb"] * args.perturb + ["--only", args.only] * bool(args.only)
        print(f"== part {i}: {name} {a[0] if isinstance(a[0], str) else ''}", flush=True)
        t = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=args.part_timeout).returncode
            out = json.loads(tmp.read_text()) if tmp.exists() else raised(name, a, f"the part's process exited {rc}")
        except subprocess.TimeoutExpired:
            out = raised(name, a, f"timed out after {args.part_timeout} s")
        tmp.unlink(missing_ok=True)
        rows += [dict(r, seconds=r.get("seconds", round(time.perf_counter() - t, 1))) for r in out]
        report(args, rows, device, partial=True)  # a run killed from outside keeps what it measured
    return rows


def report(args, rows: list[dict], device, seconds=None, partial=False) -> dict:
    failed = [r for r in rows if r["status"] in ("fail", "error")]
    out = dict(ok=not failed and not partial, partial=partial, dry_run=device.type != "cuda",
               backend=args.backend, seconds=seconds, torch=torch.__version__,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               flash_attn=decode_module.flash_attn_with_kvcache is not None, rows=rows)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    ap.add_argument("--out", default="gpu_check.json", help="the JSON report")
    ap.add_argument("--perturb", action="store_true", help="testing: break one side of every parity check")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each part in its own process (default: on CUDA)")
    ap.add_argument("--part-timeout", type=int, default=240, help="seconds per isolated part")
    ap.add_argument("--only", default="", help="run only these parts, by function, comma-separated (e.g. "
                                               "rollout_figures,attention_sweep: a part to run again, in a short GPU session)")
    ap.add_argument("--part", type=int, help=argparse.SUPPRESS)  # internal: run one part, write its rows
    args = ap.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    args.dry_run = dry
    device = torch.device("cpu") if dry else dist.device()
    args.backend = "triton" if not dry or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    sizes = SIZES["dry" if dry else "gpu"]
    parts = parts_of(device, args.backend, sizes, args.perturb)
    if args.only:
        names, known = set(args.only.split(",")), {fn.__name__ for _, fn, _ in parts}
        if names - known:
            ap.error(f"--only {','.join(sorted(names - known))}: not a part (one of {', '.join(sorted(known))})")
        parts = [p for p in parts if p[1].__name__ in names]
    isolate = (not dry) if args.isolate is None else args.isolate
    start = time.perf_counter()
    if args.part is None and isolate:
        rows = isolated(args, parts, device)
    else:
        if args.part is None:
            print(f"dry run on the CPU: tiny sizes, {args.backend} kernels" if dry else
                  f"{torch.cuda.get_device_name(device)}: {args.backend} kernels, one process")
        # one process, world size 1, with an in-memory store (no port), as grpo.dist.shard does on one GPU
        if dry:
            tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
        else:
            torch.cuda.set_device(device)
            tdist.init_process_group("nccl", store=tdist.HashStore(), rank=0, world_size=1, device_id=device)
            gib = torch.cuda.get_device_properties(device).total_memory / 2**30
            if gib < 75:
                print(f"warning: {gib:.0f} GiB of GPU memory; the sizes are for 80 GB or more")
        rows = []
        for i, (name, fn, a) in enumerate(parts):
            if args.part in (None, i):
                rows += run_part(name, fn, a, device)
        tdist.destroy_process_group()
        if args.part is not None:
            Path(args.out).write_text(json.dumps(rows, default=str))
            return
    seconds = time.perf_counter() - start

    print("| part | model | check or figure | value | target | result | note |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        value = r.get("shown") or ("" if r["value"] is None else f"{r['value']:.3g}")
        print(f"| {r['part']} | {r['model']} | {r['what']} | {value} | {r['target']} | {r['status']} "
              f"| {r['note']} |")
    out = report(args, rows, device, round(seconds, 1))
    checks = [r for r in rows if r["status"] in ("pass", "fail")]
    print(f"gpu_check: {sum(r['status'] == 'pass' for r in checks)}/{len(checks)} parity checks passed, "
          f"{sum(r['status'] == 'error' for r in rows)} parts raised, {seconds:.0f} s; report in {args.out}")
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
