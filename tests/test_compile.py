"""The Triton kernels compiled for each GPU the recipes are planned for, on this CPU
(grpo.kernels.compile_for: Triton's pipeline down to a cubin, nothing launched), and the
kernels one decode step launches, counted from the code path (grpo.kernels.cases and
grpo.measure.kernel_count, which bench/compile_kernels.py prints)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compile_for compiles; the interpreter runs"),
]

KERNELS = {"_sample_partial_kernel", "_sample_combine_kernel", "_add_rmsnorm_kernel", "_silu_mul_kernel",
           "_qkv_rope_write_kernel", "_decode_attention_kernel", "_decode_attention_combine_kernel",
           "_logprobs_fwd_kernel", "_dlogits_kernel", "_grpo_token_loss_kernel", "_group_advantages_kernel"}
TINY = dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, qkv_bias=True, tie_word_embeddings=True, max_position_embeddings=1024)


def compile_each(archs) -> dict:
    """arch -> the rows of grpo.kernels.cases.compile_rows([arch]), or why it failed (that arch's test
    fails, not the others')."""
    from grpo.kernels.cases import compile_rows
    rows = {}
    for arch in archs:
        try:
            rows[arch] = compile_rows([arch])
        except Exception as e:  # noqa: BLE001
            rows[arch] = f"{type(e).__name__}: {e}"
    return rows


CHILD = ("import json, sys; sys.path.insert(0, sys.argv[1]); from test_compile import compile_each; "
         "print(json.dumps(compile_each(int(a) for a in sys.argv[2:])))")


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory) -> dict:
    """compile_each() of every arch this session's tests ask for. A compile runs one thread (LLVM, then
    ptxas): with more than one arch asked, a child process compiles the lower half while this one
    compiles the rest."""
    archs = sorted({item.callspec.params["arch"] for item in request.session.items
                    if getattr(item, "originalname", "") == "test_every_kernel_compiles_for_the_gpu"})
    child, here = archs[:len(archs) // 2], archs[len(archs) // 2:]
    folder = tmp_path_factory.mktemp("compile")
    with open(folder / "rows.json", "w") as out, open(folder / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, os.path.dirname(__file__), *map(str, child)],
                                stdout=out, stderr=err) if child else None
        rows = compile_each(here)
        if proc is not None:
            proc.wait(timeout=900)
    if proc is not None:
        assert proc.returncode == 0, (folder / "stderr").read_text()[-3000:]
        last = (folder / "rows.json").read_text().strip().splitlines()[-1]
        rows.update({int(arch): r for arch, r in json.loads(last).items()})
    return rows


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a == 90 else pytest.mark.slow) for a in (80, 89, 90, 100)])
def test_every_kernel_compiles_for_the_gpu(arch, compiled):
    rows = compiled[arch]
    assert isinstance(rows, list), rows  # else: why it failed
    assert {r["kernel"] for r in rows} == KERNELS
    for r in rows:  # registers from the cubin itself; no kernel spills, each fits the GPU's shared memory
        assert 0 < r["regs"] <= 255 and r["status"] == "ok", r
        assert r["warps"] in (1, 4, 8) and r["arch"] == f"sm_{arch}"


