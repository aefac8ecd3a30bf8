"""grpo.engine.sampler against references: transformers' greedy generate, the model's own full
forward (log-probs, multi-turn caches), exact filter masks and their sampled frequencies;
plus batch independence of seeded sampling, stops, tools and bad input."""
import dataclasses
import math
import threading
import types

import pytest
import torch
import transformers

from grpo.engine.kv_cache import KVCache
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.engine.sampling import filter_mask, gumbel, request_key, sample, sample_hidden
from grpo.models.model import Transformer

QUESTIONS = ["Hi", "What is 12 times 7?", "Write a haiku about the sea, the wind and the long winter nights.",
             "Name three prime numbers.", "Tell me a short fact about Paris."]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]
    return Transformer.from_pretrained(smollm2_path), tok, prompts


@pytest.fixture(scope="module")
def hf_greedy(smollm2_path, smol):
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.no_grad():  # one prompt at a time: no padding in the reference
        return [ref.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
                for p in smol[2]]


def full_logprobs(model, prompt, completion, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The trainer's quantity, from scratch: log softmax(logits / T) of each completion token, over
    the kept set of the filters (filter_mask: the rule itself, not the sampler's recorded threshold)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        z = model(ids)[0, len(prompt) - 1:-1] / temperature
    z = z.masked_fill(~filter_mask(z, top_k, top_p, min_p), float("-inf"))
    return z.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


# ----------------------------------------------------------------------------- SmolLM2

@pytest.mark.parametrize("gen_batch,n", [(64, 1), (4, 3)])  # all in; fewer slots than rows, shared prompts
def test_greedy_matches_transformers(smol, hf_greedy, gen_batch, n):
    model, tok, prompts = smol
    out = Sampler(model, gen_batch=gen_batch).generate(prompts, SamplingParams(n=n, temperature=0, max_tokens=24))
    assert len(out) == len(prompts) * n
    for k, c in enumerate(out):
        assert (c.prompt_index, c.sample_index) == divmod(k, n)
        assert c.token_ids == hf_greedy[c.prompt_index], (k, tok.decode(c.token_ids))
        assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")
        assert c.loss_mask == [1] * len(c.token_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_forward(smol, temperature):
    model, _, prompts = smol
    out = Sampler(model).generate(prompts[1:4], SamplingParams(n=2, temperature=temperature, top_k=50, max_tokens=16,
                                                               seed=3))
    for c in out:
        expected = full_logprobs(model, prompts[1 + c.prompt_index], c.token_ids, temperature, top_k=50)
        # fp32, cache vs full forward differ only in op order: within 1e-4. The log-probs are top-50's,
        # renormalised: above the full vocabulary's, by the mass outside the kept set
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        whole = full_logprobs(model, prompts[1 + c.prompt_index], c.token_ids, temperature)
        assert (torch.tensor(c.logprobs) >= whole - 1e-4).all() and (torch.tensor(c.logprobs) - whole).mean() > 1e-4
        assert all(math.isfinite(h) for h in c.thresholds) and len(c.thresholds) == len(c.token_ids)


def test_stop_string_spanning_tokens(smol, hf_greedy):
    model, tok, prompts = smol
    ids = hf_greedy[0]  # "Hello! How can I assist you today?<|im_end|>"
    pieces = [tok.decode([t]) for t in ids]
    k = next(k for k in range(1, len(ids)) if len(pieces[k - 1]) > 1 and len(pieces[k]) > 1)
    stop = pieces[k - 1][-1] + pieces[k][:2]  # ends inside token k, starts inside token k-1
    out = Sampler(model, tok).generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24, stop_strings=[stop]))
    assert out[0].token_ids == ids[:k + 1] and out[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="tokenizer"):
        Sampler(model).generate(prompts[:1], SamplingParams(stop_strings=[stop]))


@pytest.mark.slow
def test_seeded_tokens_independent_of_batch_on_smollm2(smol, one_thread):
    """The sampler's guarantee: a seeded request draws the same tokens in any batch. Batches
    of 8, of 1 and a changing mix of 12 rows round the logits differently (fp32 matmul noise);
    the race over per-token noise must not let that flip a choice. With inverse-CDF sampling
    this failed: one row of the mixed run left the others at token 114. Alone (a batch of 1, a
    row's decode step at a time: the costly run) the first sample of the first prompt, whose
    request key is the same whatever n."""
    model, _, prompts = smol
    p = SamplingParams(n=4, temperature=1.0, max_tokens=128, stop_token_ids=[], seed=0)  # no stop: 128 each
    rows = [c.token_ids for c in Sampler(model, gen_batch=8).generate(prompts[1:3], p, prompt_ids=[1, 2])]
    one = dataclasses.replace(p, n=1)
    alone = Sampler(model, gen_batch=1).generate(prompts[1:2], one, prompt_ids=[1])
    mixed = Sampler(model, gen_batch=7).generate(prompts[:3], p)  # 12 rows in 7 slots: batches of 7, then 5
    assert all(len(x) == 128 for x in rows)
    assert [c.token_ids for c in alone] == rows[:1]
    assert [c.token_ids for c in mixed[4:12]] == rows  # prompts 1 and 2


@pytest.fixture(scope="module")
def solutions(smol):
    """Three prompts, each with 40 greedy tokens: the sequences to cut."""
    model, _, prompts = smol
    greedy = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[])
    sols = Sampler(model).generate(prompts[1:4], greedy)
    return [p + c.token_ids for p, c in zip(prompts[1:4], sols)], [len(p) for p in prompts[1:4]]


