"""grpo.models.model against transformers on the same weights: logits, packing, the KV-cache hook,
save/load round trips, and clear errors on what we do not support."""
import json

import pytest
import safetensors.torch
import torch
import transformers

from grpo.models.model import Transformer

# fp32 on CPU: the two implementations differ only in op order, ~1e-6; 1e-4 leaves room for
# the larger-than-usual random weights of make_hf_model
ATOL = 1e-4

CASES = [  # (family, config overrides): GQA ratios, bias, q/k norm, tied/untied, odd head_dim
    ("llama", {}),                                                            # GQA 3:1, tied (SmolLM2's shape)
    ("llama", dict(num_key_value_heads=6, tie_word_embeddings=False)),        # MHA, untied
    ("llama", dict(hidden_size=54, num_attention_heads=3, num_key_value_heads=1)),  # head_dim 18, not a power of 2
    ("llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8))),  # Llama 3.x rope
    ("qwen2", {}),                                                            # q/k/v bias, untied
    ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),         # MQA, tied
    ("qwen3", {}),                                                            # q/k norm, head_dim 24 != 64/4
    ("qwen3", dict(num_key_value_heads=4, head_dim=10, tie_word_embeddings=False)),  # head_dim 10, MHA
]


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_logits_match_transformers(tiny_dir, family, overrides):
    path, ref = tiny_dir(family, **overrides)
    model = Transformer.from_pretrained(path)
    ids = torch.randint(0, ref.config.vocab_size, (3, 17))
    with torch.no_grad():
        expected = ref(ids).logits
        got = model(ids)
    assert expected.abs().max() > 1.0, "logits too small to catch bugs"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tiny_dir):
    path, ref = tiny_dir("qwen2", max_shard_size="20KB")
    assert (transformers.utils.SAFE_WEIGHTS_INDEX_NAME in {p.name for p in __import__("pathlib").Path(path).iterdir()})
    model = Transformer.from_pretrained(path)
    ids = torch.randint(0, 131, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=ATOL, rtol=0)


def test_smollm2_matches_transformers(smollm2_path):
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 216, 2, 9, 19, 77]])
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    model = Transformer.from_pretrained(smollm2_path)
    with torch.no_grad():
        expected, got = ref(ids).logits, model(ids)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_pretrained_round_trip(tiny_dir, tmp_path, family):
    path, _ = tiny_dir(family)
    model = Transformer.from_pretrained(path)
    model.generation_config = {"eos_token_id": [5, 7], "bos_token_id": 1}
    out = tmp_path / "export"
    model.save_pretrained(out, max_shard_bytes=30_000)  # force shards + index
    assert (out / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 131, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids), atol=ATOL, rtol=0)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [5, 7]
    assert Transformer.from_pretrained(out).eos_token_ids() == [5, 7]


def test_packed_rows_do_not_attend_across_documents(tiny_dir):
    path, _ = tiny_dir("qwen3")
    model = Transformer.from_pretrained(path)
    docs = [torch.randint(0, 131, (n,)) for n in (5, 9, 1, 6)]
    packed = torch.cat(docs)[None]  # (1, 21)
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        got = model(packed, position_ids)[0].split([len(d) for d in docs])
        for d, g in zip(docs, got):
            torch.testing.assert_close(g, model(d[None])[0], atol=ATOL, rtol=0)


class DenseCache:
    """The smallest cache that speaks the model's hook: append k/v per layer, causal mask."""
    def __init__(self):
        self.k, self.v, self.q_pos = {}, {}, None

    def update(self, layer, k, v):  # k, v (B, nkv, T, D)
        self.k[layer] = torch.cat([self.k[layer], k], 2) if layer in self.k else k
        self.v[layer] = torch.cat([self.v[layer], v], 2) if layer in self.v else v
        S = self.k[layer].shape[2]
        mask = torch.arange(S)[None, :] <= self.q_pos[:, None]  # (T, S)
        return self.k[layer], self.v[layer], mask[None, None]


def test_kv_cache_hook_matches_full_forward(tiny_dir):
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path)
    ids = torch.randint(0, 131, (2, 10))
    cache = DenseCache()
    with torch.no_grad():
        full = model(ids)
        steps = []
        for lo, hi in [(0, 4), (4, 5), (5, 8), (8, 9), (9, 10)]:  # prefill, decode, multi-token append
            pos = torch.arange(lo, hi)
            cache.q_pos = pos
            steps.append(model(ids[:, lo:hi], pos.expand(2, -1), cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=0)


def test_output_index_selects_positions(tiny_dir):
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    ids = torch.randint(0, 131, (2, 8))
    index = torch.tensor([[7], [3]])
    with torch.no_grad():
        full = model(ids)
        torch.testing.assert_close(model(ids, output_index=index)[:, 0], full[[0, 1], [7, 3]])


def test_activation_checkpointing_same_gradients(tiny_dir):
    path, _ = tiny_dir("qwen3")
    ids = torch.randint(0, 131, (2, 9))
    grads = []
    for ckpt in (False, True):
        model = Transformer.from_pretrained(path).train()
        model.activation_checkpointing = ckpt
        model(ids).logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_labels_give_logprobs(tiny_dir):
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path)
    ids = torch.randint(0, 131, (2, 9))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    with torch.no_grad():
        expected = (model(ids) / 0.7).log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        expected[:, -1] = 0
        got = model(ids, labels=labels, temperature=0.7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- bad input

def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,message", [
    (dict(model_type="mistral"), "unsupported model_type 'mistral'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "unsupported rope type 'yarn'"),
    (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(head_dim=7), "head_dim=7"),
])
def test_unsupported_config_is_a_clear_error(tiny_dir, changes, message):
    path, _ = tiny_dir("llama")
    _edit_config(__import__("pathlib").Path(path), **changes)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Transformer.from_pretrained(path)


