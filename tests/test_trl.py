"""A TRL user's path: GRPOTrainer in TRL's shape with a TRL reward function and a conversational
dataset, TRL's calling convention (batched, dataset-form prompts and completions, columns as
keyword lists, None skipped), --reward_funcs names, the command line's one-line errors and TRL
names, --help, the end-of-run summary, the config history, progress bars and the trackers."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from parallel import at_once
from toy import make_toy_dir

from grpo.api import GRPOTrainer
from grpo.cli.reward_funcs import import_functions
from grpo.config import Config
from grpo.rewards import RewardFunctionsEnv, weighted_sum
from grpo.rollout import assign_rewards, render_prompt
from grpo.trainer import final_rewards

ROOT = Path(__file__).resolve().parents[1]
CONVERSATIONAL = [{"prompt": [{"role": "system", "content": "w1"}, {"role": "user", "content": f"w{i} w{i + 1}"}],
                   **({"answer": "w3"} if i % 2 == 0 else {}), "topic": f"t{i % 3}"} for i in range(10)]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> str:
    return make_toy_dir(tmp_path_factory.mktemp("toy"))


def small(out, **kw) -> Config:
    return Config(**{**dict(output_dir=str(out), max_steps=2, prompts_per_step=2, num_generations=4,
                            max_prompt_length=24, max_completion_length=6, micro_batch_tokens=128, gen_batch=8,
                            eval_limit=4, save_steps=1, profile="none", learning_rate=1e-3), **kw})


def trl_reward(calls):
    """Written as for TRL: batched; completions as messages; columns as keyword lists; None = n/a."""
    def correct_number(prompts, completions, answer=None, completion_ids=None, **kwargs):
        calls.append(SimpleNamespace(prompts=prompts, completions=completions, answer=answer, ids=completion_ids,
                                     kwargs=kwargs))
        return [None if a is None else float(a in c[0]["content"]) for c, a in zip(completions, answer)]
    return correct_number


# ----------------------------------------------------------------------------- the API

def test_grpo_trainer_with_a_trl_reward_function_and_a_conversational_dataset(toy, tmp_path, one_thread, capsys):
    calls = []
    out = tmp_path / "run"
    trainer = GRPOTrainer(model=toy, reward_funcs=[trl_reward(calls), lambda completions, **kw: [0.5] * len(completions)],
                          args=small(out, importance_sampling_level="sequence", log_completions_steps=1),
                          train_dataset=CONVERSATIONAL,
                          eval_dataset=CONVERSATIONAL[:4], reward_weights=[1.0, 2.0])
    results = trainer.train()
    assert {"before", "after"} <= set(results)
    train_calls = [c for c in calls if len(c.completions) == 8]  # a step: 2 prompts x G=4, in one call
    assert len(train_calls) == 2
    c = train_calls[0]
    assert all(p == c.prompts[0] for p in c.prompts[:4]) and c.prompts[0][0] == {"role": "system", "content": "w1"}
    assert all(isinstance(x, list) and x[0]["role"] == "assistant" for x in c.completions)
    assert c.kwargs["topic"] and len(c.kwargs["topic"]) == 8 and len(c.ids) == 8
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # None skipped in the sum: the mean is over terms that apply, the reward over the weighted sum
        assert r["rewards/<lambda>/mean"] == 0.5
        assert r["reward"] == r["reward/mean"] and r["frac_reward_zero_std"] == r["flat_groups"]
        assert "completions/mean_length" in r and "clip_ratio/region_mean" in r and "reward_std" in r
    records = [json.loads(line) for line in open(out / "rollouts" / "step_000001.jsonl")]
    assert any(r["rewards"]["correct_number"] is None for r in records)  # rows without an answer: n/a
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["export"] == str(out / "export") and "after - before" in summary["gains"]
    assert summary["evals"]["after"]["questions"] == 4
    err, stdout = capsys.readouterr().err, capsys.readouterr().out
    assert "sampling" in err and "update" in err  # a bar while a step samples and while it updates
    assert list((out / "tb").glob("events.*"))  # report_to's default: TensorBoard
    # a resume appends to the config history; the first run's settings stay
    GRPOTrainer(model=toy, reward_funcs=trl_reward([]), args=small(out, max_steps=3, resume=True),
                train_dataset=CONVERSATIONAL).train()
    history = [json.loads(line) for line in open(out / "config_history.jsonl")]
    assert [h["max_steps"] for h in history] == [2, 3] and history[1]["resume"]


def test_the_weighted_sum_skips_none_and_calls_once_per_batch():
    calls = []
    env = RewardFunctionsEnv({"a": lambda prompts, completions, **kw: calls.append(len(completions)) or [1.0, None],
                              "b": lambda prompts, completions, **kw: [None, None]}, raw_text=True)
    ex = {"prompt": "w1 w2", "answer": "x"}
    trajs = [SimpleNamespace(example=ex, text=t, completion_ids=[1], finish_reason="stop", turns=[t],
                             observations=[]) for t in ("w1", "w2")]
    assign_rewards(env, trajs, {"a": 2.0, "b": 5.0})
    assert calls == [2]
    assert [t.reward for t in trajs] == [2.0, 0.0] and trajs[1].rewards == {"a": None, "b": None}
    # every term None: unscorable, NaN (as TRL), not the 0 of an empty sum
    rewards = final_rewards(trajs, Config())
    assert rewards[0] == 2.0 and math.isnan(rewards[1]) and math.isnan(weighted_sum(trajs[1].rewards, {}))


def test_unscorable_and_infinite_rewards_in_a_step(toy, tmp_path, one_thread):
    """TRL's cases in a step: a completion every reward function returns None for gets advantage 0,
    its group's others those of the group without it; a group holding an infinite reward gets 0,
    and the optimizer step still updates the weights (it was skipped: the group's advantages were
    NaN). Both are counted in the step's metrics."""
    import torch
    from transformers import AutoTokenizer

    from grpo.engine.sampler import Sampler
    from grpo.infra.metrics import step_metrics
    from grpo.loss import group_advantages
    from grpo.models.model import Transformer
    from grpo.rollout import rollout, sampling_params
    from grpo.trainer import advantages_of, flat_groups
    from grpo.update import policy_update

    def score(prompts, completions, completion_ids, **kw):  # None for row 1, inf for row 6
        return [None if i == 1 else math.inf if i == 6 else len(ids) + 0.1 * i for i, ids in enumerate(completion_ids)]
    env = RewardFunctionsEnv({"score": score}, raw_text=True)
    cfg = small(tmp_path / "run", max_grad_norm=0.0)
    model, tok = Transformer.from_pretrained(toy), AutoTokenizer.from_pretrained(toy)
    params = sampling_params(env, tok, 4, 1.0, cfg.max_completion_length, seed=0)
    trajs = assign_rewards(env, rollout(Sampler(model, tok, gen_batch=8), tok, env, [{"prompt": "w1 w2"},
                                                                                     {"prompt": "w3 w4"}], params))
    rewards = final_rewards(trajs, cfg)
    advantages = advantages_of(rewards, cfg)
    assert math.isnan(rewards[1]) and advantages[1] == 0 and (advantages[4:] == 0).all()
    torch.testing.assert_close(advantages[[0, 2, 3]], group_advantages(rewards[[0, 2, 3]], 3))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    update = policy_update(model, None, optimizer, scheduler, trajs, advantages, cfg, "cpu")
    assert update["skipped_updates"] == 0 and math.isfinite(update["grad_norm"]) and update["grad_norm"] > 0
    assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))
    m = step_metrics(trajs, rewards, advantages, flat_groups(rewards.tolist(), 4), update, 1.0, 1.0, 1.0)
    assert m["reward/unscorable"] == 1 and m["reward/infinite_groups"] == 1 and m["flat_groups"] == 0.5