@pytest.mark.slow  # ~10 s each
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forked_continuations_equal_fresh_prefills(smol, solutions, one_thread, temperature):
    """ProcessGRPO's primitive (the sampler's one way to reuse a prefix): continue_from prefills
    each sequence once and forks its KV truncated at every cut; a cut's K continuations equal, token
    for token under the same seeds, what generate() samples from a fresh prefill of that prefix as
    a prompt. With slots for every row (one prefill per sequence) and with 9 (cuts admitted over
    time: they fork a live row of a longer cut, or, greedy here, the sequence is prefilled again
    when none is left)."""
    model, (seqs, P) = smol[0], solutions
    cuts = [[P[0], P[0] + 9, P[0] + 23], [P[1] + 31, P[1] + 2], [P[2] + 40, P[2] + 17, P[2] + 5]]  # any order
    prefixes = [x[:c] for x, cs in zip(seqs, cuts) for c in cs]
    p = SamplingParams(n=2, temperature=temperature, max_tokens=16, seed=11)  # 16 rows
    fresh = Sampler(model)
    expected = fresh.generate(prefixes, p)
    assert fresh.tokens_prefilled == sum(map(len, prefixes))
    for gen_batch in (64, 9):
        sampler = Sampler(model, gen_batch=gen_batch)
        out = sampler.continue_from(seqs, cuts, p)
        assert [(c.prompt_index, c.sample_index) for c in out] == [divmod(k, 2) for k in range(len(out))]
        for c, e in zip(out, expected):
            where = (gen_batch, c.prompt_index, c.sample_index)
            assert (c.token_ids, c.finish_reason) == (e.token_ids, e.finish_reason), where
            # the first token's logits come from a longer packed forward: fp32 op order only
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)
        once = sum(max(cs) for cs in cuts)  # one pass per sequence, up to its longest cut
        if gen_batch == 64:
            assert sampler.tokens_prefilled == once
        assert once <= sampler.tokens_prefilled < fresh.tokens_prefilled
    assert len({tuple(c.token_ids) for c in expected}) > (1 if temperature == 0 else 10)  # not all alike


# ----------------------------------------------------------------------------- tiny models

def test_seeded_sampling_independent_of_batch(tiny_dir):
    path, _ = tiny_dir("llama", vocab_size=1000)
    model = Transformer.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(torch.randint(1, 30, (), generator=g)),), generator=g).tolist() for _ in range(10)]
    stops = list(range(3, 23))  # ~2% of the mass: rows stop at different lengths, whatever the stream
    p = SamplingParams(n=2, temperature=0.9, top_p=0.95, max_tokens=24, stop_token_ids=stops, seed=1234)
    big = Sampler(model, gen_batch=64).generate(prompts, p)  # a batch of 20 rows
    few = Sampler(model, gen_batch=3).generate(prompts, p)  # fewer slots than requests: slots reused
    assert [c.token_ids for c in few] == [c.token_ids for c in big]
    assert len({len(c.token_ids) for c in big}) > 1, "rows should stop at different lengths"
    for i in (0, 7):  # alone, with its global index, as a rank holding one prompt would
        alone = Sampler(model).generate([prompts[i]], SamplingParams(**{**p.__dict__, "n": 1}), prompt_ids=[i])
        assert alone[0].token_ids == big[2 * i].token_ids
    assert big[0].token_ids != big[1].token_ids  # the n samples of a prompt differ
    other = Sampler(model).generate(prompts[:1], SamplingParams(**{**p.__dict__, "seed": 99}))
    assert other[0].token_ids != big[0].token_ids


def _decoded_rows(monkeypatch) -> list[int]:
    """The batch of every decode step from here on (grpo.engine.window.decode_hidden wrapped)."""
    import grpo.engine.window as window
    rows, inner = [], window.decode_hidden
    monkeypatch.setattr(window, "decode_hidden", lambda w, cache, tok, pos, n, span, **kw: rows.append(n)
                        or inner(w, cache, tok, pos, n, span, **kw))
    return rows


def test_decode_computes_only_live_rows(tiny_dir, monkeypatch):
    """Finished rows leave the decode batch (compaction): with one step per sync on CPU, the
    rows a decode step computes sum to one per token after each row's first; before
    compaction, rows that stopped early were computed until the highest occupied slot stopped."""
    path, _ = tiny_dir("llama", vocab_size=1000)
    model = Transformer.from_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (int(torch.randint(2, 30, (), generator=g)),), generator=g).tolist() for _ in range(6)]
    p = SamplingParams(n=3, temperature=0.9, max_tokens=40, stop_token_ids=list(range(3, 43)), seed=5)
    rows = _decoded_rows(monkeypatch)
    out = Sampler(model, gen_batch=8).generate(prompts, p)
    assert len({len(c.token_ids) for c in out}) > 3, "rows should stop at different lengths"
    assert sum(rows) == sum(len(c.token_ids) - 1 for c in out)
    assert [c.token_ids for c in out] == [c.token_ids for c in Sampler(model, gen_batch=64).generate(prompts, p)]


def test_cpu_cache_sized_to_the_call_and_release_frees_the_weights(tiny_dir):
    """Eager decode (a CPU) has no graphs to keep, so a call's cache holds its own rows, not
    gen_batch; it grows for a larger call. release() frees the cache and the decode copy of the
    weights, and the next call samples the same tokens from fresh ones."""
    path, _ = tiny_dir("qwen2", vocab_size=1000)
    model = Transformer.from_pretrained(path)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    p = lambda n: SamplingParams(n=n, temperature=1.0, max_tokens=6, stop_token_ids=[], seed=3)  # noqa: E731
    sampler = Sampler(model, gen_batch=64)
    first = sampler.generate(prompts[:3], p(2))
    assert sampler.cache.slots == 6
    sampler.generate(prompts, p(4))
    assert sampler.cache.slots == 20
    sampler.generate(prompts[:3], p(2))
    assert sampler.cache.slots == 20  # kept: never shrunk within the sampler's life
    assert Sampler(model, gen_batch=64).generate([], p(2)) == []  # a rank whose share is empty
    sampler.release()
    assert sampler.weights is None and sampler.cache is None
    assert [c.token_ids for c in sampler.generate(prompts[:3], p(2))] == [c.token_ids for c in first]
    assert Sampler(model, gen_batch=4).generate(prompts[:3], p(2))[5].token_ids == first[5].token_ids


