"""Qwen3.5's hybrid models (grpo/models/qwen35.py, grpo/models/deltanet.py): logits and gradients against transformers'
Qwen3_5ForCausalLM on tiny random configs, packed documents, the VLM checkpoint, export round trips, FSDP on
two gloo ranks, the memory plan, and a few training steps (the rule itself: tests/test_deltanet.py; the
sampler: tests/test_qwen35_sampler.py)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from grpo.config import TARGETS
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.models.lora import LoraSettings, add_lora
from grpo.models.model import Transformer

# fp32 on CPU, the same weights: op order only, but the linear layers' gated RMSNorm divides each head's
# output by its rms, down to sqrt(eps) = 1e-3 where a head reads nearly nothing, so rounding is amplified up
# to 1000x. Against a float64 evaluation of the 70-token case: ours 1.2e-4, transformers' 3.2e-4 (its
# chunked rule takes decays as differences of cumulative sums, which cancel); each other 2e-4
ATOL = 5e-4


def hybrid_config(**kw) -> transformers.Qwen3_5TextConfig:
    return transformers.Qwen3_5TextConfig(**{**dict(
        vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25)), **kw})


def make_hybrid(seed: int = 0, **kw) -> transformers.Qwen3_5ForCausalLM:
    """As conftest.make_hf_model: weights large enough that a mistake shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(hybrid_config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())  # decays from ~1 to strong
            else:
                p.normal_(0, 0.15)
    return model


@pytest.fixture
def hybrid_dir(tmp_path):
    def make(seed: int = 0, **kw):
        model = make_hybrid(seed, **kw)
        path = tmp_path / f"qwen35-{seed}-{len(list(tmp_path.iterdir()))}"
        model.save_pretrained(path)
        return str(path), model
    return make


CASES = [  # layer patterns, partial rotary, GQA in both kinds of layer, tied embeddings
    {},                                                                         # 3 linear : 1 full, untied
    dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
    dict(layer_types=["linear_attention"] * 3, num_hidden_layers=3, tie_word_embeddings=True),
    dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
         rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5),
         linear_num_value_heads=2, num_key_value_heads=4),                       # Hv = Hk, MHA
    dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"], head_dim=12,
         rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=1.0),
         linear_num_key_heads=1, tie_word_embeddings=True),                     # full rotary, Hv = 4 Hk
]


@pytest.mark.parametrize("kw", CASES, ids=range(len(CASES)))
def test_logits_match_transformers(hybrid_dir, kw):
    path, ref = hybrid_dir(**kw)
    model = Transformer.from_pretrained(path)
    ids = torch.randint(0, 131, (3, 70))  # > 64: two chunks of the chunked rule
    with torch.no_grad():
        expected, got = ref(ids, use_cache=False).logits, model(ids)  # its cache needs an attention layer
    assert expected.abs().max() > 1.0, "logits too small to catch bugs"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_labels_give_logprobs_and_gradients(hybrid_dir):
    path, ref = hybrid_dir()
    model = Transformer.from_pretrained(path)
    ids = torch.randint(0, 131, (2, 19))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    scored = lambda logits: (logits / 0.7).log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # noqa: E731
    got = model(ids, labels=labels, temperature=0.7)  # the fused log-probs, from the final hidden states
    with torch.no_grad():
        own = scored(model(ids))
    torch.testing.assert_close(got[:, :-1], own[:, :-1], atol=1e-5, rtol=0)
    assert (got[:, -1] == 0).all()
    expected = scored(ref(ids).logits)
    expected[:, -1] = 0
    torch.testing.assert_close(got, expected.detach(), atol=ATOL, rtol=0)
    got.sum().backward()
    expected.sum().backward()
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # every weight gets transformers' gradient
        g = theirs["model." + name if name != "lm_head.weight" else name].grad
        # fp32 gradients up to ~100s (make_hybrid's weights): op order differs by ~1e-5 of the largest
        torch.testing.assert_close(p.grad, g, atol=1e-4 * g.abs().max().item(), rtol=0, msg=name)


def test_packed_documents_start_from_zero_state(hybrid_dir):
    path, _ = hybrid_dir()
    model = Transformer.from_pretrained(path)
    docs = [torch.randint(0, 131, (n,)) for n in (5, 9, 1, 6)]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        got = model(torch.cat(docs)[None], position_ids)[0].split([len(d) for d in docs])
        for d, g in zip(docs, got):
            torch.testing.assert_close(g, model(d[None])[0], atol=ATOL, rtol=0)


def test_vlm_checkpoint_loads_text_model(tmp_path):
    """A Qwen3.5 vision-language checkpoint (model_type qwen3_5): the language model's weights under
    model.language_model., the vision tower's skipped, the text config flattened."""
    text = make_hybrid(tie_word_embeddings=True)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64, patch_size=2,
                  temporal_patch_size=1, num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision, tie_word_embeddings=True)
    vlm = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    vlm.model.language_model.load_state_dict(text.model.state_dict())
    vlm.save_pretrained(tmp_path / "vlm")
    assert json.loads((tmp_path / "vlm" / "config.json").read_text())["model_type"] == "qwen3_5"
    model = Transformer.from_pretrained(tmp_path / "vlm")
    ids = torch.randint(0, 131, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), text(ids).logits, atol=ATOL, rtol=0)
    assert model.config["model_type"] == "qwen3_5_text" and "vision_config" not in model.config


