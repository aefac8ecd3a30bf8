"""The sampler's host side (the Scheduler): a call's queue, its slots and rows, what enters the cache outside
decode and when, the tokens each window hands back, stop strings, finishing and tool dispatch. What runs on
the device it asks of grpo/engine/runner.py's Runner, in host lists.

  admit   waiting rows take free slots; each fresh document is prefilled once, packed with the others
          in one row (no padding), up to its longest new prompt, and each new row forks its prompt's KV
          from a row of its document that holds it (a live one, or the one just prefilled); then each
          new row's first token is sampled and accepted;
  resume  rows whose tool call returned get the observation appended, to the row and to its cache, in
          one padded forward over those rows, and their next token sampled on device, read back with
          the next window's tokens (a tool turn makes no host sync);
  launch  a decode window over the live rows, kept in the lowest slots (`_compact`); pipelined, the
          last window's tokens are taken while this one runs;
  take    a window's tokens accepted (`accept`): stops, stop strings (grpo/engine/stops.py), tool calls
          (run in a thread pool, so the other rows keep decoding) and lengths; a finished row frees its
          slot for the next request (continuous batching)."""
import concurrent.futures as cf

import torch
from torch import Tensor

from grpo.engine.progress import Progress
from grpo.engine.rows import Call, Completion, Row, SamplingParams, turn_limit
from grpo.engine.sampling import request_key
from grpo.engine.stops import find_stop_string, string_ends