def test_batch_buckets(tiny_dir, monkeypatch):
    """buckets=True (what CUDA graphs decode): each step computes the live rows' count rounded up
    to a power of two (capped at the slots), the extra slots idle, and the tokens and log-probs
    are those of exact batches."""
    from grpo.engine.sampler import bucket
    assert [bucket(n, 48) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    path, _ = tiny_dir("qwen2", vocab_size=1000)
    model = Transformer.from_pretrained(path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (int(torch.randint(2, 30, (), generator=g)),), generator=g).tolist() for _ in range(5)]
    p = SamplingParams(n=3, temperature=1.0, max_tokens=30, stop_token_ids=list(range(3, 33)), seed=7)
    plain = Sampler(model, gen_batch=12)
    exact = plain.generate(prompts, p)
    rows = _decoded_rows(monkeypatch)
    sampler = Sampler(model, gen_batch=12, buckets=True)
    bucketed = sampler.generate(prompts, p)
    assert set(rows) <= {1, 2, 4, 8, 12} and len(set(rows)) >= 3, rows
    # the sampler's own counts: the rows the steps decoded, and the live rows among them
    assert sampler.decode_steps == len(rows) and sampler.rows_decoded == sum(rows)
    assert plain.rows_decoded == plain.rows_live == sampler.rows_live < sampler.rows_decoded
    assert [c.token_ids for c in bucketed] == [c.token_ids for c in exact]
    flat = lambda out: [lp for c in out for lp in c.logprobs]
    assert flat(bucketed) == pytest.approx(flat(exact), abs=1e-5)


def _mock_graphs(sampler, monkeypatch) -> list:
    """CUDA graphs on a CPU: the sampler takes its graphed path (buckets, a window a graph), each
    'capture' recorded by its key and 'replayed' as the same decode steps run eagerly."""
    from grpo.engine.runner import Runner
    from grpo.engine.window import decode_step
    captured = []

    def graph(self, p, num_slots, cache_len):
        key = (num_slots, cache_len, p.temperature, p.top_k, p.top_p, p.min_p)
        if key not in self.graphs:
            captured.append(key)
            self.graphs[key] = types.SimpleNamespace(replay=lambda: [
                decode_step(self.weights, self.cache, self.state, p, num_slots, cache_len, c)
                for c in range(self.window)])
        return self.graphs[key]

    monkeypatch.setattr(Runner, "_graph", graph)
    sampler.runner.use_graphs = True
    return captured


def test_graphs_captured_per_power_of_two_cache_bucket_and_kept_across_calls(tiny_dir, monkeypatch):
    """A graph per (batch bucket, cache bucket, sampling settings). Cache buckets are powers of two
    from 256 (a row of 2,000 tokens: 256, 512, 1024 and the cap, 2048; a step of 256 made 8), and a
    later call, with the rollouts' settings or an eval's, replays what was captured: only new
    settings capture (an eval's greedy decode, once)."""
    from grpo.engine.sampler import cache_bucket
    assert [cache_bucket(n, 8704) for n in (1, 256, 257, 1000, 4097, 8193)] == [256, 256, 512, 1024, 8192, 8704]
    path, _ = tiny_dir("llama", vocab_size=1000)
    model = Transformer.from_pretrained(path)
    sampler = Sampler(model, gen_batch=8, sync_every=8, buckets=True, pipeline=True)
    captured = _mock_graphs(sampler, monkeypatch)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    rollout = SamplingParams(n=4, temperature=1.0, max_tokens=2000, stop_token_ids=[7, 9], seed=1)
    out = sampler.generate(prompts, rollout)
    lengths = sorted(len(c.token_ids) for c in out)
    assert lengths[0] < 1000 and lengths[-1] == 2000, lengths  # rows stop apart: several batch buckets
    caches = sorted({k[1] for k in captured})
    assert caches == [256, 512, 1024, 2048] == [256, 512, 1024, sampler.cache.max_seq_len], caches
    batches = {k[0] for k in captured}
    assert batches <= {1, 2, 4, 8} and len(batches) >= 3, batches
    assert len(captured) <= len(batches) * len(caches)
    first = len(captured)
    again = sampler.generate(prompts, rollout)   # the next step's rollouts: nothing captured
    assert len(captured) == first and [c.token_ids for c in again] == [c.token_ids for c in out]
    greedy = dataclasses.replace(rollout, n=1, temperature=0.0, max_tokens=300)
    sampler.generate(prompts, greedy)            # an eval: its own settings, captured once
    evals = len(captured) - first
    assert evals > 0 and all(k[2] == 0.0 for k in captured[first:])
    sampler.generate(prompts, greedy)
    assert len(captured) == first + evals


def test_no_pageable_host_to_device_copy_in_the_loop(tiny_dir, monkeypatch):
    """Every host value the loop sends to the device (admissions, tool turns' prefills, compaction's
    forks, rows stopped by the host) goes through kv_cache.to_device: page-locked and asynchronous
    on CUDA, where torch.tensor(..., device=cuda) waits for the window in flight to finish. Checked
    on the graphed path (mocked) with more rows than slots, tool calls and early stops."""
    import inspect

    import grpo.engine.kv_cache as kv_cache
    direct, inner = [], torch.tensor

    def tensor(*args, **kw):
        caller = inspect.stack()[1].filename
        if kw.get("device") is not None and "/grpo/" in caller.replace("\\", "/"):
            direct.append(caller)
        return inner(*args, **kw)

    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    sampler = Sampler(model, gen_batch=4, sync_every=4, buckets=True, pipeline=True)
    _mock_graphs(sampler, monkeypatch)
    monkeypatch.setattr(torch, "tensor", tensor)
    p = SamplingParams(n=4, temperature=1.0, max_tokens=40, stop_token_ids=[7], tool_stop_token_ids=[3, 6, 9],
                       max_turns=3, seed=4)
    out = sampler.generate([[4, 5, 6], [8, 9]], p, tool=lambda index, ids: [11, 12])
    assert direct == [] and len(out) == 8
    assert any(c.num_turns > 1 for c in out) and len({len(c.token_ids) for c in out}) > 1
    # and the CUDA branch: page-locked, then a non-blocking copy (torch's pinned memory needs a GPU: mocked)
    seen = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: seen.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: seen.append((a, kw)) or t)
    assert kv_cache.to_device([1, 2], "cuda").tolist() == [1, 2]
    assert seen == ["pin", (("cuda",), {"non_blocking": True})]


