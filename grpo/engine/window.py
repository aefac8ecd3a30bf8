"""The device side of a decode window: the per-slot decode state, one decode step over the occupied
slots (no host sync), the batch and key buckets a graphed window decodes, and a window's CUDA graph.
grpo/engine/runner.py runs the windows; grpo/engine/decode.py is the forward over the resident decode
weights."""
import time

import torch

from grpo.engine.decode import DecodeWeights, decode_hidden
from grpo.engine.kv_cache import KVCache
from grpo.engine.model_decode import ModelDecode
from grpo.engine.rows import SamplingParams
from grpo.engine.sampling import sample_hidden


class DecodeState:
    """Per-slot decode state on device: the next token to feed (at `pos`, not yet cached),
    tokens so far (the RNG counter), the row's max_tokens (the request's, capped by the cache),
    and whether it is decoding; the call's stop ids (V,) and the window's outputs, (slots, 1 + window):
    column 0 the token sampled outside the window since the last one (after a tool observation: the
    host reads it with this window's tokens, not on its own), columns 1.. the window's steps. It lives
    as long as the cache, so CUDA graphs that read it replay in every call."""
    def __init__(self, slots: int, window: int, vocab: int, device):
        z = lambda dtype=torch.int64: torch.zeros(slots, dtype=dtype, device=device)
        self.tok, self.pos, self.ntok, self.max_tokens, self.key = z(), z(), z(), z(), z()
        self.active = z(torch.bool)
        self.is_stop = torch.zeros(vocab, dtype=torch.bool, device=device)  # stop and tool-stop ids
        self.out_tok = torch.zeros(slots, 1 + window, dtype=torch.int64, device=device)  # (slots, 1 + window)
        self.out_lp = torch.zeros(slots, 1 + window, device=device)
        # the kept sets' thresholds (grpo/engine/sampling.py)
        self.out_thr = torch.zeros(slots, 1 + window, device=device)
        self.out_ok = torch.zeros(slots, 1 + window, dtype=torch.bool, device=device)


def decode_step(weights: DecodeWeights, cache: KVCache, state: DecodeState, params: SamplingParams,
                num_slots: int, cache_len: int, column: int):
    """One token for slots [0, num_slots): feed each row's last token (attending to cache
    positions [0, cache_len); a row not decoding, to its first key only), sample the next, record
    it in window column `column` (the outputs' column 1 + column), and retire rows that hit a stop
    id or their max_tokens. No host sync."""
    st, p, rows, out = state, params, slice(0, num_slots), 1 + column
    active, pos = st.active[rows], st.pos[rows]
    if isinstance(weights, ModelDecode):  # a hybrid model: its own forward; inactive rows hold their state
        y = weights.hidden(cache, st.tok[rows], pos, num_slots, cache_len, active)  # (num_slots, H)
    else:
        y = decode_hidden(weights, cache, st.tok[rows], pos, num_slots, cache_len,
                          active=active)  # (num_slots, H)
    head, y = weights.logits_head(y)
    tok, lp, thr = sample_hidden(y, head, st.key[rows], st.ntok[rows], p.temperature, p.top_k, p.top_p,
                                 p.min_p, packed=weights.head, kept_set=p.kept_set, return_threshold=True)
    st.out_tok[rows, out], st.out_lp[rows, out], st.out_ok[rows, out] = tok, lp, active
    st.out_thr[rows, out] = thr
    st.tok[rows] = torch.where(active, tok, st.tok[rows])
    st.pos[rows] += active
    st.ntok[rows] += active
    st.active[rows] = active & ~st.is_stop[tok] & (st.ntok[rows] < st.max_tokens[rows])


def bucket(n: int, slots: int) -> int:
    """The batch a graphed window decodes for n occupied slots: the next power of two, capped at
    `slots` (log2(slots) + 1 graphs per cache bucket, each at most twice the live rows' work)."""
    return min(slots, 1 << max(n - 1, 0).bit_length())


def cache_bucket(n: int, max_seq_len: int) -> int:
    """The keys a graphed window reads when its longest row needs n: the next power of two from
    256, capped at the cache's length. Each is a graph per batch bucket; a 256-token step gave a
    ReTool row of 8.7k tokens 34 of them (x 7 batch buckets: ~240 captures), powers of two give 7.
    The attention kernels read each row's own length, so the bucket only sets how the keys are
    split across programs (at most half of its splits past the longest row) and, without a kernel
    (SDPA over the span), at most twice the attention's work."""
    return min(max_seq_len, 1 << max(n - 1, 255).bit_length())


def capture(step, warm_state: list, pool):
    """The CUDA graph of `step()` (one decode window), with `pool` its memory pool (the windows' graphs
    replay in turn, so they share one). Warm-up runs on a side stream first, on the real state, which is
    then restored from `warm_state` ([(tensor, saved copy)]): capture itself runs nothing.
    -> (graph, seconds it took)."""
    t0 = time.time()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    for t, saved in warm_state:
        t.copy_(saved)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        step()
    torch.cuda.synchronize()
    return g, time.time() - t0
