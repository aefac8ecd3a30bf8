"""The rollout engine: a batched KV-cache sampler over the training weights, read in place.

Its door is `grpo.engine.sampler.Sampler(model, tokenizer).generate(prompts, SamplingParams(...), tool)`.
Inside: the host's scheduler (sampler.py: queue, slots, stops, tool turns), what enters the cache
outside decode (prefill.py), a decode window's device side (window.py), the decode step over resident
weights (decode.py, model_decode.py), the caches (kv_cache.py, hybrid_cache.py) and the sampling rule
(sampling.py). It imports the models and the kernels, never the GRPO story, fit or infra."""