def test_filter_masks_exact():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0, -1.0]])
    logp = logits.log_softmax(-1)
    p = logp.exp()[0]
    assert filter_mask(logp, 2, 1.0, 0.0)[0].tolist() == [True, False, True, False, True, False]  # tie at the 2nd: both
    mass = p[0]  # top-p 0.6: token 0 alone holds p[0] < 0.6, so the next (token 2) crosses and stays, and
    assert mass < 0.6 < mass + p[2]  # token 4, tied with it: a kept set is every token at or above its edge
    assert filter_mask(logp, 0, 0.6, 0.0)[0].tolist() == [True, False, True, False, True, False]
    assert filter_mask(logp, 0, 0.5, 0.0)[0].tolist() == [True, False, False, False, False, False]
    assert filter_mask(logp, 0, 1.0, 0.3)[0].tolist() == (p >= 0.3 * p.max()).tolist()
    assert filter_mask(logp, 1, 0.5, 0.0)[0].tolist() == [True] + [False] * 5


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (4, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.1), (5, 0.8, 0.05)])
def test_sampled_frequencies_follow_filtered_distribution(top_k, top_p, min_p):
    torch.manual_seed(0)
    V, N, T = 12, 40_000, 0.8
    logits = torch.randn(V) * 1.5
    key, step = torch.arange(N), torch.zeros(N, dtype=torch.int64)  # N requests' first tokens
    tokens, logprobs = sample(logits.expand(N, V), key, step, T, top_k, top_p, min_p)
    logp = (logits / T).log_softmax(-1)
    keep = filter_mask(logp[None], top_k, top_p, min_p)[0]
    expected = logp.exp() * keep / (logp.exp() * keep).sum()
    counts = torch.bincount(tokens, minlength=V).float()
    assert (counts[~keep] == 0).all(), "a filtered token was sampled"
    chi2 = ((counts - N * expected)[keep] ** 2 / (N * expected[keep])).sum()
    assert chi2 < 30, f"chi2={chi2:.1f} over {int(keep.sum())} bins"  # dof <= 11: p < 1e-3 for a true match
    torch.testing.assert_close(logprobs, expected.log()[tokens])  # log-probs of the kept set, renormalised


def test_choice_stable_under_logit_noise():
    """A different batch rounds the logits differently; the race's choice must not move with
    it. Inverse-CDF sampling with one uniform per row flipped 4 of these 2000 rows."""
    torch.manual_seed(0)
    N, V = 2000, 4000
    logits = torch.randn(N, V) * 3
    noisy = logits + 1e-5 * torch.randn(N, V)  # about fp32 matmul rounding at |logits| ~ 10-100
    key, step = torch.arange(N), torch.zeros(N, dtype=torch.int64)
    assert torch.equal(sample(logits, key, step, 1.0)[0], sample(noisy, key, step, 1.0)[0])


def test_noise_bits_as_defined_in_int64():
    """gumbel() runs its integer passes on int32; the bits are murmur3's finalizer on int64 (the
    definition the Triton kernel implements), at every position of a vocabulary chunk."""
    from grpo.kernels.reference import GOLDEN, MASK32, mix32

    def int64_definition(key, step, V, start):
        seed = mix32((key >> 32) ^ mix32(key ^ mix32(step * GOLDEN + 0x165667B1)))
        x = seed[:, None] ^ (torch.arange(start, start + V) * GOLDEN & MASK32)
        x = ((x ^ (x >> 16)) * 0x85EBCA6B) & MASK32
        x = (((x ^ (x >> 13)) * 0xC2B2AE35) & MASK32) >> 9
        return -(-((x.float() + 0.5) * 2.0**-23).log()).log()
    g = torch.Generator().manual_seed(3)
    key = torch.randint(-2**62, 2**62, (33,), generator=g)
    step = torch.randint(0, 10_000, (33,), generator=g)
    for V, start in ((4099, 0), (2048, 47_104), (5, 151_931)):
        assert torch.equal(gumbel(key, step, V, start), int64_definition(key, step, V, start)), (V, start)


def test_the_loops_scores_are_gumbels_bits():
    """sample_hidden's loop and _race score z - log E (log_exp_noise, the seeds' and the vocabulary's
    bits made once a step) rather than gumbel() + z: the same bits at every token, chunk or not."""
    from grpo.kernels.reference import int32_bits, log_exp_noise, noise_seed, weyl_bits
    g = torch.Generator().manual_seed(5)
    key = torch.randint(-2**62, 2**62, (17,), generator=g)
    step = torch.randint(0, 10_000, (17,), generator=g)
    for V, start in ((4099, 0), (2048, 47_104), (3, 151_933)):
        z = 30 * torch.randn(17, V, generator=g)  # logits far apart and close together
        ours = torch.sub(z, log_exp_noise(int32_bits(noise_seed(key, step)), weyl_bits(start, V, "cpu")))
        assert torch.equal(ours, gumbel(key, step, V, start) + z), (V, start)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampling_from_hidden_states_in_chunks(temperature):
    """sample_hidden (the CPU decode's LM head and race a vocabulary chunk at a time, no (B, V)
    logits) draws sample()'s tokens from the same logits, with a vocabulary that is not a
    multiple of the chunk; log-probs to fp32 rounding (the log-sum-exp is combined per chunk)."""
    g = torch.Generator().manual_seed(4)
    B, H, V = 19, 24, 1003
    hidden, weight = torch.randn(B, H, generator=g), torch.randn(V, H, generator=g) / 2
    key, step = torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 500, (B,), generator=g)
    tokens, lp = sample(hidden @ weight.T, key, step, temperature)
    for chunk in (64, 100, 1003, 4096):
        t, l = sample_hidden(hidden, weight, key, step, temperature, chunk=chunk)
        assert torch.equal(t, tokens), chunk
        torch.testing.assert_close(l, lp, atol=1e-5, rtol=0)
    filtered = sample_hidden(hidden, weight, key, step, 1.0, top_k=5)  # filters take the full-logits path
    assert torch.equal(filtered[0], sample(hidden @ weight.T, key, step, 1.0, top_k=5)[0])


