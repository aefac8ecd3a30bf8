"""The rollout engine: a batched KV-cache sampler over the model's own blocks.

    Sampler(model, tokenizer).generate(prompts, SamplingParams(n=8, max_tokens=500), tool)
    Sampler(model).continue_from(sequences, cuts, params)  # n continuations of each sequences[i][:c]

One loop over four moves, each a short function (1 and 2 in grpo/engine/prefill.py):
  1. admit   waiting requests take free cache slots: fresh prompts are prefilled packed in
             one row (no padding), once per prompt, then forked into the slots of its n samples.
             `continue_from` makes one document of a sequence's prefixes: the sequence is
             prefilled once, up to its longest cut, and each cut's rows fork that KV truncated
             at the cut (a causal prefix's keys and values do not depend on what follows);
  2. resume  rows whose tool call returned get the observation appended to their cache;
  3. decode  a window of steps over the occupied slots on device (grpo/engine/window.py's `decode_step`
             over the resident decode weights of grpo/engine/decode.py; stop and length checks on device
             too), then one host sync to read the tokens back;
  4. finish  stops, stop strings (grpo/engine/stops.py), tool calls (run in a thread pool, so the other rows keep
             decoding) and length; a finished row frees its slot for the next request
             (continuous batching).
Randomness is per request (grpo/engine/sampling.py), so results do not depend on the batch.
Live rows are kept in the lowest slots (`_compact`). On CUDA a decode window is one CUDA graph
over the smallest power-of-two batch bucket that holds them and a power-of-two span of keys
(cache_bucket); the graphs, the cache, the decode state and the decode weights stay for the
sampler's life (evals included, where keep_kv_cache), so each graph is captured once per run and
replayed by every later call (flash-attn's KV-cache kernel is used when importable). On CPU
the window is a single eager step over exactly the occupied slots.
Multi-turn tool calls (resume) and prefix continuations (continue_from) share the
admit/decode/finish loop with plain sampling; the sampling rule is its own file, and so is what a
call holds (grpo/engine/rows.py: SamplingParams, Completion, its rows).
"""
import concurrent.futures as cf

import torch
from torch import Tensor

from grpo.engine.cpu import trim
from grpo.engine.decode import DecodeWeights
from grpo.engine.hybrid_cache import HybridCache
from grpo.engine.kv_cache import KVCache, to_device
from grpo.engine.model_decode import ModelDecode
from grpo.engine.prefill import admit, resume
from grpo.engine.progress import Progress
from grpo.engine.rows import Call, Completion, Row, SamplingParams, public, turn_limit
from grpo.engine.sampling import request_key, sample
from grpo.engine.stops import find_stop_string, string_ends
from grpo.engine.window import DecodeState, bucket, cache_bucket, capture, decode_step

__all__ = ["Sampler", "SamplingParams", "Completion", "decode_step", "bucket", "cache_bucket"]  # the public names


