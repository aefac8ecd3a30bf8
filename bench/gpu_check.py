"""One command for a GPU's first minutes: the environment, the parity checks of every CUDA path, then the
figures of the GPU goals, in stages, each part under a time limit, every part's rows on disk as it makes them.

    python bench/gpu_check.py                          # one GPU of 80 GB or more, --budget 420 s in all
    python bench/gpu_check.py --out "$OUT"             # rows, report and log under $OUT (default bench/gpu_out/)
    python bench/gpu_check.py --only rollout_figures,attention_sweep   # some parts again (names: --help)
    python bench/gpu_check.py --dry-run --out /tmp/g   # CPU (automatic without CUDA): the same code, tiny sizes
    TRITON_INTERPRET=1 python bench/gpu_check.py --dry-run   # ...with the Triton kernels interpreted
    bash bench/first_run.sh                            # the driver for a 15-minute GPU session

Stages, in order (the budget in seconds each may take on the GPU from its first part's start):
  env     (60)   GPU, driver, torch, CUDA, Triton, torch.mm(..., out_dtype=float32), optional packages
  parity  (240)  kernels, T > 0 sampling, bf16 decode kernels, FSDP2 update, greedy decode, a tool-turn
                 rollout's sampler-trainer gap, a LoRA step and its decode gap (below). Estimated on an H200
                 from the parts' earlier times (the whole 2026-12-04 run took 288 s): about 2.5 minutes,
                 Triton's compiles included; not measured yet
  decode  (90)   decode ms per step at each shape against both floors: bandwidth and compute
  steps   (150)  three timed GRPO steps a shape (bench/step.py), after one warm-up
  rest           the other figures while the budget lasts: the calculator rollout, --preflight of each
                 shape, the 3B greedy check, fused log-probs, decode kernels' times, attention launches
A part that would start past its stage's or the run's budget writes one "skip" row instead.

Each part runs in a worker process under --part-timeout (120 s; a few parts more): a hang (a graph
capture, a collective) or an error that poisons the CUDA context costs one part. The worker runs the
parts one after another and writes each row to OUT/parts/NN.json as the part makes it, before any
teardown; after a part raised, or when the process dies (in NCCL's teardown too), a fresh worker goes
on with the next part. OUT/report.json is rewritten after every part ("partial": true until the end),
OUT/log.txt holds the workers' output, OUT/table.md the final table. Any parity failure, and any
part that raised, timed out or died, exits 1.

On a bare GPU box, torch and triton only, offline, nothing to install: run it from the clone. Its own
kernels/ and envs/ folders import as grpo.kernels and grpo.envs here (CheckoutPackages, the mapping
setup.py's package_dir makes when installed), and nothing on its path imports transformers,
tokenizers, safetensors, tqdm, flash_attn or setuptools at module level (tests/test_gpu_check.py runs
the dry run from a copy of the tree that was never installed, with all of those blocked).

Random weights of the Qwen2.5-0.5B and 3B shapes, initialized as transformers does (std 0.02), no download.
Parity, each against a reference defined here or in grpo/measure/parity.py (with the arithmetic behind each tolerance):
  kernels   fused log-probs (Triton) -> advantages -> GRPO loss with every option on, values and gradients
            w.r.t. hidden states and LM head, bf16 inputs, T 1 and 0.9; reference: the naive functions on
            the same values upcast to fp32.
  sampling  grpo.engine.sampling.sample at T > 0 (the fused Triton draw without filters on CUDA, the eager path with
            top-k / top-p), fp32 and bf16 logits, against its rule recomputed in float64 from the same
            noise: the same tokens off ties, the same kept set off its edge, log-probs within 2e-5; and the
            frequencies of many draws against the distribution (total variation within 3x a fair draw's).
  decode kernels  the bf16 decode kernels (add_rmsnorm, silu_mul, qkv_rope_write with and without qk-norm,
            decode_attention) against their references at both decode shapes, in bf16 ulps at each vector's
            scale (as many as the kernel's rounding steps), attention against a bound on SDPA's own rounding.
  update    two GRPO steps (grpo.update.policy_update, micro-batched) under FSDP2 with bf16 compute on fp32
            master weights against the same two steps on an unsharded fp32 copy in plain eager PyTorch.
            SGD, not AdamW: Adam's first step is lr * sign(g), where bf16 noise on near-zero gradients
            flips whole steps; SGD's change is linear in the gradients, so it compares them.
  sampler   greedy tokens of the FSDP2 model under dist.gathered() (as the trainer samples) with CUDA graphs
            (and flash-attn where installed) against eager decode with SDPA; a row may part only at a
            near-tie (grpo.measure.parity.TIE_REL). Checked in fp32 compute; bf16 is shown beside it.
  tool turns  a rollout with tool calls (observations injected, T 0.9, top-p 0.95) on the FSDP2 model,
            the sampler's log-probs against the trainer's forward on the same tokens, the first turn and
            the turns after an observation apart: fp32 checked tight, bf16 (the trainer's dtype) looser.
  lora      two LoRA steps under FSDP2 (bf16 base, fp32 adapters) against an unsharded fp32 reference;
            then the sampler's decode (adapters applied unmerged beside its bf16 copy, grpo/engine/decode.py)
            against the trainer's forward, and whether it samples the stepped policy, not the base.
Figures, reported against the goals (never failing): decode ms per step with graphs warm (0.5B at batch
256, 3B at batch 64), kernels per step, tokens/s, the bandwidth floor (weight + KV bytes over the spec
bandwidth) and the compute floor (matmul and attention FLOPs over the spec bf16 rate); the GRPO step's
generation share and update MFU; the calculator 0.5B recipe's rollout shape; --preflight's measured peaks
(rollouts, update, optimizer step) against the memory plan's; fused log-probs against naive; each decode
kernel's time and the decode attention's launch alternatives (bench/decode_kernels.py).
The dry run maps each part onto the CPU: the tiny model, small shapes, the torch kernels (Triton under
TRITON_INTERPRET=1), eager decode, FSDP2 over gloo. --perturb breaks one side of every parity check.
"""
import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib
import importlib.abc
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections import namedtuple
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class CheckoutPackages(importlib.abc.MetaPathFinder):
    """grpo.kernels and grpo.envs from this checkout's kernels/ and envs/ folders, the mapping setup.py's
    package_dir makes when installed: a clone that was never installed runs (a bare GPU box has no
    setuptools to install with, and no network). First on sys.meta_path, so that an installed copy
    elsewhere never stands in for this one. kernels/__init__.py covers the other way round: the folder
    found under its own name, `kernels`, by a Python started in the checkout's root."""

    def find_spec(self, name, path=None, target=None):
        parent, _, child = name.partition(".")
        if parent != "grpo" or child not in ("kernels", "envs"):
            return None
        folder = ROOT / child
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # grpo from this checkout; the other benches, reused
sys.meta_path.insert(0, CheckoutPackages())

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