def test_standard_prompts_are_text_as_trl_gives_them(toy):
    """TRL's standard form: the prompt text goes to the model as is (no chat template), and the
    reward functions get it back as text."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy)
    seen = []
    trainer = GRPOTrainer(model=toy, reward_funcs=lambda prompts, completions, **kw: seen.append(prompts) or [0.0],
                          args=Config(), train_dataset=[{"prompt": "w1 w2"}])
    env = trainer.env
    assert env.prompt(trainer.train_dataset[0]) == "w1 w2"
    assert render_prompt(tok, env.prompt(trainer.train_dataset[0])) == tok.encode("w1 w2", add_special_tokens=False)
    env.reward_batch(trainer.train_dataset, [SimpleNamespace(text="w3", completion_ids=[1], turns=[], observations=[])])
    assert seen == [["w1 w2"]]


@pytest.mark.parametrize("kwargs,message", [
    (dict(train_dataset=[{"question": "q"}]), "train_dataset row 0: no 'prompt' column"),
    (dict(train_dataset=[{"prompt": 3}]), "neither text nor chat messages"),
    (dict(reward_funcs="org/reward-model"), "reward models are not supported"),
    (dict(reward_weights=[1, 2]), "2 reward_weights for 1 reward_funcs"),
])
def test_grpo_trainer_refuses_with_one_line(kwargs, message):
    base = dict(model="m", reward_funcs=[lambda **kw: []], args=Config(), train_dataset=[{"prompt": "p"}])
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(**{**base, **kwargs})


# ----------------------------------------------------------------------------- --reward_funcs names

def test_reward_funcs_take_modules_files_and_paths(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def correct_number(prompts, completions, **kw):\n    return [1.0]\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.py").write_text("def fmt(prompts, completions, **kw):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    funcs = import_functions(f"my_rewards:correct_number,sub/other.py:fmt,{tmp_path / 'my_rewards.py'}:correct_number")
    assert list(funcs) == ["correct_number", "fmt"] and funcs["fmt"](None, None) == [0.0]
    with pytest.raises(SystemExit, match=r"^error: --reward_funcs 'my_rewards:nope': AttributeError"):
        import_functions("my_rewards:nope")
    with pytest.raises(SystemExit, match=r"^error: --reward_funcs 'missing.py:f': ImportError: no such file"):
        import_functions("missing.py:f")


@pytest.mark.slow  # processes of their own
def test_recipe_user_errors_are_one_line_and_write_nothing(toy, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "w1"}]}) + "\n")  # no answer: fine
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, str(ROOT / "recipes" / "custom_task.py"), f"--train_data={data}", "--profile=none",
            "--reward_funcs=custom_task:boxed_format"]
    cases = [([], "error: --model_path is required"),
             (["--model_path="], "error: --model_path is required"),
             (["--model_path=/no/such/model"], "error: model_path /no/such/model: no such folder"),
             ([f"--model_path={toy}", f"--output_dir={used}"], f"error: {used} holds another run (metrics.jsonl)"),
             ([f"--model_path={toy}", "--train_data=nope.jsonl"], "error: nope.jsonl: no such file"),
             ([f"--model_path={toy}", "--mask_truncated_completions", "maybe"], "error: unexpected argument 'maybe'"),
             ([f"--model_path={toy}", "--report_to=nosuch"], "error: bad config: report_to='nosuch'")]
    def run(flags):
        return subprocess.run(base + flags, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=env)
    runs = at_once(*(lambda flags=flags: run(flags) for flags, _ in cases))  # together: each mostly imports
    for (flags, message), r in zip(cases, runs):
        assert r.returncode != 0 and r.stderr.strip().startswith(message), (flags, r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no traceback
    assert sorted(p.name for p in used.iterdir()) == ["metrics.jsonl"]  # nothing written into the refused folder


# ----------------------------------------------------------------------------- report_to

def one_step(toy, out, report_to):
    cfg = small(out, max_steps=1, save_steps=0, export=False, eval_limit=0, report_to=report_to)
    GRPOTrainer(model=toy, reward_funcs=trl_reward([]), args=cfg, train_dataset=CONVERSATIONAL).train()


def test_report_to_tensorboard_or_none(toy, tmp_path, one_thread):
    """TensorBoard (always installed) is tested unconditionally; `none` leaves metrics.jsonl alone."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    one_step(toy, tmp_path / "tb", "tensorboard")
    events = EventAccumulator(str(tmp_path / "tb" / "tb")).Reload()
    assert {"reward/mean", "frac_reward_zero_std"} <= set(events.Tags()["scalars"])
    one_step(toy, tmp_path / "none", "none")
    assert not (tmp_path / "none" / "tb").exists() and (tmp_path / "none" / "metrics.jsonl").exists()


