"""What enters a sampler's cache outside the decode loop, the moves 1 and 2 of grpo/engine/sampler.py's loop:
  admit   waiting rows take free slots; each fresh document is prefilled once, packed with the others
          in one row (no padding), up to its longest new prompt, and each new row forks its prompt's KV
          from a row of its document that holds it (a live one, or the one just prefilled);
  resume  rows whose tool call returned get the observation appended, to the row and to its cache, in
          one padded forward over those rows.
Both then sample each row's next token (Sampler.sample_into) and arm it for decode."""
import torch

from grpo.engine.decode import extend
from grpo.engine.kv_cache import to_device
from grpo.engine.rows import Call, Row


def admit(sampler, call: Call):
    """Fill free slots from the queue (lowest slots first, so decode spans few slots). A
    document is prefilled once, up to its longest new prompt; each new row forks its prompt's
    KV from a row of its document whose cache holds it (a live one, or the one just prefilled)."""
    held = {}  # document -> (prompt length, slot) of its live row with the longest prompt
    # (none for a hybrid model: a live row's linear state has moved past its prompt, so prefill again)
    for s in ([] if sampler.model.args.hybrid else call.live.values()):
        if len(s.prompt) > held.get(s.doc, (0, -1))[0]:
            held[s.doc] = (len(s.prompt), s.slot)
    free, new = sampler.free_slots(call), []
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
    for chunk in prefill_chunks([h.prompt for h in heads], sampler.prefill_tokens):
        prefill(sampler, call, [heads[k] for k in chunk], starting)
    forks = {}  # (source slot, prompt length) -> destination slots
    for s in new:
        src = held[s.doc][1]
        if s.slot != src:
            forks.setdefault((src, len(s.prompt)), []).append(s.slot)
    for (src, length), dst in forks.items():
        sampler.cache.fork(src, dst, length)
    logits = torch.stack([call.prompt_logits[s.prompt_index] for s in new])  # (B_new, V)
    for i in starting:  # keep a prompt's logits only while samples of it still wait
        if call.unadmitted[i] == 0:
            del call.prompt_logits[i]
    sampler.sample_into(call, new, logits)


def prefill(sampler, call: Call, heads: list[Row], starting: set[int]):
    """One packed forward over the prompts of `heads`, each the longest new prompt of a fresh
    document (positions restart at 0 per prompt, so the model's document mask keeps them
    apart), KV into the head's slot; logits kept at the last token of each of the document's
    prompts that it covers and that has samples starting now or later."""
    dev = sampler.device
    ids = to_device([t for h in heads for t in h.prompt], dev)[None]  # (1, T) packed
    pos = torch.cat([torch.arange(len(h.prompt), device=dev) for h in heads])
    slot = torch.cat([torch.full((len(h.prompt),), h.slot, device=dev) for h in heads])
    wanted, last, offset = [], [], 0  # prompt indices and where their last tokens sit in the row
    for h in heads:
        for i, length in call.members[h.doc]:
            if length <= len(h.prompt) and (i in starting or call.unadmitted[i] > 0):
                wanted.append(i)
                last.append(offset + length - 1)
        offset += len(h.prompt)
    sampler.cache.packed(slot, pos)
    out = to_device(last, dev)[None]  # (1, K)
    logits = sampler.model(ids, pos[None], cache=sampler.cache, output_index=out)[0]  # (K, V)
    sampler.tokens_prefilled += ids.shape[1]
    for i, row in zip(wanted, logits):
        call.prompt_logits[i] = row


def resume(sampler, call: Call):
    """Rows whose tool call returned: append the observation (mask 0) to the row and to its
    cache in one padded forward over those rows, then sample their next token."""
    rows = []
    for fut in [f for f in call.pending if f.done()]:
        s = call.pending.pop(fut)
        s.in_tool = False
        V = sampler.model.args.vocab_size
        try:
            obs, bad = fut.result(), None
            if obs is not None and any(not (isinstance(t, int) and 0 <= t < V) for t in obs):
                bad = f"tool returned token ids outside the vocabulary [0, {V})"
        except Exception as e:  # a failing tool ends its own row, not the batch
            bad = f"tool raised {type(e).__name__}: {e}"
        if bad:
            sampler.finish(call, s, "error", error=bad)
            continue
        if obs is None:
            sampler.finish(call, s, "stop")
            continue
        obs = list(obs)[: s.max_tokens - len(s.token_ids)]
        cached = len(s.token_ids) - 1  # the tool-stop token itself is not in the cache yet
        s.token_ids += obs
        s.loss_mask += [0] * len(obs)
        s.logprobs += [0.0] * len(obs)
        s.thresholds += [float("-inf")] * len(obs)
        s.num_turns, s.turn_start = s.num_turns + 1, len(s.token_ids)
        if len(s.token_ids) >= s.max_tokens:
            sampler.finish(call, s, "length")
        else:
            rows.append((s, s.token_ids[cached:], len(s.prompt) + cached))
    if not rows:
        return
    dev, T = sampler.device, max(len(x) for _, x, _ in rows)
    ids = to_device([x + [0] * (T - len(x)) for _, x, _ in rows], dev)  # (B, T) padded
    valid = to_device([[t < len(x) for t in range(T)] for _, x, _ in rows], dev)
    start = to_device([p for _, _, p in rows], dev)
    slots = to_device([s.slot for s, _, _ in rows], dev)
    positions = start[:, None] + torch.arange(T, device=dev)
    if dev.type == "cpu" and not sampler.model.args.hybrid:  # through the decode weights: oneDNN's packed GEMMs where decode packs them
        logits = extend(sampler.weights, sampler.cache, ids, positions, valid, slots)  # (B, V)
    else:
        sampler.cache.rows(slots, start, T, max(p for _, _, p in rows) + T, valid)
        last = to_device([[len(x) - 1] for _, x, _ in rows], dev)  # (B, 1)
        logits = sampler.model(ids, positions, cache=sampler.cache, output_index=last)[:, 0]  # (B, V)
    sampler.sample_into(call, [s for s, _, _ in rows], logits)


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