@pytest.mark.parametrize("filtered", [False, True])
def test_bf16_lm_head_samples_from_fp32_logits(tiny_dir, filtered):
    """A 16-bit LM head (a GPU's compute dtype) gives the sampler fp32 logits summed in fp32, as the
    trainer's log-probs are: a sampled token's log-prob is float64's to fp32 rounding, not to a bf16
    rounding of each logit (a relative 2^-9: ~3e-2 at these logits' size). The decode's LM head
    (sample_hidden, both paths) and prefill's (the model's output_index) alike; on a GPU the same
    comes from one cuBLAS GEMM with an fp32 output (checked here for its shape and dtype on meta)."""
    from grpo.models.model import lm_logits
    g = torch.Generator().manual_seed(5)
    B, H, V = 6, 64, 999
    hidden = (torch.randn(B, H, generator=g) * 2).bfloat16()
    weight = (torch.randn(V, H, generator=g) * 2).bfloat16()
    key, step = torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 500, (B,), generator=g)
    exact = (hidden.double() @ weight.double().T).log_softmax(-1)  # (B, V)
    tok, lp = sample_hidden(hidden, weight, key, step, 1.0, top_k=V if filtered else 0, chunk=256)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), exact.gather(-1, tok[:, None])[:, 0], atol=2e-5, rtol=0)
    rounded = (hidden @ weight.T).double().log_softmax(-1)  # what a bf16 LM head gave
    assert (rounded - exact).abs().max() > 1e-2  # so the check above can tell them apart
    meta = lm_logits(torch.empty(3, 2, H, dtype=torch.bfloat16, device="meta"),
                     torch.empty(V, H, dtype=torch.bfloat16, device="meta"))
    assert meta.shape == (3, 2, V) and meta.dtype == torch.float32
    path, _ = tiny_dir("qwen2", vocab_size=1000)
    model = Transformer.from_pretrained(path).bfloat16()
    ids = torch.randint(0, 1000, (2, 9), generator=g)
    with torch.no_grad():
        logits = model(ids, output_index=torch.tensor([[8], [4]]))[:, 0]  # (2, V)
        full = model(ids)[[0, 1], [8, 4]]                                  # (2, V) through nn.Linear: bf16
    assert logits.dtype == torch.float32 and full.dtype == torch.bfloat16 and logits.shape == (2, 1000)
    torch.testing.assert_close(logits.bfloat16(), full, atol=0, rtol=2 ** -7)  # the same sums, rounded
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9  # fp32 values, not bf16 ones


def test_noise_is_gumbel_and_independent():
    """The hashed noise has Gumbel(0, 1) moments, and no correlation between neighbouring
    tokens, positions, or samples of one prompt (requests' keys as the sampler makes them)."""
    G, V = 64, 4096
    key = torch.tensor([request_key(1234, i, j) for i in range(2) for j in range(G // 2)])
    step = torch.arange(G) % 3
    noise = gumbel(key, step, V)  # (G, V)
    assert abs(noise.mean() - 0.5772) < 0.01 and abs(noise.std() - torch.pi / 6 ** 0.5) < 0.01
    corr = lambda a, b: torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs()
    assert corr(noise[:, 1:], noise[:, :-1]) < 0.01  # token v and v + 1
    assert corr(noise[1:], noise[:-1]) < 0.01  # sample j and j + 1 (and prompt 0 / 1 at the seam)
    assert corr(noise, gumbel(key, step + 1, V)) < 0.01  # position t and t + 1
    # 64 x 4096 draws: standard errors ~0.002 (a correlation), 0.0025 (the mean), 0.003 (the std)


def test_request_key_mixes_all_64_bits():
    """Refill prompts are numbered 1 << 40 | i: they must not reuse prompt i's stream (a 32-bit
    mask once cut the flag off), nor may any other triple collide."""
    for seed in (0, 7, -1, 1 << 33):
        for i in range(40):
            for j in range(4):
                assert request_key(seed, (1 << 40) | i, j) != request_key(seed, i, j)
                assert request_key(seed, i, j | (1 << 35)) != request_key(seed, i, j)
        assert request_key(seed ^ (1 << 50), 3, 1) != request_key(seed, 3, 1)
    prompt_ids = list(range(300)) + [(1 << 40) | i for i in range(300)]
    triples = [(s, p, j) for s in (0, 1, 1 << 32, -5) for p in prompt_ids for j in range(4)]
    keys = {request_key(*t) for t in triples}
    assert len(keys) == len(triples) and all(0 <= k < 1 << 63 for k in keys)  # 9600 distinct int64 keys


def test_first_tokens_follow_model_distribution(tiny_dir):
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    prompt = [5, 17, 99, 3]
    N = 3000
    out = Sampler(model, gen_batch=1000).generate([prompt], SamplingParams(n=N, temperature=1.3, top_p=0.9, max_tokens=1,
                                                                          stop_token_ids=[], seed=7))
    with torch.no_grad():
        logp = (model(torch.tensor([prompt]))[0, -1] / 1.3).log_softmax(-1)
    keep = filter_mask(logp[None], 0, 0.9, 0.0)[0]
    expected = logp.exp() * keep / (logp.exp() * keep).sum()
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=len(logp)).float()
    assert (counts[~keep] == 0).all()
    big = expected > 5 / N  # bins with enough mass for a chi-square term
    chi2 = ((counts - N * expected)[big] ** 2 / (N * expected[big])).sum()
    assert chi2 < big.sum() + 5 * big.sum() ** 0.5, f"chi2={chi2:.1f} over {int(big.sum())} bins"


TOOL = 7  # tool-call stop id in the tiny vocabulary


def test_multi_turn_cache_equals_full_history(tiny_dir):
    """Observations are appended to the row's cache: every later log-prob (so every next-token
    distribution) equals a from-scratch forward over the full history."""
    path, _ = tiny_dir("qwen3")
    model = Transformer.from_pretrained(path)
    calls = []

    def tool(index, ids):
        calls.append((index, list(ids)))
        assert ids[-1] in (TOOL, 8, 9)
        return [40 + len(calls) % 5] * (1 + len(calls) % 4)  # observations of 1-4 tokens

    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3]]
    p = SamplingParams(n=3, temperature=1.0, max_tokens=40, stop_token_ids=[0], tool_stop_token_ids=[TOOL, 8, 9],
                       max_turns=4, seed=5)
    out = Sampler(model, gen_batch=4).generate(prompts, p, tool=tool)
    assert calls and any(c.num_turns > 1 for c in out)
    for c in out:
        injected = [k for k, m in enumerate(c.loss_mask) if m == 0]
        assert all(c.logprobs[k] == 0.0 for k in injected)
        assert c.num_turns == 1 + sum(1 for k in range(len(injected)) if k == 0 or injected[k] != injected[k - 1] + 1)
        sampled = torch.tensor(c.loss_mask, dtype=torch.bool)
        expected = full_logprobs(model, prompts[c.prompt_index], c.token_ids, 1.0)[sampled]
        torch.testing.assert_close(torch.tensor(c.logprobs)[sampled], expected, atol=1e-4, rtol=0)
        assert c.finish_reason in ("stop", "length", "turns")
        if c.finish_reason == "turns":
            assert c.num_turns == 4 and c.token_ids[-1] in (TOOL, 8, 9)


