"""The decode step (grpo/engine/decode.py) against Transformer.forward over the same KV cache, for each
family; the decode weights after an optimizer step; the stop-string candidate tokens."""
import os
import subprocess
import sys

import pytest
import torch

from grpo.engine.decode import DecodeWeights, decode, extend
from grpo.engine.kv_cache import KVCache
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.models.model import Transformer


def _both_ways(model, prompts: list[list[int]], steps: int):
    """Prefill the prompts into a cache, then decode `steps` tokens (each row's argmax) twice from
    copies of it: through the model's forward and through decode(). -> the two (steps, n, V)
    logits and the two caches."""
    n, S = len(prompts), max(map(len, prompts)) + steps + 3
    cache = KVCache(model.args, n, S, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for i, x in enumerate(prompts):  # one prompt a forward, its KV into slot i
            cache.packed(torch.full((len(x),), i), torch.arange(len(x)))
            model(torch.tensor([x]), torch.arange(len(x))[None], cache=cache)
        caches = [cache, KVCache(model.args, n, S, torch.float32, torch.device("cpu"))]
        caches[1].k.copy_(cache.k), caches[1].v.copy_(cache.v)
        w = DecodeWeights(model)
        w.refresh(model)
        tok = torch.tensor([x[-1] for x in prompts])
        pos = torch.tensor([len(x) - 1 for x in prompts])
        # the last prompt token is fed again (rewritten at its own position): both paths alike
        out = [[], []]
        for _ in range(steps):
            span = int(pos.max()) + 1
            caches[0].rows(slice(0, n), pos, 1, span)
            out[0].append(model(tok[:, None], pos[:, None], cache=caches[0])[:, 0].float())
            out[1].append(decode(w, caches[1], tok, pos, n, span).float())
            tok, pos = out[0][-1].argmax(-1), pos + 1
    return torch.stack(out[0]), torch.stack(out[1]), caches


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decode_equals_model_forward(tiny_dir, family):
    path, _ = tiny_dir(family)
    model = Transformer.from_pretrained(path).eval()
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
    ref, ours, (c0, c1) = _both_ways(model, prompts, steps=6)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    # the same keys and values written; a later position's come through earlier layers' attention, whose
    # fp32 sums the two paths order differently (decode: a G-query block per KV head), as the logits' do
    torch.testing.assert_close(c1.k, c0.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c1.v, c0.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_decode_under_autocast_bf16(tiny_dir, family):
    """autocast_bf16: the decode weights are bf16 matmuls over an fp32 residual stream, as the
    model's autocast computes; bf16 rounding alone separates them."""
    path, _ = tiny_dir(family)
    model = Transformer.from_pretrained(path).eval()
    model.autocast_bf16 = True
    w = DecodeWeights(model)
    assert w.wqkv.dtype == torch.bfloat16 and w.ln1.dtype == torch.float32 and w.embed.dtype == torch.float32
    ref, ours, _ = _both_ways(model, [[3, 4, 5, 6], [7, 8, 9]], steps=4)
    scale = ref.abs().max()
    assert (ours - ref).abs().max() < 0.03 * scale, ((ours - ref).abs().max(), scale)


@pytest.mark.parametrize("mode", ["copy", "packed", "resident"])
def test_decode_weights_follow_the_optimizer(tiny_dir, mode, monkeypatch):
    """One sampler across an optimizer step: its next call reads the new weights, giving a fresh
    sampler's tokens. Under autocast_bf16 the bf16 copy is refreshed in place, at the same addresses;
    in fp32 on a CPU the GEMMs' weights are packed for oneDNN anew and the rest are the model's own
    tensors; without oneDNN ("resident") every weight is the model's own."""
    path, _ = tiny_dir("qwen2", vocab_size=300)
    model = Transformer.from_pretrained(path)
    model.autocast_bf16 = mode == "copy"
    if mode == "resident":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    sampler = Sampler(model, gen_batch=8)
    p = SamplingParams(n=2, temperature=1.0, max_tokens=16, stop_token_ids=[], seed=3)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    before = sampler.generate(prompts, p)
    w = sampler.weights
    assert w.mode == mode
    if mode != "copy":  # the model's tensors themselves, not a copy of them
        assert w.wo[0] is model.layers[0].self_attn.o_proj.weight and w.embed is model.embed_tokens.weight
        assert w.proj[0][0] is model.layers[0].self_attn.q_proj
    addresses = (w.wqkv.data_ptr(), w.w13.data_ptr()) if mode == "copy" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    loss = model(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[6, 7, 8, -100]])).sum()
    loss.backward()
    opt.step()
    model.eval()
    after = sampler.generate(prompts, p)
    if mode == "copy":
        assert (sampler.weights.wqkv.data_ptr(), sampler.weights.w13.data_ptr()) == addresses
    assert [c.token_ids for c in after] == [c.token_ids for c in Sampler(model, gen_batch=8).generate(prompts, p)]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_stop_string_candidates_on_smollm2(smollm2_path):
    """The tokens that can complete a stop string: every token whose text holds the string's last
    character, none of the others but partial-UTF-8 and empty ones, and few of the vocabulary."""
    from transformers import AutoTokenizer
    tk = AutoTokenizer.from_pretrained(smollm2_path)
    model = Transformer.from_pretrained(smollm2_path)
    ends = Sampler(model, tk, gen_batch=1).scheduler.string_ends(["</calc>", "\n\nUser:"])
    V = model.args.vocab_size
    assert len(ends) == V and sum(ends) < V // 5
    for v in range(0, len(tk), 7):
        piece = tk.decode([v])
        if ">" in piece or ":" in piece:
            assert ends[v], (v, piece)
        elif piece and "\ufffd" not in piece and piece.strip() == piece:
            assert not ends[v], (v, piece)


