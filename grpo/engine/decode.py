"""Decode: one new token per row over the sampler's KV cache, from weights held for it (DecodeWeights).

    weights = DecodeWeights(model)      # allocated once per sampler
    weights.refresh(model)              # at the start of every sampler call: copied in place, or packed anew
    logits = decode(weights, cache, tok, pos, n, span)   # (n,) tokens at (n,) positions -> (n, V)

Why a second forward beside Transformer.forward (which still runs every prompt's prefill, and a tool
observation's on a GPU; `extend` below takes the observations on a CPU):
- Fixed addresses. A CUDA graph replays the pointers it captured. Under FSDP2 the gathered
  weights live at new addresses in each sampler call, so graphs used to be captured anew in
  every call (~0.5 s per cache bucket). The copy here lives as long as the sampler, is refreshed
  with copy_ (the weights change after every optimizer step), and graphs captured once replay in
  every later call.
- Fused layouts. q, k and v projections are one (qd + 2 kd, H) matrix and gate and up one (2F, H):
  one GEMM each instead of three and two.
- Few kernels. A layer is add+RMSNorm, the QKV GEMM, qk-norm + rotary + KV write, attention, the O
  GEMM, add+RMSNorm, the gate-up GEMM, silu*mul and the down GEMM: grpo.kernels' Triton kernels on
  CUDA (inference only, no autograd), their PyTorch references elsewhere. The attention mask is
  built once per step, not once per layer.
Precision follows the model's: matmuls in bf16 under autocast_bf16 (CPU), the residual stream, the
norms, the embedding and the LM head in the model's dtype; attention in fp32 on a CPU. The tests
check the logits against Transformer.forward over the same cache (tests/test_decode.py).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.engine.cpu import can_pack, pack, packed_linear
from grpo.engine.sampling import HEAD_CHUNK
from grpo.kernels import add_rmsnorm, decode_attention, qkv_rope_write, silu_mul, use_triton
from grpo.kernels.logprobs import mm_fp32_out
from grpo.models.lora import effective_weight
from grpo.models.model import lm_logits

try:  # optional: flash-attn's KV-cache kernel, where installed (CUDA)
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None


class DecodeWeights:
    """The weights decode reads, in one of three modes (`self.mode`):

    - "copy" (a GPU; a CPU under autocast_bf16): stacked per layer, wqkv (L, qd + 2kd, H) [q | k | v
      rows], bqkv (L, qd + 2kd) (Qwen2), wo (L, H, qd), w13 (L, 2F, H) [gate | up], w2 (L, H, F), norms
      (L, H) and (L, D) (Qwen3's q/k norms), embed (V, H), lm_head (V, H) (the same tensor when tied),
      refreshed in place: a GPU's CUDA graphs replay fixed addresses. Under LoRA the adapters are merged
      into the copy where it is fp32; where it is half precision (a bf16 base, autocast_bf16) they are
      applied unmerged, as the trainer's LoRALinear does: round_bf16(W + s B A) would drop every
      entry of s B A below half an ulp of W (~6e-5 at |W| ~ 0.02), most of what a few steps at lr
      1e-5 move, so the sampler would draw from nearly the base model. `adapters`: per GEMM, A of its
      adapted targets stacked (L, k r, in) and B block-diagonal (L, out, k r): two small GEMMs more.
    - "packed" (a CPU in fp32 with oneDNN, every x86 build of torch): a layer's four GEMMs from its
      weights reordered once per call into oneDNN's blocked layout (torch.ops.mkldnn, what inductor's
      CPU freezing uses). One fp32 thread of an AVX512 CPU, SmolLM2's 30 layers: 1.3-2.2x torch's
      F.linear at 4-128 rows; with oneDNN and MKL held to AVX2, 1.0-1.2x (bench/RESULTS.md). The LM
      head is packed too, in sample_hidden's vocabulary chunks (`head`); the norms and the embedding
      are the model's own tensors. The reorder is ~0.3 s a call there.
    - "resident" (a CPU without oneDNN, or with bf16 weights; no LoRA, no autocast): no copy at all, the
      model's own tensors, q, k, v and gate, up as separate GEMMs (0.5 GiB less than a copy of
      SmolLM2-135M in fp32, and within the +-10% noise of the fused GEMMs at 24-100 rows)."""

    def __init__(self, model, mode: str | None = None):
        a = self.args = model.args
        # the residual stream's dtype (fp32 on CPU, the FSDP compute dtype on GPU) and the matmuls'
        self.act_dtype, self.mm_dtype, self.device = _layout(model)
        self.mode = mode or _mode(model)  # kernel counts ask for "copy": a GPU's layout on a CPU
        self.inv_freq = model.inv_freq.detach().clone().float()  # (D/2,), fixed by the config
        self.head = None  # packed mode: the LM head's vocabulary chunks, packed (sample_hidden)
        self.head32 = None  # the LM head in fp32, where the logits need a copy of it (logits_head)
        self.adapters = None  # GEMM name -> (A, B) stacks, where LoRA is applied unmerged
        if self.mode != "copy":
            return  # refresh() takes the model's tensors (and packs the GEMMs' weights)
        L, H, D, F_, V = a.n_layers, a.dim, a.head_dim, a.ffn_dim, a.vocab_size
        qkv = (a.n_heads + 2 * a.n_kv_heads) * D
        mm = lambda *shape: torch.empty(*shape, dtype=self.mm_dtype, device=self.device)
        act = lambda *shape: torch.empty(*shape, dtype=self.act_dtype, device=self.device)
        self.wqkv, self.wo = mm(L, qkv, H), mm(L, H, a.n_heads * D)
        self.w13, self.w2 = mm(L, 2 * F_, H), mm(L, H, F_)
        self.bqkv = mm(L, qkv) if a.qkv_bias else None
        self.ln1, self.ln2, self.norm = act(L, H), act(L, H), act(H)
        self.q_norm, self.k_norm = (act(L, D), act(L, D)) if a.qk_norm else (None, None)
        self.embed = act(V, H)
        self.lm_head = self.embed if a.tie_embeddings else act(V, H)
        lora = getattr(model, "lora", None)
        if lora is not None and self.mm_dtype.itemsize < 4:  # half precision: adapters unmerged
            self.scale, self.adapters = lora.scale, {}
            for g, names in GEMMS.items():
                k = sum(n in lora.targets for n in names)  # the GEMM's adapted targets
                if k:
                    mods = _linears(model.layers[0], names)
                    ins, outs = mods[0].in_features, sum(m.out_features for m in mods)
                    B = torch.zeros(L, outs, k * lora.r, dtype=self.mm_dtype, device=self.device)
                    self.adapters[g] = (mm(L, k * lora.r, ins), B)

    def _lora(self, g: str, i: int, x: Tensor, y: Tensor) -> Tensor:
        """y + s (x A^T) B^T of GEMM g's adapted targets in layer i (unmerged LoRA), else y."""
        if self.adapters is None or g not in self.adapters:
            return y
        A, B = self.adapters[g]
        return y + self.scale * F.linear(F.linear(x, A[i]), B[i])  # (n, k r) between: cheap

    def matches(self, model) -> bool:
        """Whether these weights' dtypes, device and mode still fit the model (autocast may be switched)."""
        return _layout(model) == (self.act_dtype, self.mm_dtype, self.device) and self.mode == _mode(model)

    def logits_head(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """The LM head the sampled logits read, and the hidden states (n, H) as they enter it: the head
        itself, or its fp32 copy (head32, made once per call) with y rounded to the head's dtype, what
        grpo.kernels.scaled_logits' fallback would compute from fp32 copies made at every step."""
        return (self.lm_head, y) if self.head32 is None else (self.head32, y.to(self.lm_head.dtype))

    def _refresh_head32(self):
        """head32: an fp32 copy of a 16-bit LM head on CUDA where torch.mm cannot give it fp32 logits
        (grpo.kernels.logprobs.mm_fp32_out), refreshed in place (at a fixed address, for the graphs);
        else None."""
        w = self.lm_head
        if not needs_head32(w):
            self.head32 = None
            return
        if self.head32 is None or self.head32.shape != w.shape:
            self.head32 = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        self.head32.copy_(w)

    # a layer's four GEMMs, x in the matmuls' dtype: (n, H) -> (n, qd + 2kd) [q | k | v], (n, qd) -> (n, H),
    # (n, H) -> (n, 2F) [gate | up], (n, F) -> (n, H)
    def qkv(self, i: int, x: Tensor) -> Tensor:
        if self.mode == "packed":
            return packed_linear(x, self.packs[i][0], self.bqkv[i])
        if self.mode == "resident":
            return torch.cat([F.linear(x, p.weight, p.bias) for p in self.proj[i]], dim=-1)
        return self._lora("qkv", i, x, F.linear(x, self.wqkv[i], None if self.bqkv is None else self.bqkv[i]))

    def o(self, i: int, x: Tensor) -> Tensor:
        if self.mode == "packed":
            return packed_linear(x, self.packs[i][1])
        return self._lora("o", i, x, F.linear(x, self.wo[i]))

    def gate_up(self, i: int, x: Tensor) -> Tensor:
        if self.mode == "packed":
            return packed_linear(x, self.packs[i][2])
        if self.mode == "resident":
            return torch.cat([F.linear(x, p.weight) for p in self.mlp_in[i]], dim=-1)
        return self._lora("gate_up", i, x, F.linear(x, self.w13[i]))

    def down(self, i: int, x: Tensor) -> Tensor:
        if self.mode == "packed":
            return packed_linear(x, self.packs[i][3])
        return self._lora("down", i, x, F.linear(x, self.w2[i]))

    def matrices(self, i: int) -> list:  # layer i's weights as torch's plain GEMMs read them (benches)
        if self.mode == "copy":
            return [self.wqkv[i], self.wo[i], self.w13[i], self.w2[i]]
        return [p.weight for p in (*self.proj[i], *self.mlp_in[i])] + [self.wo[i], self.w2[i]]

    @torch.no_grad()
    def refresh(self, model):
        """The model's current weights, as decode will read them: after an optimizer step the next
        decode reads the new ones. A copy is always a full one: a version counter would miss writes
        through .data, and under FSDP2 the gathered tensors are new in every call (a 0.5B model in bf16
        is 1 GB: ~0.3 ms on an H200; SmolLM2-135M on 2 CPU cores ~0.1 s a call). Under LoRA
        (grpo/models/lora.py) each adapted weight is merged on the way in, W + s B A, where the copy is fp32,
        and its adapters copied beside W where it is half precision: either way the sampler samples from
        the adapted model with no other step. Packed and resident: the model's own tensors as they are
        now (the optimizer writes them in place; under FSDP2 the gathered ones of this call), and the
        GEMMs' weights packed anew."""
        if self.mode != "copy":
            self._take(model)
            return self._refresh_head32()
        a = self.args
        qd, kd = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        weight = (lambda m, out: out.copy_(m.weight)) if self.adapters is not None else (
            lambda m, out: effective_weight(m, out=out))
        for i, b in enumerate(model.layers):
            at, mlp = b.self_attn, b.mlp
            rows = ((at.q_proj, 0, qd), (at.k_proj, qd, qd + kd), (at.v_proj, qd + kd, qd + 2 * kd))
            for w, lo, hi in rows:
                weight(w, self.wqkv[i, lo:hi])
                if self.bqkv is not None:
                    self.bqkv[i, lo:hi].copy_(w.bias)
            weight(at.o_proj, self.wo[i])
            weight(mlp.gate_proj, self.w13[i, : a.ffn_dim])
            weight(mlp.up_proj, self.w13[i, a.ffn_dim:])
            weight(mlp.down_proj, self.w2[i])
            for g, (A, B) in (self.adapters or {}).items():  # A stacked, B block-diagonal (its zeros stay)
                row = col = 0
                for m in _linears(b, GEMMS[g]):
                    if hasattr(m, "lora_A"):
                        k = m.lora_A.shape[0]
                        block = B[i, row:row + m.out_features, col:col + k]
                        A[i, col:col + k].copy_(m.lora_A)
                        block.copy_(m.lora_B) if m.enabled else block.zero_()  # adapters_off: the base's
                        col += k
                    row += m.out_features
            self.ln1[i].copy_(b.input_layernorm.weight)
            self.ln2[i].copy_(b.post_attention_layernorm.weight)
            if self.q_norm is not None:
                self.q_norm[i].copy_(at.q_norm.weight)
                self.k_norm[i].copy_(at.k_norm.weight)
        self.norm.copy_(model.norm.weight)
        self.embed.copy_(model.embed_tokens.weight)
        if self.lm_head is not self.embed:
            self.lm_head.copy_(model.lm_head.weight)
        self._refresh_head32()

    def _take(self, model):
        layers = model.layers
        self.proj = [(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj) for b in layers]
        self.mlp_in = [(b.mlp.gate_proj, b.mlp.up_proj) for b in layers]
        self.wo = [b.self_attn.o_proj.weight for b in layers]
        self.w2 = [b.mlp.down_proj.weight for b in layers]
        self.ln1 = [b.input_layernorm.weight for b in layers]
        self.ln2 = [b.post_attention_layernorm.weight for b in layers]
        qk = self.args.qk_norm
        self.q_norm = [b.self_attn.q_norm.weight for b in layers] if qk else None
        self.k_norm = [b.self_attn.k_norm.weight for b in layers] if qk else None
        self.norm, self.embed = model.norm.weight, model.embed_tokens.weight
        self.lm_head = model.lm_head.weight
        if self.mode == "packed":  # each GEMM's weight (fused, LoRA merged) reordered for oneDNN
            self.packs = self.head = None  # the last call's, freed before the new ones exist
            fused = lambda ps: pack(torch.cat([effective_weight(p) for p in ps]))  # noqa: E731
            self.packs = [(fused(q), fused((b.self_attn.o_proj,)), fused(g), fused((b.mlp.down_proj,)))
                          for q, g, b in zip(self.proj, self.mlp_in, layers)]
            self.bqkv = [torch.cat([p.bias for p in q]) if self.args.qkv_bias else None for q in self.proj]
            # the LM head in sample_hidden's vocabulary chunks: its GEMM 1.6x F.linear's at 24-100 rows
            self.head = [pack(self.lm_head[s:s + HEAD_CHUNK])
                         for s in range(0, self.args.vocab_size, HEAD_CHUNK)]


GEMMS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}  # decode's four GEMMs a layer, and the linear layers each one fuses