def test_tool_endings_and_errors(tiny_dir):
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    p = SamplingParams(n=4, temperature=1.0, max_tokens=30, stop_token_ids=[], tool_stop_token_ids=list(range(0, 131, 3)),
                       seed=1)

    def tool(index, ids):
        if index == 0:
            return None  # ends the row
        if index == 1:
            raise RuntimeError("sandbox crashed")
        return [500] if index == 2 else [11, 12]  # 500: not in the vocabulary

    out = Sampler(model).generate([[4, 5, 6]], p, tool=tool)
    assert out[0].finish_reason == "stop" and out[0].token_ids[-1] % 3 == 0
    assert out[1].finish_reason == "error" and "sandbox crashed" in out[1].error
    assert out[2].finish_reason == "error" and "vocabulary" in out[2].error
    assert out[3].finish_reason in ("turns", "length") and 11 in out[3].token_ids
    no_tool = Sampler(model).generate([[4, 5, 6]], p)  # a tool stop without a tool just stops
    assert all(c.finish_reason == "stop" and c.token_ids[-1] % 3 == 0 for c in no_tool)


def test_slow_tool_does_not_stall_other_rows(tiny_dir):
    """The first tool call blocks until the other rows have made three more calls: it returns
    only if they keep decoding meanwhile (no wall-clock timing, so a busy machine is fine)."""
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    first, others_went_on, lock, seen = [], threading.Event(), threading.Lock(), []

    def tool(index, ids):
        with lock:
            if not first:
                first.append(index)
                blocking = True
            else:
                blocking = False
                seen.append(index)
                if len([i for i in seen if i != first[0]]) >= 3:
                    others_went_on.set()
        if blocking:
            assert others_went_on.wait(timeout=60), "other rows stalled while one tool call ran"
        return [11]

    p = SamplingParams(n=4, temperature=1.0, max_tokens=60, stop_token_ids=[], tool_stop_token_ids=list(range(0, 131, 4)),
                       max_turns=100, seed=2)
    out = Sampler(model).generate([[4, 5, 6]], p, tool=tool)
    assert others_went_on.is_set()
    assert out[first[0]].finish_reason != "error" and out[first[0]].num_turns > 1


class LetterTokenizer:  # a CPU double: token t is one letter, so stop strings span tokens
    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def test_decode_window_equals_single_steps(tiny_dir):
    """The GPU path decodes several steps per host sync (rows that stop mid-window run on and are
    cut back); on CPU, windows of 1 and 5 must give identical rows, stop strings and tools included."""
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    tok = LetterTokenizer()
    p = SamplingParams(n=3, temperature=1.0, max_tokens=40, stop_token_ids=[0], stop_strings=["ab", "zz"],
                       tool_stop_strings=["q"], max_turns=3, seed=17)  # a seed whose rows pass both checks
    tool = lambda index, ids: [50 + index, 51]
    runs = [Sampler(model, tok, gen_batch=4, sync_every=w).generate([[4, 5, 6], [7, 8]], p, tool=tool) for w in (1, 5)]
    strip = lambda c: {**c.__dict__, "logprobs": None}
    assert [strip(c) for c in runs[0]] == [strip(c) for c in runs[1]]
    assert any(c.num_turns > 1 for c in runs[0])  # a tool call
    assert any(tok.decode(c.token_ids[-2:]) == "zz" and c.finish_reason == "stop" for c in runs[0])  # spans 2
    for a, b in zip(*runs):  # the batch differs (rows run on within a window): fp32 op-order noise only
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    for c in runs[0]:
        text = tok.decode(c.token_ids[-2:])
        if c.finish_reason == "stop" and c.token_ids[-1] != 0:
            assert text.endswith(("ab", "zz")) or c.token_ids[-1] % 26 == 16  # a "q" tool call (no tool: stop)


@pytest.mark.parametrize("window", [1, 3])
def test_pipelined_windows_equal_in_turn(tiny_dir, window):
    """pipeline=True (the CUDA default): the next window is launched before the last one's tokens
    are taken, so the host acts a window late (stop strings, tool calls, finishes, compaction and
    admission into freed slots). On a CPU the same reordered work must give identical rows."""
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    tok = LetterTokenizer()
    p = SamplingParams(n=3, temperature=1.0, max_tokens=40, stop_token_ids=[0], stop_strings=["ab", "zz"],
                       tool_stop_strings=["q"], max_turns=3, seed=17)
    tool = lambda index, ids: [50 + index, 51]
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12], [13]]
    runs = [Sampler(model, tok, gen_batch=5, sync_every=window, pipeline=pipe, buckets=pipe).generate(
        prompts, p, tool=tool) for pipe in (False, True)]
    strip = lambda c: {**c.__dict__, "logprobs": None}
    assert [strip(c) for c in runs[1]] == [strip(c) for c in runs[0]]
    assert {c.finish_reason for c in runs[0]} >= {"stop"} and any(c.num_turns > 1 for c in runs[0])
    for a, b in zip(*runs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    seqs, cuts = [list(range(3, 30)), list(range(40, 60))], [[5, 17, 27], [3, 20]]
    q = SamplingParams(n=2, temperature=1.0, max_tokens=12, stop_token_ids=[1, 2, 3], seed=4)
    cont = [Sampler(model, gen_batch=4, sync_every=window, pipeline=pipe).continue_from(seqs, cuts, q)
            for pipe in (False, True)]
    assert [c.token_ids for c in cont[1]] == [c.token_ids for c in cont[0]]


def test_bad_requests_fail_alone(tiny_dir):
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    sampler = Sampler(model, max_seq_len=32)
    out = sampler.generate([[1, 2], [], [1, 999], list(range(40)), [3, 4]],
                           SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[]))
    assert [c.finish_reason for c in out[1:4]] == ["error"] * 3
    assert "empty" in out[1].error and "vocabulary" in out[2].error and "max_seq_len" in out[3].error
    assert len(out[0].token_ids) == 8 and len(out[4].token_ids) == 8
    for bad in (dict(max_tokens=0), dict(n=0), dict(temperature=-1), dict(top_p=0)):
        with pytest.raises(ValueError, match="SamplingParams needs"):
            SamplingParams(**bad)
    long = sampler.generate([list(range(1, 28))], SamplingParams(temperature=0, max_tokens=100, stop_token_ids=[]))
    assert len(long[0].token_ids) == 32 - 27 and long[0].finish_reason == "length"  # the cache row is full
    small = Sampler(model, kv_budget_bytes=KVCache.slot_bytes(model.args, 20, torch.float32))  # one row of 20 tokens
    out = small.generate([list(range(1, 26)), [1, 2, 3]], SamplingParams(max_tokens=50, stop_token_ids=[], seed=0))
    assert out[0].finish_reason == "error" and "max_seq_len=20" in out[0].error
    assert len(out[1].token_ids) == 17 and out[1].finish_reason == "length"