import decode_kernels as bench_decode_kernels  # noqa: E402
import logprobs as bench_logprobs  # noqa: E402
import sampler as bench_sampler  # noqa: E402
import step as bench_step  # noqa: E402

from grpo.infra import dist  # noqa: E402
from grpo.models import layers as layers_module  # noqa: E402
from grpo.config import Config  # noqa: E402
from grpo.kernels import add_rmsnorm, decode_attention, fused_sample, linear_logprobs, qkv_rope_write, silu_mul  # noqa: E402
from grpo.kernels.cases import SHAPES as DECODE_SHAPES  # noqa: E402
from grpo.kernels.reference import entropy_ref, linear_logprobs_ref  # noqa: E402
from grpo.config import TARGETS  # noqa: E402
from grpo.models.lora import LoraSettings, adapters_off, add_lora, trainable  # noqa: E402
from grpo.loss import LossOptions, group_advantages, policy_loss  # noqa: E402
from grpo.fit.memory import GIB, memory_plan  # noqa: E402
from grpo.models.model import Transformer  # noqa: E402
from grpo.measure.parity import (LOGPROB_TOL, attention_bound, greedy_rows, kept_reference,  # noqa: E402
                                 sample_reference, sampling_errors, tv_distance, tv_tolerance, ulps_at_scale)
from grpo.fit.preflight import preflight  # noqa: E402
from grpo.rollout import Trajectory  # noqa: E402
from grpo.engine.sampler import Sampler, SamplingParams  # noqa: E402
from grpo.engine.sampling import sample  # noqa: E402
from grpo.update import batch_logprobs, collate, loss_options, policy_update, update_batches  # noqa: E402

decode_module = importlib.import_module("grpo.engine.decode")  # a module global of it is switched (fused_paths)
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
                sampling=(256, 151936, 65536, 64), decode_kernels=(DECODE_SHAPES, 1024),
                fused=(32768, 151936, (896, 2048)), greedy=(32, 96), update=(16, 4, 128, 256, 1024),
                tool=(2, 8, 64, 3, 192, 16, 48), lora=(16, 32),
                decode={"qwen2.5-0.5b": (256, 256, 512), "qwen2.5-3b": (64, 256, 512)},
                rollout=(8, 128, 4, 500, 25, 100, 256),
                step={"qwen2.5-0.5b": (16, 8, 256, 512), "qwen2.5-3b": (8, 8, 256, 512)}),
    "dry": dict(models=["tiny"], kernels=(4, 9, 301, (40,)), sampling=(8, 301, 4096, 16),
                decode_kernels=({"tiny": dict(B=5, H=64, NH=4, NKV=2, D=16, F=48)}, 40),
                fused=(256, 2048, (64,)), greedy=(6, 12), update=(8, 4, 12, 16, 64), tool=(2, 3, 8, 3, 24, 3, 6),
                lora=(4, 8), decode={"tiny": (8, 16, 8)}, rollout=(4, 8, 3, 24, 3, 6, 16),
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
# LoRA: the whole clipped step lands on the adapters, B starting at 0; 8x the full update's rate so that
# its effect on the log-probs stands well above bf16's noise (a merged bf16 copy would lose most of it)
LORA_LR = 4.0
# the bf16 decode kernels: (the error allowed, in bf16 ulps at the vector's scale (grpo.measure.parity.ulps_at_scale),
# the roundings to bf16 on the way). A kernel computes in fp32 and rounds where the model rounds; its fp32
# sums and functions differ from the reference's in the last bits, so each rounding may land one ulp apart:
# add_rmsnorm's output rounds twice (normalized, then scaled) after its residual sum, the same exact sum
# rounded once; silu_mul rounds once; rotary rounds once, after qk-norm's two roundings of each input (1 + 2
# x 2: each input flip moves the rotated pair by up to one ulp); v is copied. Under TRITON_INTERPRET the
# casts to bf16 truncate (numpy has no bf16), where the GPU and torch round to nearest: one ulp more a rounding
DECODE_ULPS = {"add_rmsnorm y": (2, 3), "add_rmsnorm h": (0, 1), "silu_mul": (1, 1), "qkv_rope_write q": (1, 1),
               "qkv_rope_write k": (1, 1), "qkv_rope_write v": (0, 0), "qkv_rope_write +qk_norm q": (5, 3),
               "qkv_rope_write +qk_norm k": (5, 3), "qkv_rope_write +qk_norm v": (0, 0)}
# sampler against trainer, mean abs log-prob gap in nats over sampled tokens: fp32 differs in summation order
# only (CPU: ~1e-6); bf16, both sides rounding activations through every layer with other kernels and
# batch shapes, as bf16 against fp32 does in the update check (0.010-0.018 at the 0.5B shape)
GAP_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.05}


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
    mods = [(layers_module, "flash_attn_varlen_func"), (decode_module, "flash_attn_with_kvcache")]
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

# ----------------------------------------------------------------------------- the environment


OPTIONAL = ("flash_attn", "transformers", "tokenizers", "safetensors", "tqdm", "numpy", "setuptools")


def present(name: str) -> bool:
    """Importable, without importing it (a blocked name has a spec with no file)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and (spec.origin is not None or bool(spec.submodule_search_locations))


def environment(device) -> list[dict]:
    """One row per fact: the GPU, its driver, torch, CUDA, Triton, whether torch.mm takes out_dtype
    (grpo.kernels' fp32 logits from bf16 inputs; without it they upcast first), the optional packages."""
    facts = {"python": platform.python_version(), "torch": torch.__version__, "CUDA": torch.version.cuda or "none",
             "grpo": f"{Path(sys.modules['grpo'].__file__).parents[1]}, kernels from "
                     f"{Path(kernels_module.__file__).parent}"}
    try:
        import triton
        facts["Triton"] = triton.__version__
    except ImportError:
        facts["Triton"] = "absent"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        facts["GPU"] = f"{p.name}, sm {p.major}{p.minor}, {p.total_memory / GIB:.1f} GiB, {p.multi_processor_count} SMs"
        try:
            facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=20).stdout.strip() or "unknown"
        except (OSError, subprocess.TimeoutExpired):
            facts["driver"] = "unknown (no nvidia-smi)"
    else:
        facts["GPU"] = f"none (CPU, {os.cpu_count()} cores)"
    a = torch.randn(64, 96, device=device).bfloat16()
    b = torch.randn(96, 80, device=device).bfloat16()
    try:
        z = torch.mm(a, b, out_dtype=torch.float32)
        err = (z - a.float() @ b.float()).abs().max().item()
        facts["mm out_dtype=float32"] = f"works ({z.dtype}, max err {err:.1e} against fp32)"
    except (TypeError, RuntimeError) as e:
        facts["mm out_dtype=float32"] = f"no ({type(e).__name__}: {str(e).splitlines()[0][:80]}): logits upcast first"
    facts["optional packages"] = ", ".join(f"{n} {'yes' if present(n) else 'no'}" for n in OPTIONAL)
    return [row("env", "", k, None, shown=v) for k, v in facts.items()]