def _linears(block, names: tuple) -> list:  # a block's linear layers of those names, in order
    return [getattr(block.self_attn if n in GEMMS["qkv"] + GEMMS["o"] else block.mlp, n) for n in names]


def _mode(model) -> str:
    """How decode reads the weights (DecodeWeights): "packed" on a CPU in fp32 with oneDNN, "resident" on
    one without (no LoRA: a merged W + s B A needs a buffer), else "copy"."""
    act, mm, device = _layout(model)
    if device.type != "cpu" or act != mm:
        return "copy"
    if mm == torch.float32 and can_pack():
        return "packed"
    return "resident" if getattr(model, "lora", None) is None else "copy"


def needs_head32(lm_head: Tensor) -> bool:
    """Whether the sampled logits need an fp32 copy of this LM head: a 16-bit one on CUDA where torch.mm
    cannot give 16-bit operands an fp32 output."""
    half = lm_head.dtype in (torch.float16, torch.bfloat16)
    return lm_head.is_cuda and half and not mm_fp32_out(lm_head.dtype)


def _layout(model) -> tuple:  # (activation dtype, matmul dtype, device) of a decode copy of `model`
    p = next(model.parameters())
    return p.dtype, torch.bfloat16 if getattr(model, "autocast_bf16", False) else p.dtype, p.device