def test_model_left_as_found(tiny_dir):
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Sampler(model).generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0))
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_autocast_casts_each_weight_once_per_call_and_never_a_stale_one(tiny_dir, monkeypatch):
    """Under autocast_bf16 a call casts each block weight to bf16 once for its prefills (the
    autocast cache, kept alive for the call) and copies it once into the decode weights (bf16),
    not once per forward or decode step; after the weights change in place the next call sees
    the new ones, also inside a caller's autocast, where torch would keep the cache."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountWeightCasts(TorchDispatchMode):
        def __init__(self, params):
            super().__init__()
            self.ptrs, self.casts, self.copies = {p.data_ptr() for p in params}, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
                self.casts += 1
            if func is torch.ops.aten.copy_.default and args[1].data_ptr() in self.ptrs:
                self.copies += 1  # DecodeWeights.refresh
            return func(*args, **(kwargs or {}))

    path, _ = tiny_dir("llama", vocab_size=1000)
    model = Transformer.from_pretrained(path)
    model.autocast_bf16 = True
    weights = [p for blk in model.layers for n, p in blk.named_parameters() if p.dim() == 2]
    p = SamplingParams(n=2, temperature=0, max_tokens=12, stop_token_ids=[])
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    forwards = _decoded_rows(monkeypatch)  # one entry per decode step
    hook = model.register_forward_hook(lambda *a: forwards.append(1))
    counter = CountWeightCasts(weights)
    with counter:
        first = Sampler(model).generate(prompts, p)
    hook.remove()
    assert len(forwards) > 5 and counter.casts == len(weights) and counter.copies == len(weights)
    with torch.autocast("cpu", enabled=False):  # a caller's autocast: torch would keep the cache on exit
        Sampler(model).generate(prompts, p)
        with torch.no_grad():
            for w in weights:
                w.mul_(-1.5)
        second = Sampler(model).generate(prompts, p)
    fresh = Transformer.from_pretrained(path)
    fresh.load_state_dict(model.state_dict())
    fresh.autocast_bf16 = True
    assert [c.token_ids for c in second] == [c.token_ids for c in Sampler(fresh).generate(prompts, p)]
    assert [c.token_ids for c in second] != [c.token_ids for c in first]


def test_sampling_and_update_bars_without_tqdm(tiny_dir, monkeypatch):
    """bench/gpu_check.py runs on a bare GPU box (torch and triton only): with tqdm not importable,
    a sampler call with progress=True samples as usual and the update's bar does nothing."""
    import sys

    from grpo.update import progress_bar
    path, _ = tiny_dir("llama", vocab_size=1000)
    model = Transformer.from_pretrained(path)
    p = SamplingParams(n=2, temperature=1.0, max_tokens=5, stop_token_ids=[], seed=1)
    want = [c.token_ids for c in Sampler(model).generate([[5, 6, 7]], p)]
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    assert [c.token_ids for c in Sampler(model).generate([[5, 6, 7]], p, progress=True)] == want
    bar = progress_bar(3)
    assert bar.disable and bar.update(1) is None and bar.close() is None


def test_max_turn_tokens_bounds_each_turn(tiny_dir):
    """max_turn_tokens: no assistant turn samples more than that many tokens (the calculator
    reference's eval: 1,000 a turn); a turn that reaches it ends the row ("length"), as the reference's
    runner took a cut turn as the last one; the whole completion may be longer than one turn's limit."""
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    p = SamplingParams(n=4, temperature=1.0, max_tokens=200, stop_token_ids=[], tool_stop_token_ids=list(range(0, 131, 9)),
                       max_turns=50, max_turn_tokens=12, seed=3)
    out = Sampler(model).generate([[4, 5, 6], [7, 8]], p, tool=lambda index, ids: [11, 12, 13])
    for c in out:
        turns, start = [], 0
        for k in range(1, len(c.loss_mask) + 1):  # sampled runs between injected observations
            if k == len(c.loss_mask) or c.loss_mask[k] != c.loss_mask[k - 1]:
                if c.loss_mask[start]:
                    turns.append(k - start)
                start = k
        assert max(turns) <= 12, (turns, c.finish_reason)
        if c.finish_reason == "length" and len(c.token_ids) < 200:  # not the whole completion's limit
            assert turns[-1] == 12, turns
    assert any(c.num_turns > 1 for c in out) and any(len(c.token_ids) > 12 for c in out)
    assert any(c.finish_reason == "length" and len(c.token_ids) < 200 for c in out)
    with pytest.raises(ValueError, match="max_turn_tokens"):
        SamplingParams(max_turn_tokens=-1)


