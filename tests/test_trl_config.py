"""A TRL config means here what it means in TRL (docs/trl.md): steps_per_generation counts TRL's
micro-steps, DAPO divides every optimizer step of a batch by the batch's tokens / S, LoRA with no
target_modules takes PEFT's default, LoRA options we do not implement are refused in one line, and a
LoRA merge is written in the base's dtype unless float32 is asked for."""
import dataclasses
from pathlib import Path

import pytest
import torch
from toy import make_toy_dir

from grpo import update
from grpo.config import PEFT_DEFAULT_TARGETS, TARGETS, Config, parse_targets
from grpo.flags import parse_args
from grpo.models import lora
from grpo.models.model import SUPPORTED, Transformer
from grpo.rollout import Trajectory

DOC = Path(__file__).resolve().parents[1] / "docs" / "trl.md"


def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "trl.yaml"
    path.write_text(text)
    return str(path)


# ----------------------------------------------------------------------------- steps_per_generation


def hand_batch(tmp_path, lengths: list[int], G: int = 2):
    """A toy model and len(lengths) trajectories (groups of G, in order) with completions of these
    lengths and advantages +1 / -1 alternating, so every group has something to learn."""
    model = Transformer.from_pretrained(make_toy_dir(tmp_path / "model"))
    trajs = [Trajectory(example={}, prompt_index=i // G, prompt_ids=[4, 6 + i % 7], completion_ids=[6 + (i + j) % 50
             for j in range(n)], loss_mask=[1] * n, sampler_logprobs=[0.0] * n, finish_reason="stop", num_turns=1)
             for i, n in enumerate(lengths)]
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(lengths))])
    return model, trajs, advantages


def step_losses(monkeypatch, model, trajs, advantages, cfg) -> list[float]:
    """policy_update at lr 0 (rho stays 1): each optimizer step's loss, its micro-batches summed."""
    steps, real = [[]], update.policy_loss

    def spy(*args, **kwargs):
        loss, m = real(*args, **kwargs)
        steps[-1].append(float(loss.detach()))
        return loss, m
    monkeypatch.setattr(update, "policy_loss", spy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_post_hook(lambda *_: steps.append([]))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    update.policy_update(model, None, optimizer, scheduler, trajs, advantages, cfg, "cpu")
    return [sum(s) for s in steps if s]


def test_a_trl_yaml_with_accumulation_makes_one_optimizer_step_per_generation(tmp_path, monkeypatch):
    """TRL: steps_per_generation micro-steps per generation, gradient_accumulation_steps of them per
    optimizer step (grpo_config.py: None = gradient_accumulation_steps). 8 and 8: one step."""
    yaml = write_yaml(tmp_path, "gradient_accumulation_steps: 8\nsteps_per_generation: 8\nnum_generations: 2\n"
                                "prompts_per_step: 2\n")
    cfg = parse_args(Config, ["--config", yaml, "--profile=none"])
    assert cfg.optimizer_steps() == 1
    model, trajs, advantages = hand_batch(tmp_path, [3, 5, 2, 6])
    assert len(step_losses(monkeypatch, model, trajs, advantages, cfg)) == 1
    # TRL's defaults: gradient_accumulation_steps 1, steps_per_generation = it: one step; 2 of 1: two
    assert parse_args(Config, ["--profile=none"]).steps_per_generation == 1
    assert parse_args(Config, ["--steps_per_generation=2", "--profile=none"]).optimizer_steps() == 2
    assert parse_args(Config, ["--gradient_accumulation_steps=4", "--profile=none"]).optimizer_steps() == 1
    with pytest.raises(ValueError, match="steps_per_generation=2 must be a multiple of gradient_accumulation_steps=4"):
        parse_args(Config, ["--gradient_accumulation_steps=4", "--steps_per_generation=2", "--profile=none"])


def test_dapo_divides_each_step_by_the_generations_tokens_over_s(tmp_path, monkeypatch):
    """TRL (grpo_trainer.py, _compute_loss, dapo): every step of a generation divides by
    num_items_in_batch (its tokens, all ranks) x gradient_accumulation_steps / steps_per_generation,
    one constant; so S = 2 steps of unequal token counts are the one-step token mean split evenly."""
    lengths = [3, 5, 2, 6, 7, 1, 8, 4]          # step 1 (groups 0, 1): 16 tokens; step 2: 20
    model, trajs, advantages = hand_batch(tmp_path, lengths)
    per_seq = [-float(a) * n for a, n in zip(advantages, lengths)]  # rho = 1: each token's loss is -A
    N = sum(lengths)
    base = dict(num_generations=2, prompts_per_step=4, loss_type="dapo", tis_cap=0.0, max_completion_length=8,
                micro_batch_tokens=64)
    one = step_losses(monkeypatch, model, trajs, advantages, Config(**base, steps_per_generation=1))
    two = step_losses(monkeypatch, model, trajs, advantages, Config(**base, steps_per_generation=2))
    torch.testing.assert_close(one, [sum(per_seq) / N], atol=1e-5, rtol=0)
    torch.testing.assert_close(two, [sum(per_seq[:4]) / (N / 2), sum(per_seq[4:]) / (N / 2)], atol=1e-5, rtol=0)
    assert sum(lengths[:4]) != sum(lengths[4:]) and sum(two) / 2 == pytest.approx(one[0], abs=1e-5)


# ----------------------------------------------------------------------------- LoRA


def test_no_target_modules_is_pefts_default_for_every_architecture():
    """TRL's ModelConfig.lora_target_modules defaults to None: PEFT picks per architecture."""
    constants = pytest.importorskip("peft.utils.constants")
    for model_type in SUPPORTED:
        assert tuple(constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type]) == \
            PEFT_DEFAULT_TARGETS[model_type] == parse_targets(None)
    cfg = parse_args(Config, ["--use_peft", "--profile=none"])
    assert cfg.lora_target_modules == "q_proj,v_proj" and lora.settings_of(cfg).targets == ("q_proj", "v_proj")
    assert lora.LoraSettings().targets == ("q_proj", "v_proj")
    assert parse_args(Config, ["--use_peft", "--lora_target_modules=all-linear", "--profile=none"]
                      ).lora_target_modules == ",".join(TARGETS)