class Scheduler:
    """`runner`: the device side; `tokenizer`: for stop strings; `tool_workers`: the tool calls' thread
    pool; `pipeline`: launch the next decode window before taking the last one's tokens."""
    def __init__(self, runner, tokenizer, tool_workers: int, pipeline: bool):
        self.runner, self.tokenizer, self.pipeline = runner, tokenizer, pipeline
        self.pool = cf.ThreadPoolExecutor(tool_workers)
        self.string_end = {}  # stop strings -> (V,) bool: tokens that can complete one of them

    # ------------------------------------------------------------------------- a call

    def start(self, prompts: list[list[int]], p: SamplingParams, tool, prompt_ids: list[int] | None,
              progress: bool, docs: list[int] | None = None) -> Call:
        """Check the request, have the runner size the cache for it, and queue its prompts x n rows, each
        with its random stream's key (a bad prompt's rows are finished with an error here). `docs`:
        each prompt's document (default: its own); a document's rows queue longest prompt first."""
        r = self.runner
        if (p.stop_strings or p.tool_stop_strings) and self.tokenizer is None:
            raise ValueError("stop strings need the Sampler's tokenizer: Sampler(model, tokenizer=...)")
        prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        if len(prompt_ids) != len(prompts):
            raise ValueError(f"{len(prompt_ids)=} != {len(prompts)=}")
        seed = p.seed if p.seed is not None else int(torch.randint(2**31, ()))
        stops = set(r.model.eos_token_ids() if p.stop_token_ids is None else p.stop_token_ids)
        rows = max(1, min(r.gen_batch, len(prompts) * p.n))  # a rank's share may be empty: one slot
        longest = max((len(x) for x in prompts), default=0) + p.max_tokens
        r.prepare(longest, rows, stops | set(p.tool_stop_token_ids))
        S, V, n = r.cache.max_seq_len, r.model.args.vocab_size, p.n
        strings = p.stop_strings + p.tool_stop_strings  # c chars span at most c tokens (+ partial bytes)
        tail = 2 * max(map(len, strings)) + 4 if strings else 0
        out = [None] * (len(prompts) * n)
        docs = list(range(len(prompts))) if docs is None else docs
        members = {}
        for i, (d, x) in enumerate(zip(docs, prompts)):
            members.setdefault(d, []).append((i, len(x)))
        call = Call(p, tool, out, stops, set(p.tool_stop_token_ids), tail,
                    self.string_ends(strings) if strings else None, [n] * len(prompts), members)
        # longest prompt first within a document: while such a row lives, its cache holds the
        # prefixes of all the document's later (shorter) prompts, which then fork it with no prefill
        for i in sorted(range(len(prompts)), key=lambda i: (docs[i], -len(prompts[i]), i)):
            prompt = prompts[i]
            bad = check(prompt, V, S)
            for j in range(n):
                if bad:
                    out[i * n + j] = Completion(i, j, finish_reason="error", num_turns=0,
                                                error=f"prompt {i}: {bad}")
                else:
                    key, max_tokens = request_key(seed, prompt_ids[i], j), min(p.max_tokens, S - len(prompt))
                    call.waiting.append(Row(i * n + j, i, j, list(prompt), key, max_tokens, docs[i]))
        call.bar = Progress(sum(c is None for c in out), progress)
        return call

    def string_ends(self, strings: list[str]) -> list[bool]:
        """grpo.engine.stops.string_ends, once per set of strings."""
        key = tuple(sorted(set(strings)))
        if key not in self.string_end:
            self.string_end[key] = string_ends(self.tokenizer, self.runner.model.args.vocab_size, list(key))
        return self.string_end[key]

    def free_slots(self, call: Call) -> list[int]:
        return sorted(set(range(self.runner.cache.slots)) - set(call.live))

    # ------------------------------------------------------------------------- 1. admit

    def admit(self, call: Call):
        """Fill free slots from the queue (lowest slots first, so decode spans few slots). A
        document is prefilled once, up to its longest new prompt; each new row forks its prompt's
        KV from a row of its document whose cache holds it (a live one, or the one just prefilled)."""
        held = {}  # document -> (prompt length, slot) of its live row with the longest prompt
        # (none for a hybrid model: a live row's linear state has moved past its prompt, so prefill again)
        for s in ([] if self.runner.model.args.hybrid else call.live.values()):
            if len(s.prompt) > held.get(s.doc, (0, -1))[0]:
                held[s.doc] = (len(s.prompt), s.slot)
        free, new = self.free_slots(call), []
        while free and call.waiting:
            s = call.waiting.popleft()
            s.slot = free.pop(0)
            call.unadmitted[s.prompt_index] -= 1
            call.live[s.slot] = s
            new.append(s)
        if not new:
            return
        groups = {}
        for s in new:
            groups.setdefault(s.doc, []).append(s)
        # prefill a document unless a live row holds every new prompt's KV and its logits are kept
        fresh = [g for d, g in groups.items()
                 if any(len(s.prompt) > held.get(d, (0, -1))[0] or s.prompt_index not in call.prompt_logits
                        for s in g)]
        heads = [max(g, key=lambda s: len(s.prompt)) for g in fresh]  # prefilled up to their longest prompt
        for h in heads:
            held[h.doc] = (len(h.prompt), h.slot)
        starting = {s.prompt_index for s in new}
        for chunk in prefill_chunks([h.prompt for h in heads], self.runner.prefill_tokens):
            self._prefill(call, [heads[k] for k in chunk], starting)
        forks = {}  # (source slot, prompt length) -> destination slots
        for s in new:
            src = held[s.doc][1]
            if s.slot != src:
                forks.setdefault((src, len(s.prompt)), []).append(s.slot)
        for (src, length), dst in forks.items():
            self.runner.fork(src, dst, length)
        logits = torch.stack([call.prompt_logits[s.prompt_index] for s in new])  # (B_new, V)
        for i in starting:  # keep a prompt's logits only while samples of it still wait
            if call.unadmitted[i] == 0:
                del call.prompt_logits[i]
        self._sample_into(call, new, logits)

    def _prefill(self, call: Call, heads: list[Row], starting: set[int]):
        """One packed forward over the prompts of `heads`, each the longest new prompt of a fresh
        document, KV into the head's slot; logits kept at the last token of each of the document's
        prompts that it covers and that has samples starting now or later."""
        wanted, last, offset = [], [], 0  # prompt indices and where their last tokens sit in the row
        for h in heads:
            for i, length in call.members[h.doc]:
                if length <= len(h.prompt) and (i in starting or call.unadmitted[i] > 0):
                    wanted.append(i)
                    last.append(offset + length - 1)
            offset += len(h.prompt)
        logits = self.runner.prefill([h.prompt for h in heads], [h.slot for h in heads], last)
        for i, row in zip(wanted, logits):
            call.prompt_logits[i] = row

    def _sample_into(self, call: Call, seqs: list[Row], logits: Tensor):
        """Sample one token per row from (B, V) logits outside the decode loop (a prompt's first token:
        its prefill has read the host's lists back already), accept it, then arm the rows that go on in
        the device state."""
        keys, steps = [s.key for s in seqs], [len(s.token_ids) for s in seqs]
        tok, lp, thr = self.runner.sample(call.params, logits, keys, steps)
        go = [not self.accept(call, s, [t], [l], [h]) for s, t, l, h in zip(seqs, tok, lp, thr)]
        # every row's state, not only those that go on: a decode step computes inactive slots too and
        # writes their k, v at their `pos`. A row whose first token was a tool call kept the slot's stale
        # pos, and the writes there overwrote its prompt's keys (its next tokens drew from a corrupted
        # cache: seen as a sampler-trainer gap of ~3 nats on the tokens after its observation). At its
        # own next position they write a key and value that resume() writes there again.
        # (token to feed, its position, tokens so far, max_tokens, key)
        state = [[s.token_ids[-1], len(s.prompt) + len(s.token_ids) - 1, len(s.token_ids),
                  turn_limit(call, s), s.key] for s in seqs]
        self.runner.arm([s.slot for s in seqs], state, go)

    # ------------------------------------------------------------------------- 2. resume

    def resume(self, call: Call):
        """Rows whose tool call returned: append the observation (mask 0) to the row and to its
        cache in one padded forward over those rows, then sample their next token on device, where the
        row goes on decoding from it; the host reads it with the next window's (Runner.lead)."""
        rows, V = [], self.runner.model.args.vocab_size
        for fut in [f for f in call.pending if f.done()]:
            s = call.pending.pop(fut)
            s.in_tool = False
            try:
                obs, bad = fut.result(), None
                if obs is not None and any(not (isinstance(t, int) and 0 <= t < V) for t in obs):
                    bad = f"tool returned token ids outside the vocabulary [0, {V})"
            except Exception as e:  # a failing tool ends its own row, not the batch
                bad = f"tool raised {type(e).__name__}: {e}"
            if bad:
                self.finish(call, s, "error", error=bad)
                continue
            if obs is None:
                self.finish(call, s, "stop")
                continue
            obs = list(obs)[: s.max_tokens - len(s.token_ids)]
            cached = len(s.token_ids) - 1  # the tool-stop token itself is not in the cache yet
            s.token_ids += obs
            s.loss_mask += [0] * len(obs)
            s.logprobs += [0.0] * len(obs)
            s.thresholds += [float("-inf")] * len(obs)
            s.num_turns, s.turn_start = s.num_turns + 1, len(s.token_ids)
            if len(s.token_ids) >= s.max_tokens:
                self.finish(call, s, "length")
            else:
                rows.append((s, s.token_ids[cached:], len(s.prompt) + cached))
        if rows:
            logits = self.runner.observe([(s.slot, x, p) for s, x, p in rows])  # (B, V)
            # (the new token's position, tokens so far with it, max_tokens, key)
            state = [[len(s.prompt) + len(s.token_ids), len(s.token_ids) + 1, turn_limit(call, s), s.key]
                     for s, _, _ in rows]
            self.runner.lead(call.params, logits, [s.slot for s, _, _ in rows], state)
            for s, _, _ in rows:
                s.lead = True

    # ------------------------------------------------------------------------- 3. decode, 4. finish

    def decoding(self, call: Call) -> bool:  # a live row is not in a tool call
        return any(not s.in_tool for s in call.live.values())

    def launch(self, call: Call):
        """A decode window over the live rows (grpo/engine/runner.py) -> the window whose tokens to take
        now: this one, or pipelined the one before it (None after the first)."""
        self._compact(call)
        longest = max(len(s.prompt) + len(s.token_ids) + s.lead for s in call.live.values())
        handle = self.runner.launch(call.params, len(call.live), longest, call.in_flight is not None)
        window = (handle, [(slot, s, s.epoch) for slot, s in call.live.items()])  # who was in each slot
        call.bar.tokens(lambda: sum(len(s.token_ids) for s in call.live.values())
                        + sum(len(c.token_ids) for c in call.out if c is not None))
        if not self.pipeline:
            return window
        call.in_flight, window = window, call.in_flight  # while this one runs, the previous one is taken
        return window

    def drain(self, call: Call):  # nothing left to launch: the window in flight is taken
        window, call.in_flight = call.in_flight, None
        return window

    def take(self, call: Call, window):
        """Accept one window's tokens. Its rows: (slot, row, epoch) at its launch; a row that stopped
        since (a stop string found in the window before, a finish) takes none of its tokens, and
        the row now in that slot, if any, was not decoding in it."""
        if window is None:
            return
        handle, rows = window
        toks, lps, oks, thrs = self.runner.read(handle)  # the window's one host sync
        # a row's accepted tokens are a prefix of the window (once retired on device it stays
        # retired), after the token sampled before it where there is one (column 0): one run of columns
        stopped = []
        for slot, s, epoch in rows:
            ok = oks[slot]
            lo, hi = 1 - ok[0], 1 + sum(ok[1:])
            if hi > lo and s.epoch == epoch:
                s.lead = s.lead and not ok[0]
                if self.accept(call, s, toks[slot][lo:hi], lps[slot][lo:hi], thrs[slot][lo:hi]):
                    stopped.append(s.slot)
        if stopped:  # stop strings are found here, not on device: retire those rows there too
            self.runner.retire(stopped)

    def wait(self, call: Call):
        """Every live row is in a tool call: wait for one, unless a waiting row can take a free slot."""
        if call.pending and not (call.waiting and self.free_slots(call)):
            cf.wait(list(call.pending), return_when=cf.FIRST_COMPLETED)

    def _compact(self, call: Call):
        """Move the rows in the highest occupied slots down into the free slots below them, so
        that a decode step over [0, max(live) + 1) computes no finished row. A move copies the
        row's cached positions once (a fork) and its decode state; without it, rows that finished
        early kept being computed until the highest slot finished (67% of the rows computed in a
        32-row rollout). Randomness is keyed by request, not slot, so tokens do not change."""
        n = len(call.live)
        holes = [slot for slot in range(n) if slot not in call.live]
        tops = sorted((slot for slot in call.live if slot >= n), reverse=True)
        for dst, src in zip(holes, tops):
            s = call.live.pop(src)
            # pipelined, the row may have cached a window more than the host has taken
            ahead = self.runner.window * (call.in_flight is not None)
            known = len(s.prompt) + len(s.token_ids) + s.lead + ahead
            self.runner.move(src, dst, known)
            s.slot, call.live[dst] = dst, s

    def accept(self, call: Call, s: Row, toks: list[int], lps: list[float], thrs: list[float]) -> bool:
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
        found = find_stop_string(self.tokenizer, call, s, start) if call.tail else None
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


def check(prompt: list[int], V: int, S: int) -> str | None:
    """What is wrong with a prompt for a vocabulary of V and rows of S positions, or None."""
    if len(prompt) == 0:
        return "empty prompt"
    if any(not (isinstance(t, int) and 0 <= t < V) for t in prompt):
        return f"token ids outside the vocabulary [0, {V})"
    if len(prompt) >= S:
        return f"{len(prompt)} tokens leave no room in max_seq_len={S}"
    return None


def prefill_chunks(prompts: list[list[int]], budget: int) -> list[list[int]]:
    """Split prompt indices into runs of at most `budget` tokens (a longer prompt goes alone)."""
    chunks, size = [[]], 0
    for k, x in enumerate(prompts):
        if chunks[-1] and size + len(x) > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(k)
        size += len(x)
    return [c for c in chunks if c]
