"""The recipes end to end on tiny random models of their families: two GRPO steps each,
from the command line, with the eval before and after and the Hugging Face export.

The tiny checkpoints borrow SmolLM2's tokenizer (vocab 49152, the same <|im_start|>/<|im_end|>
ChatML layout as Qwen2.5); the Qwen3 one gets a stand-in chat template with Qwen3's structure
(the real one is not available offline), thinking on/off included.
"""
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from parallel import at_once

import grpo.eval
import grpo.trainer
from grpo.rollout import render_prompt

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
IM_END = 2  # <|im_end|> in SmolLM2's vocabulary: the end of an assistant turn, as in Qwen2.5

# Qwen3's template, reduced to what the trainer touches: ChatML turns; earlier assistant turns
# lose their <think> block; the generation prompt of the non-thinking mode (enable_thinking=False)
# ends in an empty think block.
QWEN3_STANDIN_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}")
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
# one intra-op thread: these models are tiny, and on a shared 2-core machine a second OpenMP
# thread turns each small matmul from microseconds into milliseconds (measured: 500x)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # tests/conftest.py


def make_tiny_chat_model(path: Path, family: str, smollm2_path: str, chat_template: str | None = None) -> str:
    """A random `family` checkpoint (qwen2 | qwen3) with tiny dims and SmolLM2's tokenizer."""
    dims = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096,
                bos_token_id=1, eos_token_id=IM_END)
    if family == "qwen2":
        cfg, cls = transformers.Qwen2Config(**dims), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(head_dim=16, **dims), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    cls(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(smollm2_path) / name, path / name)
    if chat_template is not None:
        (path / "chat_template.jinja").write_text(chat_template)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END], "bos_token_id": 1}))
    return str(path)


def tiny_flags(model: str, out: Path) -> list[str]:
    # the random model rarely ends a turn: a recipe's own eval budget (6,500 or 16,384 tokens) fills its cache
    return [f"--model_path={model}", f"--output_dir={out}", "--max_steps=2", "--prompts_per_step=2", "--num_generations=2",
            "--max_completion_length=24", "--eval_limit=4", "--profile=none", "--dtype=float32", "--gen_batch=8",
            "--save_steps=2", "--eval_max_completion_length=24"]


def check_run(out: Path, family: str, eval_rows: int = 4):
    """2 RL steps in metrics.jsonl, eval before and after, an export transformers loads."""
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2], rows
    assert all(r["completion/len"] > 0 and "loss" in r for r in steps), steps
    for phase in ("before", "after"):
        records = [json.loads(line) for line in open(out / f"eval_{phase}.jsonl")]
        assert len(records) == eval_rows
        # an "error" row is a prompt the sampler refused (e.g. longer than its cache): it would score 0 silently
        assert not [r for r in records if r["finish_reason"] == "error"], records
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_000002"]  # --save_steps=2
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "export")
    assert model.config.model_type == family
    tok = transformers.AutoTokenizer.from_pretrained(out / "export")
    ids = torch.tensor([tok.encode("What is 2 plus 3?")])
    assert torch.isfinite(model(ids).logits).all()


# ----------------------------------------------------------------------------- calculator (Qwen2.5)

def test_calculator_recipe_two_steps(tmp_path, smollm2_path):
    """calculator_qwen25_05b.py runs calculator_qwen25_3b.py's main() with its own defaults (model and
    output folder, both given here): the 3B file's whole path too, but for its own last line, which
    test_every_recipe_has_help runs."""
    model = make_tiny_chat_model(tmp_path / "tiny-qwen2", "qwen2", smollm2_path)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "calculator_qwen25_05b.py"), *tiny_flags(model, out),
           "--train_questions=8", "--eval_questions=4", "--max_prompt_length=512"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_run(out, "qwen2")


# ----------------------------------------------------------------------------- GSM8K (Qwen3, thinking off)