def test_compile_for_launches_nothing_and_restores_triton():
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from grpo.kernels import compile_for, gpu, references, silu_mul
    saved = driver._active, JITFunction.__getitem__, dict(JITFunction.__dict__)
    gu = torch.randn(3, 2 * 1000)
    with compile_for(90) as launches:
        assert gpu(gu)  # the GPU's way for a CPU tensor
        out = silu_mul(gu)
        with references():  # the reference computes, on the CPU
            ref = silu_mul(gu)
    (name, k), = launches
    assert name == "_silu_mul_kernel" and k.asm["cubin"][:4] == b"\x7fELF" and k.metadata.num_warps == 4
    assert k.metadata.target.arch == 90
    assert out.shape == ref.shape == (3, 1000)
    torch.testing.assert_close(ref, torch.nn.functional.silu(gu[:, :1000]) * gu[:, 1000:])
    assert (driver._active, JITFunction.__getitem__, dict(JITFunction.__dict__)) == saved and not gpu(gu)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_decode_step_kernels_counted(family):
    """Through the Triton kernels a layer is 6 launches and 4 GEMMs, for each family (Qwen3's q/k
    norms inside the q/k/v kernel), the step has no host sync seen (a CUDA graph holds it), and the
    count is linear in the layers (what the bench extrapolates)."""
    from grpo.measure.kernel_count import step_count
    config = dict(TINY, model_type=family, qkv_bias=family == "qwen2", head_dim=32 if family == "qwen3" else None)
    counts = {(L, way): step_count(config, 4, L, way, 90) for L in (1, 2, 3)
              for way in ("triton", "torch", "model")}
    total = lambda c: c["launches"] + sum(c["ops"].values())  # noqa: E731
    for way in ("triton", "torch", "model"):
        t = [total(counts[L, way]) for L in (1, 2, 3)]
        assert t[2] - t[1] == t[1] - t[0], (way, t)
        assert counts[1, way]["host_syncs"] == 0, way
    one, two = counts[1, "triton"], counts[2, "triton"]
    assert two["launches"] - one["launches"] == 6  # add_rmsnorm x2, qkv_rope_write, attention + combine, silu_mul
    # o, gate|up and down; qkv with its bias (Qwen2) or without
    assert dict(two["ops"] - one["ops"]) == ({"mm": 3, "addmm": 1} if family == "qwen2" else {"mm": 4})
    assert counts[1, "torch"]["launches"] == counts[1, "model"]["launches"] == 0
    assert total(two) - total(one) < (total(counts[2, "torch"]) - total(counts[1, "torch"])) / 4


def test_the_attention_sweep_compiles_each_launch(monkeypatch):
    """The attention sweep (grpo.kernels.cases.sweep: bench/decode_kernels.py --sweep, a GPU's) on this
    CPU, compiled only: each alternative launch builds, the shipped one is among them, and the
    wrapper's own launch is restored."""
    from grpo.kernels import cases, compile_for, layers
    shipped = layers._attention_launch
    monkeypatch.setattr(cases, "time_ms", lambda fn, iters, reps: (fn(), 1.0)[1])
    with compile_for(90) as launches:
        rows = cases.sweep(torch.bfloat16, 1, 1, dev="cpu")
    assert layers._attention_launch is shipped
    assert len(rows) == 2 * len(cases.SWEEP) and sum(r["shipped"] for r in rows) == 2
    attention = [k for name, k in launches if name == "_decode_attention_kernel"]
    assert {(k.metadata.num_warps, k.metadata.num_stages) for k in attention} == {(w, s) for _, w, s in cases.SWEEP}
    # each launch a kernel of its own (keys a block is a constexpr) per shape; the shipped launch, timed
    # first as the base, is one of them
    assert len({k.hash for k in attention}) == 2 * len(set(cases.SWEEP)), len(attention)


@pytest.mark.parametrize("arch", [90, pytest.param(100, marks=pytest.mark.slow)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [2, 4, 7])
def test_decode_attention_on_tensor_cores_for_16_bit_caches(G, D, arch):
    """bf16 caches: both dots on the tensor cores (mma in the PTX), the query heads of a KV head
    padded only to a power of two (Qwen3-0.6B's 2, Qwen3-4B's 4, Qwen2.5-0.5B's 7 -> 8; the MMA pads
    to its own tile); fp32 caches: "ieee" dots on the FMA units (no mma, no tf32). No spill, at
    Qwen2.5's head dim (64 for 0.5B) and Qwen3's (128), on Hopper and on Blackwell (sm_100, where a
    launch that did not spill on sm_90 did)."""
    from grpo.kernels import compile_for, decode_attention
    from grpo.kernels.cases import resources
    B, nkv, S = 4, 2, 256
    g = torch.Generator().manual_seed(0)
    for dtype, mma in ((torch.bfloat16, True), (torch.float32, False)):
        q = torch.randn(B, nkv * G, D, generator=g).to(dtype)
        k_cache, v_cache = (torch.randn(B, S, nkv, D, generator=g).to(dtype) for _ in range(2))
        with compile_for(arch) as launches:
            decode_attention(q, k_cache, v_cache, torch.arange(B), torch.full((B,), S))
        k = next(k for name, k in launches if name == "_decode_attention_kernel")
        ptx = k.asm["ptx"]
        assert ("mma" in ptx) == mma, (dtype, G, D)
        assert "tf32" not in ptx
        assert resources(k.asm["cubin"])["spill_bytes"] == 0, (dtype, G, D)
        assert k.src.constants[(k.src.fn.arg_names.index("BLOCK_G"),)] == 1 << (G - 1).bit_length()