# ----------------------------------------------------------------------------- parity: kernels and sampling


def kernel_parity(device, backend: str, sizes: dict, perturb: bool):
    B, T, V, Hs = sizes["kernels"]
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
        yield parity("kernels", f"H={H}", f"{backend} log-probs+loss T={temp}: worst err/tol",
                     max(err[k] / KERNEL_TOL[k] for k in err), 1.0,
                     " ".join(f"{k} {v:.1e}" for k, v in err.items()), errors=err)


SAMPLING_CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.9, 0, 0.9), (1.0, 50, 0.95)]  # (T, top_k, top_p)


@torch.no_grad()
def sampling_parity(device, backend: str, sizes: dict, perturb: bool):
    """grpo.engine.sampling.sample at T > 0, as the sampler calls it (on CUDA the fused Triton draw where no filter
    is set), and the fused kernel by name where it would not be taken (a CPU under the interpreter), against
    grpo.measure.parity.sample_reference: the row's value is the log-prob error over LOGPROB_TOL plus every token
    parted off a tie and every kept-set entry off its edge (so any of those fails it). Then N draws of one
    row of Vd logits against softmax over the kept set (total variation)."""
    B, V, N, Vd = sizes["sampling"]
    g = torch.Generator(device).manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(B, V, generator=g, device=device) * 3).to(dtype)  # a few hundred tokens hold the mass
        key = torch.randint(0, 1 << 62, (B,), generator=g, device=device)
        step = torch.randint(0, 4096, (B,), generator=g, device=device)
        dt = str(dtype).removeprefix("torch.")
        for T, k, p in SAMPLING_CASES:
            filtered = k > 0 or p < 1.0
            ref = sample_reference(logits, key, step, T, k, p)
            sides = [("sample()", lambda: sample(logits, key, step, T, k, p, return_threshold=True))]
            if not filtered and backend == "triton" and device.type != "cuda":  # CUDA's sample() takes it already
                sides.append(("fused_sample triton", lambda: (*fused_sample(logits, key, step, T, backend="triton"), None)))
            for what, draw in sides:
                tokens, lp, threshold = draw()
                if perturb:  # a known-bad draw: one row's token moved, every log-prob off by 1e-3
                    tokens, lp = tokens.clone(), lp + 1e-3
                    tokens[0] = (tokens[0] + 1) % V
                e = sampling_errors(tokens, lp, threshold if filtered else None, logits, T, ref)
                value = e["logprob_max_err"] / LOGPROB_TOL + e["token_rows_off_tie"] + e.get("kept_set_off_edge", 0)
                note = (f"{B} rows x {V}: tokens parted off a tie {e['token_rows_off_tie']}, at a tie "
                        f"{e['token_rows_at_tie']}; log-prob max err {e['logprob_max_err']:.1e}"
                        + (f"; kept-set entries off its edge {e['kept_set_off_edge']}, rows at its edge "
                           f"{e['kept_set_rows_at_edge']}" if filtered else ""))
                yield parity("sampling", dt, f"{what} T={T:g} top_k={k} top_p={p:g} vs float64 rule: "
                             "lp err/tol + tokens and kept set off", value, 1.0, note, errors=e)
    for T, k, p in ((1.0, 0, 1.0), (0.9, 0, 0.9)):  # the draws' distribution
        base = torch.randn(Vd, generator=g, device=device) * 2
        key = torch.randint(0, 1 << 62, (N,), generator=g, device=device)
        temp = T * 1.5 if perturb else T  # a known-bad temperature
        tokens, _ = sample(base.expand(N, Vd).contiguous(), key, torch.zeros_like(key), temp, k, p)
        z = base.double()[None] / T
        keep, _ = kept_reference(z, k, p)
        probs = z.masked_fill(~keep, float("-inf")).softmax(-1)[0]
        tv, tol = tv_distance(tokens.cpu(), probs.cpu()), tv_tolerance(Vd, N)
        yield parity("sampling", "fp32", f"sample() T={T:g} top_p={p:g}: {N} draws over {Vd} tokens, total variation "
                     "from the kept set's softmax", tv, tol, f"{int(keep.sum())} tokens kept")


def decode_inputs(B: int, H: int, NH: int, NKV: int, D: int, F: int, S: int, device) -> dict:
    """bf16 inputs of one decode layer's kernels, rows at random cache lengths."""
    g = torch.Generator(device).manual_seed(6)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device).bfloat16()  # noqa: E731
    pos = torch.randint(0, S, (B,), generator=g, device=device)
    freqs = pos.float()[:, None] * (1e6 ** -(torch.arange(0, D, 2, device=device) / D))
    return dict(x=rand(B, H), res=rand(B, H), w=1 + 0.1 * rand(H), gu=rand(B, 2 * F), qkv=rand(B, (NH + 2 * NKV) * D),
                cos=freqs.cos(), sin=freqs.sin(), pos=pos, slot=torch.arange(B, device=device), qn=1 + 0.1 * rand(D),
                kn=1 + 0.1 * rand(D), q=rand(B, NH, D), k_cache=rand(B, S, NKV, D), v_cache=rand(B, S, NKV, D),
                length=torch.randint(1, S + 1, (B,), generator=g, device=device))