def test_standin_template_non_thinking_prompt(smollm2_path):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = QWEN3_STANDIN_TEMPLATE
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    off = tok.decode(render_prompt(tok, messages, enable_thinking=False))
    on = tok.decode(render_prompt(tok, messages, enable_thinking=True))
    assert off.endswith(EMPTY_THINK), off
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on, on
    # Qwen3's structure: an earlier assistant turn loses its think block
    history = messages + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\n5"}, {"role": "user", "content": "and 4?"}]
    assert "hmm" not in tok.decode(render_prompt(tok, history, enable_thinking=False))


@pytest.mark.skipif(not (DATA / "gsm8k" / "train.jsonl").exists(), reason="../shared/data/gsm8k not found")
def test_gsm8k_recipe_two_steps_thinking_off(tmp_path, smollm2_path, monkeypatch):
    """The recipe file run as __main__ in this process, so that spies on the trainer's and the
    eval's rollout can see the prompts: both must end in Qwen3's empty think block."""
    model = make_tiny_chat_model(tmp_path / "tiny-qwen3", "qwen3", smollm2_path, QWEN3_STANDIN_TEMPLATE)
    out = tmp_path / "run"
    seen = {"train": [], "eval": []}

    def spy(real, phase):
        def wrapped(sampler, tokenizer, env, examples, params, *args, **kw):
            trajs = real(sampler, tokenizer, env, examples, params, *args, **kw)
            seen[phase].append((kw.get("chat_kwargs"), {tokenizer.decode(t.prompt_ids) for t in trajs}))
            return trajs
        return wrapped

    monkeypatch.setattr(grpo.trainer, "rollout", spy(grpo.trainer.rollout, "train"))
    monkeypatch.setattr(grpo.eval, "rollout", spy(grpo.eval.rollout, "eval"))
    train_data = tmp_path / "train.jsonl"  # a slice: the recipe reads the file whole
    train_data.write_text("".join((DATA / "gsm8k" / "train.jsonl").read_text().splitlines(True)[:200]))
    argv = [*tiny_flags(model, out), f"--train_data={train_data}", f"--eval_data={DATA / 'gsm8k' / 'test.jsonl'}"]
    monkeypatch.setattr(sys, "argv", ["gsm8k_qwen3_06b.py", *argv])
    runpy.run_path(str(ROOT / "recipes" / "gsm8k_qwen3_06b.py"), run_name="__main__")
    check_run(out, "qwen3")
    assert len(seen["train"]) == 2 and len(seen["eval"]) == 2, {k: len(v) for k, v in seen.items()}
    for phase, calls in seen.items():
        for chat_kwargs, prompts in calls:
            assert chat_kwargs == {"enable_thinking": False}, (phase, chat_kwargs)
            assert all(p.endswith(EMPTY_THINK) for p in prompts), (phase, [p[-60:] for p in prompts])
    eval_prompts = seen["eval"][0][1]
    assert all("ANSWER:" in p.split("<|im_start|>user")[0] for p in eval_prompts)  # the 10-shot system prompt


# ----------------------------------------------------------------------------- ReTool (Qwen3, code interpreter)

@pytest.mark.skipif(not (DATA / "math500" / "test.jsonl").exists(), reason="../shared/data/math500 not found")
def test_retool_recipe_two_steps(tmp_path, smollm2_path):
    """The pipeline on a tiny random Qwen3-shaped model with the stand-in tools template: it
    never writes a tool call (tests/test_retool.py runs real sandbox calls on SmolLM2)."""
    from test_retool import QWEN3_TOOLS_TEMPLATE
    model = make_tiny_chat_model(tmp_path / "tiny-qwen3", "qwen3", smollm2_path, QWEN3_TOOLS_TEMPLATE)
    out = tmp_path / "run"
    train_data = tmp_path / "train.jsonl"
    train_data.write_text("".join((DATA / "math500" / "test.jsonl").read_text().splitlines(True)[:16]))
    cmd = [sys.executable, str(ROOT / "recipes" / "retool_qwen3_4b.py"), *tiny_flags(model, out),
           f"--train_data={train_data}", "--question_field=problem", "--answer_field=answer",
           f"--eval_data={DATA / 'aime' / 'aime24.jsonl'}", "--eval_n=2", "--max_prompt_length=512",
           "--gradient_checkpointing=false", "--steps_per_generation=2"]  # 2 prompts: one group a step
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_run(out, "qwen3", eval_rows=8)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "reward/mean" in line]
    assert all({"reward/correct", "reward/tool_calls", "reward/tool_errors"} <= set(r) for r in rows)
    assert all(r["reward/mean"] == 2 * r["reward/correct"] - 1 for r in rows)   # +-1, as the reference


RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.py"))


@pytest.fixture(scope="module")
def helps() -> dict:
    """Every recipe's --help, the processes started together (tests/parallel.py: each mostly imports)."""
    def run(recipe):
        return subprocess.run([sys.executable, f"recipes/{recipe}", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env=ONE_THREAD)
    return dict(zip(RECIPES, at_once(*(lambda recipe=recipe: run(recipe) for recipe in RECIPES))))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_has_help(recipe, helps):
    r = helps[recipe]
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(f"--{name} (" in r.stdout for name in ("model_path", "learning_rate", "num_generations"))


def test_bad_recipe_flag_fails_before_any_work():
    r = subprocess.run([sys.executable, "recipes/calculator_smollm2_cpu.py", "--num_generation=4"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert r.returncode != 0 and "plan:" not in r.stdout
    assert r.stderr.strip().startswith("error: unknown field --num_generation"), r.stderr  # one line, no traceback


# ----------------------------------------------------------------------------- ProcessGRPO (Qwen2.5)

@pytest.mark.parametrize("credit", ["process", "outcome"])
def test_processgrpo_recipe_two_steps(credit, tmp_path, smollm2_path, monkeypatch, capsys):
    """Two steps on generated problems (no network), run in this process so that a spy on the
    frozen copy's continuations sees them: one call per step with --credit=process, none with
    --credit=outcome (plain GRPO: no frozen copy is even loaded). The solve-rate filter is on by
    default (process: a stub keeps every problem, its file and cost lines checked); the outcome
    run turns it off."""
    import grpo.envs.processgrpo
    import grpo.process
    model = make_tiny_chat_model(tmp_path / "tiny-qwen2", "qwen2", smollm2_path)
    out, calls = tmp_path / "run", []
    real = grpo.process.ProcessCredit.success_rates

    def spy(self, trajs, ends, step):
        rates = real(self, trajs, ends, step)
        calls.append(dict(self.stats, trajs=len(trajs), frozen=self.sampler.model))
        return rates

    monkeypatch.setattr(grpo.process.ProcessCredit, "success_rates", spy)
    shapes, update = [], grpo.trainer.policy_update     # what reaches the update: (N,) or per-token (N, C)
    monkeypatch.setattr(grpo.trainer, "policy_update",
                        lambda *a, **kw: shapes.append(tuple(a[5].shape)) or update(*a, **kw))
    filtered = []
    monkeypatch.setattr(grpo.envs.processgrpo, "filter_by_solve_rate", lambda s, t, e, examples, **kw: (
        filtered.append(len(examples)) or (examples, [4] * len(examples),
                                           dict(samples=8 * len(examples), completion_tokens=5, prompt_tokens=3,
                                                seconds=0.0))))
    val = tmp_path / "val.jsonl"   # GSM8K's columns: validation from another distribution than the generator's
    val.write_text("".join(json.dumps({"question": f"Ana has {i} pens and buys 3. How many?",
                                       "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"}) + "\n" for i in range(4)))
    argv = [*tiny_flags(model, out), "--train_data=multistep:train:2", f"--credit={credit}",
            "--num_continuations=2", "--max_continuation_length=8", "--max_process_steps=3",
            "--continuation_batch=8", f"--eval_data={val}"]
    argv += ["--filter_solve_rate=false"] if credit == "outcome" else []
    monkeypatch.setattr(sys, "argv", ["processgrpo_qwen25_05b.py", *argv])
    runpy.run_path(str(ROOT / "recipes" / "processgrpo_qwen25_05b.py"), run_name="__main__")
    check_run(out, "qwen2")
    if credit == "outcome":
        assert calls == [] and shapes == [(4,), (4,)] and filtered == [], (calls, shapes, filtered)
        return
    printed = capsys.readouterr().out
    assert filtered == [14] and len(open(out / "train_filtered.jsonl").readlines()) == 14
    assert "filter: 14 candidate problems x 8 samples = 112 samples; at most 2,688 sampled tokens (24 each)" in printed
    assert "filter cost: 112 samples, 5 sampled tokens" in printed
    assert len(calls) == 2, calls                     # one credit call per step, over its 2 x 2 solutions
    assert len(shapes) == 2 and all(len(s) == 2 and s[0] == 4 for s in shapes), shapes
    for c in calls:
        # 1 to 3 boundaries per solution, the prompt's own (p_0) once for its 2 solutions
        assert c["trajs"] == 4 and 2 <= c["boundaries"] <= 10 and c["continuations"] == 2 * c["boundaries"]
        frozen = c["frozen"]               # the second Transformer: eval mode, no grad, fp32 on CPU
        assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
        assert next(frozen.parameters()).dtype == torch.float32
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "reward/mean" in line]
    for r in rows:  # the credit's costs are logged each step; forking prefilled fewer tokens than prefixes
        assert 0 < r["credit/time_share"] < 1 and r["credit/continuations"] == 2 * r["credit/boundaries"]
        assert r["credit/prefill_tokens"] <= r["credit/prefix_tokens"]


def test_processgrpo_filter_refuses_another_runs_folder(tmp_path, smollm2_path, monkeypatch):
    """The solve-rate filter writes into output_dir before train() runs: a fresh run refuses a
    folder that holds another run before any filtering (and before that run's file is touched)."""
    import grpo.envs.processgrpo
    model = make_tiny_chat_model(tmp_path / "tiny-qwen2", "qwen2", smollm2_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "train_filtered.jsonl").write_text("another run's problems\n")
    monkeypatch.setattr(grpo.envs.processgrpo, "filter_by_solve_rate",
                        lambda *a, **k: pytest.fail("filtered into another run's folder"))
    argv = [*tiny_flags(model, out), "--train_data=multistep:train:2", "--credit=outcome",
            "--eval_data=multistep:validation:1", "--continuation_batch=8"]   # the filter: on by default
    monkeypatch.setattr(sys, "argv", ["processgrpo_qwen25_05b.py", *argv])
    with pytest.raises(SystemExit, match="holds another run"):
        runpy.run_path(str(ROOT / "recipes" / "processgrpo_qwen25_05b.py"), run_name="__main__")
    assert (out / "train_filtered.jsonl").read_text() == "another run's problems\n"


def test_calculator_prompts_per_step_follow_the_reference_rule(monkeypatch):
    """--prompts_per_step 0 (the default): 8 generations per GPU / G, as the docstring says: 8 on 8
    GPUs, the reference's 3B batch (2 training GPUs) 2, its 0.5B's (6) 6, one GPU 1; a given value wins."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import calculator_qwen25_3b as recipe

    from grpo.flags import parse_args
    doc = recipe.__doc__
    assert "8 on 8 GPUs" in doc and "(3B: 2 prompts" in doc and "--prompts_per_step 6" in open(
        ROOT / "recipes" / "calculator_qwen25_05b.py").read()
    for gpus, want in ((8, 8), (2, 2), (6, 6), (1, 1)):
        monkeypatch.setenv("WORLD_SIZE", str(gpus))
        assert parse_args(recipe.CalculatorQwen, []).prompts_per_step == want
    assert parse_args(recipe.CalculatorQwen, ["--prompts_per_step", "3"]).prompts_per_step == 3
    assert parse_args(recipe.CalculatorQwen, ["--num_generations", "16"]).prompts_per_step == 1  # 8 / 16: at least one
    cfg = parse_args(recipe.CalculatorQwen, [])
    assert (cfg.beta, cfg.warmup_steps, cfg.lr_scheduler_type, cfg.max_turns, cfg.answer_abs_tol) == (
        0.002, 10, "constant", 6, 0.1)
    with pytest.raises(ValueError, match="--judge_model"):  # a judge with no model: every request would fail
        parse_args(recipe.CalculatorQwen, ["--judge_base_url", "http://judge/v1"])