def test_trl_yaml_lists_are_comma_separated_fields(tmp_path):
    """TRL's list fields (lora_target_modules, report_to) in a YAML list; scale_rewards' booleans as TRL maps them."""
    cfg = parse_args(Config, ["--config", write_yaml(tmp_path, "use_peft: true\nlora_target_modules: [v_proj, o_proj]\n"
                                                     "report_to: [none]\nscale_rewards: false\n"), "--profile=none"])
    assert (cfg.lora_target_modules, cfg.report_to, cfg.scale_rewards) == ("v_proj,o_proj", "none", "none")


REFUSED = [dict(alora_invocation_tokens=[5, 6]), dict(use_dora=True), dict(target_parameters=["mlp.experts"]),
           dict(exclude_modules=["k_proj"]), dict(trainable_token_indices=[3]), dict(layers_to_transform=[0]),
           dict(lora_bias=True), dict(bias="all"), dict(modules_to_save=["lm_head"]), dict(rank_pattern={"q_proj": 2}),
           dict(use_qalora=True), dict(init_lora_weights="pissa")]


@pytest.mark.parametrize("option", REFUSED, ids=[next(iter(o)) for o in REFUSED])
def test_lora_options_we_do_not_implement_are_refused_in_one_line(tmp_path, option):
    """By peft_config= (grpo.api) and by --adapter_path (an adapter_config.json PEFT wrote)."""
    peft = pytest.importorskip("peft")
    from grpo.api import lora_fields
    name = next(iter(option))
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **option)
    with pytest.raises(ValueError, match=rf"peft_config: unsupported LoRA options {name}=") as e:
        lora_fields(config)
    assert "\n" not in str(e.value)
    config.save_pretrained(tmp_path)
    (tmp_path / lora.ADAPTER_WEIGHTS).write_bytes(b"")
    with pytest.raises(ValueError, match=rf"adapter_path {tmp_path}: unsupported LoRA options {name}="):
        lora.adapter_settings(tmp_path)


