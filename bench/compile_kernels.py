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

Part 2, count: one decode step of the sampler (grpo.engine.sampler.decode_step: the decode forward and
sampling, then the step's bookkeeping) at Qwen2.5-0.5B batch 256 and 3B batch 64, bf16
weights left uninitialized (the count reads no value), the cache at 256 + 512 positions. Counted: the Triton launches the wrappers make
on that GPU (compiled, not run) and every PyTorch op that does work on a tensor (views and
allocations excluded), as a TorchDispatchMode sees them; each is taken as one kernel. Counted at
1 and 2 layers (the decode is a loop over layers, so the count is a + b L), then given at the
model's L. Three columns: the decode through the model's own forward with eager sampling (the
sampler's decode of 2026-11-30), grpo.engine.decode with the PyTorch references, grpo.engine.decode with the
Triton kernels (what a CUDA run takes). An estimate from the code, not a profile: cuBLAS may
split a GEMM in two, and a composite op a few kernels; bench/gpu_check.py profiles the real step.

`host_syncs`: the ops seen that make the host wait for the device (a value read, an output whose
shape depends on values); `.tolist()` and `.cpu()` on a CPU tensor dispatch nothing and are not
seen, so the check of record is the CUDA graph capture that bench/gpu_check.py runs.

Imports torch and triton (and grpo, no transformers). Each table is followed by its rows as JSON.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from table import print_table  # noqa: E402

# part 1's compile (grpo.kernels.cases) and part 2's count (grpo.measure.kernel_count) live in the package
from grpo.measure.kernel_count import step_count  # noqa: E402
from grpo.kernels.cases import compile_rows  # noqa: E402
from grpo.kernels.target import SMS  # noqa: E402

QWEN = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=32768, qkv_bias=True)
SHAPES = {  # name: (config, decode batch, layers of the real model)
    "qwen2.5-0.5b": (dict(QWEN, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                          num_key_value_heads=2), 256, 24),
    "qwen2.5-3b": (dict(QWEN, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                        num_key_value_heads=2), 64, 36),
}


def count_rows(arch: int) -> list[dict]:
    rows = []
    for name, (config, B, L) in SHAPES.items():
        for way, what in (("model", "model forward + eager sampling"), ("torch", "grpo.engine.decode, torch references"),
                          ("triton", "grpo.engine.decode, Triton kernels")):
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