@pytest.mark.slow  # wandb starts a service process
def test_report_to_wandb_offline(toy, tmp_path, one_thread, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'grpo[wandb]')")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is our default
    monkeypatch.setenv("WANDB_SILENT", "true")
    one_step(toy, tmp_path / "run", "wandb")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs


TRACKIO_RUN = """
import sys
from test_trl import CONVERSATIONAL, GRPOTrainer, small, trl_reward
cfg = small(sys.argv[2], max_steps=1, save_steps=0, export=False, eval_limit=0, report_to="trackio")
GRPOTrainer(model=sys.argv[1], reward_funcs=trl_reward([]), args=cfg, train_dataset=CONVERSATIONAL).train()
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs("grpo-test", "run")
assert logs and "reward/mean" in logs[0] and "frac_reward_zero_std" in logs[0], logs
"""


@pytest.mark.slow  # a process of its own: trackio reads TRACKIO_DIR when imported
def test_report_to_trackio_offline(toy, tmp_path):
    import importlib.util
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio not installed (pip install 'grpo[trackio]')")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "grpo-test",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                                                os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", TRACKIO_RUN, toy, str(tmp_path / "run")], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert list((tmp_path / "trackio").glob("grpo-test*.db")), list((tmp_path / "trackio").iterdir())


