"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464): the linear-attention layer of
Qwen3.5's hybrid models, in plain PyTorch.

Each value head keeps a (Dk, Dv) state S instead of a KV cache. Token t decays it by a_t = exp(g_t)
and writes, at rate beta_t, the part of v_t that the decayed state does not already predict from
k_t (the delta rule):

    S_t = a_t S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - (a_t S_{t-1})^T k_t),   o_t = S_t^T q_t

with q, k L2-normalised per head and q scaled by Dk^-1/2. Before that, q, k and v go through a short
causal depthwise convolution (kernel K, 4 in Qwen3.5) and SiLU; after, each head's output is
RMS-normed and gated by silu(z).

Two forms of one recurrence, both with a float32 state:
  - gated_delta_chunked (training, prefill): the sequence in chunks of C tokens; within a chunk the
    deltas solve one unit-lower-triangular system (the WY/UT form of the paper's section 3), so a
    chunk is a few (C x C) and (C x D) matmuls, and only the chunks are sequential;
  - gated_delta_step (decode): one token, the recurrence as written.
A row's whole decode state is (conv window: its last K-1 inputs, S); the sampler keeps one per row
and per linear layer (grpo/engine/hybrid_cache.py). Padded tokens (valid False) get g = 0 and beta = 0,
so they leave S as it was, and the window is cut at each row's last real token.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class LinearArgs:
    """The linear layers' shapes (config.json's linear_* fields)."""
    k_heads: int     # Hk: query/key heads
    v_heads: int     # Hv: value heads, a multiple of Hk (each q/k head serves Hv / Hk value heads)
    k_dim: int       # Dk
    v_dim: int       # Dv
    conv_kernel: int  # K

    @property
    def conv_dim(self) -> int:  # C: the channels through the convolution, [q | k | v]
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


# ----------------------------------------------------------------------------- the math

def causal_conv1d(x: Tensor, weight: Tensor, window: Tensor | None = None,
                  lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution and SiLU. x (B, T, C), weight (C, K), window (B, K-1, C): the
    K-1 inputs before x (None: zeros, a sequence's start); lengths (B,): real tokens per row (default
    T). -> y (B, T, C) in x's dtype, and the new window (B, K-1, C): the K-1 inputs up to each row's
    last real token."""
    B, T, C = x.shape
    K = weight.shape[-1]
    if window is None:
        window = x.new_zeros(B, K - 1, C)
    xs = torch.cat([window.to(x.dtype), x], 1)  # (B, K-1+T, C)
    # decode: one output a channel, a K-term dot product (F.conv1d's setup costs ~20x that on a CPU)
    if T == 1:
        y = F.silu((xs * weight.t().to(x.dtype)).sum(1, keepdim=True))
    else:
        y = F.silu(F.conv1d(xs.transpose(1, 2), weight[:, None].to(x.dtype), groups=C)).transpose(1, 2)
    if lengths is None:
        return y, xs[:, T:]
    idx = lengths[:, None] + torch.arange(K - 1, device=x.device)  # (B, K-1): a row's last K-1 inputs
    return y, xs.gather(1, idx[..., None].expand(-1, -1, C))


def gated_delta_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
                        chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The gated delta rule over a sequence, C = chunk_size tokens at a time.
    q, k (B, T, H, Dk) normalised (q scaled), v (B, T, H, Dv), g (B, T, H) log decay (<= 0), beta
    (B, T, H), state (B, H, Dk, Dv) or None (zeros) -> o (B, T, H, Dv) fp32, final state fp32.

    In a chunk starting from state S, with G_i = g_1 + .. + g_i (the decay from the chunk's start
    through token i) and D_ij = exp(G_i - G_j) for j <= i (0 above the diagonal):
        delta_i + beta_i sum_{j<i} D_ij (k_i.k_j) delta_j = beta_i (v_i - e^{G_i} S^T k_i)
    i.e. (I + A) delta = U - W S, solved once per chunk for both right-hand sides; then
        o_i = e^{G_i} S^T q_i + sum_{j<=i} D_ij (q_i.k_j) delta_j,
        S' = e^{G_C} S + sum_j e^{G_C - G_j} k_j delta_j^T."""
    B, T, H, Dk = k.shape
    Dv, C = v.shape[-1], min(chunk_size, max(T, 1))  # a shorter sequence is one chunk of its own length
    pad = -T % C  # padded tokens: beta 0, g 0, so they write nothing and decay nothing

    def chunks(x: Tensor) -> Tensor:  # (B, T, H, ...) -> (B, H, N, C, ...) fp32
        x = fp32(x).transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(B, H, -1, C, *x.shape[3:])

    S = fp32(q.new_zeros(B, H, Dk, Dv)) if state is None else fp32(state)
    if T == 0:
        return fp32(v.new_zeros(B, 0, H, Dv)), S
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    G = g.cumsum(-1)  # (B, H, N, C)
    # log D_ij = g_{j+1} + .. + g_i summed term by term (a cumsum down each column), not as G_i - G_j:
    # at strong decay G reaches -100s within a chunk, and that difference loses ~|G| 2^-24 of D in fp32
    # (1e-5 of a logit in the tests' tiny model, against 1e-7 this way)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    logD = g[..., :, None].masked_fill(~causal.tril(-1), 0).cumsum(-2)  # (B, H, N, C, C)
    D = logD.masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * D).tril(-1)  # strictly lower: the earlier deltas token i's corrects
    I_A = A + torch.eye(C, device=q.device)
    U = torch.linalg.solve_triangular(I_A, v * beta[..., None], upper=False,
                                      unitriangular=True)  # (.., C, Dv)
    W = torch.linalg.solve_triangular(I_A, kb * G.exp()[..., None], upper=False,
                                      unitriangular=True)  # (.., C, Dk)
    scores = q @ k.transpose(-1, -2) * D  # (B, H, N, C, C) within the chunk, causal
    q_read = q * G.exp()[..., None]  # reads the chunk's starting state
    k_write = k * logD[..., -1, :, None].exp()  # writes, decayed to the chunk's end: e^{G_C - G_j}
    out = []
    for n in range(q.shape[2]):  # the only sequential part: one step per chunk
        delta = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, Dv)
        out.append(q_read[:, :, n] @ S + scores[:, :, n] @ delta)
        S = S * G[:, :, n, -1, None, None].exp() + k_write[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(out, 2).reshape(B, H, -1, Dv)[:, :, :T]
    return o.transpose(1, 2), S


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of the recurrence: q, k (B, H, Dk), v (B, H, Dv), g, beta (B, H), state (B, H, Dk, Dv)
    -> o (B, H, Dv), the new state (both fp32)."""
    q, k, v, g, beta = map(fp32, (q, k, v, g, beta))
    S = fp32(state) * g.exp()[..., None, None]
    delta = beta[..., None] * (v - (k[..., None, :] @ S)[..., 0, :])  # (B, H, Dv): v minus what S predicts
    S = S + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ S)[..., 0, :], S


def gated_delta_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """gated_delta_chunked's arguments and results, one token at a time (the reference form)."""
    B, T, H, Dk = k.shape
    S = fp32(q.new_zeros(B, H, Dk, v.shape[-1])) if state is None else fp32(state)
    out = []
    for t in range(T):
        o, S = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        out.append(o)
    return torch.stack(out, 1), S


def fp32(x: Tensor) -> Tensor:  # the rule's dtype: fp32, or float64 for float64 inputs (tests, gradcheck)
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:  # x / sqrt(|x|^2 + eps), over the last dim
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- the layer

class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight initialized to ones), then times silu(z)."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        xf = fp32(x)
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return (y * F.silu(fp32(z))).type_as(x)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention token mixer. Parameter names are transformers' (linear_attn.*).

    forward(x, cache, varlen): x (B, T, H) -> (B, T, H). `varlen`: packed documents (the model's
    (cu_seqlens, max_len, bounds)), each run from a zero state. `cache`: the sampler's
    (grpo/engine/hybrid_cache.py): a packed prefill writes each document's final state into its row; rows
    that continue their history start from theirs and write it back."""
    chunk_size = 64  # the chunked form's C: tokens per chunk (any C gives the same result)

    def __init__(self, args, layer_idx: int):
        super().__init__()
        la: LinearArgs = args.linear
        self.layer_idx, self.la = layer_idx, la
        Hv, Dv, K = la.v_heads, la.v_dim, la.conv_kernel
        self.in_proj_qkv = nn.Linear(args.dim, la.conv_dim, bias=False)  # [q | k | v]
        self.in_proj_z = nn.Linear(args.dim, Hv * Dv, bias=False)  # the output gate
        self.in_proj_b = nn.Linear(args.dim, Hv, bias=False)  # beta = sigmoid(b): the write rate
        self.in_proj_a = nn.Linear(args.dim, Hv, bias=False)  # the decay's input
        # depthwise, weight (C, 1, K) as checkpoints store it; only its weight is used (causal_conv1d)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, K, groups=la.conv_dim, bias=False, padding=K - 1)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))  # g = -exp(A_log) softplus(a + dt_bias): Mamba2's decay
        self.norm = GatedRMSNorm(Dv, args.norm_eps)
        self.out_proj = nn.Linear(Hv * Dv, args.dim, bias=False)

    def forward(self, x: Tensor, cache=None, varlen=None) -> Tensor:
        if varlen is not None and not isinstance(varlen, tuple):
            raise NotImplementedError("share_prompt is not supported for Qwen3.5's hybrid models "
                                      "(a linear layer would need each completion to start from the "
                                      "prompt's state)")
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)  # (B, T, C)
        z = self.in_proj_z(x).view(B, T, self.la.v_heads, self.la.v_dim)
        beta = fp32(self.in_proj_b(x).sigmoid())  # (B, T, Hv)
        g = -fp32(self.A_log).exp() * F.softplus(fp32(self.in_proj_a(x)) + fp32(self.dt_bias))  # (B, T, Hv)
        if varlen is not None:  # packed documents, flattened: each from a zero state
            o = self._documents(qkv, g, beta, varlen[2], cache)
        elif cache is not None and cache.read is not None:  # rows continuing their history
            window, state, valid = cache.linear_read(self.layer_idx)
            if valid is not None:  # padding holds the state: no decay, no write
                g, beta = g * valid[..., None], beta * valid[..., None]
            lengths = None if valid is None else valid.sum(1)
            o, window, state = self.mix(qkv, g, beta, window, state, lengths)
            cache.linear_write(self.layer_idx, window, state)
        else:
            o, _, _ = self.mix(qkv, g, beta)
        o = self.norm(o.to(x.dtype), z)  # (B, T, Hv, Dv)
        return self.out_proj(o.reshape(B, T, -1))

    def _documents(self, qkv: Tensor, g: Tensor, beta: Tensor, bounds: list[int], cache) -> Tensor:
        """Packed documents [bounds[i], bounds[i+1]) of the flattened (B*T) tokens, one at a time
        from a zero state; with a cache (a packed prefill) each one's final state goes to its row."""
        B, T, C = qkv.shape
        flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        qkv, g, beta = flat(qkv), flat(g), flat(beta)
        outs, windows, states = [], [], []
        for s, e in zip(bounds[:-1], bounds[1:]):
            o, window, state = self.mix(qkv[:, s:e], g[:, s:e], beta[:, s:e])
            outs.append(o)
            windows.append(window)
            states.append(state)
        if cache is not None:
            slots = cache.token_slot[torch.tensor(bounds[:-1], device=qkv.device)]  # each document's row
            cache.linear_write(self.layer_idx, torch.cat(windows), torch.cat(states), slots)
        return torch.cat(outs, 1).view(B, T, *outs[0].shape[2:])

    def mix(self, qkv: Tensor, g: Tensor, beta: Tensor, window: Tensor | None = None,
            state: Tensor | None = None, lengths: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The convolution and the delta rule from (window, state) (None: a sequence's start).
        qkv (B, T, C), g, beta (B, T, Hv) -> o (B, T, Hv, Dv) fp32, the new window and state.
        One token from a state takes the recurrent step; more take the chunked form."""
        la, (B, T, _) = self.la, qkv.shape
        qkv, window = causal_conv1d(qkv, self.conv1d.weight[:, 0], window, lengths)
        q, k, v = qkv.split([la.k_heads * la.k_dim, la.k_heads * la.k_dim, la.v_heads * la.v_dim], -1)
        q, k = (l2_normalize(fp32(t).view(B, T, la.k_heads, la.k_dim)) for t in (q, k))
        q = q * la.k_dim ** -0.5
        if la.v_heads != la.k_heads:  # each q/k head serves Hv / Hk consecutive value heads
            q, k = (t.repeat_interleave(la.v_heads // la.k_heads, dim=2) for t in (q, k))
        v = fp32(v).view(B, T, la.v_heads, la.v_dim)
        with torch.autocast(qkv.device.type, enabled=False):  # the rule's matmuls in fp32 under autocast_bf16
            if T == 1 and state is not None:
                o, state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
                return o[:, None], window, state
            o, state = gated_delta_chunked(q, k, v, g, beta, state, self.chunk_size)
        return o, window, state