def decode(w: DecodeWeights, cache, tok: Tensor, pos: Tensor, n: int, span: int,
           backend: str | None = None) -> Tensor:
    """decode_hidden's rows through the LM head -> logits (n, V), in the LM head's dtype (the
    sampler samples from the hidden states instead: grpo.engine.sampling.sample_hidden)."""
    return _linear(decode_hidden(w, cache, tok, pos, n, span, backend), w.lm_head)


def decode_hidden(w: DecodeWeights, cache, tok: Tensor, pos: Tensor, n: int, span: int,
                  backend: str | None = None, active: Tensor | None = None) -> Tensor:
    """Rows [0, n) of the cache each take one token: tok (n,) at positions pos (n,), attending
    to cache positions [0, span) up to their own. Their k, v are written at pos. -> the final
    norm's output (n, H), what the LM head reads. No host sync, static shapes: a CUDA graph can
    hold it. `backend`: the kernels' ("triton" on CUDA when importable, else "torch"; tests force
    "triton" on a CPU under TRITON_INTERPRET). `active` (n,) bool: rows not decoding (finished, in a
    tool call, a bucket's free slots) attend over their first key only, not their stale lengths (their
    outputs are dropped; what they write at pos is written again before it is read)."""
    a = w.args
    kb = "triton" if use_triton(tok, backend, "decode") else "torch"
    slot = torch.arange(n, device=tok.device)
    freqs = pos[:, None].float() * w.inv_freq  # (n, D/2) fp32
    cos, sin = freqs.cos(), freqs.sin()
    # attention: flash-attn's kernel, else ours (both read the cache in place), else SDPA with a
    # mask built once a step, not once a layer. q is in the matmuls' dtype
    kernel = ("flash" if tok.is_cuda and _flash(w.mm_dtype)
              else "triton" if kb == "triton" and cache.k.dtype == w.mm_dtype else None)
    # keys each row reads, its own included (a row not decoding: its first only)
    length = pos + 1 if active is None else torch.where(active, pos + 1, 1)
    bias = None if kernel else _key_bias(length - 1, span)  # (n, 1, 1, span)
    length = length.to(torch.int32) if kernel == "flash" else length
    x, res = w.embed[tok], None  # (n, H); res: the residual stream
    for i in range(a.n_layers):
        q, res = _qkv(w, i, x, res, cos, sin, cache, slot, pos, kb)  # (n, nh, D); k, v now cached at pos
        o = _attend(q, cache.k[i], cache.v[i], slot, length, span, bias, kernel)  # (n, nh, D)
        x, res = _o_mlp(w, i, o.reshape(n, -1), res, kb)
    y, _ = add_rmsnorm(x, res, w.norm, a.norm_eps, backend=kb)
    return y


