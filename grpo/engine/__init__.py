"""The rollout engine: a batched KV-cache sampler over the training weights, read in place.

Its door is `grpo.engine.sampler.Sampler(model, tokenizer).generate(prompts, SamplingParams(...), tool)`,
its loop: admit, resume, decode window, finish. Inside: the host's Scheduler (scheduler.py: queue, slots,
admission and forks, accepted tokens, stops, tool turns; what a call holds: rows.py), the device's Runner
(runner.py: prefill and observation forwards, decode windows, buckets, graphs, host buffers), a decode
window's device side (window.py), the decode step over resident weights (decode.py, model_decode.py), the
caches (kv_cache.py, hybrid_cache.py) and the sampling rule (sampling.py). It imports the models and the
kernels, never the GRPO story, fit or infra."""