# ----------------------------------------------------------------------------- the README, as written

def readme_task() -> tuple[dict, str]:
    """docs/your_task.md's "Your own task" (the README points there): its files ({name: text}, from the
    blocks after `<!-- file: NAME -->`) and its commands (the bash block after `<!-- run -->`)."""
    import re
    text = (ROOT / "docs" / "your_task.md").read_text()
    section = text.split("## Your own task", 1)[1].split("\n## ", 1)[0]
    files = dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", section, re.S))
    commands = re.search(r"<!-- run -->\n```bash\n(.*?)```", section, re.S).group(1)
    return files, commands


@pytest.mark.slow  # the recipe and grpo.cli.eval, as processes of their own
def test_the_readme_task_works_as_written_from_a_fresh_folder(toy, tmp_path):
    """The README's files in an empty folder and its three commands, run by bash as written; only
    the model (the toy for SmolLM2, whose 135M parameters would take minutes here) and the sizes
    (flags appended, which win) differ."""
    files, commands = readme_task()
    assert set(files) == {"my_rewards.py", "train.jsonl", "my_task.yaml"}
    folder = tmp_path / "my_task"
    folder.mkdir()
    for name, body in files.items():
        (folder / name).write_text(body)
    assert len((folder / "train.jsonl").read_text().splitlines()) == 10
    small_flags = ("--max_completion_length=8 --max_prompt_length=64 --micro_batch_tokens=512 --gen_batch=16 "
                   "--eval_limit=3 --profile=none")
    script = commands.replace("$(python -m grpo.models.smollm2)", toy)
    script = "\n".join(line + (" " + small_flags if "custom_task.py" in line and not line.endswith("\\") else "")
                       for line in script.replace("\\\n", "").splitlines())
    env = {**os.environ, "GRPO": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", "-e", "-c", script], cwd=folder, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = folder / "runs" / "mine"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["export"] == "runs/mine/export" and "after - before" in summary["gains"]
    assert [json.loads(line)["max_steps"] for line in open(run / "config_history.jsonl")] == [10, 20]
    assert "gain after - before" in r.stdout and "per-sample records" in r.stdout
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [row["step"] for row in rows if "reward/mean" in row] == list(range(1, 21))
    assert all("rewards/correct_number/mean" in row for row in rows if "reward/mean" in row)


def test_datasets_dataset_and_list_of_dicts_give_the_same_examples():
    datasets = pytest.importorskip("datasets", reason="datasets not installed (pip install 'grpo[data]')")
    from grpo.api import dataset_examples
    rows = [{k: r.get(k) for k in ("prompt", "answer", "topic")} for r in CONVERSATIONAL]
    assert dataset_examples(datasets.Dataset.from_list(rows), "d") == dataset_examples(CONVERSATIONAL, "d")


def test_an_env_of_our_protocol_keeps_its_tool_and_is_scored_by_trl_functions():
    """GRPOTrainer(env=...): the env's prompt, tool protocol and terms, plus the reward functions,
    which see a multi-turn completion as assistant turns with the observations between them."""
    class ToolEnv:
        stop_strings, max_turns, observation_role = ["</call>"], 3, "tool"

        def prompt(self, example):
            return [{"role": "user", "content": example["question"]}]

        def step(self, text):
            return "4"

        def reward(self, example, trajectory):
            return {"correct": 1.0}
    seen = []
    trainer = GRPOTrainer(model="m", reward_funcs=lambda completions, **kw: seen.append(completions) or [0.5],
                          args=Config(), train_dataset=[{"prompt": [{"role": "user", "content": "2+2"}]}],
                          env=ToolEnv())
    env = trainer.env
    assert (env.stop_strings, env.max_turns, env.observation_role, env.step("x")) == (["</call>"], 3, "tool", "4")
    t = SimpleNamespace(text="<call>2+2</call>4 so 4", turns=["<call>2+2</call>", "so 4"], observations=["4"],
                        completion_ids=[1, 2])
    assert env.reward_batch(trainer.train_dataset, [t]) == [{"correct": 1.0, "<lambda>": 0.5}]
    assert seen[0] == [[{"role": "assistant", "content": "<call>2+2</call>"}, {"role": "tool", "content": "4"},
                        {"role": "assistant", "content": "so 4"}]]