@pytest.mark.slow  # a child interpreter
def test_decode_with_triton_kernels_under_the_interpreter(tiny_dir):
    """decode() through the Triton kernels (what CUDA runs), interpreted on the CPU, against its
    torch path: the kernels' wiring (layouts, strides, the cache writes), not only each kernel."""
    path, _ = tiny_dir("qwen3", vocab_size=97)
    code = f"""
import torch
from grpo.engine.decode import DecodeWeights, decode, extend
from grpo.engine.kv_cache import KVCache
from grpo.models.model import Transformer
model = Transformer.from_pretrained({path!r}).eval()
w = DecodeWeights(model)
w.refresh(model)
g = torch.Generator().manual_seed(0)
caches = [KVCache(model.args, 3, 24, torch.float32, torch.device("cpu")) for _ in range(2)]
for c in caches[1:]:
    c.k.copy_(torch.randn(c.k.shape, generator=g)), c.v.copy_(torch.randn(c.v.shape, generator=g))
caches[0].k.copy_(caches[1].k), caches[0].v.copy_(caches[1].v)
tok, pos = torch.tensor([5, 17, 60]), torch.tensor([3, 11, 0])
with torch.no_grad():
    # span 20 of 24: the interpreter's attention splits those 20 keys in two (the third row, at
    # position 0, reads one key: its second split is empty), and never reads past them
    ref = decode(w, caches[0], tok, pos, 3, 20, backend="torch")
    out = decode(w, caches[1], tok, pos, 3, 20, backend="triton")
torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(caches[1].v, caches[0].v)
print("ok", (out - ref).abs().max().item())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("family,mode", [("llama", "packed"), ("qwen2", "packed"), ("qwen3", "packed"),
                                         ("qwen2", "resident"), ("qwen3", "copy")])
def test_extend_equals_model_forward(tiny_dir, family, mode, monkeypatch):
    """Rows that continue their history with several tokens (a tool's observation, padded): extend()
    through the decode weights gives Transformer.forward's logits at each row's last real token, and
    writes the same keys and values, the padding none. In each of the decode weights' modes: "copy"
    under autocast_bf16 (bf16 matmuls both ways, so bf16's rounding apart), "resident" without oneDNN."""
    path, _ = tiny_dir(family)
    model = Transformer.from_pretrained(path).eval()
    model.autocast_bf16 = mode == "copy"
    if mode == "resident":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    prompts, new = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15]], [[20, 21, 22], [23], [24, 25]]
    S = 16
    caches = [KVCache(model.args, 4, S, torch.float32, torch.device("cpu")) for _ in range(2)]
    slots = torch.tensor([2, 0, 3])  # not in row order
    T = max(map(len, new))
    ids = torch.tensor([x + [0] * (T - len(x)) for x in new])
    valid = torch.tensor([[t < len(x) for t in range(T)] for x in new])
    start = torch.tensor([len(x) for x in prompts])
    positions = start[:, None] + torch.arange(T)
    with torch.no_grad():
        for c in caches:
            for s, x in zip(slots.tolist(), prompts):
                c.packed(torch.full((len(x),), s), torch.arange(len(x)))
                model(torch.tensor([x]), torch.arange(len(x))[None], cache=c)
        caches[0].rows(slots, start, T, int(positions.max()) + 1, valid)
        last = torch.tensor([[len(x) - 1] for x in new])
        ref = model(ids, positions, cache=caches[0], output_index=last)[:, 0]
        w = DecodeWeights(model)
        w.refresh(model)
        ours = extend(w, caches[1], ids, positions, valid, slots)
    assert w.mode == mode and ref.abs().max() > 0.1
    tol = dict(atol=3e-2 * ref.abs().max().item(), rtol=0) if mode == "copy" else dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours, ref, **tol)
    tol = dict(atol=3e-2, rtol=3e-2) if mode == "copy" else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].k, caches[0].k, **tol)  # padding wrote nothing in either
    torch.testing.assert_close(caches[1].v, caches[0].v, **tol)
