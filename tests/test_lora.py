"""grpo.models.lora against peft + transformers on the same adapter weights, the sampler through merged
adapters, what trains and what a checkpoint and an export hold, and the errors for what we cannot
load. (Two ranks and a bitwise resume with LoRA: tests/test_dist.py.)"""
import json

import pytest
import torch
import transformers

from grpo.config import TARGETS
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.models import lora
from grpo.models.lora import LoraSettings, add_lora, effective_weight, read_adapter, save_adapter
from grpo.models.model import Transformer

peft = pytest.importorskip("peft")  # the test extra installs it; the package never imports it

ATOL = 1e-4  # fp32, two implementations: op order only (as tests/test_model.py)
CASES = [("qwen2", {}), ("qwen3", {}), ("llama", {})]
SETTINGS = [LoraSettings(r=4, alpha=8, dropout=0.0, targets=TARGETS),
            LoraSettings(r=8, alpha=4, dropout=0.0, rslora=True, targets=("q_proj", "v_proj", "down_proj"))]


def randomize(model, seed: int = 1, std: float = 0.1):
    """B starts at zero (the adapted model equals the base): give every adapter values that show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.adapters(model):
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * std)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * std)
    return model


def adapted(path: str, settings: LoraSettings, seed: int = 1) -> Transformer:
    return randomize(add_lora(Transformer.from_pretrained(path), settings), seed)


@pytest.mark.parametrize("settings", SETTINGS, ids=["all-linear", "rslora-3-modules"])
@pytest.mark.parametrize("family,overrides", CASES, ids=[c[0] for c in CASES])
def test_logits_match_peft_and_the_exports_load(tiny_dir, tmp_path, family, overrides, settings):
    """Our adapted model, its PEFT folder loaded by peft over transformers' base, and its merged
    export loaded by transformers: one set of logits."""
    path, _ = tiny_dir(family, **overrides)
    model = adapted(path, settings)
    save_adapter(tmp_path / "adapter", model.state_dict(), settings, path)
    model.save_pretrained(tmp_path / "merged")
    ids = torch.randint(0, model.args.vocab_size, (2, 13))
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ours = model.eval()(ids)
        plain = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(ids).logits
    assert (ours - plain).abs().max() > 0.1, "the adapters change nothing: the test would not see them"
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    torch.testing.assert_close(merged, theirs, atol=ATOL, rtol=0)


def test_adapted_model_starts_equal_to_the_base_and_only_adapters_get_gradients(tiny_dir):
    path, _ = tiny_dir("qwen2")
    base, model = Transformer.from_pretrained(path), add_lora(Transformer.from_pretrained(path),
                                                                      LoraSettings(dropout=0.1, targets=TARGETS))
    ids = torch.randint(0, 131, (2, 9))
    assert torch.equal(model.eval()(ids), base.eval()(ids))  # B = 0: exactly the base, not approximately
    assert len(lora.adapters(model)) == 2 * 7 and model.lora.targets == TARGETS
    model.train()(ids).logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        if lora.is_adapter_key(name):
            assert p.requires_grad and p.grad is not None and p.dtype == torch.float32, name
        else:
            assert not p.requires_grad and p.grad is None, name
    assert all(m.lora_B.grad.abs().sum() > 0 for m in lora.adapters(model))  # dL/dA = 0 while B = 0
    assert set(map(id, lora.trainable(model))) == {id(p) for n, p in model.named_parameters() if lora.is_adapter_key(n)}


def test_adapters_initialise_as_peft_and_every_rank_alike(tiny_dir):
    """A ~ Kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(in)), from the seed alone (not torch's global RNG)."""
    path, _ = tiny_dir("llama")
    a = add_lora(Transformer.from_pretrained(path), LoraSettings(), seed=3)
    torch.rand(100)  # a rank that drew something else first
    b = add_lora(Transformer.from_pretrained(path), LoraSettings(), seed=3)
    for x, y in zip(lora.adapters(a), lora.adapters(b)):
        assert torch.equal(x.lora_A, y.lora_A) and not x.lora_B.any()
        bound = 1 / x.in_features ** 0.5
        assert x.lora_A.abs().max() <= bound and x.lora_A.abs().max() > 0.8 * bound


def test_sampler_greedy_tokens_equal_a_model_holding_the_merged_weights(tiny_dir, tmp_path):
    """The decode copy is merged at the start of every call: after the adapters change, the next
    call samples from the new ones."""
    path, _ = tiny_dir("qwen3")
    model = adapted(path, SETTINGS[0])
    sampler = Sampler(model)
    prompts = [[5, 9, 17, 3], [7, 7, 1], [100, 2, 30, 44, 12]]
    params = SamplingParams(temperature=0, max_tokens=12)

    def merged_tokens():
        model.save_pretrained(tmp_path / "m")
        plain = Transformer.from_pretrained(tmp_path / "m")
        return [c.token_ids for c in Sampler(plain).generate(prompts, params)]

    base_tokens = [c.token_ids for c in Sampler(Transformer.from_pretrained(path)).generate(prompts, params)]
    first = [c.token_ids for c in sampler.generate(prompts, params)]
    assert first == merged_tokens() and first != base_tokens
    randomize(model, seed=2)  # as an optimizer step would
    second = [c.token_ids for c in sampler.generate(prompts, params)]
    assert second == merged_tokens() and second != first


def test_effective_weight_is_w_plus_s_b_a():
    lin = torch.nn.Linear(6, 5)
    layer = lora.LoRALinear(lin, r=3, scale=0.5, dropout=0.0, generator=torch.Generator().manual_seed(0))
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(4, 6, dtype=torch.float64)
    expected = x @ (lin.weight.double() + 0.5 * layer.lora_B.double() @ layer.lora_A.double()).T + lin.bias.double()
    torch.testing.assert_close(layer(x.float()).double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.float() @ effective_weight(layer).T + lin.bias, expected.float(), atol=1e-5, rtol=0)
    out = torch.zeros(7, 6)  # the decode copy's rows: merged in place
    effective_weight(layer, out=out[1:6])
    assert torch.equal(out[1:6], effective_weight(layer)) and not out[0].any() and not out[6].any()
    layer.enabled = False
    assert effective_weight(layer) is lin.weight


def test_the_kl_reference_is_the_base(tiny_dir):
    path, _ = tiny_dir("llama")
    base, model = Transformer.from_pretrained(path), adapted(path, SETTINGS[0])
    ids = torch.randint(0, 131, (2, 7))
    with torch.no_grad():
        assert torch.equal(lora.BaseModel(model)(ids), base(ids))
        assert not torch.equal(model(ids), base(ids))  # and the adapters are back on afterwards


def test_adapter_folder_round_trip_and_what_is_refused(tiny_dir, tmp_path):
    path, _ = tiny_dir("qwen2")
    model = adapted(path, SETTINGS[1])
    save_adapter(tmp_path / "a", model.state_dict(), SETTINGS[1], path)
    settings, state = read_adapter(tmp_path / "a")
    assert settings == SETTINGS[1]
    fresh = add_lora(Transformer.from_pretrained(path), settings, seed=9)
    lora.load_adapter(fresh, state)
    assert all(torch.equal(a, b) for a, b in zip(lora.trainable(fresh), lora.trainable(model)))
    config = json.loads((tmp_path / "a" / lora.ADAPTER_CONFIG).read_text())
    for change, message in [({"use_dora": True}, "use_dora=True"), ({"peft_type": "IA3"}, "only LORA"),
                            ({"target_modules": ["q_proj", "lm_head"]}, "lm_head: not a linear layer")]:
        (tmp_path / "a" / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            read_adapter(tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        read_adapter(tmp_path)
    other = add_lora(Transformer.from_pretrained(path), LoraSettings(r=2, targets=SETTINGS[1].targets))
    with pytest.raises(ValueError, match="has shape"):
        lora.load_adapter(other, state)


def test_config_errors_and_trl_names():
    from grpo.config import Config
    from grpo.flags import parse_args
    with pytest.raises(ValueError, match="qkv_proj: not a linear layer of the blocks; choose from q_proj"):
        parse_args(Config, ["--use_peft", "--lora_target_modules", "q_proj,qkv_proj"])
    with pytest.raises(ValueError, match="needs --use_peft"):
        parse_args(Config, ["--adapter_path", "somewhere"])
    with pytest.raises(ValueError, match="lora_r=0"):
        parse_args(Config, ["--use_peft", "--lora_r", "0"])
    cfg = parse_args(Config, ["--use_peft", "--lora_r", "8", "--lora_target_modules", "v_proj,q_proj"])
    assert lora.settings_of(cfg) == LoraSettings(r=8, alpha=32, dropout=0.05, targets=("q_proj", "v_proj"))


def test_grpo_trainer_takes_a_peft_lora_config(tiny_dir):
    from grpo import GRPOConfig, GRPOTrainer
    path, _ = tiny_dir("llama")
    data = [{"prompt": "a b", "answer": "c"}]
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    t = GRPOTrainer(path, reward, GRPOConfig(), data,
                    peft_config=peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    a = t.args
    assert (a.use_peft, a.lora_r, a.lora_alpha, a.lora_dropout, a.lora_target_modules) == (True, 8, 16, 0.1, "q_proj,v_proj")
    with pytest.raises(ValueError, match="use_dora=True"):
        GRPOTrainer(path, reward, GRPOConfig(), data, peft_config=peft.LoraConfig(use_dora=True))
    with pytest.raises(ValueError, match="not a linear layer"):
        GRPOTrainer(path, reward, GRPOConfig(), data, peft_config=peft.LoraConfig(target_modules=["lm_head"]))


def test_a_lora_run_checkpoints_the_adapters_and_exports_both_ways(tmp_path):
    """A run with --use_peft and beta > 0 (the reference: the base, adapters off): its checkpoint
    holds the adapters and their optimizer state, not the base; its merged export loads in
    transformers and its adapter folder in peft, with one set of logits; `python -m grpo.cli.export`
    writes the same two from the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from toy import ToyEnv, make_toy_dir

    from grpo.config import Config
    from grpo.infra.export import main as export_main
    from grpo.trainer import train
    base_path = make_toy_dir(tmp_path / "model")
    cfg = Config(model_path=base_path, output_dir=str(tmp_path / "run"), max_steps=2, prompts_per_step=2,
                 num_generations=4, learning_rate=1e-2, max_prompt_length=16, max_completion_length=8,
                 micro_batch_tokens=256, gen_batch=8, eval_limit=0, save_steps=1, beta=0.04, use_peft=True,
                 lora_r=4, lora_target_modules="q_proj,v_proj,down_proj")
    train(cfg, ToyEnv(), [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(8)])
    run = tmp_path / "run"
    kl = [r["kl"] for r in map(json.loads, open(run / "metrics.jsonl")) if "kl" in r]
    assert kl and kl[-1] > 0  # the reference is the base: after a step the adapted policy differs from it
    ckpt = run / "checkpoints" / "step_000002"
    keys = [k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(lora.is_adapter_key(k) for k in keys), keys[:5]  # 2 layers x 3 modules x (A, B)
    assert len(keys) == 12
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32)(ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        plain = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, run / "adapter")(ids).logits
    assert (merged - plain).abs().max() > 1e-3  # training moved the adapters
    torch.testing.assert_close(adapted, merged, atol=ATOL, rtol=0)
    export_main([str(ckpt), str(tmp_path / "cli_adapter"), "--adapter"])
    export_main([str(ckpt), str(tmp_path / "cli_merged")])
    for name in ("cli_adapter/adapter_model.safetensors", "cli_merged/model.safetensors"):
        ours, theirs = load_file(tmp_path / name), load_file(run / name.replace("cli_adapter", "adapter")
                                                               .replace("cli_merged", "export"))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_a_run_starts_from_an_adapter_folder(tmp_path):
    """--adapter_path: the run's model is the base plus that adapter (its r and modules win over
    the flags, and config.json records them)."""
    from safetensors.torch import load_file
    from toy import ToyEnv, make_toy_dir

    from grpo.config import Config
    from grpo.trainer import train
    base_path = make_toy_dir(tmp_path / "model")
    settings = LoraSettings(r=2, alpha=4, dropout=0.0, targets=("k_proj", "up_proj"))
    model = randomize(add_lora(Transformer.from_pretrained(base_path), settings))
    save_adapter(tmp_path / "adapter", model.state_dict(), settings, base_path)
    cfg = Config(model_path=base_path, output_dir=str(tmp_path / "run"), max_steps=0, eval_limit=0, save_steps=0,
                 max_prompt_length=16, max_completion_length=8, micro_batch_tokens=256, use_peft=True,
                 adapter_path=str(tmp_path / "adapter"))
    train(cfg, ToyEnv(), [{"question": "w1 w2", "answer": ""}])
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (recorded["lora_r"], recorded["lora_alpha"], recorded["lora_target_modules"]) == (2, 4, "k_proj,up_proj")
    model.save_pretrained(tmp_path / "expected")
    got, expected = load_file(tmp_path / "run" / "export" / "model.safetensors"), \
        load_file(tmp_path / "expected" / "model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_dropout_is_on_the_adapters_input_in_training_only_and_a_bf16_base_runs_outside_fsdp(tiny_dir):
    path, _ = tiny_dir("qwen2")
    model = adapted(path, LoraSettings(r=4, dropout=0.5))
    ids = torch.randint(0, 131, (2, 9))
    with torch.no_grad():
        eval_logits = model.eval()(ids)
        for m in lora.adapters(model):
            m.dropout = 0.0
        assert torch.equal(model(ids), eval_logits)  # eval: no dropout at all
        for m in lora.adapters(model):
            m.dropout = 0.5
        a, b = model.train()(ids), model(ids)
        assert not torch.equal(a, b) and not torch.equal(a, eval_logits)
        for m in lora.adapters(model):  # adapters off: dropout touches nothing else
            m.enabled = False
        assert torch.equal(model(ids), model.eval()(ids))
    bf16 = add_lora(Transformer.from_pretrained(path, dtype=torch.bfloat16), LoraSettings(r=4))
    randomize(bf16)
    assert lora.adapters(bf16)[0].lora_A.dtype == torch.float32
    with torch.no_grad():
        out = bf16.eval()(ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_a_bf16_base_under_autocast_computes_what_autocast_did_and_merges_in_fp32(tiny_dir):
    """grpo.models.lora.cast_base (a CPU under autocast_bf16): the same matmul inputs as autocast's own cast
    of the fp32 base, so the same logits, bitwise; and a merge asked for in fp32 keeps s B A whole
    (the default, the base's bf16: tests/test_trl_config.py)."""
    path, _ = tiny_dir("qwen2")
    fp32, bf16 = adapted(path, SETTINGS[0]), adapted(path, SETTINGS[0])
    lora.cast_base(bf16, torch.bfloat16)
    assert bf16.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16 and not bf16.layers[0].mlp.up_proj.weight.requires_grad
    fp32.autocast_bf16 = bf16.autocast_bf16 = True
    ids = torch.randint(0, 131, (2, 9))
    with torch.no_grad():
        assert torch.equal(fp32.eval()(ids), bf16.eval()(ids))
    merged = lora.merged_state(bf16.state_dict(), SETTINGS[0], torch.float32)
    w = "layers.0.self_attn.q_proj.weight"
    assert merged[w].dtype == torch.float32
    expected = bf16.state_dict()[w].float() + SETTINGS[0].scale * (bf16.layers[0].self_attn.q_proj.lora_B
                                                                  @ bf16.layers[0].self_attn.q_proj.lora_A).detach()
    torch.testing.assert_close(merged[w], expected, atol=1e-6, rtol=0)