def _qkv(w: DecodeWeights, i: int, x: Tensor, res: Tensor | None, cos: Tensor, sin: Tensor, cache,
         slot: Tensor, pos: Tensor, kb: str) -> tuple[Tensor, Tensor]:
    """Layer i up to attention: add+RMSNorm, the QKV GEMM, q/k norms and rotary, k and v written at
    (slot, pos). x (n, H), the residual stream res -> q (n, nh, D) and the new residual."""
    a = w.args
    y, res = add_rmsnorm(x, res, w.ln1[i], a.norm_eps, backend=kb)
    qkv = w.qkv(i, y.to(w.mm_dtype))  # (n, qd + 2kd)
    q = qkv_rope_write(qkv, cos, sin, cache.k[i], cache.v[i], slot, pos, a.n_heads, a.n_kv_heads, a.head_dim,
                       None if w.q_norm is None else w.q_norm[i], None if w.k_norm is None else w.k_norm[i],
                       a.norm_eps, backend=kb)
    return q, res


def _o_mlp(w: DecodeWeights, i: int, o: Tensor, res: Tensor, kb: str) -> tuple[Tensor, Tensor]:
    """Layer i after attention: the O GEMM, add+RMSNorm, the gate-up GEMM, silu*mul, the down GEMM.
    o (n, qd) -> the layer's output (n, H) and the residual."""
    x = w.o(i, o.to(w.mm_dtype)).to(res.dtype)
    y, res = add_rmsnorm(x, res, w.ln2[i], w.args.norm_eps, backend=kb)
    return w.down(i, silu_mul(w.gate_up(i, y.to(w.mm_dtype)), backend=kb).to(w.mm_dtype)).to(res.dtype), res


