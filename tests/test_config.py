"""grpo.config's precedence: Config defaults < GPU profile < the recipe's defaults < YAML < command
line, resolved once, and recorded as applied."""
from dataclasses import dataclass

from grpo import config
from grpo.config import Config, apply_profile, parse_args

FAKE = dict(gen_batch=256, kv_budget_gb=50.0, micro_batch_tokens=49152)


@dataclass
class Recipe(Config):
    micro_batch_tokens: int = 4096   # the recipe's own choice: a profile must not override it


def test_the_profile_sizes_only_what_the_recipe_left_at_the_default(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "pick_profile", lambda name=None: dict(FAKE))
    cfg = parse_args(Recipe, [])
    assert (cfg.gen_batch, cfg.kv_budget_gb, cfg.micro_batch_tokens) == (256, 50.0, 4096)
    assert cfg.profile_applied["settings"] == {"gen_batch": 256, "kv_budget_gb": 50.0}
    assert cfg.profile_applied["kept_from_the_recipe"] == {"micro_batch_tokens": 4096}
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("gen_batch: 32\n")
    cfg = parse_args(Recipe, ["--config", str(yaml_file)])           # YAML over the profile
    assert cfg.gen_batch == 32 and cfg.kv_budget_gb == 50.0
    cfg = parse_args(Recipe, ["--config", str(yaml_file), "--gen_batch", "8"])  # the command line over YAML
    assert cfg.gen_batch == 8
    assert parse_args(Recipe, ["--profile", "none"]).gen_batch == Config().gen_batch


@dataclass
class Small(Recipe):
    gen_batch: int = 64   # Config's own default, declared: the recipe's choice all the same


def test_a_field_the_recipe_declares_at_configs_default_is_kept(monkeypatch):
    monkeypatch.setattr(config, "pick_profile", lambda name=None: dict(FAKE))
    assert Small.gen_batch == Config.gen_batch
    cfg = parse_args(Small, [])
    assert (cfg.gen_batch, cfg.kv_budget_gb, cfg.micro_batch_tokens) == (64, 50.0, 4096)  # Recipe's field too
    assert cfg.profile_applied["kept_from_the_recipe"] == {"gen_batch": 64, "micro_batch_tokens": 4096}


def test_a_config_built_in_python_records_no_profile(tmp_path, monkeypatch):
    """record_run writes what was applied, never a profile resolved again at record time."""
    import json
    from grpo import trainer
    monkeypatch.setattr(config, "pick_profile", lambda name=None: dict(FAKE))
    cfg = Config(model_path="x", output_dir=str(tmp_path / "run"))
    trainer.record_run(cfg)
    meta = json.loads((tmp_path / "run" / "config.json").read_text())["_meta"]
    assert meta["profile"]["settings"] == {} and "no profile applied" in meta["profile"]["note"]
    cfg = Config(model_path="x", output_dir=str(tmp_path / "run2"))
    apply_profile(cfg)
    trainer.record_run(cfg)
    meta = json.loads((tmp_path / "run2" / "config.json").read_text())["_meta"]
    assert meta["profile"]["settings"] == FAKE
