"""grpo.config and its command line (grpo/flags.py): the precedence Config defaults < profile < the
recipe's defaults < YAML < command line, resolved once and recorded as applied (on a GPU the profile
leaves to the memory plan the sizes nobody set: grpo.fit.sizing.size_to_memory sizes them at start; on a
CPU it sets fp32); one-line errors, TRL's names, booleans, YAML and --help."""
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpo.config import Config
from grpo.fit import profile
from grpo.fit.memory import SIZED
from grpo.fit.profile import apply_profile
from grpo.flags import parse_args, print_help

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Recipe(Config):
    micro_batch_tokens: int = 4096   # the recipe's own choice: the plan must not override it


def test_on_a_gpu_the_plan_sizes_only_what_nobody_set(monkeypatch, tmp_path):
    monkeypatch.setattr(profile, "_cuda", lambda: True)
    cfg = parse_args(Recipe, [])
    assert cfg.profile_applied["sized_by_plan"] == ["gen_batch", "kv_budget_gb", "gradient_checkpointing"]
    assert cfg.profile_applied["kept_from_the_recipe"] == {"micro_batch_tokens": 4096}
    assert cfg.dtype == "auto" and cfg.profile_applied["settings"] == {}  # fp32 is the CPU's
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("gen_batch: 32\n")
    cfg = parse_args(Recipe, ["--config", str(yaml_file)])           # YAML: its value, not the plan's
    assert cfg.gen_batch == 32 and cfg.profile_applied["sized_by_plan"] == ["kv_budget_gb", "gradient_checkpointing"]
    cfg = parse_args(Recipe, ["--config", str(yaml_file), "--gen_batch", "8", "--gradient_checkpointing"])
    assert cfg.gen_batch == 8 and cfg.profile_applied["sized_by_plan"] == ["kv_budget_gb"]
    cfg = parse_args(Recipe, ["--profile", "none"])
    assert cfg.gen_batch == Config().gen_batch and cfg.profile_applied["sized_by_plan"] == []
    assert parse_args(Recipe, ["--profile", "L4"]).profile_applied["sized_by_plan"] == \
        ["gen_batch", "kv_budget_gb", "gradient_checkpointing"]  # sized for an L4's memory, on any GPU
    with pytest.raises(ValueError, match="unknown profile 'T4': auto, none, cpu or a GPU"):
        parse_args(Recipe, ["--profile", "T4"])


def test_on_a_cpu_the_profile_is_fp32_and_sizes_nothing(monkeypatch):
    monkeypatch.setattr(profile, "_cuda", lambda: False)
    cfg = parse_args(Recipe, [])
    assert cfg.dtype == "float32" and cfg.profile_applied["settings"] == {"dtype": "float32"}
    assert cfg.profile_applied["sized_by_plan"] == []
    assert parse_args(Recipe, ["--dtype", "bfloat16"]).profile_applied["settings"] == {}  # the flag's, not the profile's


@dataclass
class Small(Recipe):
    gen_batch: int = 64   # Config's own default, declared: the recipe's choice all the same


def test_a_field_the_recipe_declares_at_configs_default_is_kept(monkeypatch):
    monkeypatch.setattr(profile, "_cuda", lambda: True)
    assert Small.gen_batch == Config.gen_batch
    cfg = parse_args(Small, [])
    assert cfg.profile_applied["sized_by_plan"] == ["kv_budget_gb", "gradient_checkpointing"]
    assert cfg.profile_applied["kept_from_the_recipe"] == {"gen_batch": 64, "micro_batch_tokens": 4096}


def test_a_micro_batch_the_plan_sizes_is_not_refused_before_it_is_sized(monkeypatch):
    """Config's 8192 tokens cannot hold a 512 + 8192-token sequence; on a GPU the plan sizes it at start
    (at least the longest sequence), so parsing lets it be; set by hand, or on a CPU, it is refused."""
    long = ["--max_prompt_length", "512", "--max_completion_length", "8192"]
    monkeypatch.setattr(profile, "_cuda", lambda: True)
    assert "micro_batch_tokens" in parse_args(Config, long).profile_applied["sized_by_plan"]
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        parse_args(Config, long + ["--micro_batch_tokens", "8192"])
    monkeypatch.setattr(profile, "_cuda", lambda: False)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        parse_args(Config, long)


def test_a_config_built_in_python_records_no_profile(tmp_path, monkeypatch):
    """record_run writes what was applied, never a profile resolved again at record time."""
    import json

    from grpo.fit.build import record_run
    monkeypatch.setattr(profile, "_cuda", lambda: True)
    cfg = Config(model_path="x", output_dir=str(tmp_path / "run"))
    record_run(cfg)
    meta = json.loads((tmp_path / "run" / "config.json").read_text())["_meta"]
    assert meta["profile"]["settings"] == {} and "no profile applied" in meta["profile"]["note"]
    cfg = Config(model_path="x", output_dir=str(tmp_path / "run2"))
    apply_profile(cfg)
    record_run(cfg)
    meta = json.loads((tmp_path / "run2" / "config.json").read_text())["_meta"]
    assert meta["profile"]["sized_by_plan"] == list(SIZED)