@torch.no_grad()
def extend(w: DecodeWeights, cache, ids: Tensor, pos: Tensor, valid: Tensor, slots: Tensor,
           real: Tensor | None = None, span: int | None = None) -> Tensor:
    """Rows continuing their history with several tokens each (a tool's observation), through the
    decode weights (on a CPU, oneDNN's packed GEMMs instead of the model's F.linear: a few dozen rows
    at a time, where torch's GEMM reads the weights slowest). ids, pos, valid (B, T): the tokens, their
    positions and which are real in a padded batch; slots (B,) the rows' cache slots. Real tokens' k, v
    are written at pos; each attends to its row's keys up to its own. -> the LM head's logits (B, V) at
    each row's last real token, in fp32 as Transformer.forward's `output_index` gives them. CPU only
    (the torch references of the decode kernels). `real` (N,), the real tokens' flat indices in (B, T)
    row-major, and `span`, the keys read (the last real position + 1): the caller's, from its host lists
    (computed here from `valid` without them: host reads)."""
    a, (B, T) = w.args, ids.shape
    idx = valid.reshape(-1).nonzero().squeeze(1) if real is None else real  # (N,) the real tokens, row-major
    p = pos.reshape(-1)[idx]
    freqs = p[:, None].float() * w.inv_freq  # (N, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    slot = slots[:, None].expand(B, T).reshape(-1)[idx]  # (N,)
    span = int(pos.masked_fill(~valid, 0).max()) + 1 if span is None else span
    keys = torch.arange(span, device=ids.device)
    hidden_keys = ~(keys <= pos[..., None])[:, None]  # (B, 1, T, span): later than the query's own position
    bias = torch.zeros(B, 1, T, span, device=ids.device).masked_fill_(hidden_keys, float("-inf"))
    x, res = w.embed[ids.reshape(-1)[idx]], None  # (N, H)
    nh, nkv, D = a.n_heads, a.n_kv_heads, a.head_dim
    for i in range(a.n_layers):
        q, res = _qkv(w, i, x, res, cos, sin, cache, slot, p, "torch")  # (N, nh, D)
        # (B, nh, T, D)
        qp = q.new_zeros(B * T, nh, D).index_copy_(0, idx, q).view(B, T, nh, D).transpose(1, 2)
        k, v = (c[i][slots, :span].transpose(1, 2).float() for c in (cache.k, cache.v))  # (B, nkv, span, D)
        o = F.scaled_dot_product_attention(qp.float(), k, v, attn_mask=bias, enable_gqa=nh != nkv)
        x, res = _o_mlp(w, i, o.transpose(1, 2).reshape(B * T, nh * D)[idx].to(q.dtype), res, "torch")
    y, _ = add_rmsnorm(x, res, w.norm, a.norm_eps, backend="torch")  # (N, H)
    last = valid.sum(1).cumsum(0) - 1  # (B,) each row's last real token among the N
    return lm_logits(y[last], w.lm_head)  # (B, V) fp32


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x.to(weight.dtype), weight, bias)


