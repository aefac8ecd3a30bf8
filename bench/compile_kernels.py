"""Benchmark without a GPU: every Triton kernel compiled for the GPUs the recipes are planned
for, and the kernels one decode step launches, counted from the code path.

    python bench/compile_kernels.py                  # sm_80 A100, sm_89 RTX 6000 Ada, sm_90 H100/H200, sm_100 B200
    python bench/compile_kernels.py --arch 90 --skip-count

Part 1, compile: each kernel, at the launch configuration its wrapper picks on that GPU (tile
sizes, warps, grids sized by its SM count), compiled by Triton's own pipeline down to a cubin
(ptxas ships in Triton's wheel; grpo.kernels.target.compile_for), on CPU tensors and launched
nowhere. Registers, spills and shared memory are read from the cubin (cuobjdump, also in the
wheel). What a GPU session would have found first, on any CPU: a kernel that does not build
for an arch, one that spills registers, or one that asks for more shared memory than the GPU
gives a block (a launch error there). The decode kernels at both goal shapes (0.5B: head dim 64;
3B: 128), the training kernels at the 0.5B's.

Part 2, count: one decode step of the sampler (grpo.sampler.decode_step: the decode forward and
sampling, then the step's bookkeeping) at Qwen2.5-0.5B batch 256 and 3B batch 64, bf16
weights left uninitialized (the count reads no value), the cache at 256 + 512 positions. Counted: the Triton launches the wrappers make
on that GPU (compiled, not run) and every PyTorch op that does work on a tensor (views and
allocations excluded), as a TorchDispatchMode sees them; each is taken as one kernel. Counted at
1 and 2 layers (the decode is a loop over layers, so the count is a + b L), then given at the
model's L. Three columns: the decode through the model's own forward with eager sampling (the
sampler's decode of 2026-11-30), grpo.decode with the PyTorch references, grpo.decode with the
Triton kernels (what a CUDA run takes). An estimate from the code, not a profile: cuBLAS may
split a GEMM in two, and a composite op a few kernels; bench/gpu_check.py profiles the real step.

`host_syncs`: the ops seen that make the host wait for the device (a value read, an output whose
shape depends on values); `.tolist()` and `.cpu()` on a CPU tensor dispatch nothing and are not
seen, so the check of record is the CUDA graph capture that bench/gpu_check.py runs.

Imports torch and triton (and grpo, no transformers). Each table is followed by its rows as JSON.
"""
import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
import decode_kernels  # noqa: E402
from table import print_table  # noqa: E402

from grpo import kernels  # noqa: E402
from grpo.kernels.target import SMS, compile_for  # noqa: E402

ARCHS = {80: "A100", 89: "RTX 6000 Ada", 90: "H100/H200", 100: "B200"}
SHARED_MAX = {80: 166912, 89: 101376, 90: 232448, 100: 232448}  # bytes of shared memory a block may take
QWEN = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=32768, qkv_bias=True)
SHAPES = {  # name: (config, decode batch, layers of the real model)
    "qwen2.5-0.5b": (dict(QWEN, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                          num_key_value_heads=2), 256, 24),
    "qwen2.5-3b": (dict(QWEN, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                        num_key_value_heads=2), 64, 36),
}
PLEN, NEW = 256, 512

# ----------------------------------------------------------------------------- part 1: compile


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
        kernels.linear_logprobs(hidden, weight, labels, 0.9, return_entropy=True)[0].sum().backward()

    return [("linear_logprobs fwd + bwd", f"({N}, {H}) x ({V}, {H}) {str(dtype)[6:]}", logprobs),
            ("grpo_token_loss", f"({B}, {T}), KL + TIS",
             lambda: kernels.grpo_token_loss(lp, old, adv, mask, ref_logprobs=ref, beta=0.04,
                                             sampler_logprobs=old, tis_cap=2.0).sum().backward()),
            ("group_advantages", f"({B * G},), G {G}", lambda: kernels.group_advantages(rewards, G))]


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
    calls = [(model, dt, n, s, (lambda c=c: c(None))) for dt in dtypes for model in decode_kernels.SHAPES
             for n, s, c in decode_kernels.cases(dt, "cpu", model)]
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
                status = ("spills" if r["spill_bytes"] else "") + (" shared > max" if shared > SHARED_MAX[arch] else "")
                rows.append(dict(arch=f"sm_{arch}", gpu=ARCHS[arch], model=model, dtype=str(dtype)[6:],
                                 case=name, kernel=kname,
                                 shape=shape, warps=k.metadata.num_warps, stages=k.metadata.num_stages,
                                 regs=r["regs"], spill_bytes=r["spill_bytes"], shared_bytes=shared,
                                 compile_s=seconds, status=status.strip() or "ok"))
                seconds = 0.0  # the case's time, shown once
    return rows

# ----------------------------------------------------------------------------- part 2: count


