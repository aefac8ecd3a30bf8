"""Each kernel's calls at the shapes of the goals, for the benches (bench/decode_kernels.py,
bench/compile_kernels.py, bench/gpu_check.py) and their tests: the decode kernels at Qwen2.5-0.5B's
and 3B's decode shapes (`cases`, timed on CUDA by `time_ms`), the training kernels at a 0.5B
update's (`training_cases`), what each compiles to for a GPU arch on any machine (`compile_rows`:
Triton's pipeline down to a cubin, launched nowhere; registers, spills and shared memory read from
it by cuobjdump, which ships in Triton's wheel), and the decode attention's launch alternatives
against the shipped one (`SWEEP`, `sweep`). Imports torch and triton only, as the rest of grpo.kernels.
"""
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from . import layers
from .advantages import group_advantages
from .grpo_loss import grpo_token_loss
from .layers import add_rmsnorm, decode_attention, qkv_rope_write, silu_mul
from .logprobs import linear_logprobs
from .sampling import fused_sample
from .target import compile_for

# ----------------------------------------------------------------------------- the decode kernels

SHAPES = {"qwen2.5-0.5b": dict(B=256, H=896, NH=14, NKV=2, D=64, F=4864),
          "qwen2.5-3b": dict(B=64, H=2048, NH=16, NKV=2, D=128, F=11008)}
V, S = 151936, 1024  # vocabulary; cache positions per slot


def time_ms(fn, iters: int, reps: int) -> float:
    """Best of `reps` of the mean ms of `iters` calls of fn, replayed from one CUDA graph: the device's
    time alone. Launched from Python a kernel of a few microseconds takes the host's 20-60 us to
    launch, and timing that launch loop measured the host (the first H200 sweep, 2026-12-04: every
    decode-attention launch at 77-145 us, two clusters, the shipped launch 0.88x of itself).
    A call that cannot be captured (a host sync in a reference) is timed as a plain loop."""
    fn()                                                     # warm-up: Triton compiles here
    torch.cuda.synchronize()
    replay = None
    try:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()                                             # a side-stream warm-up, as capture wants
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(iters):
                    fn()
        replay = graph.replay
    except Exception:  # noqa: BLE001 - not capturable: time the launches instead
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if replay is not None:
            replay()
        else:
            for _ in range(iters):
                fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def cases(dtype: torch.dtype, dev: str = "cuda", model: str = "qwen2.5-0.5b"):
    """(name, shape, call with a backend argument) at `model`'s decode shapes."""
    B, H, NH, NKV, D, F = SHAPES[model].values()
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *shape, dt=dtype: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
    key = torch.randint(0, 1 << 62, (B,), generator=g, device=dev)
    step = torch.randint(0, 4096, (B,), generator=g, device=dev)
    out = []
    for ldt in dict.fromkeys((torch.float32, dtype)):  # fp32 logits, and the model dtype's
        logits = rand(B, V, dt=ldt) * 4
        for T in (1.0, 0.0):
            out.append((f"fused_sample T={T:g}", f"({B}, {V}) {str(ldt)[6:]}",
                        lambda be, l=logits, T=T: fused_sample(l, key, step, T, backend=be)))
    x, res, w = rand(B, H), rand(B, H), 1 + 0.1 * rand(H)
    out.append(("add_rmsnorm", f"({B}, {H})", lambda be: add_rmsnorm(x, res, w, 1e-6, backend=be)))
    gu = rand(B, 2 * F)
    out.append(("silu_mul", f"({B}, {2 * F})", lambda be: silu_mul(gu, backend=be)))
    qkv = rand(B, (NH + 2 * NKV) * D)
    pos = torch.randint(0, S, (B,), generator=g, device=dev)
    freqs = pos.float()[:, None] * (1e6 ** -(torch.arange(0, D, 2, device=dev) / D))
    cos, sin = freqs.cos(), freqs.sin()
    k_cache, v_cache = rand(B, S, NKV, D), rand(B, S, NKV, D)
    slot = torch.arange(B, device=dev)
    qn, kn = 1 + 0.1 * rand(D), 1 + 0.1 * rand(D)
    for norm in (False, True):
        out.append((f"qkv_rope_write{' +qk_norm' if norm else ''}", f"({B}, {qkv.shape[1]})",
                    lambda be, n=norm: qkv_rope_write(qkv, cos, sin, k_cache, v_cache, slot, pos, NH, NKV, D,
                                                      qn if n else None, kn if n else None, backend=be)))
    q = rand(B, NH, D)
    length = torch.randint(1, S + 1, (B,), generator=g, device=dev)
    out.append(("decode_attention", f"({B}, {NH}, {D}) x {S}",
                lambda be: decode_attention(q, k_cache, v_cache, slot, length, backend=be)))
    return out


# (keys a block, warps, stages) tried by the sweep; the shipped one is layers._attention_launch's
SWEEP = [(16, 4, 1), (16, 4, 3), (16, 8, 3), (32, 4, 2), (32, 4, 3), (32, 8, 2), (32, 8, 3), (64, 4, 1),
         (64, 4, 2), (64, 8, 2), (64, 8, 3), (64, 4, 3), (128, 4, 2), (128, 8, 2)]