def _flash(dtype) -> bool:  # flash-attn takes half precision only
    return flash_attn_with_kvcache is not None and dtype in (torch.float16, torch.bfloat16)


def _key_bias(pos: Tensor, span: int) -> Tensor:  # (n,) -> (n, 1, 1, span) fp32: 0 = may attend, -inf not
    keys = torch.arange(span, device=pos.device)
    return torch.zeros(len(pos), 1, 1, span, device=pos.device).masked_fill_(
        (keys > pos[:, None])[:, None, None], float("-inf"))


def _attend(q: Tensor, k: Tensor, v: Tensor, slot: Tensor, length: Tensor, span: int, bias: Tensor | None,
            kernel: str | None) -> Tensor:
    """q (n, nh, D) of rows in slots [0, n) against one layer's cache k, v (slots, S, nkv, D), each
    over its first length[b] (<= span) keys -> (n, nh, D)."""
    n = len(q)
    if kernel == "flash":
        return flash_attn_with_kvcache(q[:, None], k[:n], v[:n], cache_seqlens=length, causal=True)[:, 0]
    if kernel == "triton":  # the cache up to span (a view): the kernel splits a row's keys, not all S
        return decode_attention(q, k[:, :span], v[:, :span], slot, length, backend="triton")
    nh, nkv, D = q.shape[1], k.shape[2], q.shape[2]
    k, v = k[:n, :span].transpose(1, 2), v[:n, :span].transpose(1, 2)  # (n, nkv, span, D): contiguous on CPU
    # CPU: fp32 attention (its bf16 kernels are the slower ones there; see Attention.forward). The
    # G = nh / nkv query heads of a KV head are one query block over its keys: one (G, span) score block
    # per row and KV head, not G single-query ones, and no K/V copies (SDPA's enable_gqa repeats them)
    y = F.scaled_dot_product_attention(q.float().view(n, nkv, nh // nkv, D), k.float(), v.float(),
                                       attn_mask=bias)
    return y.reshape(n, nh, D).to(q.dtype)
