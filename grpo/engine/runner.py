"""The sampler's device side (the Runner): the model, the weights decode reads (grpo/engine/decode.py's
DecodeWeights, or a hybrid model's ModelDecode), the KV or hybrid cache, the per-slot decode state, the
windows' host buffers and CUDA graphs; and what runs on them: a packed prefill of fresh prompts, a tool
observation's forward, forks and moves of a row's cache, a token sampled from logits, and decode windows.

It decides nothing about rows: grpo/engine/scheduler.py says which slots, tokens and positions, in host
lists, and reads a window's tokens back (`read`: the one host sync of a window). A tool turn reads nothing
back: the observation's positions and real tokens come from the host's lists, and the token after it is
sampled on device into the decode state (`lead`), handed to the host with the next window's tokens."""
import torch
from torch import Tensor

from grpo.engine.cpu import trim
from grpo.engine.decode import DecodeWeights, extend
from grpo.engine.hybrid_cache import HybridCache
from grpo.engine.kv_cache import KVCache, to_device
from grpo.engine.model_decode import ModelDecode
from grpo.engine.rows import SamplingParams
from grpo.engine.sampling import sample
from grpo.engine.window import DecodeState, bucket, cache_bucket, capture, decode_step


class Runner:
    """Device state that stays for the sampler's life (evals included): the cache, the decode state, the
    decode weights and the graphs, until `release()`. Counters since construction, for costs and benches:
    tokens_prefilled, capture_seconds, decode_steps, rows_decoded (rows x steps computed) and rows_live (of
    those, the ones that drew a token)."""
    def __init__(self, model, gen_batch: int, max_seq_len: int | None, kv_budget_bytes: int | None,
                 prefill_tokens: int | None, window: int | None, cuda_graphs: bool, buckets: bool | None):
        p = next(model.parameters())
        self.model, self.dtype, self.device = model, p.dtype, p.device
        self.gen_batch, self.fixed_len = gen_batch, max_seq_len
        # tokens per packed prefill forward: bounds the (T, T) document mask and attention scores
        self.prefill_tokens = prefill_tokens or (8192 if p.is_cuda else 2048)
        self.max_positions = model.config.get("max_position_embeddings", 1 << 20)
        if kv_budget_bytes is None:  # CUDA: half of what is free; CPU: 2 GiB (pages are touched only as used)
            kv_budget_bytes = torch.cuda.mem_get_info(p.device)[0] // 2 if p.is_cuda else 2 << 30
        self.kv_budget_bytes, self.window = kv_budget_bytes, window or (8 if p.is_cuda else 1)
        # a hybrid model (Qwen3.5: Gated DeltaNet layers) keeps a linear state per row beside the KV cache,
        # and decodes eagerly through its own forward (grpo/engine/model_decode.py), not DecodeWeights
        hybrid = model.args.hybrid
        self.cache_type, self.decode_type = (HybridCache, ModelDecode) if hybrid else (KVCache, DecodeWeights)
        self.use_graphs = cuda_graphs and p.is_cuda and not hybrid
        self.buckets = self.use_graphs if buckets is None else buckets
        # a tool's observation: through the decode weights on a CPU (oneDNN's packed GEMMs where decode
        # packs them), through the model's forward elsewhere
        self.extend = p.device.type == "cpu" and not hybrid
        self.tokens_prefilled = 0  # tokens through prefill forwards since construction (costs, benches)
        self.capture_seconds = 0.0  # CUDA graph capture (warm-up included) since construction
        # decode work since construction: steps, and rows x steps decoded (a graphed window decodes
        # its bucket) against the rows x steps that drew a token (rows decoding, not in a tool call)
        self.decode_steps = self.rows_decoded = self.rows_live = 0
        self.launched = 0  # windows launched: their host buffers alternate
        self.weights = self.decode_type(model)  # refreshed at the start of every call
        # (batch bucket, cache bucket, sampling) -> one window's graph
        self.graphs, self.graph_pool = {}, None
        self.cache = self.state = self.host_out = None
        if max_seq_len:
            self.allocate(max_seq_len)

    # ------------------------------------------------------------------------- memory

    def fits(self) -> int:
        """The longest row the budget holds."""
        return self.kv_budget_bytes // self.cache_type.slot_bytes(self.model.args, 1, self.dtype)

    def allocate(self, max_seq_len: int, rows: int | None = None):
        """A cache of rows of max_seq_len: gen_batch slots (within the budget), or with eager decode
        (no graphs to keep) only the `rows` this call has, so that a 48-row call holds 48 rows."""
        wanted = self.gen_batch if self.use_graphs or rows is None else rows  # rows: at most gen_batch
        row_bytes = self.cache_type.slot_bytes(self.model.args, max_seq_len, self.dtype)
        slots = min(wanted, self.kv_budget_bytes // row_bytes)
        if slots < 1:
            raise ValueError(f"kv_budget_bytes={self.kv_budget_bytes} holds no row of {max_seq_len} tokens")
        self.release(weights=False)  # the graphs read the old cache and state
        self.cache = self.cache_type(self.model.args, slots, max_seq_len, self.dtype, self.device)
        st = self.state = DecodeState(slots, self.window, self.model.args.vocab_size, self.device)
        pin = self.device.type == "cuda"  # page-locked: the copies back overlap the next window
        self.host_out = [[torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                          for t in (st.out_tok, st.out_lp, st.out_ok, st.out_thr)] for _ in range(2)]

    def release(self, weights: bool = True):
        """Free the KV cache, the graphs that read it and the resident decode weights (a second copy
        of the model, where decode keeps one: the trainer's update wants the memory, where it is
        short); the next call allocates a cache sized to itself and copies the weights in again."""
        self.cache, self.state, self.graphs, self.graph_pool = None, None, {}, None
        if weights:
            self.weights = None
        if self.device.type == "cpu":
            trim()  # the freed cache back to the OS, not kept by the allocator

    def prepare(self, need: int, rows: int, stops: set[int]):
        """Before a call: a cache for `rows` rows of `need` positions (sized to this call; grown only if a
        later one needs more), the weights as they are now, and the call's stop ids armed on device."""
        fits = self.fits()
        need = min(self.max_positions, fits, need)
        if self.cache is None or (self.fixed_len is None and self.cache.max_seq_len < need) or (
                not self.use_graphs and self.cache.slots < rows):
            self.allocate(self.fixed_len or min(-(-need // 64) * 64, fits), rows)
        # released, or autocast_bf16 switched
        if self.weights is None or not self.weights.matches(self.model):
            self.weights, self.graphs, self.graph_pool = self.decode_type(self.model), {}, None
        self.weights.refresh(self.model)  # this call samples from the weights as they are now
        V = self.model.args.vocab_size
        self.state.active.zero_()
        self.state.out_ok[:, 0] = False  # no token waits to be read from an earlier call
        self.state.is_stop.zero_()  # decode_step retires a row at either kind of stop id
        self.state.is_stop[to_device([t for t in stops if 0 <= t < V], self.device, torch.int64)] = True

    # ------------------------------------------------------------------------- outside the decode loop

    def prefill(self, prompts: list[list[int]], slots: list[int], last: list[int]) -> Tensor:
        """One packed forward over `prompts` (positions restart at 0 per prompt, so the model's document
        mask keeps them apart), prompt i's KV into slot slots[i] -> the logits (K, V) at the packed row's
        positions `last`."""
        dev = self.device
        ids = to_device([t for x in prompts for t in x], dev)[None]  # (1, T) packed
        pos = torch.cat([torch.arange(len(x), device=dev) for x in prompts])
        slot = torch.cat([torch.full((len(x),), s, device=dev) for x, s in zip(prompts, slots)])
        self.cache.packed(slot, pos)
        out = to_device(last, dev)[None]  # (1, K)
        logits = self.model(ids, pos[None], cache=self.cache, output_index=out)[0]  # (K, V)
        self.tokens_prefilled += ids.shape[1]
        return logits

    def observe(self, rows: list[tuple[int, list[int], int]]) -> Tensor:
        """Rows (slot, tokens, start) continuing their history with tokens from position start (a tool's
        observation after the call's own stop token): one padded forward over them -> the logits (B, V)
        at each row's last token. No host sync: the real tokens' places come from the host's lists."""
        dev, T = self.device, max(len(x) for _, x, _ in rows)
        ids = to_device([x + [0] * (T - len(x)) for _, x, _ in rows], dev)  # (B, T) padded
        valid = to_device([[t < len(x) for t in range(T)] for _, x, _ in rows], dev)
        start = to_device([p for _, _, p in rows], dev)
        slots = to_device([s for s, _, _ in rows], dev)
        b, t = to_device([[b for b, (_, x, _) in enumerate(rows) for _ in x],
                          [t for _, x, _ in rows for t in range(len(x))]], dev)  # (N,) each: the real tokens
        positions = start[:, None] + torch.arange(T, device=dev)
        if self.extend:  # keys up to the last real position
            return extend(self.weights, self.cache, ids, positions, valid, slots, b * T + t,
                          max(p + len(x) for _, x, p in rows))  # (B, V)
        self.cache.rows(slots, start, T, max(p for _, _, p in rows) + T, valid, (b, t))
        last = to_device([[len(x) - 1] for _, x, _ in rows], dev)  # (B, 1)
        return self.model(ids, positions, cache=self.cache, output_index=last)[:, 0]  # (B, V)

    def fork(self, src: int, dst: list[int], length: int):
        self.cache.fork(src, dst, length)

    def sample(self, params: SamplingParams, logits: Tensor, keys: list[int], steps: list[int]) -> tuple:
        """One token per row of (B, V) logits by the call's rule -> host lists of tokens, log-probs and
        kept-set thresholds (a host sync)."""
        p, dev = params, self.device
        tok, lp, thr = sample(logits, to_device(keys, dev), to_device(steps, dev), p.temperature, p.top_k,
                              p.top_p, p.min_p, p.kept_set, True)
        return tok.tolist(), lp.tolist(), thr.tolist()  # host sync

    def lead(self, params: SamplingParams, logits: Tensor, slots: list[int], rows: list[list[int]]):
        """Each row's next token from (B, V) logits, sampled and armed on device with no host sync: rows
        (position of the new token, tokens so far with it, max_tokens, key). The token goes to the decode
        state (fed next, decoding unless a stop id or the row's max_tokens) and to its outputs' column 0,
        which the next window hands to the host with its own tokens (a stop string found there in it
        then retires the row)."""
        p, st, idx = params, self.state, to_device(slots, self.device)
        pos, ntok, limit, key = to_device(rows, self.device).T.contiguous()
        tok, lp, thr = sample(logits, key, ntok - 1, p.temperature, p.top_k, p.top_p, p.min_p, p.kept_set,
                              True)
        st.tok[idx], st.pos[idx], st.ntok[idx], st.max_tokens[idx], st.key[idx] = tok, pos, ntok, limit, key
        st.active[idx] = ~st.is_stop[tok] & (ntok < limit)
        st.out_tok[idx, 0], st.out_lp[idx, 0], st.out_thr[idx, 0] = tok, lp, thr
        st.out_ok[idx, 0] = True

    def arm(self, slots: list[int], rows: list[list[int]], go: list[bool]):
        """Each slot's decode state: (token to feed, its position, tokens so far, max_tokens, key) per row,
        and whether it decodes."""
        st, idx = self.state, to_device(slots, self.device)
        new = to_device(rows, self.device)
        st.tok[idx], st.pos[idx], st.ntok[idx], st.max_tokens[idx], st.key[idx] = new.T
        st.active[idx] = to_device(go, self.device, torch.bool)

    def move(self, src: int, dst: int, known: int):
        """A row from slot src into slot dst: its first `known` cached positions (a fork) and its state."""
        st = self.state
        self.cache.fork(src, [dst], min(self.cache.max_seq_len, known))
        for t in (st.tok, st.pos, st.ntok, st.max_tokens, st.key, st.active):
            t[dst] = t[src]
        for t in (st.out_tok, st.out_lp, st.out_thr, st.out_ok):  # a token the host has not read yet
            t[dst, 0] = t[src, 0]
        st.active[src] = st.out_ok[src, 0] = False

    def retire(self, slots: list[int]):
        """Those rows stop decoding (stop strings are found on the host)."""
        self.state.active[to_device(slots, self.device)] = False

    # ------------------------------------------------------------------------- decode windows

    def launch(self, params: SamplingParams, live: int, longest: int, ahead: bool) -> tuple:
        """A window of decode steps over the live rows, slots [0, live) (a graphed one: the smallest
        power-of-two bucket that holds them; free and tool-waiting slots in it compute too, `active`
        keeps them from moving), its outputs copied to host memory (asynchronous on CUDA). `longest`:
        the longest row's positions; `ahead`: a window is still in flight, so the rows may be a window
        further on than the host knows. -> the window (host buffers, slots decoded, done event)."""
        st, W = self.state, self.window
        num_slots = bucket(live, self.cache.slots) if self.buckets else live
        self.decode_steps += W
        self.rows_decoded += W * num_slots  # rows_live: counted from the window's tokens (read)
        cache_len = min(self.cache.max_seq_len, longest + W * (1 + ahead))  # the keys a window reads
        if self.use_graphs:
            cache_len = cache_bucket(cache_len, self.cache.max_seq_len)  # buckets, one graph each
            self._graph(params, num_slots, cache_len).replay()
        else:
            for column in range(W):
                decode_step(self.weights, self.cache, st, params, num_slots, cache_len, column)
        out = self.host_out[self.launched % 2]
        self.launched += 1
        for host, dev in zip(out, (st.out_tok, st.out_lp, st.out_ok, st.out_thr)):
            host[:num_slots].copy_(dev[:num_slots], non_blocking=True)
        st.out_ok[:, 0] = False  # the tokens sampled before this window go to the host with it
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()
        return out, num_slots, done

    def read(self, window: tuple) -> tuple[list, list, list, list]:
        """A launched window's tokens, log-probs, whether each was drawn, thresholds: (slots, 1 + W) host
        lists, column 0 the tokens sampled on device before it (Runner.lead)."""
        out, num_slots, done = window
        if done is not None:
            done.synchronize()  # host sync: once per window
        toks, lps, oks, thrs = (t[:num_slots].tolist() for t in out)
        self.rows_live += sum(sum(ok[1:]) for ok in oks)
        return toks, lps, oks, thrs

    def _graph(self, params: SamplingParams, num_slots: int, cache_len: int):
        """The CUDA graph of one decode window over slots [0, num_slots) and keys [0, cache_len),
        captured on first use and kept (with the cache, the state and the decode weights it
        reads, all at fixed addresses) for every later call. Warm-up runs on a copy of the
        state, which is then restored (capture runs nothing)."""
        p, st = params, self.state
        key = (num_slots, cache_len, p.temperature, p.top_k, p.top_p, p.min_p, p.kept_set)
        if key not in self.graphs:
            # the graphs replay in turn, so they share one memory pool; it lives and dies with them
            # (release(), a new cache): capturing into a pool whose graphs were freed trips an assert
            # in the caching allocator (seen on an H200, torch 2.11)
            self.graph_pool = self.graph_pool or torch.cuda.graph_pool_handle()
            step = lambda: [  # noqa: E731
                decode_step(self.weights, self.cache, st, p, num_slots, cache_len, column)
                for column in range(self.window)]
            saved = [(t, t.clone()) for t in (st.tok, st.pos, st.ntok, st.active)]  # warm-up moves them
            self.graphs[key], seconds = capture(step, saved, self.graph_pool)
            self.capture_seconds += seconds
        return self.graphs[key]
