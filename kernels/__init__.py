"""Fused kernels for the log-prob, advantage and loss path and for decode sampling: a leaf
that imports torch and triton, never `grpo.*` (tests/test_layers.py).

- linear_logprobs: LM head + log-softmax + gather without the (N, V) logits; Triton on CUDA,
  the same chunked algorithm in PyTorch elsewhere (the CPU training path).
- grpo_token_loss, group_advantages: Triton only. Their PyTorch references are the plain
  functions of grpo/loss.py, which calls these kernels on CUDA and the references elsewhere.
- fused_sample: grpo.engine.sampling's unfiltered Gumbel-max draw and the token's log-prob in one
  pass over the logits, bit-identical tokens; grpo/engine/sampling.py calls it for CUDA logits.
  Inference only.
- add_rmsnorm, silu_mul, qkv_rope_write (kernels/layers.py): a decode layer's elementwise work
  in three kernels (residual add + RMSNorm; SwiGLU; q|k|v split + q/k norm + rotary + KV-cache
  write). Triton on CUDA, their references elsewhere. Inference only.
- decode_attention (kernels/layers.py): one query per row over its KV-cache slot, GQA,
  split-KV online softmax (flash-decoding) in fp32. Inference only.
Naive versions for tests and benches: grpo.kernels.reference. Which way each call goes (Triton
with GPU tiles, or the reference), and compile_for(), which compiles every launch for a GPU on
a machine without one: grpo.kernels.target.
"""
import sys

if __name__ == "kernels":
    # Found by its folder name, not installed as grpo.kernels: Python started in a checkout's root
    # (`python -m pytest`, `python -c`) puts that root first on sys.path, where this folder shadows
    # PyPI's `kernels`, which transformers imports when it is installed (a dependency since 5.x).
    # Load that package in this module's place instead; with none installed, say where this one is.
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    from pathlib import Path

    _root = Path(__file__).resolve().parent.parent
    _spec = PathFinder.find_spec("kernels", [p for p in sys.path if Path(p or ".").resolve() != _root])
    if _spec is None:
        raise ModuleNotFoundError(f"No module named 'kernels' outside {_root} (its kernels/ folder is "
                                  "imported as grpo.kernels)", name="kernels")
    sys.modules["kernels"] = module_from_spec(_spec)  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(sys.modules["kernels"])
else:
    from .advantages import group_advantages
    from .grpo_loss import grpo_token_loss
    from .layers import add_rmsnorm, decode_attention, qkv_rope_write, silu_mul
    from .logprobs import linear_logprobs, scaled_logits
    from .sampling import fused_sample
    from .target import HAS_TRITON, compile_for, gpu, references, use_triton

    __all__ = ["linear_logprobs", "scaled_logits", "grpo_token_loss", "group_advantages", "fused_sample",
               "add_rmsnorm", "silu_mul", "qkv_rope_write", "decode_attention", "HAS_TRITON", "compile_for",
               "gpu", "references", "use_triton"]