def test_missing_weight_file_is_a_clear_error(tiny_dir, tmp_path):
    path, _ = tiny_dir("qwen2", max_shard_size="20KB")
    import pathlib
    shard = sorted(pathlib.Path(path).glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        Transformer.from_pretrained(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path / "nowhere")


def test_wrong_shape_and_missing_weight_are_clear_errors(tiny_dir):
    import pathlib
    path, _ = tiny_dir("qwen2")
    file = pathlib.Path(path) / "model.safetensors"
    state = safetensors.torch.load_file(file)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    safetensors.torch.save_file(state, file)
    with pytest.raises(ValueError, match=r"up_proj.weight.*shape \(95, 64\)"):
        Transformer.from_pretrained(path)
    del state["model.layers.0.mlp.up_proj.weight"]
    safetensors.torch.save_file(state, file)
    with pytest.raises(ValueError, match="missing weights.*up_proj"):
        Transformer.from_pretrained(path)


def test_unreachable_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing to fall back on
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a local folder and could not be fetched"):
        Transformer.from_pretrained("nobody/no-such-model")


def test_corrupt_config_and_truncated_weights_name_the_file(tiny_dir):
    import pathlib
    path = pathlib.Path(tiny_dir("qwen2")[0])
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])  # a download or copy cut short
    with pytest.raises(ValueError, match=f"{weights}: not a readable safetensors file"):
        Transformer.from_pretrained(path)
    weights.write_bytes(data)
    (path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": ')
    with pytest.raises(ValueError, match=f"{path / 'config.json'}: not valid JSON"):
        Transformer.from_pretrained(path)


@pytest.mark.parametrize("n_kv", [2, 6])  # grouped-query and plain multi-head
def test_per_document_attention_equals_the_document_mask(n_kv):
    """The packed prefill's attention (causal SDPA per document, no (T x T) mask) against SDPA
    under the dense document mask, on rows of several documents, lengths 1 to 9."""
    import torch.nn.functional as F

    from grpo.models.model import Transformer as M
    from grpo.models.layers import doc_mask, per_document_attention
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3, 4]])
    B, T, nh, D = *pos.shape, 6, 8
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (nh, n_kv, n_kv))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=doc_mask(pos), enable_gqa=n_kv != nh)
    ours = per_document_attention(q, k, v, M._varlen(pos), gqa=n_kv != nh)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_packed_prefill_builds_no_document_mask(tiny_dir, monkeypatch):
    """A forward with a cache in packed mode (the sampler's prefill) never builds the (T x T)
    mask, and gives the logits of the masked forward without a cache."""
    import grpo.models.model as model_module
    from grpo.engine.kv_cache import KVCache
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    ids = torch.randint(0, model.args.vocab_size, pos.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, pos)
        cache = KVCache(model.args, 3, 16, torch.float32, "cpu")
        cache.packed(torch.tensor([0] * 4 + [1] * 3 + [2] * 5), pos[0])
        monkeypatch.setattr(model_module, "doc_mask", lambda p: pytest.fail("dense mask built"))
        ours = model(ids, pos, cache=cache)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_autocast_bf16_keeps_fp32_outside_the_blocks(tiny_dir):
    """autocast_bf16: bf16 matmuls in the blocks, fp32 logits and log-probs, close to fp32's; the
    sampler decodes under it (its fp32 cache takes the bf16 keys) and its greedy tokens follow."""
    from grpo.engine.sampler import Sampler, SamplingParams
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path).eval()
    ids = torch.randint(0, model.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        model.autocast_bf16 = True
        ours = model(ids)
        lp = model(ids, labels=ids)
    assert ours.dtype == torch.float32 and lp.dtype == torch.float32
    assert 0 < (ours - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 rounding, not another model
    out = Sampler(model).generate(ids.tolist(), SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[]))
    assert all(len(c.token_ids) == 6 for c in out)


def test_autocast_bf16_attends_in_fp32(tiny_dir, monkeypatch):
    """Under autocast_bf16 attention runs in fp32 (q, k, v and the kernel): on CPUs its bf16 kernels
    are the slow ones (decode ~4x). Checked on every path: plain, packed documents, the sampler's
    packed prefill and decode over the cache."""
    import grpo.models.model as gm
    from grpo.engine.sampler import Sampler, SamplingParams
    seen, sdpa = [], gm.F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, *a, **kw)
    monkeypatch.setattr(gm.F, "scaled_dot_product_attention", spy)
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path).eval()
    model.autocast_bf16 = True
    ids = torch.randint(0, model.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        model(ids, torch.tensor([list(range(6)) * 2, list(range(12))]))  # packed documents
    Sampler(model).generate(ids.tolist(), SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[]))
    assert len(seen) > 4 * model.args.n_layers
    assert set(seen) == {(torch.float32, torch.float32, torch.float32, False)}