@pytest.mark.parametrize("argv,message", [
    (["--loss_type=ppo"], "loss_type"),
    (["--num_generations=1"], "num_generations"),
    (["--learning_rate=abc"], "expected float"),
    (["--no_such_field=1"], "unknown field --no_such_field"),
    (["--temperature=0"], "temperature"),
    (["--resume=maybe"], "expected true or false"),
    (["--kernels=triton"], "kernels"),
])
def test_bad_config_is_a_clear_error(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(Config, argv + ["--profile=none"])


@pytest.mark.slow  # a process of its own
def test_parse_args_overrides_yaml_and_help(tmp_path):
    cfg = parse_args(Config, ["--learning_rate=3e-6", "--resume", "--loss_type", "dapo", "--profile=none"])
    assert (cfg.learning_rate, cfg.resume, cfg.loss_type) == (3e-6, True, "dapo")
    assert cfg.epsilon_high == cfg.epsilon == 0.2
    # epsilon_high follows epsilon unless set; a named GPU's profile leaves the sizes to the plan at start
    cfg = parse_args(Config, ["--epsilon", "0.3", "--profile=L4"])
    assert (cfg.epsilon, cfg.epsilon_high) == (0.3, 0.3) and "gen_batch" in cfg.profile_applied["sized_by_plan"]
    assert parse_args(Config, ["--epsilon=0.3", "--epsilon_high=0.28", "--profile=none"]).epsilon_high == 0.28
    # a YAML file of the same names, flags over it
    (tmp_path / "run.yaml").write_text("learning_rate: 2.0e-6\nnum_generations: 4\nloss_type: dr_grpo\n")
    cfg = parse_args(Config, ["--config", str(tmp_path / "run.yaml"), "--num_generations=6", "--profile=none"])
    assert (cfg.learning_rate, cfg.num_generations, cfg.loss_type) == (2e-6, 6, "dr_grpo")
    (tmp_path / "bad.yaml").write_text("lr: 1\n")
    with pytest.raises(ValueError, match="unknown field.*lr"):
        parse_args(Config, ["--config", str(tmp_path / "bad.yaml")])
    head = "from grpo.config import Config; from grpo.flags import parse_args; "
    out = subprocess.run([sys.executable, "-c", head + "parse_args(Config, ['--help'])"], capture_output=True, text=True)
    assert out.returncode == 0 and "--num_generations (int, default 8)" in out.stdout
    assert "G: completions per prompt" in out.stdout and "{grpo | bnpo | dr_grpo | dapo | cispo | sapo}" in out.stdout
    # from the real command line: one line, no traceback
    out = subprocess.run([sys.executable, "-c", head + "parse_args(Config)", "--lr=1"], capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.strip() == "error: unknown field --lr (did you mean --learning_rate?)"


@pytest.mark.parametrize("argv,message", [
    (["--per_device_train_batch_size=4"], "use --prompts_per_step"),
    (["--generation_batch_size", "8"], "use --prompts_per_step"),
    (["--vllm_importance_sampling_clip_max=3"], "use --tis_cap"),
    (["--use_vllm"], "not needed: the sampler runs on the training weights"),
    (["--peft_config=x"], r"GRPOTrainer\(peft_config=peft.LoraConfig"),
    (["--use_dora"], "LoRA only"),
    (["--num_generation=4"], r"did you mean --num_generations"),
])
def test_trl_names_say_what_to_use(argv, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_args(Config, argv + ["--profile=none"])
    assert "eval_temperature" not in str(e.value) and "gradient_checkpointing" not in str(e.value)


def test_every_bool_takes_true_false_1_0():
    for text, value in (("false", False), ("true", True), ("0", False), ("1", True)):
        cfg = parse_args(Config, ["--mask_truncated_completions", text, "--beta", "0.1", "--profile=none"])
        assert cfg.mask_truncated_completions is value and cfg.beta == 0.1
    assert parse_args(Config, ["--export", "--seed", "3", "--profile=none"]).export is True
    assert parse_args(Config, ["--importance_sampling_level", "sequence", "--profile=none"]).importance_sampling_level \
        == "sequence"
    from grpo.cli.eval import _flag
    assert _flag("false") is False and _flag("1") is True


def test_yaml_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("max_steps: many\n")
    with pytest.raises(ValueError, match=rf"--config {bad}: key 'max_steps'='many': expected int"):
        parse_args(Config, ["--config", str(bad)])
    bad.write_text("use_vllm: true\n")
    with pytest.raises(ValueError, match=rf"--config {bad}: key 'use_vllm' is a TRL option \(GRPOConfig, ModelConfig\)"):
        parse_args(Config, ["--config", str(bad)])


def test_help_is_grouped_with_required_fields_first(capsys, monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("custom_task_help", ROOT / "recipes" / "custom_task.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "custom_task_help", module)
    spec.loader.exec_module(module)
    print_help(module.CustomTask)
    text = capsys.readouterr().out
    heads = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert heads == ["required:", "model and data:", "GRPO:", "generation:", "optimization:", "LoRA:",
                     "logging, eval and checkpoints:", "hardware:"]
    required = text.split("required:")[1].split("model and data:")[0]
    for name in ("model_path", "train_data", "reward_funcs"):
        assert f"--{name} (str, REQUIRED)" in required
    # a description that continues on comment lines is shown whole
    assert "masking them too makes not stopping free" in text