def sweep(dtype: torch.dtype, iters: int, reps: int, dev: str = "cuda") -> list[dict]:
    """The decode attention's launch alternatives at both shapes, against the shipped one (CUDA).
    A spilling configuration (fp32: 64 keys x 4 warps x 3 stages) is timed too; one
    the GPU cannot launch (too much shared memory) is a row saying so."""
    from triton.runtime.errors import OutOfResources
    rows = []
    with torch.no_grad():
        for model in SHAPES:
            call = next(c for name, _, c in cases(dtype, dev, model) if name == "decode_attention")
            shipped = layers._attention_launch(SHAPES[model]["D"], dtype)
            base = time_ms(lambda: call("triton"), iters, reps)
            for cfg in SWEEP:
                r = dict(model=model, keys_warps_stages=str(cfg), shipped=cfg == shipped)
                try:
                    with mock.patch.object(layers, "_attention_launch", lambda D, dtype, cfg=cfg: cfg):
                        us = 1e3 * time_ms(lambda: call("triton"), iters, reps)
                    rows.append(dict(r, us=us, speed=1e3 * base / us, error=""))
                except OutOfResources as e:  # e.g. 136 KB of shared memory on an RTX 6000 Ada
                    rows.append(dict(r, us=float("nan"), speed=float("nan"),
                                     error=str(e).splitlines()[0][:120]))
    return rows


# ----------------------------------------------------------------------------- compiled for a GPU

ARCHS = {80: "A100", 89: "RTX 6000 Ada", 90: "H100/H200", 100: "B200"}
SHARED_MAX = {80: 166912, 89: 101376, 90: 232448, 100: 232448}  # bytes of shared memory a block may take


def training_cases(dtype: torch.dtype = torch.bfloat16):
    """(name, shape, call) for the training-path kernels, at a Qwen2.5-0.5B update's shapes, the
    log-prob kernel's operands in `dtype` (bf16 under FSDP's mixed precision, fp32 without)."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 256, 896, 151936
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    B, T, G = 16, 1024, 8
    lp, old, ref = (torch.randn(B, T, generator=g) for _ in range(3))
    adv, mask, rewards = torch.randn(B, 1, generator=g), torch.ones(B, T), torch.rand(B * G, generator=g)
    lp.requires_grad_()

    def logprobs():
        linear_logprobs(hidden, weight, labels, 0.9, return_entropy=True)[0].sum().backward()

    return [("linear_logprobs fwd + bwd", f"({N}, {H}) x ({V}, {H}) {str(dtype)[6:]}", logprobs),
            ("grpo_token_loss", f"({B}, {T}), KL + TIS",
             lambda: grpo_token_loss(lp, old, adv, mask, ref_logprobs=ref, beta=0.04,
                                     sampler_logprobs=old, tis_cap=2.0).sum().backward()),
            ("group_advantages", f"({B * G},), G {G}", lambda: group_advantages(rewards, G))]


def resources(cubin: bytes) -> dict:
    """Registers and stack-frame (+ local) bytes of a cubin's one function, by cuobjdump. A Triton
    kernel has no local arrays or calls, so a stack frame holds spilled registers: ptxas -v said so
    of each frame seen (the first shipped decode attention: 232 bytes, 320 bytes of spill stores,
    at D 64; 3,608 and 6,364 at D 128, sm_90)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return dict(regs=int(fields["REG"]), spill_bytes=int(fields["STACK"]) + int(fields["LOCAL"]))


def compile_rows(archs: list[int], dtypes=(torch.bfloat16, torch.float32)) -> list[dict]:
    """One row per kernel specialization launched by each case, for each arch, with the operands in
    each of `dtypes` (bf16: FSDP's mixed precision; fp32: a run without it, whose fp32 tiles take
    twice the registers and shared memory)."""
    calls = [(model, dt, n, s, (lambda c=c: c(None))) for dt in dtypes for model in SHAPES
             for n, s, c in cases(dt, "cpu", model)]
    calls += [("qwen2.5-0.5b", dt, *case) for dt in dtypes for case in training_cases(dt)]
    rows = []
    for arch in archs:
        for model, dtype, name, shape, call in calls:
            with compile_for(arch) as launches:
                t0 = time.perf_counter()
                call()
                seconds = time.perf_counter() - t0
            seen = set()
            for kname, k in launches:
                if k.hash in seen:  # the same specialization launched again (the backward's chunks)
                    continue
                seen.add(k.hash)
                r = resources(k.asm["cubin"])
                shared = k.metadata.shared
                status = (("spills" if r["spill_bytes"] else "")
                          + (" shared > max" if shared > SHARED_MAX[arch] else ""))
                rows.append(dict(arch=f"sm_{arch}", gpu=ARCHS[arch], model=model, dtype=str(dtype)[6:],
                                 case=name, kernel=kname,
                                 shape=shape, warps=k.metadata.num_warps, stages=k.metadata.num_stages,
                                 regs=r["regs"], spill_bytes=r["spill_bytes"], shared_bytes=shared,
                                 compile_s=seconds, status=status.strip() or "ok"))
                seconds = 0.0  # the case's time, shown once
    return rows
