"""The kernels one decode step launches, counted from the code path on any machine (no GPU): the
sampler's decode step (grpo.engine.sampler.decode_step) over a model of the given shape, its weights left
uninitialized (the count reads no value), with the Triton launches its wrappers would make on a GPU
arch (compiled, not run: grpo.kernels.compile_for) and every PyTorch op that does work on a tensor,
as a TorchDispatchMode sees them. For bench/compile_kernels.py (the table at the goals' shapes) and
its test; an estimate from the code, not a profile (bench/gpu_check.py profiles the real step).
"""
import contextlib
from collections import Counter
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo import kernels
from grpo.kernels.target import compile_for

PLEN, NEW = 256, 512  # the step's position (a prompt's length) and the tokens after it the cache holds


class OpCount(TorchDispatchMode):
    """PyTorch ops that do work on a tensor (each a kernel, or a copy, on a GPU): not views, not
    allocations. `host_syncs`: ops that make the host wait for the device (a CUDA graph cannot
    hold them): a value read, or an output sized by the values."""
    FREE = {"empty", "empty_strided", "empty_like", "new_empty", "_unsafe_view", "lift_fresh", "detach"}
    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
             "unique_consecutive", "repeat_interleave", "bincount", "histc"}

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
    from grpo.models.model import Transformer
    with torch.device("meta"):  # shapes only: the weights are allocated empty, in bf16, below
        model = Transformer({**config, "num_hidden_layers": layers})
    return model.to_empty(device="cpu").to(torch.bfloat16).eval()


def step_count(config: dict, B: int, layers: int, way: str, arch: int) -> dict:
    """Kernels of one decode step over B rows at position PLEN, `way` one of "model" | "torch" | "triton"."""
    import grpo.engine.window as window  # where decode_step finds decode_hidden
    from grpo.engine.decode import DecodeWeights
    from grpo.engine.sampler import Sampler, SamplingParams, decode_step
    from grpo.engine.sampling import sample
    model = build(config, layers)
    sampler = Sampler(model, gen_batch=B, max_seq_len=PLEN + NEW, cuda_graphs=False)
    sampler.weights = DecodeWeights(model, mode="copy")  # the GPU's stacked copy, not a CPU's packed weights
    st = sampler.runner.state
    st.tok[:B], st.pos[:B], st.active[:B], st.max_tokens[:B] = 1, PLEN, True, NEW
    count, real = OpCount(), kernels.fused_sample

    def sample_kernel(*args, **kw):  # its tokens were never computed: valid ids for the step's indexing
        tok, lp = real(*args, **kw)
        count.paused = True
        tok.zero_()
        count.paused = False
        return tok, lp

    # the decode before grpo.engine.decode (a row of bench/RESULTS.md): the model's forward over the cache
    def model_decode(w, cache, tok, pos, n, span, **kw):  # kw: decode_hidden's `active`
        cache.rows(slice(0, n), pos, 1, span)
        return model(tok[:, None], pos[:, None], cache=cache)[:, 0]

    with contextlib.ExitStack() as stack, torch.no_grad():
        launches = stack.enter_context(compile_for(arch))
        if way != "triton":
            stack.enter_context(kernels.references())
        if way == "model":  # the model's forward gives logits, and the sampler samples them
            stack.enter_context(mock.patch.object(window, "decode_hidden", model_decode))
            stack.enter_context(mock.patch.object(
                window, "sample_hidden",
                lambda logits, weight, *a, packed=None, **kw: sample(logits, *a, **kw)))
        stack.enter_context(mock.patch.object(kernels, "fused_sample", sample_kernel))
        with count:
            decode_step(sampler.weights, sampler.cache, st,
                        SamplingParams(temperature=1.0, stop_token_ids=[]), B, PLEN + 1, 0)
    return dict(launches=len(launches), ops=count.ops, host_syncs=count.host_syncs)