@torch.no_grad()
def decode_kernel_parity(device, backend: str, sizes: dict, perturb: bool):
    """The bf16 decode kernels against their references (grpo.kernels.reference) at each decode shape: each
    output in bf16 ulps at its vector's scale against DECODE_ULPS; decode attention against
    grpo.measure.parity.attention_bound (its value: the worst error over the bound)."""
    shapes, S = sizes["decode_kernels"]
    bad = (lambda t: t + 4 * t.float().abs().max().to(t.dtype) + 1) if perturb else (lambda t: t)  # a known-bad kernel
    for model, shape in shapes.items():
        B, H, NH, NKV, D, F = (shape[k] for k in ("B", "H", "NH", "NKV", "D", "F"))
        i = decode_inputs(B, H, NH, NKV, D, F, S, device)
        out = {}
        y, h = add_rmsnorm(i["x"], i["res"], i["w"], 1e-6, backend=backend)
        y_r, h_r = add_rmsnorm(i["x"], i["res"], i["w"], 1e-6, backend="torch")
        out["add_rmsnorm y"], out["add_rmsnorm h"] = (bad(y), y_r), (bad(h), h_r)
        out["silu_mul"] = (bad(silu_mul(i["gu"], backend=backend)), silu_mul(i["gu"], backend="torch"))
        for norm in (False, True):
            name = "qkv_rope_write" + (" +qk_norm" if norm else "")
            qs, caches = [], []
            for bk in (backend, "torch"):  # each side writes its own cache
                kc, vc = torch.zeros_like(i["k_cache"]), torch.zeros_like(i["v_cache"])
                qs.append(qkv_rope_write(i["qkv"], i["cos"], i["sin"], kc, vc, i["slot"], i["pos"], NH, NKV, D,
                                         i["qn"] if norm else None, i["kn"] if norm else None, backend=bk))
                caches.append((kc[i["slot"], i["pos"]], vc[i["slot"], i["pos"]]))
            out[f"{name} q"] = (bad(qs[0]), qs[1])
            out[f"{name} k"], out[f"{name} v"] = (bad(caches[0][0]), caches[1][0]), (bad(caches[0][1]), caches[1][1])
        interpreted = backend == "triton" and device.type != "cuda"
        for what, (a, b) in out.items():
            ulps, roundings = DECODE_ULPS[what]
            yield parity("decode kernels", model, f"bf16 {what}: error in ulps at the vector's scale",
                         ulps_at_scale(a, b), ulps + roundings * interpreted,
                         f"{tuple(b.shape)}" + ("; interpreted: its casts truncate" if interpreted else ""))
        args = (i["q"], i["k_cache"], i["v_cache"], i["slot"], i["length"])
        o, o_r = bad(decode_attention(*args, backend=backend)), decode_attention(*args, backend="torch")
        bound = attention_bound(i["q"], i["k_cache"][i["slot"]], i["v_cache"][i["slot"]], i["length"], o_r, D**-0.5)
        err = ((o.float() - o_r.float()).abs().amax(-1) / bound).max().item()
        yield parity("decode kernels", model, f"bf16 decode_attention, {S} cache positions: error / SDPA's rounding bound",
                     err, 1.0, f"({B}, {NH}, {D}); bound median {bound.median().item():.1e}")

# ----------------------------------------------------------------------------- parity: the update and the sampler


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


def two_steps(model, ref, cfg: Config, batches: list, device, lr: float, perturb: bool) -> tuple[dict, dict]:
    """Two SGD steps of policy_update on the trained parameters of `model` (FSDP2, fused paths) and of `ref`
    (unsharded, fp32, the torch paths): per side, the first batch's log-probs before and after, and the grad norms."""
    def logprobs(m) -> torch.Tensor:  # (mask tokens,) of the first batch, in update_batches' order
        mbs = update_batches(*batches[0], cfg, device)
        # gathered, so resharded after: a forward without backward leaves the FSDP root unsharded, and
        # its parameters would then read as the bf16 copies, not the fp32 master weights
        with dist.gathered(m):
            return torch.cat([lp[b["loss_mask"] > 0] for lp, b in zip(batch_logprobs(m, mbs, 1.0), mbs)])

    res = {}
    for side, m in (("fsdp", model), ("ref", ref)):
        opt = torch.optim.SGD(trainable(m), lr=lr * (1.25 if perturb and side == "fsdp" else 1.0))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        opts = dataclasses.replace(loss_options(cfg), backend="torch" if side == "ref" else None)
        with fused_paths(kernels=side == "fsdp", flash=side == "fsdp"):
            before = logprobs(m)
            norms = [policy_update(m, None, opt, sched, *batch, cfg, device, opts)["grad_norm"] for batch in batches]
            res[side] = dict(before=before, after=logprobs(m), norms=norms)
    return res["fsdp"], res["ref"]


def change_error(model, ref, w0: dict) -> float:
    """Relative error of the trained weights' change, one tensor at a time (a sharded one gathered)."""
    num = den = 0.0
    ref_params = dict(ref.named_parameters())
    for k, p in model.named_parameters():
        if k not in w0:
            continue
        d_fsdp = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float() - w0[k]
        d_ref = ref_params[k].detach().float() - w0[k]
        num, den = num + (d_fsdp - d_ref).pow(2).sum().item(), den + d_ref.pow(2).sum().item()
    return math.sqrt(num / max(den, 1e-30))


def step_rows(part: str, name: str, f: dict, r: dict, change: float) -> list[dict]:
    lp_err = lambda key: (f[key] - r[key]).abs().mean().item()  # noqa: E731
    return [parity(part, name, "FSDP2 bf16 vs fp32 eager: log-probs before, mean abs err", lp_err("before"),
                   UPDATE_TOL["lp"]),
            parity(part, name, "...each step's grad norm, relative err",
                   max(abs(a - b) / b for a, b in zip(f["norms"], r["norms"])), UPDATE_TOL["grad_norm"],
                   " ".join(f"{a:.4g}/{b:.4g}" for a, b in zip(f["norms"], r["norms"]))),
            parity(part, name, "...change of the trained weights after 2 SGD steps, relative err", change,
                   UPDATE_TOL["weight_change"]),
            parity(part, name, "...log-probs after step 2, mean abs err", lp_err("after"), UPDATE_TOL["lp"])]


def update_parity(name: str, device, sizes: dict, perturb: bool):
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
    f, r = two_steps(model, ref, cfg, batches, device, LR, perturb)
    return step_rows("update", name, f, r, change_error(model, ref, w0))