class OpCount(TorchDispatchMode):
    """PyTorch ops that do work on a tensor (each a kernel, or a copy, on a GPU): not views, not
    allocations. `host_syncs`: ops that make the host wait for the device (a CUDA graph cannot
    hold them): a value read, or an output sized by the values."""
    FREE = {"empty", "empty_strided", "empty_like", "new_empty", "_unsafe_view", "lift_fresh", "detach"}
    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
             "repeat_interleave", "bincount", "histc"}

    def __init__(self):
        super().__init__()
        self.ops, self.host_syncs, self.paused = Counter(), 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused:
            if name in self.SYNCS:
                self.host_syncs += 1
            elif not (func.is_view or name in self.FREE):
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def build(config: dict, layers: int):
    from grpo.model import Transformer
    with torch.device("meta"):  # shapes only: the weights are allocated empty, in bf16, below
        model = Transformer({**config, "num_hidden_layers": layers})
    return model.to_empty(device="cpu").to(torch.bfloat16).eval()


def step_count(config: dict, B: int, layers: int, way: str, arch: int) -> dict:
    """Kernels of one decode step over B rows at position PLEN, `way` one of "model" | "torch" | "triton"."""
    import grpo.window as window  # where decode_step finds decode_hidden
    from grpo.sampler import Sampler, SamplingParams, decode_step
    from grpo.sampling import sample
    model = build(config, layers)
    sampler = Sampler(model, gen_batch=B, max_seq_len=PLEN + NEW, cuda_graphs=False)
    st = sampler.state
    st.tok[:B], st.pos[:B], st.active[:B], st.max_tokens[:B] = 1, PLEN, True, NEW
    count, real = OpCount(), kernels.fused_sample

    def sample_kernel(*args, **kw):  # its tokens were never computed: valid ids for the step's indexing
        tok, lp = real(*args, **kw)
        count.paused = True
        tok.zero_()
        count.paused = False
        return tok, lp

    def model_decode(w, cache, tok, pos, n, span):  # the decode of 2026-11-30: the model's forward over the cache
        cache.rows(slice(0, n), pos, 1, span)
        return model(tok[:, None], pos[:, None], cache=cache)[:, 0]

    with contextlib.ExitStack() as stack, torch.no_grad():
        launches = stack.enter_context(compile_for(arch))
        if way != "triton":
            stack.enter_context(kernels.references())
        if way == "model":  # the model's forward gives logits, and the sampler samples them
            stack.enter_context(mock.patch.object(window, "decode_hidden", model_decode))
            stack.enter_context(mock.patch.object(window, "sample_hidden",
                                                  lambda logits, weight, *a: sample(logits, *a)))
        stack.enter_context(mock.patch.object(kernels, "fused_sample", sample_kernel))
        with count:
            decode_step(sampler.weights, sampler.cache, st, SamplingParams(temperature=1.0, stop_token_ids=[]), B,
                        PLEN + 1, 0)
    return dict(launches=len(launches), ops=count.ops, host_syncs=count.host_syncs)


def count_rows(arch: int) -> list[dict]:
    rows = []
    for name, (config, B, L) in SHAPES.items():
        for way, what in (("model", "model forward + eager sampling"), ("torch", "grpo.decode, torch references"),
                          ("triton", "grpo.decode, Triton kernels")):
            one, two = (step_count(config, B, n, way, arch) for n in (1, 2))
            total = lambda c: c["launches"] + sum(c["ops"].values())  # noqa: E731
            per_layer, outside = total(two) - total(one), 2 * total(one) - total(two)
            layer_ops = two["ops"] - one["ops"]
            rows.append(dict(model=name, batch=B, way=what, per_layer=per_layer, outside=outside,
                             layers=L, kernels=outside + L * per_layer,
                             triton_per_layer=two["launches"] - one["launches"],
                             host_syncs=one["host_syncs"],
                             layer_ops=", ".join(f"{k} {v}" for k, v in layer_ops.most_common())))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=sorted(SMS), choices=sorted(SMS))
    ap.add_argument("--skip-count", action="store_true", help="part 1 only")
    a = ap.parse_args()
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}; "
          f"compiled for CUDA, launched nowhere")
    rows = compile_rows(a.arch)
    print_table(rows, ["arch", "gpu", "model", "dtype", "case", "kernel", "shape", "warps", "stages", "regs", "spill_bytes",
                       "shared_bytes", "compile_s", "status"])
    if not a.skip_count:
        arch = 90 if 90 in a.arch else a.arch[0]
        print(f"\nkernels per decode step, counted at sm_{arch}'s launch configuration "
              f"(1 and 2 layers, then a + b L):")
        crows = count_rows(arch)
        print_table(crows, ["model", "batch", "way", "per_layer", "outside", "layers", "kernels", "triton_per_layer",
                            "host_syncs"])
        for r in crows:
            print(f"{r['model']}, {r['way']}: a layer's torch ops: {r['layer_ops'] or 'none'}")


if __name__ == "__main__":
    main()
