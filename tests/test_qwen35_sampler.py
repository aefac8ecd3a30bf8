"""The sampler on Qwen3.5's hybrid models (grpo/engine/hybrid_cache.py, grpo/engine/model_decode.py): per-row linear state
beside the attention layers' KV cache, against transformers' generate, a fresh prefill, and the trainer's
log-probs; tool turns; LoRA on the linear layers' projections."""
import time

import pytest
import torch
import transformers
from test_qwen35 import ATOL, hybrid_dir  # noqa: F401  (hybrid_dir: a fixture)

from grpo.config import TARGETS
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.models.lora import LoraSettings, adapters, add_lora
from grpo.models.model import Transformer


def trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """What the trainer scores: the labels path (fused log-probs) over the whole text from scratch."""
    ids = torch.tensor([prompt + completion])
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt) - 1:-1] = torch.tensor(completion)
    with torch.no_grad():
        return model(ids, labels=labels, temperature=temperature)[0, len(prompt) - 1:-1]


PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [40], [17, 18, 19, 20, 21, 22, 23]]

# fp32, sampler against trainer: the packed prefill, recurrent steps and chunked observations against one
# chunked forward differ in op order only, but the gated RMSNorm divides a head's output by its rms, down to
# sqrt(eps) = 1e-3 for a head that reads nearly nothing: up to 1000x its rounding (4e-5 seen, most under 1e-6;
# attention-only models: 4e-6). In float64 the same comparison leaves only the sampling's own fp32 (5e-7)
FP32_GAP = 1e-4


@pytest.mark.parametrize("gen_batch,n", [(64, 1), (3, 2)])  # all in at once; fewer slots than rows
def test_greedy_matches_transformers_generate(hybrid_dir, gen_batch, n):
    path, ref = hybrid_dir()
    model = Transformer.from_pretrained(path)
    out = Sampler(model, gen_batch=gen_batch).generate(
        PROMPTS, SamplingParams(n=n, temperature=0, max_tokens=20, stop_token_ids=[]))
    for c in out:
        p = PROMPTS[c.prompt_index]
        with torch.no_grad():
            expected = ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
        assert c.token_ids == expected, c.prompt_index


def test_forked_samples_equal_fresh_prefill_and_trainer(hybrid_dir):
    """n samples of a prompt fork its prefilled state (all at once, or prefilled again as slots free
    up): the same tokens either way, and each token's log-prob is the trainer's over the whole text."""
    path, _ = hybrid_dir()
    model = Transformer.from_pretrained(path)
    p = SamplingParams(n=4, temperature=1.0, max_tokens=24, stop_token_ids=[5], seed=3)
    runs = [Sampler(model, gen_batch=b).generate(PROMPTS, p) for b in (64, 3, 1)]
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]] == [c.token_ids for c in runs[2]]
    assert len({tuple(c.token_ids) for c in runs[0]}) > 10
    for c in runs[1]:
        expected = trainer_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=FP32_GAP, rtol=0)


def test_sampler_logprobs_are_the_trainers_in_float64(hybrid_dir):
    path, _ = hybrid_dir()
    model = Transformer.from_pretrained(path, dtype=torch.float64)
    p = SamplingParams(n=3, temperature=1.0, max_tokens=24, stop_token_ids=[5], seed=3)
    for c in Sampler(model, gen_batch=4).generate(PROMPTS, p):
        expected = trainer_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)


def test_continue_from_equals_fresh_prefills(hybrid_dir):
    path, _ = hybrid_dir()
    model = Transformer.from_pretrained(path)
    seq = list(range(3, 30))
    cuts = [[20, 4, 11]]
    p = SamplingParams(n=2, temperature=1.0, max_tokens=10, stop_token_ids=[], seed=7)
    expected = Sampler(model).generate([seq[:c] for c in cuts[0]], p)
    for gen_batch in (64, 2):
        out = Sampler(model, gen_batch=gen_batch).continue_from([seq], cuts, p)
        assert [c.token_ids for c in out] == [c.token_ids for c in expected]


TOOL = 7  # tool-call stop id in the tiny vocabulary


def test_tool_turns_extend_the_state(hybrid_dir):
    """Observations of 1-4 tokens (a padded batch when several rows return at once) go through the
    linear layers' state and the attention layers' cache; rows in a tool call meanwhile hold their
    state. Every later log-prob is the trainer's over the full history."""
    path, _ = hybrid_dir()
    model = Transformer.from_pretrained(path)
    calls = []

    def tool(index, ids):
        calls.append(index)
        time.sleep(0.01 * (index % 3))  # some rows stay in their call while others decode
        return [40 + len(calls) % 5] * (1 + len(calls) % 4)

    p = SamplingParams(n=3, temperature=1.0, max_tokens=40, stop_token_ids=[0], tool_stop_token_ids=[TOOL, 8, 9],
                       max_turns=4, seed=5)
    out = Sampler(model, gen_batch=4).generate(PROMPTS[:2], p, tool=tool)
    assert calls and any(c.num_turns > 1 for c in out)
    for c in out:
        sampled = torch.tensor(c.loss_mask, dtype=torch.bool)
        expected = trainer_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, 1.0)[sampled]
        torch.testing.assert_close(torch.tensor(c.logprobs)[sampled], expected, atol=FP32_GAP, rtol=0)


def test_lora_on_every_projection(hybrid_dir, tmp_path):
    """Adapters on the linear layers' five projections as well as attention's and the MLP's: the
    sampler samples the adapted model (its own forward), and the merged export loads in transformers."""
    path, _ = hybrid_dir()
    model = add_lora(Transformer.from_pretrained(path), LoraSettings(r=4, alpha=8, dropout=0.0, targets=TARGETS))
    assert {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad} == set(TARGETS)
    with torch.no_grad():
        for m in adapters(model):
            m.lora_B.normal_(0, 0.1)  # B starts at zero: make the adapters count
    p = SamplingParams(n=2, temperature=1.0, max_tokens=12, stop_token_ids=[], seed=1)
    for c in Sampler(model).generate(PROMPTS[:2], p):
        expected = trainer_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=FP32_GAP, rtol=0)
    model.save_pretrained(tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, 131, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids), atol=ATOL, rtol=0)