def lora_parity(name: str, device, sizes: dict, perturb: bool):
    """Two LoRA steps as the trainer takes them (a bf16 base, fp32 adapters on all seven linear layers, FSDP2)
    against an unsharded fp32 reference; then a T 1 rollout of the stepped policy by the sampler, whose decode
    applies the adapters unmerged beside its bf16 copy, scored by the trainer's forward (the gap), by the fp32
    reference after the step and by the base (adapters off: the model before the step, B being 0). The
    sampler should draw from the stepped policy: its gap to it well under its distance to the base."""
    n, G, plen, clen, mbt = sizes["update"]
    r, new = sizes["lora"]
    settings = LoraSettings(r=r, alpha=2.0 * r, dropout=0.0, targets=TARGETS)
    model = add_lora(build(name, device).to(torch.bfloat16), settings, seed=0)  # the base in the compute dtype
    ref = add_lora(build(name, device), settings, seed=0)  # fp32 base, the same adapters
    w0 = {k: p.detach().clone().float() for k, p in ref.named_parameters() if p.requires_grad}
    dist.shard(model, torch.bfloat16)
    cfg = Config(num_generations=G, prompts_per_step=n // G, max_prompt_length=plen, max_completion_length=clen,
                 micro_batch_tokens=mbt, learning_rate=LORA_LR, max_grad_norm=1.0, tis_cap=0.0).check()
    batches = [synthetic_batch(model.args.vocab_size, n, G, plen, clen, seed) for seed in (1, 2)]
    f, rr = two_steps(model, ref, cfg, batches, device, LORA_LR, perturb)
    yield from step_rows("lora", name, f, rr, change_error(model, ref, w0))
    prompts = list({tuple(t.prompt_ids): None for t in batches[0][0]})
    params = SamplingParams(n=2, temperature=1.0, max_tokens=new, stop_token_ids=[], seed=7)
    model.eval()
    with torch.no_grad(), dist.gathered(model):
        sampler = Sampler(model, gen_batch=2 * len(prompts), max_seq_len=plen + new)
        done = sampler.generate([list(p) for p in prompts], params)
        sampler.close()
        trajs = [Trajectory(example={}, prompt_index=c.prompt_index, prompt_ids=list(prompts[c.prompt_index]),
                            completion_ids=c.token_ids, loss_mask=c.loss_mask, sampler_logprobs=c.logprobs,
                            finish_reason=c.finish_reason, num_turns=1) for c in done]
        b = collate(trajs, device)
        policy = batch_logprobs(model, [b], 1.0)[0]
    with torch.no_grad(), fused_paths(kernels=False, flash=False):
        after = batch_logprobs(ref, [b], 1.0)[0]
        with adapters_off(ref):
            base = batch_logprobs(ref, [b], 1.0)[0]
    mask = b["loss_mask"] > 0
    sampled = b["sampler_logprobs"][mask] + (0.1 if perturb else 0.0)
    gap = lambda lp: (sampled - lp[mask]).abs().mean().item()  # noqa: E731
    effect = (after - base)[mask].abs().mean().item()
    note = (f"{int(mask.sum())} tokens; gap to the trainer {gap(policy):.4f}, to the fp32 stepped policy "
            f"{gap(after):.4f}, to the base {gap(base):.4f}; the step moved the log-probs {effect:.4f}")
    yield parity("lora", name, "decode (adapters unmerged, bf16 copy) vs the trainer's forward: mean abs log-prob gap",
                 gap(policy), GAP_TOL[torch.bfloat16], note)
    what = "...decode's gap to the stepped fp32 policy / to the base"
    if effect < 2 * GAP_TOL[torch.bfloat16]:
        yield row("lora", name, what, gap(after) / max(gap(base), 1e-30), note=note + ": too small a step to tell")
    else:
        yield parity("lora", name, what, gap(after) / max(gap(base), 1e-30), 0.5, note)


def greedy_parity(name: str, device, sizes: dict, perturb: bool):
    """fp32 compute is the check: graphs and eager decode then differ in summation order alone (other
    batch shapes), so only exact near-ties may flip. bf16, the trainer's dtype, is reported beside it
    with the gaps at which rows parted: bf16 noise through 36 random layers can exceed TIE_REL."""
    for dtype in (torch.float32, torch.bfloat16):
        yield from greedy_case(name, device, sizes, perturb, dtype)
        gc.collect()


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
            sampler.close()
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


def turns_of(loss_mask: list[int]) -> list[int]:
    """Per completion token, the assistant turn it belongs to: a turn starts after each injected block."""
    out, turn, prev = [], 0, 1
    for m in loss_mask:
        turn += m == 1 and prev == 0
        out.append(turn)
        prev = m
    return out