def test_a_plain_peft_lora_config_is_accepted_both_ways(tmp_path):
    peft = pytest.importorskip("peft")
    from grpo.api import lora_fields
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"], task_type="CAUSAL_LM")
    assert lora_fields(config)["lora_target_modules"] == "q_proj,v_proj"
    assert lora_fields(peft.LoraConfig())["lora_target_modules"] is None  # None: PEFT's default, resolved by check()
    config.save_pretrained(tmp_path)
    (tmp_path / lora.ADAPTER_WEIGHTS).write_bytes(b"")
    assert lora.adapter_settings(tmp_path) == lora.LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj"))


def test_trl_lora_flags_we_do_not_implement_are_refused_in_one_line():
    for flag, message in [("--lora_target_parameters=x", "linear layers"), ("--use_dora", "LoRA only"),
                          ("--lora_modules_to_save=x", "only the adapters"), ("--load_in_4bit", "not supported")]:
        with pytest.raises(ValueError, match=message) as e:
            parse_args(Config, ["--use_peft", flag, "--profile=none"])
        assert str(e.value).startswith(f"{flag.split('=')[0]} is a TRL option") and "\n" not in str(e.value)


def test_a_bf16_merge_is_written_in_bf16_by_default_and_float32_keeps_a_small_update():
    """W = 1 in bf16 (ulp 2^-7): s B A = 2^-10 is below half an ulp, gone in a bf16 merge, kept in fp32."""
    settings = lora.LoraSettings(r=1, alpha=1.0, targets=("q_proj",))
    state = {"layers.0.self_attn.q_proj.weight": torch.ones(2, 3, dtype=torch.bfloat16),
             "layers.0.self_attn.q_proj.lora_A": torch.full((1, 3), 2.0 ** -5),
             "layers.0.self_attn.q_proj.lora_B": torch.full((2, 1), 2.0 ** -5)}
    w = "layers.0.self_attn.q_proj.weight"
    default, wide = lora.merged_state(state, settings), lora.merged_state(state, settings, torch.float32)
    assert default[w].dtype == torch.bfloat16 and torch.equal(default[w], state[w])
    assert wide[w].dtype == torch.float32 and torch.equal(wide[w], torch.full((2, 3), 1 + 2.0 ** -10))
    assert sorted(default) == [w]


def test_the_export_command_writes_a_lora_merge_in_the_bases_dtype():
    from grpo.infra.export import export_dtype
    assert export_dtype("auto", {"dtype": "bfloat16"}, lora=True) == torch.bfloat16
    assert export_dtype("auto", {"torch_dtype": "bfloat16"}, lora=False) == torch.float32  # fp32 masters as they are
    assert export_dtype("float32", {"dtype": "bfloat16"}, lora=True) == torch.float32
    assert parse_args(Config, ["--export_dtype=float32", "--profile=none"]).export_dtype == "float32"


# ----------------------------------------------------------------------------- docs/trl.md


def test_docs_trl_lists_every_trl_name_we_refuse_or_accept():
    from grpo.flags import TRL_NAMES
    text = DOC.read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    accepted = {"learning_rate", "num_generations", "num_iterations", "steps_per_generation",
                "gradient_accumulation_steps", "max_completion_length", "max_steps", "epsilon", "epsilon_high",
                "delta", "beta", "loss_type", "scale_rewards", "importance_sampling_level",
                "mask_truncated_completions", "temperature", "top_p", "top_k", "min_p", "weight_decay",
                "adam_beta1", "adam_beta2", "adam_epsilon", "warmup_steps", "lr_scheduler_type", "max_grad_norm",
                "seed", "output_dir", "save_steps", "save_total_limit", "eval_steps", "report_to",
                "gradient_checkpointing", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
                "lora_target_modules", "use_rslora", "dtype", "disable_dropout", "use_bias_correction_kl",
                "sapo_temperature_pos", "sapo_temperature_neg"}
    assert accepted <= {f.name for f in dataclasses.fields(Config)}
    missing = sorted((set(TRL_NAMES) | accepted) - rows)
    assert not missing, f"docs/trl.md has no row for {missing}"