def test_tool_turns_read_nothing_back_inside_the_loop(tiny_dir, monkeypatch):
    """A tool turn's observation reaches the device, and the token after it is drawn there, with no read of
    the batch state: from the first window on, the loop's only host syncs are each window's one read of its
    tokens (Runner.read). Counted on the graphed path (mocked CUDA graphs: buckets, pipelined windows) with
    tool turns, through both observation forwards (a CPU's through the decode weights, the model's own):
    value reads (tolist, item, int(), bool()) and outputs sized by values (nonzero, ...). Before, each tool
    turn read its next token back, and a CPU's observation forward its real tokens' places and span."""
    from grpo.engine.runner import Runner
    from grpo.measure.kernel_count import OpCount
    from torch.utils._python_dispatch import TorchDispatchMode

    counting, syncs, reads = [False], [], []

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__  # repeat_interleave by an int repeat sizes nothing by values
            if counting[0] and name in OpCount.SYNCS and not (name == "repeat_interleave" and
                                                              not isinstance(args[1], torch.Tensor)):
                syncs.append(name)
            return func(*args, **(kwargs or {}))

    def host_read(method):
        inner = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda t, *a: (counting[0] and syncs.append(method), inner(t, *a))[1])

    def read(self, window):  # the window's own read: not counted
        counting[0] = False
        reads.append(1)
        try:
            return real_read(self, window)
        finally:
            counting[0] = True

    def launch(self, *args):  # counting from the first window on (the first admission's prefill reads its
        counting[0] = True    # packed documents' bounds back, in the model: once, before the loop decodes)
        return real_launch(self, *args)

    for method in ("tolist", "item", "numpy"):
        host_read(method)
    real_read, real_launch = Runner.read, Runner.launch
    monkeypatch.setattr(Runner, "read", read)
    monkeypatch.setattr(Runner, "launch", launch)
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    p = SamplingParams(n=4, temperature=1.0, max_tokens=40, stop_token_ids=[7], tool_stop_token_ids=[3, 6, 9],
                       max_turns=3, seed=4)
    for extend in (True, False):
        # every row in at once
        sampler = Sampler(model, gen_batch=8, sync_every=4, buckets=True, pipeline=True)
        _mock_graphs(sampler, monkeypatch)
        sampler.runner.extend = extend
        launched = sampler.decode_steps
        with Syncs():
            out = sampler.generate([[4, 5, 6], [8, 9]], p, tool=lambda index, ids: [11, 12])
        counting[0] = False
        assert sum(c.num_turns - 1 for c in out) >= 4, "tool turns inside the loop"
        assert syncs == [] and len(reads) == (sampler.decode_steps - launched) // 4, (extend, syncs)
        reads.clear()


def test_inactive_slots_attend_over_their_first_key(tiny_dir, monkeypatch):
    """A slot that does not decode in a step (a row in a tool call, a finished or free slot in a bucket)
    attends over its first key, not over its stale length: each layer's attention reads pos + 1 keys for a
    decoding row and 1 for the others (on the SDPA path, the key mask says the same). Their outputs are
    dropped, and what they write at pos is written again before it is read: the tokens are an exact
    batch's."""
    import grpo.engine.decode as decode
    import grpo.engine.window as window
    step, checked, attend, hidden = {}, [], decode._attend, window.decode_hidden

    def decode_hidden(w, cache, tok, pos, n, span, **kw):
        step.update(pos=pos.clone(), active=kw["active"].clone())
        return hidden(w, cache, tok, pos, n, span, **kw)

    def _attend(q, k, v, slot, length, span, bias, kernel):
        want = torch.where(step["active"], step["pos"] + 1, 1)
        assert torch.equal(length, want)
        open_keys = None if bias is None else (bias[:, 0, 0] == 0).sum(-1)  # the SDPA path's key mask
        assert bias is None or torch.equal(open_keys, torch.minimum(want, torch.tensor(span)))
        checked.append(int((~step["active"] & (step["pos"] > 0)).sum()))
        return attend(q, k, v, slot, length, span, bias, kernel)

    path, _ = tiny_dir("qwen3")
    model = Transformer.from_pretrained(path)
    p = SamplingParams(n=3, temperature=1.0, max_tokens=30, stop_token_ids=[0], tool_stop_token_ids=[7, 8, 9],
                       max_turns=4, seed=5)
    tool = lambda index, ids: [40 + index % 5] * (1 + index % 3)  # noqa: E731
    exact = Sampler(model, gen_batch=6).generate([[1, 2, 3], [9, 8, 7, 6, 5]], p, tool=tool)
    monkeypatch.setattr(window, "decode_hidden", decode_hidden)
    monkeypatch.setattr(decode, "_attend", _attend)
    bucketed = Sampler(model, gen_batch=6, buckets=True, sync_every=3)
    out = bucketed.generate([[1, 2, 3], [9, 8, 7, 6, 5]], p, tool=tool)
    assert sum(checked) > 0, "inactive slots past their first position"
    assert [c.token_ids for c in out] == [c.token_ids for c in exact]
    assert any(c.num_turns > 1 for c in out)


def test_a_16_bit_lm_head_in_fp32_once_per_call_where_mm_gives_no_fp32(tiny_dir, monkeypatch):
    """Where torch.mm cannot give 16-bit operands an fp32 output (older PyTorch on CUDA), the logits came from
    fp32 copies of both operands (grpo.kernels.scaled_logits' fallback), the whole LM head's at every decode
    step. The decode weights keep one fp32 copy of the head, made once per call, and the tokens and log-probs
    are the same (mocked: a bf16 model on a CPU taken for such a GPU; top-k reads the whole head's logits)."""
    import grpo.engine.decode as decode
    from torch.utils._python_dispatch import TorchDispatchMode

    path, _ = tiny_dir("qwen2", vocab_size=1000)
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16)
    head = model.lm_head.weight

    class HeadCopies(TorchDispatchMode):  # the head read into a new fp32 tensor, or copied into one
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
                self.copies += src.data_ptr() == head.data_ptr() and src.shape == head.shape
            return func(*args, **(kwargs or {}))

    p = SamplingParams(n=2, temperature=1.0, top_k=50, max_tokens=12, stop_token_ids=[], seed=3)
    runs = []
    for fp32_head in (False, True):
        monkeypatch.setattr(decode, "needs_head32", lambda w, on=fp32_head: on and w.dtype == torch.bfloat16)
        sampler, count = Sampler(model), HeadCopies()
        with count:
            runs.append(sampler.generate([[5, 6, 7], [8, 9]], p))
        steps = sampler.decode_steps
        # prefills read the model's own head (fp32 copies there, once a prefill, not a step)
        assert (sampler.weights.head32 is not None) == fp32_head
        assert count.copies == (1 + 1 if fp32_head else steps + 1), (fp32_head, count.copies, steps)
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    assert [c.logprobs for c in runs[0]] == [c.logprobs for c in runs[1]]
