"""Run safety on CPU, in one process: a run never destroys another (the output folder, config.json,
metric rows per series on resume, fsync before pruning), and errors a user can act on, raised
before anything slow loads. The two-rank cases (failures, the clock, the checkpoint choice, the
warm-start split) are in test_dist.py."""
import dataclasses
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from toy import ToyEnv, make_toy_dir

from grpo import trainer
from grpo.config import Config
from grpo.infra import checkpoint, dist
from grpo.infra.checkpoint import Checkpointer
from grpo.infra.data import DataError, load_examples
from grpo.infra.metrics import series
from grpo.models.model import Transformer
from grpo.trainer import train

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(40)]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> str:
    return make_toy_dir(tmp_path_factory.mktemp("toy"))


def config(model_path: str, out: Path, **kw) -> Config:
    base = dict(model_path=model_path, output_dir=str(out), max_steps=2, prompts_per_step=2,
                num_generations=2, learning_rate=1e-3, max_prompt_length=16, max_completion_length=6,
                micro_batch_tokens=64, gen_batch=8, eval_limit=2, eval_n=1, save_steps=1, export=False, profile="none")
    return Config(**{**base, **kw})


def no_model(*args, **kwargs):
    pytest.fail("the model was loaded: the error should have come first")


def files(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


class Crash(Exception):
    pass


class CrashingEnv(ToyEnv):
    """ToyEnv with gold demonstrations for the warm-start that crashes at RL step `rl_step` (its
    first reward, counting calls) or while rendering warm-start step `sft_step` (0-based)."""
    def __init__(self, cfg: Config, rl_step: int = 0, sft_step: int = -1):
        self.rewards = self.golds = 0
        self.crash_reward = (rl_step - 1) * cfg.prompts_per_step * cfg.num_generations if rl_step else -1
        self.crash_gold = sft_step * cfg.sft_batch if sft_step >= 0 else -1

    def reward(self, example, trajectory):
        self.rewards += 1  # assign_rewards() calls this from threads; one step's calls all come after the last step's
        if self.rewards - 1 == self.crash_reward:
            raise Crash("reward")
        return super().reward(example, trajectory)

    def gold_messages(self, example):
        self.golds += 1
        if self.golds - 1 == self.crash_gold:
            raise Crash("warm-start")
        return [{"role": "assistant", "content": "w0 w1 w2 w3"}]


def run(cfg: Config, env) -> dict:
    return train(cfg, env, EXAMPLES, EXAMPLES[:2], eval_env=ToyEnv())  # eval rewards stay out of the count


def logged(out: Path) -> list[tuple[str, int]]:
    """(series, step) of every metrics.jsonl row, in file order."""
    return [(series(r), r["step"]) for r in map(json.loads, open(out / "metrics.jsonl"))]


# ----------------------------------------------------------------------------- the output folder

def test_a_fresh_run_refuses_a_folder_that_holds_another_run(toy, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(config(toy, out), ToyEnv())
    before = files(out)
    monkeypatch.setattr(trainer, "build", no_model)
    with pytest.raises(FileExistsError, match=r"holds another run \(metrics.jsonl, checkpoints\): "
                                              r"use --resume to continue it, or another --output_dir"):
        run(config(toy, out, seed=1), ToyEnv())
    assert files(out) == before  # nothing pruned, appended or rewritten
    # a folder with other files, or with only the config.json of a run that never started, is free
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "notes.txt").write_text("mine")
    (tmp_path / "fresh" / "config.json").write_text("{}")
    with pytest.raises(pytest.fail.Exception, match="the model was loaded"):
        run(config(toy, tmp_path / "fresh"), ToyEnv())
    assert (tmp_path / "fresh" / "notes.txt").read_text() == "mine"


def test_config_json_records_the_run(toy, tmp_path):
    cfg = config(toy, tmp_path / "run", max_steps=1)
    run(cfg, ToyEnv())
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    meta = record.pop("_meta")
    assert record == dataclasses.asdict(cfg)  # every field, as resolved (epsilon_high filled in)
    assert meta["grpo_version"] == importlib.metadata.version("grpo")
    # built in Python, not by parse_args: no profile was applied, and the record says so
    assert meta["profile"] == {"name": "none", "resolved": None, "settings": {},
                               "note": "Config built in Python: no profile applied"}
    assert meta["torch_version"] == torch.__version__ and meta["world_size"] == 1
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a clone: the commit the code came from
        assert meta["git_commit"] == head.stdout.strip() and isinstance(meta["git_dirty"], bool)


def test_resume_refuses_another_runs_folder_and_says_what_differs(toy, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(config(toy, out, max_steps=1), ToyEnv())
    other = make_toy_dir(tmp_path / "other-model", seed=1)
    monkeypatch.setattr(trainer, "build", no_model)
    with pytest.raises(ValueError) as e:
        run(config(other, out, resume=True, num_generations=4), ToyEnv())
    assert f"--resume: {out / 'config.json'} was written by another run" in str(e.value)
    assert f"model_path: {toy!r} there, {other!r} now" in str(e.value)
    assert "num_generations: 2 there, 4 now" in str(e.value)
    (out / "config.json").write_text('{"model_path": ')  # cut short
    with pytest.raises(ValueError, match=f"{out / 'config.json'}: not valid JSON"):
        run(config(toy, out, resume=True), ToyEnv())


# ----------------------------------------------------------------------------- metric rows on resume

def rl(*steps) -> list:
    return [("rl", s) for s in steps]


@pytest.mark.parametrize("case", ["step 0", "mid warm-start", "mid RL"])
def test_resume_purges_metric_rows_per_series(toy, tmp_path, case):
    """A crash, then --resume: every series (the warm-start's sft/*, each eval, the RL steps) ends up
    with each row once. The warm-start has no checkpoint of its own (the first is written after it,
    at step 0), so a crash mid warm-start resumes from nothing and runs it again."""
    out = tmp_path / "run"
    kw = {"step 0": dict(sft_steps=2, save_steps=5, max_steps=3),          # crash in step 2, checkpoint 0
          "mid warm-start": dict(sft_steps=3, save_steps=1, max_steps=2),  # crash in warm-start step 1
          "mid RL": dict(sft_steps=4, save_steps=2, max_steps=4)}[case]    # crash in step 4, checkpoint 2
    cfg = config(toy, out, sft_batch=2, **kw)
    crash = {"step 0": dict(rl_step=2), "mid warm-start": dict(sft_step=1), "mid RL": dict(rl_step=4)}[case]
    with pytest.raises(Crash):
        run(cfg, CrashingEnv(cfg, **crash))
    first = [json.loads(line) for line in open(out / "metrics.jsonl")]
    run(config(toy, out, sft_batch=2, resume=True, **kw), CrashingEnv(cfg))
    sft = [("sft", s) for s in range(cfg.sft_steps)]
    evals = [("eval/before", 0), ("eval/warmstart", 0)]
    expected = {"step 0": sft + evals + rl(1, 2, 3) + [("eval/after", 3)],
                "mid warm-start": sft + evals + rl(1, 2) + [("eval/after", 2)],
                "mid RL": sft + evals + rl(1, 2, 3, 4) + [("eval/after", 4)]}[case]
    assert sorted(logged(out)) == sorted(expected)
    kept = [json.loads(line) for line in open(out / "metrics.jsonl")][:len(sft) + 2]
    if case != "mid warm-start":  # the rows of the interrupted run it continues are its own, untouched
        assert kept == [r for r in first if series(r) != "rl"][:len(sft) + 2]


# ----------------------------------------------------------------------------- checkpoints

def test_checkpoint_files_are_fsynced_before_older_ones_are_pruned(toy, tmp_path, monkeypatch):
    events = []
    fsync, remove = os.fsync, checkpoint._remove
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(checkpoint, "_remove",
                        lambda path: events.append(("remove", str(path))) or remove(path))
    model = Transformer.from_pretrained(toy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = Checkpointer(str(tmp_path), keep_last=1)
    try:
        ckpt.save(1, model, optimizer, scheduler)
        events.clear()
        ckpt.save(2, model, optimizer, scheduler)
    finally:
        ckpt.close()
    root = (tmp_path / "checkpoints").resolve()
    pruned = next(i for i, e in enumerate(events) if e[0] == "remove")
    assert events[pruned][1] == str(tmp_path / "checkpoints" / "step_000001")
    synced = {e[1] for e in events[:pruned] if e[0] == "fsync"}
    new = root / "step_000002.tmp"  # the folder's name until the commit renames it
    for path in (new / "rng_0.pt", new / "meta.json", new, root):  # root: the rename itself
        assert str(path) in synced, f"{path} not fsynced before the prune: {sorted(synced)}"


# ----------------------------------------------------------------------------- errors a user can act on

@pytest.mark.parametrize("model_path,message", [
    ("", "model_path is empty: pass --model_path="),
    ("/no/such/model", "model_path /no/such/model: no such folder"),
    ("EMPTY_DIR", "no config.json: not a Hugging Face checkpoint folder"),
])
def test_a_bad_model_path_fails_before_the_tokenizer_loads(model_path, message, tmp_path, monkeypatch):
    import transformers
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_model)
    if model_path == "EMPTY_DIR":
        model_path = str(tmp_path / "empty")
        os.mkdir(model_path)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run(config(model_path, tmp_path / "run"), ToyEnv())
    assert not (tmp_path / "run").exists()  # refused before anything is written (no config.json left behind)


def test_an_empty_dataset_fails_before_the_model_loads(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "build", no_model)
    with pytest.raises(ValueError, match="no training examples: the dataset is empty"):
        train(config(toy, tmp_path / "run"), ToyEnv(), [])


def test_batch_splits_over_ranks_are_checked_at_start(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "build", no_model)
    monkeypatch.setattr(dist, "world_size", lambda: 3)  # as under torchrun --nproc_per_node=3
    with pytest.raises(ValueError, match=r"prompts_per_step=2 must be a multiple of the world size 3"):
        run(config(toy, tmp_path / "run"), ToyEnv())
    cfg = config(toy, tmp_path / "run", prompts_per_step=3, sft_steps=1, sft_batch=4)
    with pytest.raises(ValueError, match=r"sft_batch=4 must be a multiple of the world size 3"):
        run(cfg, CrashingEnv(cfg))
    with pytest.raises(ValueError, match=r"the warm-start needs env.gold_messages\(example\)"):
        run(cfg, ToyEnv())


def test_a_kv_budget_that_holds_no_row_fails_at_start(toy, tmp_path):
    """The sampler sizes its cache per call; the budget is still checked before any step runs."""
    cfg = config(toy, tmp_path / "run", kv_budget_gb=1e-6)
    with pytest.raises(ValueError, match=r"kv_budget_gb=1e-06: 0.00 GiB of KV cache holds no row"):
        run(cfg, ToyEnv())


def test_process_group_timeout_is_a_config_field(toy, tmp_path, monkeypatch):
    assert Config().dist_timeout_min == 60  # long rollouts: one rank's 16k-token turn while the others wait
    calls = []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist.tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.tdist, "init_process_group", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(dist, "_watch_failures", lambda: None)
    dist.init(90.0)
    assert len(calls) == 1 and calls[0]["timeout"] == datetime.timedelta(minutes=90)
    inits = []
    monkeypatch.setattr(dist, "init", lambda *a: inits.append(a))
    monkeypatch.setattr(trainer, "build", no_model)
    with pytest.raises(pytest.fail.Exception):
        run(config(toy, tmp_path / "run", dist_timeout_min=120), ToyEnv())
    assert inits == [(120,)]


def test_corrupt_data_and_eval_without_questions_are_named(tmp_path):
    from grpo.cli.eval import main
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "answer": \n')
    with pytest.raises(DataError, match=f"{bad}:2: not valid JSON"):
        load_examples(bad)
    with pytest.raises(SystemExit, match="--data is empty"):  # not the task's default data, silently
        main(["--model_path", "unused", "--task", "gsm8k", "--data", ""])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match="empty.jsonl: no examples"):
        main(["--model_path", "unused", "--task", "gsm8k", "--data", str(tmp_path / "empty.jsonl")])


@pytest.mark.slow  # a process of its own
def test_an_old_torch_is_refused_at_import():
    code = "import torch; torch.__version__ = '{}'; import grpo.infra.dist"
    old = subprocess.run([sys.executable, "-c", code.format("2.7.1+cu126")], capture_output=True, text=True)
    assert old.returncode != 0
    assert "ImportError: grpo needs torch >= 2.8 (FSDP2's fully_shard(reshard_after_forward=None)" \
        in old.stderr
    new = subprocess.run([sys.executable, "-c", code.format("2.8.0")], capture_output=True, text=True)
    assert new.returncode == 0, new.stderr
    assert f'"torch>={dist.MIN_TORCH}"' in (ROOT / "setup.py").read_text()  # setup.py says the same