def tool_gap_parity(name: str, device, sizes: dict, perturb: bool):
    """A rollout with tool turns on the FSDP2 model, as the trainer samples: P prompts x n rows, T 0.9 and top-p
    0.95 (kept-set log-probs), turns ending at any of V / mean_turn random tool-stop tokens, each call answered
    by `obs` tokens, up to `turns` turns. The trainer's forward (the update's collate and log-probs, its kept
    sets from the sampler's thresholds) scores the same tokens; the mean |gap| over sampled tokens, the first
    turn and the later ones (whose keys follow an injected observation) apart. fp32 is the tight check."""
    P, n, plen, turns, max_tokens, obs, mean_turn = sizes["tool"]
    for dtype in (torch.float32, torch.bfloat16):
        model = dist.shard(build(name, device), dtype)
        V = model.args.vocab_size
        g = torch.Generator().manual_seed(8)
        stops = torch.randperm(V, generator=g)[: max(1, V // mean_turn)].tolist()
        prompts = [torch.randint(0, V, (plen,), generator=g).tolist() for _ in range(P)]
        answer = torch.randint(0, V, (obs,), generator=g).tolist()
        params = SamplingParams(n=n, temperature=0.9, top_p=0.95, max_tokens=max_tokens, stop_token_ids=[],
                                tool_stop_token_ids=stops, max_turns=turns, seed=4)
        model.eval()
        with torch.no_grad(), dist.gathered(model):
            sampler = Sampler(model, gen_batch=P * n, max_seq_len=plen + max_tokens)
            done = sampler.generate(prompts, params, tool=lambda index, ids: answer)
            sampler.close()
            del sampler
            trajs = [Trajectory(example={}, prompt_index=c.prompt_index, prompt_ids=prompts[c.prompt_index],
                                completion_ids=c.token_ids, loss_mask=c.loss_mask, sampler_logprobs=c.logprobs,
                                finish_reason=c.finish_reason, num_turns=c.num_turns,
                                kept_thresholds=list(c.thresholds)) for c in done]
            b = collate(trajs, device)
            lp = batch_logprobs(model, [b], params.temperature)[0]
        turn = torch.zeros_like(lp, dtype=torch.long)
        for i, t in enumerate(trajs):
            L = len(t.prompt_ids)
            turn[i, L - 1:L - 1 + len(t.completion_ids)] = torch.tensor(turns_of(t.loss_mask), dtype=torch.long)
        gap = (b["sampler_logprobs"] + (0.1 if perturb else 0.0) - lp).abs()
        mask = b["loss_mask"] > 0
        dt = str(dtype).removeprefix("torch.")
        calls = sum(t.num_turns - 1 for t in trajs)
        for what, sel in (("first turn", mask & (turn == 0)), ("turns after an observation", mask & (turn > 0))):
            k = int(sel.sum())
            if k == 0:
                yield row("tool turns", name, f"{dt} {what}: sampler vs trainer log-probs", None, status="skip",
                          note=f"no such tokens ({calls} tool calls)")
                continue
            note = f"{k} tokens of {len(trajs)} rows, {calls} tool calls; max abs gap {gap[sel].max().item():.2e}"
            yield parity("tool turns", name, f"{dt} {what}: sampler vs trainer log-probs, mean abs gap",
                         gap[sel].mean().item(), GAP_TOL[dtype], note)
        del model
        gc.collect()

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


def decode_floors(model, B: int, plen: int, new: int, device) -> dict:
    """ms per decode step of B rows if it did nothing but read its bytes at the spec bandwidth (weights, and
    the KV cache at the mean length plen + new / 2), or nothing but its FLOPs at the spec bf16 rate
    (2 x matmul parameters a token, and 4 x layers x heads x head dim a token and key: q k^T and p v);
    on a CPU the compute floor's rate is a measured fp32 matmul, and no bandwidth floor."""
    a = model.args
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = next((bw for keys, bw in BANDWIDTH if all(k in name for k in keys)), None)
    out = dict(gpu=name, bw=bw, bandwidth_ms=None)
    if bw is not None:
        out["bandwidth_ms"] = 1e3 * B / bench_sampler.roofline_tps(model, B, plen, new, bw)
    peak, peak_note = bench_step.peak_flops(device)
    flops = B * (2 * bench_step.matmul_params(model) + 4 * a.n_layers * a.n_heads * a.head_dim * (plen + new / 2))
    out |= dict(compute_ms=1e3 * flops / peak, peak_note=peak_note)
    return out


def decode_figures(name: str, device, sizes: dict) -> list[dict]:
    """Sampled decode (T 1) at the shape's batch, graphs warm: a first call captures them (its time
    is reported apart), the next ones are timed. Kernels per step: one decode step profiled alone.
    Against both floors (decode_floors): the step's time over the larger of the two."""
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
    sampler.close()
    if kernels is not None:
        rows.append(goal("figures", name, "kernels per decode step", kernels, f"{kernels}",
                         target_kernels is None or kernels <= target_kernels,
                         f"<= {target_kernels}" if target_kernels else "", "device kernels and copies, eager"))
    f = decode_floors(model, B, plen, new, device)
    floor = max(f["compute_ms"], f["bandwidth_ms"] or 0.0)
    shown = f"{f['bandwidth_ms']:.3f}" if f["bandwidth_ms"] is not None else "n/a"
    rows.append(row("figures", name, "decode floors, ms/step: bandwidth / compute", floor,
                    shown=f"{shown} / {f['compute_ms']:.3f}",
                    note=f"{f['gpu']}: " + (f"{f['bw'] / 1e12:.2f} TB/s" if f["bw"] else "no known bandwidth")
                    + f"; {f['peak_note']}"))
    rows.append(row("figures", name, "decode ms/step over its binding floor", ms / floor, shown=f"{ms / floor:.1f}x",
                    note="the larger floor: " + ("bandwidth" if floor == f["bandwidth_ms"] else "compute")))
    if f["bandwidth_ms"] is not None:
        share = f["bandwidth_ms"] / ms
        rows.append(row("figures", name, "decode share of the bandwidth roofline", share, shown=f"{share:.1%}"))
    return rows


def preflight_figures(name: str, device, sizes: dict) -> list[dict]:
    """--preflight of a run of the step's shape (bench/step.py's) sized by the memory plan for this GPU, as
    the trainer builds it: fp32 master weights under FSDP2 with bf16 compute, the sampler over the gathered
    weights, AdamW. One worst-case step (every row at full length, the largest micro-batch, an optimizer step
    at lr 0): the measured peaks of the rollouts, the update and the step against the plan's (grpo/fit/preflight.py)."""
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
    sampler.close()
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
    sampler.close()
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
    from grpo.engine.sampler import decode_step
    st = sampler.runner.state
    st.pos[:B], st.active[:B] = plen, True
    step = lambda: decode_step(sampler.weights, sampler.cache, st, SamplingParams(temperature=1.0), B, plen + 1, 0)
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    st.active.zero_()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


STEPS = 3  # timed GRPO steps a shape, after one warm-up (its graph captures and allocator growth)


def step_figures(name: str, device, sizes: dict) -> list[dict]:
    B, G, plen, new = sizes["step"][name]
    model = build(name, device)
    profile = bench_step.sizes_on_this_gpu(model.args, B, G, plen, new, device)  # as a run sizes itself here
    r = bench_step.bench(name, model, B, G, plen, new, device, STEPS, profile)
    note = (f"{B} x {G} rows, {plen} + {new} tokens, best of {STEPS} steps {r['step_s']:.2f} s: generate "
            f"{r['generate_s']:.2f}, old log-probs {r['old_logprobs_s']:.2f}, update {r['update_s']:.2f}")
    return [goal("figures", name, "generation share of a GRPO step", r["gen_share"], f"{r['gen_share']:.0%}",
                 r["gen_share"] < 0.5, "< 50%", note, step=r),
            goal("figures", name, "update MFU", r["update_mfu"], f"{r['update_mfu']:.1%}",
                 r["update_mfu"] >= 0.4, ">= 40%", f"{r['update_tflops']:.1f} TFLOP/s against {r['peak']}")]

# ----------------------------------------------------------------------------- stages and parts


# seconds a stage may take on the GPU from its first part's start (None: what the run's budget leaves)
STAGES = {"env": 60, "parity": 240, "decode": 90, "steps": 150, "rest": None}
Part = namedtuple("Part", "stage name fn args timeout")


def parts_of(device, backend: str, sizes: dict, perturb: bool, timeout: int) -> list[Part]:
    """Every part, in the order they run: the stages in order, each part with its time limit."""
    first, *others = sizes["models"]
    check = (device, backend, sizes, perturb)
    parts = [Part("env", "env", environment, (device,), timeout),
             Part("parity", "kernels", kernel_parity, check, timeout),
             Part("parity", "sampling", sampling_parity, check, timeout),
             Part("parity", "decode kernels", decode_kernel_parity, check, timeout),
             Part("parity", "update", update_parity, (first, device, sizes, perturb), timeout),
             Part("parity", "sampler", greedy_parity, (first, device, sizes, perturb), timeout),
             Part("parity", "tool turns", tool_gap_parity, (first, device, sizes, perturb), timeout),
             Part("parity", "lora", lora_parity, (first, device, sizes, perturb), timeout)]
    parts += [Part("decode", "figures", decode_figures, (m, device, sizes), timeout) for m in sizes["models"]]
    parts += [Part("steps", "figures", step_figures, (m, device, sizes), int(timeout * 1.5)) for m in sizes["models"]]
    parts += [Part("rest", "figures", rollout_figures, (first, device, sizes), timeout)]
    parts += [Part("rest", "figures", preflight_figures, (m, device, sizes), timeout) for m in sizes["models"]]
    parts += [Part("rest", "sampler", greedy_parity, (m, device, sizes, perturb), timeout) for m in others]
    parts += [Part("rest", "figures", fused_figures, (device, sizes), timeout),
              Part("rest", "figures", kernel_figures, (device,), timeout),
              Part("rest", "figures", attention_sweep, (device,), timeout)]
    return parts


def model_of(part: Part) -> str:
    return part.args[0] if isinstance(part.args[0], str) else ""


def raised(part: Part, note: str) -> dict:
    """The row of a part that did not finish (raised, timed out, died)."""
    return row(part.name, model_of(part), "raised", None, status="error", note=note)

# ----------------------------------------------------------------------------- the output folder


def part_file(out: Path, i: int, kind: str) -> Path:  # OUT/parts/NN.json (rows) and NN.start (its start time)
    return out / "parts" / f"{i:02d}.{kind}"


def write_rows(out: Path, i: int, rows: list, done: bool):
    """Atomically: a reader (the supervisor, a run killed from outside) sees the old file or the new one."""
    path = part_file(out, i, "json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(rows=rows, done=done), default=str))
    os.replace(tmp, path)


def read_rows(out: Path, i: int) -> tuple[list, bool] | None:
    path = part_file(out, i, "json")
    if not path.exists():
        return None
    got = json.loads(path.read_text())
    return got["rows"], got["done"]


def started(out: Path, i: int) -> float | None:
    path = part_file(out, i, "start")
    return float(path.read_text()) if path.exists() else None


def budget_left(args, parts: list[Part], i: int) -> str | None:
    """Why part i may not start now (its stage's seconds spent, or the run's), else None. A stage's clock
    starts at its first part's start. No budget (--budget 0, the dry run's default): never."""
    if not args.budget:
        return None
    now = time.time()
    if now > args.run_start + args.budget:
        return f"the run's budget of {args.budget} s is spent"
    stage, limit = parts[i].stage, STAGES[parts[i].stage]
    starts = [t for k, p in enumerate(parts) if p.stage == stage and (t := started(Path(args.out), k)) is not None]
    if limit is not None and starts and now > min(starts) + limit:
        return f"the {stage} stage's {limit} s are spent"
    return None


def deadline(args, parts: list[Part], i: int, start: float) -> float:
    """When part i, started at `start`, is stopped: its time limit, its stage's and the run's budget."""
    end = start + parts[i].timeout
    if args.budget:
        end = min(end, args.run_start + args.budget)
        stage, limit = parts[i].stage, STAGES[parts[i].stage]
        starts = [t for k, p in enumerate(parts) if p.stage == stage and (t := started(Path(args.out), k)) is not None]
        if limit is not None and starts:
            end = min(end, min(starts) + limit)
    return end

def skip(out: Path, i: int, part: Part, why: str):
    part_file(out, i, "start").write_text(repr(time.time()))
    write_rows(out, i, [row(part.name, model_of(part), part.fn.__name__, None, status="skip", note=f"not run: {why}")],
               done=True)

# ----------------------------------------------------------------------------- the worker: parts in one process

RESTART = 3  # a worker's exit code after a part raised: go on in a fresh process
TEARDOWN_S = 30  # seconds a worker may take to end (the process group's teardown) after its last part's rows


def run_part(out: Path, i: int, part: Part) -> bool:
    """Part i, each row written as it comes (a part may yield them), then done. -> whether it finished."""
    rows, t = [], time.perf_counter()
    part_file(out, i, "start").write_text(repr(time.time()))
    try:
        for r in part.fn(*part.args):
            rows.append(dict(r, seconds=round(time.perf_counter() - t, 1)))
            write_rows(out, i, rows, done=False)
    except Exception as e:  # reported, and fails the run; the other parts still run
        traceback.print_exc()
        rows.append(dict(raised(part, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"),
                         seconds=round(time.perf_counter() - t, 1)))
        write_rows(out, i, rows, done=True)
        return False
    write_rows(out, i, rows, done=True)
    return True


def worker(args, parts: list[Part], device, first: int, isolated: bool):
    """Parts first.. in this process, world size 1, an in-memory store (no port), as grpo.infra.dist.shard does on one
    GPU. Every part's rows are on disk before the next starts, and before the process group's teardown."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        tdist.init_process_group("nccl", store=tdist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    out = Path(args.out)
    for i in range(first, len(parts)):
        why = budget_left(args, parts, i)
        if why:
            skip(out, i, parts[i], why)
            continue
        print(f"== {i:02d} {parts[i].stage}: {parts[i].fn.__name__} {model_of(parts[i])}", flush=True)
        if args.hang_in == parts[i].fn.__name__:  # testing: a part that never returns (a graph capture, a collective)
            part_file(out, i, "start").write_text(repr(time.time()))
            time.sleep(1e6)
        ok = run_part(out, i, parts[i])
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.crash_after == parts[i].fn.__name__:  # testing: a process that dies after its rows, as in a teardown
            os.kill(os.getpid(), signal.SIGKILL)
        if not ok and isolated:  # a part that raised may have poisoned the CUDA context: the rest in a fresh process
            sys.stdout.flush()
            os._exit(RESTART)
    tdist.destroy_process_group()

# ----------------------------------------------------------------------------- the supervisor


def supervise(args, parts: list[Part], on_part) -> None:
    """Workers from part 0 on; each stopped at its part's deadline, and after any death a fresh one from the
    part after the one it died in (or after which: a process that died after a part's rows). `on_part(i)`
    once part i's rows are final."""
    out, i = Path(args.out), 0
    log = open(out / "log.txt", "a")
    while i < len(parts):
        if args.budget and time.time() > args.run_start + args.budget:  # no worker to start only to skip the rest
            for k in range(i, len(parts)):
                skip(out, k, parts[k], budget_left(args, parts, k))
                on_part(k)
            break
        cmd = [sys.executable, __file__, "--worker", str(i), "--out", str(out), "--run-start", repr(args.run_start),
               "--budget", str(args.budget), "--part-timeout", str(args.part_timeout)]
        cmd += ["--dry-run"] * args.dry_run + ["--perturb"] * args.perturb + ["--only", args.only] * bool(args.only)
        cmd += ["--crash-after", args.crash_after] * bool(args.crash_after) + ["--hang-in", args.hang_in] * bool(args.hang_in)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        reported, timed_out, hung = i, None, False
        while proc.poll() is None:
            while reported < len(parts) and (got := read_rows(out, reported)) and got[1]:
                on_part(reported)
                reported += 1
            if reported == len(parts):  # every row written: the teardown alone is left, TEARDOWN_S at most
                try:
                    proc.wait(TEARDOWN_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    hung = True
                break
            t = started(out, reported)
            if t is not None and time.time() > (end := deadline(args, parts, reported, t)):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = "its limit" if end >= t + parts[reported].timeout else "budget"
                break
            time.sleep(0.2)
        rc = proc.returncode
        j = next((k for k in range(reported, len(parts)) if not ((got := read_rows(out, k)) and got[1])), len(parts))
        for k in range(reported, j):
            on_part(k)
        if rc == 0 and j == len(parts) or rc == RESTART and j > i:
            i = j
            continue
        how = f"signal {-rc}" if rc < 0 else f"exit {rc}"
        if j == len(parts) or j > i and started(out, j) is None:  # died after part j - 1's rows (a teardown)
            why = (f"the process hung in its teardown, killed after {TEARDOWN_S} s" if hung else
                   f"the process died ({how})")
            write_rows(out, j - 1, read_rows(out, j - 1)[0] + [raised(parts[j - 1], f"{why} after this part's rows "
                                                                      "were written")], done=True)
            on_part(j - 1, again=True)
            i = j
            continue
        # died in part j (or timed out), or before it began: its rows so far, and why it stopped
        rows, t = (read_rows(out, j) or ([], False))[0], started(out, j)
        spent = time.time() - t if t is not None else 0.0
        if timed_out == "budget":  # not the part's fault: its stage's or the run's seconds ran out
            last = row(parts[j].name, model_of(parts[j]), parts[j].fn.__name__, None, status="skip",
                       note=f"stopped after {spent:.0f} s: the stage's or the run's budget is spent")
        else:
            last = raised(parts[j], f"timed out after {spent:.0f} s" if timed_out else
                          f"the process died ({how}) " + ("during the part" if t is not None else "before the part began")
                          + f" (see {out / 'log.txt'})")
        write_rows(out, j, rows + [dict(last, seconds=round(spent, 1))], done=True)
        on_part(j)
        i = j + 1
    log.close()

# ----------------------------------------------------------------------------- report


def collect(args, parts: list[Part]) -> list[dict]:
    out = []
    for i in range(len(parts)):
        got = read_rows(Path(args.out), i)
        out += got[0] if got else []
    return out


def report(args, rows: list[dict], seconds=None, partial=False) -> dict:
    failed = [r for r in rows if r["status"] in ("fail", "error")]
    env = {r["what"]: r["shown"] for r in rows if r["part"] == "env"}
    out = dict(ok=not failed and not partial, partial=partial, dry_run=args.dry_run, backend=args.backend,
               seconds=seconds, torch=torch.__version__, device=env.get("GPU", ""), env=env,
               flash_attn=decode_module.flash_attn_with_kvcache is not None, rows=rows)
    (Path(args.out) / "report.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| part | model | check or figure | value | target | result | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        value = r.get("shown") or ("" if r["value"] is None else f"{r['value']:.3g}")
        lines.append(f"| {r['part']} | {r['model']} | {r['what']} | {value} | {r['target']} | {r['status']} "
                     f"| {r['note']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "gpu_out"),
                    help="the output folder: parts/ (each part's rows), report.json, table.md, log.txt")
    ap.add_argument("--budget", type=int, default=None,
                    help="seconds for the whole run, stages included (default: 420 on CUDA, none on a dry run: of a 15-minute GPU session, a machine's start and a rerun's minutes are left)")
    ap.add_argument("--part-timeout", type=int, default=120, help="seconds per part (the timed steps 1.5x)")
    ap.add_argument("--perturb", action="store_true", help="testing: break one side of every parity check")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                    help="parts in worker processes, a fresh one after a failure (--no-isolate: all in this one)")
    ap.add_argument("--only", default="", help="run only these parts, by function, comma-separated (e.g. "
                                               "rollout_figures,attention_sweep: a part to run again); env always runs")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # internal: run parts from this one on
    ap.add_argument("--run-start", type=float, help=argparse.SUPPRESS)  # internal: the supervisor's start
    ap.add_argument("--crash-after", default="", help=argparse.SUPPRESS)  # testing: die after this part's rows
    ap.add_argument("--hang-in", default="", help=argparse.SUPPRESS)  # testing: this part never returns
    args = ap.parse_args()
    args.dry_run = dry = args.dry_run or not torch.cuda.is_available()
    args.budget = (0 if dry else 420) if args.budget is None else args.budget
    args.run_start = args.run_start or time.time()
    device = torch.device("cpu") if dry else dist.device()
    args.backend = "triton" if not dry or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    sizes = SIZES["dry" if dry else "gpu"]
    parts = parts_of(device, args.backend, sizes, args.perturb, args.part_timeout)
    if args.only:
        names, known = set(args.only.split(",")), {p.fn.__name__ for p in parts}
        if names - known:
            ap.error(f"--only {','.join(sorted(names - known))}: not a part (one of {', '.join(sorted(known))})")
        parts = [p for p in parts if p.fn.__name__ in names or p.stage == "env"]
    out = Path(args.out)
    if args.worker is not None:
        return worker(args, parts, device, args.worker, isolated=True)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    for f in (out / "parts").iterdir():  # this run's parts only
        f.unlink()
    print(f"gpu_check: {'dry run on the CPU, tiny sizes' if dry else 'CUDA'}, {args.backend} kernels, {len(parts)} parts"
          + (f", {args.budget} s budget" if args.budget else "") + f"; rows in {out}", flush=True)

    def on_part(i: int, again: bool = False):
        rows, _ = read_rows(out, i)
        p = parts[i]
        report(args, collect(args, parts), partial=True)  # a run killed from outside keeps what it measured
        if again:  # a row added after the part was reported: its process died after its rows
            print(f"   part {i}: {rows[-1]['note']}", flush=True)
            return
        counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "error", "skip")}
        print(f"== part {i}: {p.stage} {p.fn.__name__} {model_of(p)}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
              + f" ({sum(r.get('seconds', 0) or 0 for r in rows[-1:]):.0f} s)", flush=True)
        if p.stage == "env":
            print("   " + " | ".join(f"{r['what']}: {r['shown']}" for r in rows), flush=True)

    if args.isolate:
        supervise(args, parts, on_part)
    else:
        worker(args, parts, device, 0, isolated=False)
        for i in range(len(parts)):
            on_part(i)
    seconds = time.time() - args.run_start
    rows = collect(args, parts)
    text = table(rows)
    print(text)
    (out / "table.md").write_text(text + "\n")
    result = report(args, rows, round(seconds, 1))
    checks = [r for r in rows if r["status"] in ("pass", "fail")]
    print(f"gpu_check: {sum(r['status'] == 'pass' for r in checks)}/{len(checks)} parity checks passed, "
          f"{sum(r['status'] == 'error' for r in rows)} parts raised, {seconds:.0f} s; report in {out / 'report.json'}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
