"""The rollout engine's door: a batched KV-cache sampler over the model's own blocks.

    Sampler(model, tokenizer).generate(prompts, SamplingParams(n=8, max_tokens=500), tool)
    Sampler(model).continue_from(sequences, cuts, params)  # n continuations of each sequences[i][:c]

Two parts around one short loop, in nano-vllm's shape: the host's Scheduler (grpo/engine/scheduler.py: the
queue, slots and rows, admission and forks, the tokens each window hands back, stop strings, finishing, tool
dispatch) and the device's Runner (grpo/engine/runner.py: the model, the decode weights, the cache, the
decode state, buckets, graphs and host buffers; prefill and observation forwards, decode windows). The loop:
  1. admit   waiting requests take free cache slots: fresh prompts are prefilled packed in
             one row (no padding), once per prompt, then forked into the slots of its n samples.
             `continue_from` makes one document of a sequence's prefixes: the sequence is
             prefilled once, up to its longest cut, and each cut's rows fork that KV truncated
             at the cut (a causal prefix's keys and values do not depend on what follows);
  2. resume  rows whose tool call returned get the observation appended to their cache;
  3. decode  a window of steps over the occupied slots on device (grpo/engine/window.py's `decode_step`
             over the resident decode weights of grpo/engine/decode.py; stop and length checks on device
             too), then one host sync to read the tokens back;
  4. finish  stops, stop strings (grpo/engine/stops.py), tool calls (run in a thread pool, so the other rows
             keep decoding) and length; a finished row frees its slot for the next request
             (continuous batching).
Randomness is per request (grpo/engine/sampling.py), so results do not depend on the batch.
Live rows are kept in the lowest slots. On CUDA a decode window is one CUDA graph over the smallest
power-of-two batch bucket that holds them and a power-of-two span of keys (cache_bucket); the graphs,
the cache, the decode state and the decode weights stay for the sampler's life (evals included, where
keep_kv_cache), so each graph is captured once per run and replayed by every later call (flash-attn's
KV-cache kernel is used when importable). On CPU the window is a single eager step over exactly the
occupied slots. Multi-turn tool calls (resume) and prefix continuations (continue_from) share the loop
with plain sampling; what a call holds is grpo/engine/rows.py (SamplingParams, Completion, its rows).
"""
import torch

from grpo.engine.rows import Call, Completion, SamplingParams, public
from grpo.engine.runner import Runner
from grpo.engine.scheduler import Scheduler
from grpo.engine.window import bucket, cache_bucket, decode_step

# the public names
__all__ = ["Sampler", "SamplingParams", "Completion", "decode_step", "bucket", "cache_bucket"]


class _Part:
    """A sampler attribute that lives in one of its parts: Sampler.cache reads and writes
    Sampler.runner.cache. Only the model, the cache and decode weights callers inspect, and the cost
    counters; the rest is reached through the parts (sampler.runner.use_graphs, sampler.scheduler.pool)."""
    def __init__(self, part: str):
        self.part = part

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value):
        setattr(getattr(obj, self.part), self.name, value)


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
    decode_steps, rows_decoded (rows x steps computed) and rows_live (of those, the ones that drew a
    token)."""
    model, cache, weights = (_Part("runner") for _ in range(3))
    tokens_prefilled, capture_seconds, decode_steps = (_Part("runner") for _ in range(3))
    rows_decoded, rows_live = _Part("runner"), _Part("runner")

    def __init__(self, model, tokenizer=None, gen_batch: int = 64, max_seq_len: int | None = None,
                 kv_budget_bytes: int | None = None, prefill_tokens: int | None = None,
                 sync_every: int | None = None, cuda_graphs: bool = True, tool_workers: int = 8,
                 buckets: bool | None = None, pipeline: bool | None = None):
        self.runner = Runner(model, gen_batch, max_seq_len, kv_budget_bytes, prefill_tokens, sync_every,
                             cuda_graphs, buckets)
        pipeline = self.runner.use_graphs if pipeline is None else pipeline
        self.scheduler = Scheduler(self.runner, tokenizer, tool_workers, pipeline)

    def release(self, weights: bool = True):
        """Free the KV cache, the graphs that read it and the resident decode weights (Runner.release)."""
        self.runner.release(weights)

    def close(self):
        """Stop the tool-call threads (a sampler that is done: it takes no tool call after this)."""
        self.scheduler.pool.shutdown()

    @torch.no_grad()  # not inference_mode: under it autocast does not cache its weight casts (see _run)
    def generate(self, prompts: list[list[int]], params: SamplingParams, tool=None,
                 prompt_ids: list[int] | None = None, progress: bool = False) -> list[Completion]:
        """n completions per prompt, in prompt order (prompt i's samples at i*n .. i*n+n-1).
        `tool(index, completion_ids) -> observation ids | None` is called from a worker thread
        when a row stops on a tool-call stop. `prompt_ids`: global prompt indices for seeding."""
        return self._run(self.scheduler.start(prompts, params, tool, prompt_ids, progress))

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
        return self._run(self.scheduler.start(prompts, params, None, prompt_ids, progress, docs))

    def _run(self, call: Call) -> list[Completion]:
        # A disabled autocast around the loop keeps torch's autocast cache alive between forwards:
        # under the model's autocast_bf16 each weight is cast to bf16 once per call, not once per
        # decode step (CPU, SmolLM2-135M, 48 rows: ~110 -> ~93 ms a step). The weights do not change
        # during a call; the cache is dropped at its end, also when a caller's autocast encloses it.
        sched = self.scheduler
        try:
            with torch.autocast(self.runner.device.type, enabled=False):
                while call.busy:
                    sched.admit(call)  # 1. waiting rows into free slots: prefill, forks, first tokens
                    sched.resume(call)  # 2. rows back from a tool call: the observation into the cache
                    if sched.decoding(call):  # 3. a decode window; 4. finish: a window's tokens taken
                        sched.take(call, sched.launch(call))  # (pipelined: the window before this one)
                    elif call.in_flight:  # nothing left to launch: the last window's tokens
                        sched.take(call, sched.drain(call))
                    else:  # every live row in a tool call
                        sched.wait(call)
        finally:
            torch.clear_autocast_cache()
        call.bar.close()
        return [c if type(c) is Completion else public(c) for c in call.out]