class Sampler:
    """`max_seq_len`: a fixed cache of rows of that length, allocated now (a longer prompt is
    refused); without it, the first call sizes the cache, and a later one grows it within
    `kv_budget_bytes` when needed (with graphs gen_batch slots; eager, the call's own rows). The
    cache, the decode state, the decode weights and the CUDA graphs stay for the next call;
    `release()` frees them until then.
    `buckets`: decode the occupied slots rounded up to a power of two (the graphs' batch sizes;
    default: with graphs), instead of exactly the occupied ones. `pipeline` (default: with graphs):
    launch the next decode window before taking the last one's tokens, so the device does not wait
    while Python accepts them (on a CPU it only reorders the same work: the tests run it there).
    Counters since construction, for costs and benches: tokens_prefilled, capture_seconds,
    decode_steps, rows_decoded (rows x steps computed) and rows_live (of those, the ones that drew a token).
    free_slots, sample_into and finish are the loop's own, public for grpo/engine/prefill.py's moves."""
    def __init__(self, model, tokenizer=None, gen_batch: int = 64, max_seq_len: int | None = None,
                 kv_budget_bytes: int | None = None, prefill_tokens: int | None = None,
                 sync_every: int | None = None, cuda_graphs: bool = True, tool_workers: int = 8,
                 buckets: bool | None = None, pipeline: bool | None = None):
        p = next(model.parameters())
        self.model, self.tokenizer, self.dtype, self.device = model, tokenizer, p.dtype, p.device
        self.gen_batch, self.fixed_len = gen_batch, max_seq_len
        # tokens per packed prefill forward: bounds the (T, T) document mask and attention scores
        self.prefill_tokens = prefill_tokens or (8192 if p.is_cuda else 2048)
        self.max_positions = model.config.get("max_position_embeddings", 1 << 20)
        if kv_budget_bytes is None:  # CUDA: half of what is free; CPU: 2 GiB (pages are touched only as used)
            kv_budget_bytes = torch.cuda.mem_get_info(p.device)[0] // 2 if p.is_cuda else 2 << 30
        self.kv_budget_bytes, self.window = kv_budget_bytes, sync_every or (8 if p.is_cuda else 1)
        # a hybrid model (Qwen3.5: Gated DeltaNet layers) keeps a linear state per row beside the KV cache,
        # and decodes eagerly through its own forward (grpo/engine/model_decode.py), not DecodeWeights
        hybrid = model.args.hybrid
        self.cache_type, self.decode_type = (HybridCache, ModelDecode) if hybrid else (KVCache, DecodeWeights)
        self.use_graphs = cuda_graphs and p.is_cuda and not hybrid
        self.buckets = self.use_graphs if buckets is None else buckets
        self.pipeline = self.use_graphs if pipeline is None else pipeline
        self.pool = cf.ThreadPoolExecutor(tool_workers)
        self.tokens_prefilled = 0  # tokens through prefill forwards since construction (costs, benches)
        self.capture_seconds = 0.0  # CUDA graph capture (warm-up included) since construction
        # decode work since construction: steps, and rows x steps decoded (a graphed window decodes
        # its bucket) against the rows x steps that drew a token (rows decoding, not in a tool call)
        self.decode_steps = self.rows_decoded = self.rows_live = 0
        self.weights = self.decode_type(model)  # refreshed at the start of every call
        self.graphs, self.graph_pool = {}, None  # (batch bucket, cache bucket, sampling) -> one window's graph
        self._string_end = {}  # stop strings -> (V,) bool: tokens that can complete one of them
        self.cache = None
        if max_seq_len:
            self._allocate(max_seq_len)

    def _allocate(self, max_seq_len: int, rows: int | None = None):
        """A cache of rows of max_seq_len: gen_batch slots (within the budget), or with eager decode
        (no graphs to keep) only the `rows` this call has, so that a 48-row call holds 48 rows."""
        wanted = self.gen_batch if self.use_graphs or rows is None else rows  # rows: at most gen_batch
        slots = min(wanted, self.kv_budget_bytes // self.cache_type.slot_bytes(self.model.args, max_seq_len, self.dtype))
        if slots < 1:
            raise ValueError(f"kv_budget_bytes={self.kv_budget_bytes} holds no row of {max_seq_len} tokens")
        self.release(weights=False)  # the graphs read the old cache and state
        self.cache = self.cache_type(self.model.args, slots, max_seq_len, self.dtype, self.device)
        self.state = DecodeState(slots, self.window, self.model.args.vocab_size, self.device)
        pin = self.device.type == "cuda"  # page-locked: the copies back overlap the next window
        self.host_out = [[torch.empty(slots, self.window, dtype=t.dtype, pin_memory=pin)
                          for t in (self.state.out_tok, self.state.out_lp, self.state.out_ok, self.state.out_thr)]
                         for _ in range(2)]

    def release(self, weights: bool = True):
        """Free the KV cache, the graphs that read it and the resident decode weights (a second copy
        of the model, where decode keeps one: the trainer's update wants the memory, where it is
        short); the next call allocates a cache sized to itself and copies the weights in again."""
        self.cache, self.state, self.graphs, self.graph_pool = None, None, {}, None
        if weights:
            self.weights = None
        if self.device.type == "cpu":
            trim()  # the freed cache back to the OS, not kept by the allocator

    # ------------------------------------------------------------------------- the loop

    @torch.no_grad()  # not inference_mode: under it autocast does not cache its weight casts (see _run)
    def generate(self, prompts: list[list[int]], params: SamplingParams, tool=None,
                 prompt_ids: list[int] | None = None, progress: bool = False) -> list[Completion]:
        """n completions per prompt, in prompt order (prompt i's samples at i*n .. i*n+n-1).
        `tool(index, completion_ids) -> observation ids | None` is called from a worker thread
        when a row stops on a tool-call stop. `prompt_ids`: global prompt indices for seeding."""
        return self._run(self._start(prompts, params, tool, prompt_ids, progress))

    @torch.no_grad()
    def continue_from(self, sequences: list[list[int]], cuts: list[list[int]], params: SamplingParams,
                      prompt_ids: list[int] | None = None, progress: bool = False) -> list[Completion]:
        """n continuations of every prefix sequences[i][:c], c in cuts[i], in that order (prefix j's
        samples at j*n .. j*n+n-1): what generate() gives for the prefixes as prompts, with the same
        seeds (`prompt_ids`: one per prefix), but each sequence is prefilled once, not once per cut,
        and its cuts' rows fork its KV (a tool is not supported here). Rows of a longer cut are
        admitted first; a later cut forks a live row of its sequence, and only when none is left
        (fewer slots than the sequence's rows) is the sequence prefilled again, up to that cut."""
        prompts, docs = [], []
        for i, (x, cs) in enumerate(zip(sequences, cuts, strict=True)):
            for c in cs:
                if not 0 < c <= len(x):
                    raise ValueError(f"sequence {i}: cut {c} outside [1, {len(x)}]")
                prompts.append(list(x[:c]))
                # a hybrid model's linear state cannot be cut back to a shorter prefix: one document a cut
                docs.append(len(docs) if self.model.args.hybrid else i)
        return self._run(self._start(prompts, params, None, prompt_ids, progress, docs))

    def _run(self, call: Call) -> list[Completion]:
        # A disabled autocast around the loop keeps torch's autocast cache alive between forwards:
        # under the model's autocast_bf16 each weight is cast to bf16 once per call, not once per
        # decode step (CPU, SmolLM2-135M, 48 rows: ~110 -> ~93 ms a step). The weights do not change
        # during a call; the cache is dropped at its end, also when a caller's autocast encloses it.
        try:
            with torch.autocast(self.device.type, enabled=False):
                while call.waiting or call.live or call.pending or call.in_flight:
                    admit(self, call)  # grpo/engine/prefill.py: 1. new rows into free slots
                    resume(self, call)  # 2. rows back from a tool call
                    if any(not s.in_tool for s in call.live.values()):
                        self._decode(call)
                        call.bar.tokens(lambda: sum(len(s.token_ids) for s in call.live.values())
                                        + sum(len(c.token_ids) for c in call.out if c is not None))
                    elif call.in_flight:  # nothing left to launch: take the last window's tokens
                        self._take(call, *call.in_flight)
                        call.in_flight = None
                    elif call.pending and not (call.waiting and self.free_slots(call)):
                        cf.wait(list(call.pending), return_when=cf.FIRST_COMPLETED)
        finally:
            torch.clear_autocast_cache()
        call.bar.close()
        return [c if type(c) is Completion else public(c) for c in call.out]

    def _start(self, prompts: list[list[int]], p: SamplingParams, tool, prompt_ids: list[int] | None,
               progress: bool, docs: list[int] | None = None) -> Call:
        """Check the request, size the cache for it, and queue its prompts x n rows, each with
        its random stream's key (a bad prompt's rows are finished with an error here). `docs`:
        each prompt's document (default: its own); a document's rows queue longest prompt first."""
        if (p.stop_strings or p.tool_stop_strings) and self.tokenizer is None:
            raise ValueError("stop strings need the Sampler's tokenizer: Sampler(model, tokenizer=...)")
        prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        if len(prompt_ids) != len(prompts):
            raise ValueError(f"{len(prompt_ids)=} != {len(prompts)=}")
        seed = p.seed if p.seed is not None else int(torch.randint(2**31, ()))
        fits = self.kv_budget_bytes // self.cache_type.slot_bytes(self.model.args, 1, self.dtype)  # the longest row it holds
        need = min(self.max_positions, fits, max((len(x) for x in prompts), default=0) + p.max_tokens)
        rows = max(1, min(self.gen_batch, len(prompts) * p.n))  # a rank's share may be empty: one slot
        if self.cache is None or (self.fixed_len is None and self.cache.max_seq_len < need) or (
                not self.use_graphs and self.cache.slots < rows):
            # sized to this call; grown only if a later one needs more
            self._allocate(self.fixed_len or min(-(-need // 64) * 64, fits), rows)
        if self.weights is None or not self.weights.matches(self.model):  # released, or autocast_bf16 switched
            self.weights, self.graphs, self.graph_pool = self.decode_type(self.model), {}, None
        self.weights.refresh(self.model)  # this call samples from the weights as they are now
        S, V, n = self.cache.max_seq_len, self.model.args.vocab_size, p.n
        stops = set(self.model.eos_token_ids() if p.stop_token_ids is None else p.stop_token_ids)
        strings = p.stop_strings + p.tool_stop_strings  # c chars span at most c tokens (+ partial bytes)
        tail = 2 * max(map(len, strings)) + 4 if strings else 0
        out = [None] * (len(prompts) * n)
        docs = list(range(len(prompts))) if docs is None else docs
        members = {}
        for i, (d, x) in enumerate(zip(docs, prompts)):
            members.setdefault(d, []).append((i, len(x)))
        call = Call(p, tool, out, stops, set(p.tool_stop_token_ids), tail,
                     self._string_ends(strings) if strings else None, [n] * len(prompts), members)
        # longest prompt first within a document: while such a row lives, its cache holds the
        # prefixes of all the document's later (shorter) prompts, which then fork it with no prefill
        for i in sorted(range(len(prompts)), key=lambda i: (docs[i], -len(prompts[i]), i)):
            prompt = prompts[i]
            bad = self._check(prompt, V, S)
            for j in range(n):
                if bad:
                    out[i * n + j] = Completion(i, j, finish_reason="error", num_turns=0,
                                                error=f"prompt {i}: {bad}")
                else:
                    key, max_tokens = request_key(seed, prompt_ids[i], j), min(p.max_tokens, S - len(prompt))
                    call.waiting.append(Row(i * n + j, i, j, list(prompt), key, max_tokens, docs[i]))
        call.bar = Progress(sum(c is None for c in out), progress)
        self.state.active.zero_()
        self.state.is_stop.zero_()  # decode_step retires a row at either kind of stop id
        self.state.is_stop[to_device([t for t in stops | call.tool_stops if 0 <= t < V], self.device, torch.int64)] = True
        return call

    def _string_ends(self, strings: list[str]) -> list[bool]:
        """grpo.engine.stops.string_ends, once per set of strings."""
        key = tuple(sorted(set(strings)))
        if key not in self._string_end:
            self._string_end[key] = string_ends(self.tokenizer, self.model.args.vocab_size, list(key))
        return self._string_end[key]

    def _check(self, prompt: list[int], V: int, S: int) -> str | None:
        if len(prompt) == 0:
            return "empty prompt"
        if any(not (isinstance(t, int) and 0 <= t < V) for t in prompt):
            return f"token ids outside the vocabulary [0, {V})"
        if len(prompt) >= S:
            return f"{len(prompt)} tokens leave no room in max_seq_len={S}"
        return None

    def free_slots(self, call: Call) -> list[int]:
        return sorted(set(range(self.cache.slots)) - set(call.live))

    def sample_into(self, call: Call, seqs: list[Row], logits: Tensor):
        """Sample one token per row from (B, V) logits outside the decode loop (first tokens,
        after observations), then arm the rows that go on in the device state."""
        st, p = self.state, call.params
        keys = to_device([s.key for s in seqs], self.device)
        steps = to_device([len(s.token_ids) for s in seqs], self.device)
        tok, lp, thr = sample(logits, keys, steps, p.temperature, p.top_k, p.top_p, p.min_p, p.kept_set, True)
        tok, lp, thr = tok.tolist(), lp.tolist(), thr.tolist()  # host sync
        go = [not self._accept(call, s, [t], [l], [h]) for s, t, l, h in zip(seqs, tok, lp, thr)]
        # every row's state, not only those that go on: a decode step computes inactive slots too and
        # writes their k, v at their `pos`. A row whose first token was a tool call kept the slot's stale
        # pos, and the writes there overwrote its prompt's keys (its next tokens drew from a corrupted
        # cache: seen as a sampler-trainer gap of ~3 nats on the tokens after its observation). At its
        # own next position they write the very key and value that resume() writes there anyway.
        idx = to_device([s.slot for s in seqs], self.device)
        new = to_device([[s.token_ids[-1], len(s.prompt) + len(s.token_ids) - 1, len(s.token_ids),
                          turn_limit(call, s), s.key] for s in seqs], self.device)
        st.tok[idx], st.pos[idx], st.ntok[idx], st.max_tokens[idx], st.key[idx] = new.T
        st.active[idx] = to_device(go, self.device, torch.bool)

    # ------------------------------------------------------------------------- 3. decode

    def _decode(self, call: Call):
        st, W = self.state, self.window
        # The live rows sit in slots [0, len(live)) (_compact). Eager decode computes exactly those;
        # a CUDA graph replays the shapes it was captured with, so a graphed window decodes the
        # smallest power-of-two bucket that holds them (free and tool-waiting slots in it compute
        # too; `active` keeps them from moving): one graph per (bucket, cache bucket, sampling
        # settings), captured once and replayed by every later call.
        self._compact(call)
        num_slots = bucket(len(call.live), self.cache.slots) if self.buckets else len(call.live)
        self.decode_steps += W
        self.rows_decoded += W * num_slots  # rows_live: counted from the window's tokens (_take)
        longest = max(len(s.prompt) + len(s.token_ids) for s in call.live.values())
        # keys a window reads: [0, cache_len); pipelined, the rows may be a window further on than
        # the host knows (the window in flight)
        cache_len = min(self.cache.max_seq_len, longest + W * (1 + (call.in_flight is not None)))
        if self.use_graphs:
            cache_len = cache_bucket(cache_len, self.cache.max_seq_len)  # buckets, one graph each
            self._graph(call, num_slots, cache_len).replay()
        else:
            for column in range(W):
                decode_step(self.weights, self.cache, st, call.params, num_slots, cache_len, column)
        # the window's outputs to host memory (asynchronous on CUDA), with who was in each slot
        out = self.host_out[call.launched % 2]
        for host, dev in zip(out, (st.out_tok, st.out_lp, st.out_ok, st.out_thr)):
            host[:num_slots].copy_(dev[:num_slots], non_blocking=True)
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()
        window = (out, num_slots, [(slot, s, s.epoch) for slot, s in call.live.items()], done)
        call.launched += 1
        if not self.pipeline:
            self._take(call, *window)
            return
        if call.in_flight:  # while this window runs, the previous one's tokens are accepted
            self._take(call, *call.in_flight)
        call.in_flight = window

    def _take(self, call: Call, out: list, num_slots: int, rows: list, done):
        """Accept one window's tokens. `rows`: (slot, row, epoch) at its launch; a row that stopped
        since (a stop string found in the window before, a finish) takes none of its tokens, and
        the row now in that slot, if any, was not decoding in it."""
        if done is not None:
            done.synchronize()  # host sync: once per window
        # a row's accepted tokens are a prefix of the window (once retired on device it stays
        # retired), so a row takes its first `ok` columns at once
        toks, lps, oks, thrs = (t[:num_slots].tolist() for t in out)
        stopped = []
        for slot, s, epoch in rows:
            k = sum(oks[slot])
            self.rows_live += k
            if k and s.epoch == epoch and self._accept(call, s, toks[slot][:k], lps[slot][:k], thrs[slot][:k]):
                stopped.append(s.slot)
        if stopped:  # stop strings are found here, not on device: retire those rows there too
            self.state.active[to_device(stopped, self.device)] = False

    def _compact(self, call: Call):
        """Move the rows in the highest occupied slots down into the free slots below them, so
        that a decode step over [0, max(live) + 1) computes no finished row. A move copies the
        row's cached positions once (a fork) and its decode state; without it, rows that finished
        early kept being computed until the highest slot finished (67% of the rows computed in a
        32-row rollout). Randomness is keyed by request, not slot, so tokens do not change."""
        n = len(call.live)
        holes = [slot for slot in range(n) if slot not in call.live]
        tops = sorted((slot for slot in call.live if slot >= n), reverse=True)
        st = self.state
        for dst, src in zip(holes, tops):
            s = call.live.pop(src)
            # pipelined, the row may have cached a window more than the host has taken
            known = len(s.prompt) + len(s.token_ids) + self.window * (call.in_flight is not None)
            self.cache.fork(src, [dst], min(self.cache.max_seq_len, known))
            for t in (st.tok, st.pos, st.ntok, st.max_tokens, st.key, st.active):
                t[dst] = t[src]
            st.active[src] = False
            s.slot, call.live[dst] = dst, s

    def _graph(self, call: Call, num_slots: int, cache_len: int):
        """The CUDA graph of one decode window over slots [0, num_slots) and keys [0, cache_len),
        captured on first use and kept (with the cache, the state and the decode weights it
        reads, all at fixed addresses) for every later call. Warm-up runs on a copy of the
        state, which is then restored (capture runs nothing)."""
        p, st = call.params, self.state
        key = (num_slots, cache_len, p.temperature, p.top_k, p.top_p, p.min_p, p.kept_set)
        if key not in self.graphs:
            # the graphs replay in turn, so they share one memory pool; it lives and dies with them
            # (release(), a new cache): capturing into a pool whose graphs were freed trips an assert
            # in the caching allocator (seen on an H200, torch 2.11)
            self.graph_pool = self.graph_pool or torch.cuda.graph_pool_handle()
            step = lambda: [decode_step(self.weights, self.cache, st, p, num_slots, cache_len, column)  # noqa: E731
                            for column in range(self.window)]
            saved = [(t, t.clone()) for t in (st.tok, st.pos, st.ntok, st.active)]  # warm-up moves them
            self.graphs[key], seconds = capture(step, saved, self.graph_pool)
            self.capture_seconds += seconds
        return self.graphs[key]

    # ------------------------------------------------------------------------- 4. finish

    def _accept(self, call: Call, s: Row, toks: list[int], lps: list[float], thrs: list[float]) -> bool:
        """Append a row's sampled tokens (one window's, in order); True when the row stops decoding
        (finished, or in a tool call). The device retires a row at a stop id and at max_tokens, so
        only the last token can end it that way; a stop string can end it earlier, found at the
        tokens that can complete one (call.string_end), and the tokens after it are dropped."""
        p, start = call.params, len(s.token_ids)
        s.token_ids += toks
        s.loss_mask += [1] * len(toks)
        s.logprobs += lps
        s.thresholds += thrs
        is_tool = is_stop = False
        found = find_stop_string(self.tokenizer, call, s, start) if call.tail else None  # grpo/engine/stops.py
        if found:
            j, is_tool, is_stop = found
            del s.token_ids[j + 1:], s.loss_mask[j + 1:], s.logprobs[j + 1:], s.thresholds[j + 1:]  # dropped
        last = s.token_ids[-1]
        is_tool, is_stop = is_tool or last in call.tool_stops, is_stop or last in call.stops
        # the turn's own limit ends a turn that is not a tool call; a call that closes on it still runs
        full = len(s.token_ids) >= (s.max_tokens if is_tool else turn_limit(call, s))
        if is_stop or (is_tool and call.tool is None):
            self.finish(call, s, "stop")
        elif full:  # also a tool call with no room left for its observation
            self.finish(call, s, "length")
        elif is_tool and s.num_turns >= p.max_turns:
            self.finish(call, s, "turns")
        elif is_tool:
            call.pending[self.pool.submit(call.tool, s.index, list(s.token_ids))] = s
            s.in_tool = True
        else:
            return False
        s.epoch += 1  # a window launched before now holds nothing of this row's
        return True

    def finish(self, call: Call, s: Row, reason: str, error: str | None = None):
        s.finish_reason, s.error = reason, error
        del call.live[s.slot]
        call.out[s.index] = s
        call.bar.update(1)