def test_save_pretrained_round_trip(hybrid_dir, tmp_path):
    path, _ = hybrid_dir(tie_word_embeddings=True)
    model = Transformer.from_pretrained(path)
    model.save_pretrained(tmp_path / "export", max_shard_bytes=40_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(0, 131, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- FSDP

@pytest.mark.slow  # torchrun, two processes
def test_fsdp_two_ranks(hybrid_dir, tmp_path):
    """dist_worker.check_fsdp on a hybrid model: sampling under dist.gathered() with one all-gather per
    module, the same tokens and log-probs as unsharded, the labels forward and its gradients, the export."""
    path, _ = hybrid_dir(tie_word_embeddings=True)
    worker = str(Path(__file__).with_name("qwen35_dist_worker.py"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                        worker, path, str(tmp_path / "export")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert "fsdp checks passed (5 modules, tied=True)" in r.stdout + r.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    ids = torch.randint(0, 131, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, Transformer.from_pretrained(path)(ids), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- the memory plan

def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_memory_plan_counts_the_hybrid_model(hybrid_dir):
    """grpo.fit.memory on a hybrid model: its parameters, its LoRA adapters, the sampler's rows (the attention
    layers' KV and the linear layers' state) and no decode copy, as the code allocates them."""
    from grpo.config import Config
    from grpo.fit.memory import memory_plan
    path, _ = hybrid_dir(tie_word_embeddings=True)
    model = Transformer.from_pretrained(path)
    P, M = 12, 20
    cfg = Config(prompts_per_step=3, num_generations=2, max_prompt_length=P, max_completion_length=M,
                 gen_batch=64, dtype="float32", eval_limit=0, micro_batch_tokens=64)
    plan = {name: b for name, b, _ in memory_plan(model.args, cfg, 1, "cpu", 64).phases["rollouts"]}
    assert plan["master weights, fp32, sharded"] == nbytes(model.parameters())
    sampler = Sampler(model, gen_batch=64)
    sampler.generate([list(range(3, 3 + P))] * 3, SamplingParams(n=2, max_tokens=M, stop_token_ids=[], seed=0))
    c = sampler.cache
    assert plan["KV cache"] == nbytes([c.k, c.v, c.conv, c.state]) and plan["decode copy of the weights"] == 0
    add_lora(model, LoraSettings(r=4, targets=TARGETS))
    lora = memory_plan(model.args, Config(**{**vars(cfg), "use_peft": True, "lora_r": 4, "lora_target_modules": "all-linear"}),
                       1, "cpu", 64)
    assert {n: b for n, b, _ in lora.phases["update"]}["LoRA adapters, fp32 master"] == nbytes(
        p for p in model.parameters() if p.requires_grad)


def test_memory_plan_counts_what_the_layers_keep(hybrid_dir):
    """The activations a token and layer: [linear, full] layers twice keep two layers' mean more than once
    (within 3%: per-chunk and per-call tensors the plan leaves out, ~1% at 256 tokens)."""
    from test_backward import saved_activation_bytes

    from grpo.fit.memory import act_bytes_per_token
    kept, T = [], 256
    for types in (["linear_attention", "full_attention"], ["linear_attention", "full_attention"] * 2):
        path, _ = hybrid_dir(num_hidden_layers=len(types), layer_types=types, hidden_size=96,
                             linear_num_value_heads=6, linear_num_key_heads=3, linear_key_head_dim=16)
        model = Transformer.from_pretrained(path).train()
        kept.append(saved_activation_bytes(model, torch.randint(0, 131, (1, T))))
    planned = 2 * T * act_bytes_per_token(model.args, 4)
    assert abs(kept[1] - kept[0] - planned) < 0.03 * planned, (kept[1] - kept[0], planned)


# ----------------------------------------------------------------------------- the loop

def test_training_steps_and_export(tmp_path):
    """trainer.train on a tiny hybrid model with the toy task's tokenizer: rollouts, updates, the
    sampler-trainer gap at fp32 rounding, and an export that transformers loads as Qwen3_5ForCausalLM."""
    from toy import ToyEnv, make_toy_dir

    from grpo.config import Config
    from grpo.trainer import train
    path = make_toy_dir(tmp_path / "model")  # the tokenizer and generation_config; the weights replaced below
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(hybrid_config(vocab_size=64, eos_token_id=2, pad_token_id=0)).save_pretrained(path)
    examples = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(40)]
    cfg = Config(model_path=path, output_dir=str(tmp_path / "run"), max_steps=3, prompts_per_step=4, num_generations=4,
                 learning_rate=3e-3, max_prompt_length=16, max_completion_length=8, micro_batch_tokens=128, gen_batch=8,
                 eval_limit=4, eval_n=2, save_steps=0, export=True, beta=0.04)
    train(cfg, ToyEnv(), examples, examples[:4])
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "sampler_gap_max" in r]
    assert len(rows) == 3 and max(r["sampler_gap_max"] for r in rows) < 1e-5
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export", dtype=torch.float32)
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
