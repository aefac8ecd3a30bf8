"""grpo.config's precedence: Config defaults < profile < the recipe's defaults < YAML < command line,
resolved once, and recorded as applied. On a GPU the profile leaves to the memory plan the sizes nobody
set (grpo.trainer.size_to_memory sizes them at start); on a CPU it sets fp32."""
from dataclasses import dataclass

import pytest

from grpo import config
from grpo.config import Config, apply_profile, parse_args
from grpo.memory import SIZED


@dataclass
class Recipe(Config):
    micro_batch_tokens: int = 4096   # the recipe's own choice: the plan must not override it


def test_on_a_gpu_the_plan_sizes_only_what_nobody_set(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "_cuda", lambda: True)
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
    monkeypatch.setattr(config, "_cuda", lambda: False)
    cfg = parse_args(Recipe, [])
    assert cfg.dtype == "float32" and cfg.profile_applied["settings"] == {"dtype": "float32"}
    assert cfg.profile_applied["sized_by_plan"] == []
    assert parse_args(Recipe, ["--dtype", "bfloat16"]).profile_applied["settings"] == {}  # the flag's, not the profile's


@dataclass
class Small(Recipe):
    gen_batch: int = 64   # Config's own default, declared: the recipe's choice all the same


def test_a_field_the_recipe_declares_at_configs_default_is_kept(monkeypatch):
    monkeypatch.setattr(config, "_cuda", lambda: True)
    assert Small.gen_batch == Config.gen_batch
    cfg = parse_args(Small, [])
    assert cfg.profile_applied["sized_by_plan"] == ["kv_budget_gb", "gradient_checkpointing"]
    assert cfg.profile_applied["kept_from_the_recipe"] == {"gen_batch": 64, "micro_batch_tokens": 4096}


def test_a_micro_batch_the_plan_sizes_is_not_refused_before_it_is_sized(monkeypatch):
    """Config's 8192 tokens cannot hold a 512 + 8192-token sequence; on a GPU the plan sizes it at start
    (at least the longest sequence), so parsing lets it be; set by hand, or on a CPU, it is refused."""
    long = ["--max_prompt_length", "512", "--max_completion_length", "8192"]
    monkeypatch.setattr(config, "_cuda", lambda: True)
    assert "micro_batch_tokens" in parse_args(Config, long).profile_applied["sized_by_plan"]
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        parse_args(Config, long + ["--micro_batch_tokens", "8192"])
    monkeypatch.setattr(config, "_cuda", lambda: False)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        parse_args(Config, long)


def test_a_config_built_in_python_records_no_profile(tmp_path, monkeypatch):
    """record_run writes what was applied, never a profile resolved again at record time."""
    import json
    from grpo import trainer
    monkeypatch.setattr(config, "_cuda", lambda: True)
    cfg = Config(model_path="x", output_dir=str(tmp_path / "run"))
    trainer.record_run(cfg)
    meta = json.loads((tmp_path / "run" / "config.json").read_text())["_meta"]
    assert meta["profile"]["settings"] == {} and "no profile applied" in meta["profile"]["note"]
    cfg = Config(model_path="x", output_dir=str(tmp_path / "run2"))
    apply_profile(cfg)
    trainer.record_run(cfg)
    meta = json.loads((tmp_path / "run2" / "config.json").read_text())["_meta"]
    assert meta["profile"]["sized_by_plan"] == list(SIZED)
