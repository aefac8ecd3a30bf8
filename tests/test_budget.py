"""The run budget (grpo.fit.budget) and the CPU choices (grpo.fit.precision): the plan's arithmetic on
hand-written numbers, the stop rule, a whole toy run that shrinks its evals to fit, and the
precision choice forced each way by a stubbed measurement and checked against a real one."""
import json

import pytest
import torch
from toy import ToyEnv, make_toy_dir

from grpo import trainer
from grpo.config import Config
from grpo.fit import budget, precision
from grpo.fit.budget import Rates, RunBudget, TimePlan, estimate, fit, rl_budget, stop_reason
from grpo.flags import parse_args
from grpo.trainer import train

EXAMPLES = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(40)]


# ----------------------------------------------------------------------------- the stop rule

def test_time_budget_stops_before_a_step_that_would_overrun_it(monkeypatch):
    """The budget is judged on the step to come: 4 steps of 20 s in a 90-second budget would
    end the fifth at 100 s, so RL stops after 4 (it ran the fifth before, to 100 s)."""
    monkeypatch.setattr(budget.time, "time", lambda: 1080.0)
    assert stop_reason(False, 90.0, 1000.0, 4) == "budget"   # 80 s in, next ends at 100 s
    assert stop_reason(False, 90.0, 1010.0, 4) is None       # 70 s in, next ends at 87.5 s
    assert stop_reason(False, None, 0.0, 1) is None          # no budget
    assert stop_reason(True, 90.0, 1075.0, 1) == "sigterm"


def test_min_steps_run_past_a_spent_budget(monkeypatch):
    """A budget already spent still gets min_rl_steps steps: a run always does some GRPO."""
    monkeypatch.setattr(budget.time, "time", lambda: 1000.0)
    assert stop_reason(False, -50.0, 900.0, 1, min_steps=3) is None
    assert stop_reason(False, -50.0, 900.0, 2, min_steps=3) is None
    assert stop_reason(False, -50.0, 900.0, 3, min_steps=3) == "budget"
    assert stop_reason(True, -50.0, 900.0, 1, min_steps=3) == "sigterm"  # SIGTERM does not wait


def test_run_budget_leaves_time_for_the_last_eval():
    """RL gets what the run budget leaves after the time spent and one more eval of the length
    of the last; with time_budget_min too, the smaller of the two."""
    assert rl_budget(RunBudget(), 500.0, 100.0) is None
    assert rl_budget(RunBudget(time_budget_min=6), 500.0, 100.0) == 360.0
    assert rl_budget(RunBudget(run_budget_min=20), 500.0, 240.0) == 1200 - 500 - 240
    assert rl_budget(RunBudget(run_budget_min=20, time_budget_min=6), 500.0, 240.0) == 360.0
    assert rl_budget(RunBudget(run_budget_min=20, time_budget_min=6), 800.0, 240.0) == 160.0


def test_the_config_fields_make_the_budget_object():
    """A command line's --run_budget_min / --time_budget_min (Config fields) make the RunBudget that
    train() takes when it is given none; without either there is none (the default)."""
    assert RunBudget.of(Config()) is None
    assert RunBudget.of(Config(min_eval_questions=100, min_rl_steps=8)) is None  # floors without a limit
    assert RunBudget.of(parse_args(Config, ["--run_budget_min", "18.5", "--min_eval_questions", "100",
                                            "--min_rl_steps", "8"])) == RunBudget(18.5, 0.0, 100, 8)
    assert RunBudget.of(Config(time_budget_min=6)) == RunBudget(time_budget_min=6)
    with pytest.raises(ValueError, match="must not be negative"):
        RunBudget(run_budget_min=-1)


# ----------------------------------------------------------------------------- the plan

def test_fit_scales_both_evals_alike_within_bounds():
    # 200 + 10 questions at 2 s and 10 s: 500 s of evals; 250 s left -> half of each
    assert fit(250.0, 2.0, 10.0, 200, 10) == (100, 5)
    assert fit(1e9, 2.0, 10.0, 200, 10) == (200, 10)        # never more than configured
    assert fit(1.0, 2.0, 10.0, 200, 10) == (budget.MIN_EVAL, 4)  # never below the floors
    assert fit(-100.0, 2.0, 10.0, 200, 10) == (budget.MIN_EVAL, 4)
    assert fit(1.0, 2.0, 10.0, 200, 10, floor=100) == (100, 4)  # min_eval_questions (the CPU recipe's 100)
    assert fit(250.0, 2.0, 10.0, 200, 10, floor=100) == (100, 5)
    assert fit(1.0, 2.0, 10.0, 12, 3) == (12, 3)             # a floor above the configured size: as configured


def test_estimate_counts_tokens_protocols_and_ranks():
    cfg = Config(eval_greedy=True, eval_temperature=1.0, eval_n=1, sft_steps=5, max_completion_length=200,
                 prompts_per_step=4, num_generations=2, num_iterations=1)
    rates = Rates(decode=0.01, train=0.003)
    u = estimate(cfg, rates, prompt_len=100, sft_tokens=1000)
    # two protocols (sampled + greedy): each question decodes to the limit and prefills its prompt
    assert u["before"] == u["warmstart"] == u["after"] == pytest.approx(2 * (200 * 0.01 + 100 * 0.001))
    assert u["warm-start"] == pytest.approx(1000 * 0.003)
    assert u["rl_step"] == pytest.approx(8 * (200 * 0.01 + 300 * 0.003))
    half = estimate(cfg, rates, 100, 1000, world=2)            # two ranks: half the rows each
    assert half["after"] == pytest.approx(u["after"] / 2) and half["rl_step"] == pytest.approx(u["rl_step"] / 2)


def unit(before=1.0, per_q=1.0, sft=1.0, rl=10.0):
    return {"before": before, "warmstart": per_q, "after": per_q, "warm-start": sft, "rl_step": rl}


def plan(cfg: Config, unit: dict, eval_q: int, before_q: int) -> TimePlan:
    """The TimePlan of the budget `cfg`'s fields ask for."""
    return TimePlan.plan(cfg, RunBudget.of(cfg), unit, eval_q, before_q)


def test_plan_keeps_a_fitting_run_and_shrinks_one_that_does_not():
    cfg = Config(run_budget_min=10, sft_steps=100, min_rl_steps=3, eval_limit=200, eval_before_limit=10)
    # 100 s warm-start + 30 s RL + 10 before + 2 x 200 evals = 540 s < 600 s: as configured
    fits = plan(cfg, unit(), 200, 10)
    assert (fits.eval_q, fits.before_q, fits.shrunk) == (200, 10, "")
    # evals at 3 s a question: 1,230 s > 600; 470 s left for 10 x 1 + 200 x 6 -> both at 0.389
    slow = plan(cfg, unit(per_q=3.0), 200, 10)
    assert (slow.eval_q, slow.before_q) == (77, 4) and "shrunk to fit" in slow.shrunk
    assert "does not fit" not in slow.line()
    # nothing fits: the floors, and the line says how long the run will take
    hopeless = plan(cfg, unit(rl=1000.0), 200, 10)
    assert (hopeless.eval_q, hopeless.before_q) == (budget.MIN_EVAL, 4)
    assert "does not fit on this machine" in hopeless.line()


def test_plan_pairs_before_with_after_when_no_warm_start():
    """Without a warm-start and a separate before-eval size, before and after share questions."""
    cfg = Config(run_budget_min=1, sft_steps=0, min_rl_steps=1, eval_limit=100, eval_before_limit=0)
    b = plan(cfg, unit(before=2.0, per_q=2.0, rl=5.0), 100, 100)
    assert b.eval_q == b.before_q < 100


def test_measured_phases_correct_later_estimates():
    cfg = Config(run_budget_min=10, sft_steps=10, min_rl_steps=1, eval_limit=200, eval_before_limit=10)
    b = plan(cfg, unit(), 200, 10)
    b.done("before", 20.0, 10)          # twice the estimate
    b.done("warm-start", 20.0, 10)
    assert b.factor() == pytest.approx(2.0)
    assert b.estimate("rl_step", 1) == pytest.approx(20.0)
    # 40 s spent; 600 - 40 - 20 (an RL step at 2x) = 540 s for 2 evals of 2 x 1 s a question -> 135
    assert b.refit(40.0) and b.eval_q == 135 and "after the warm-start" in b.shrunk
    # phases that ran faster than a slow probe said: the evals grow back, up to the configured size
    b.done("warmstart", 1.0, 1000)
    assert b.refit(40.0) and b.eval_q == 200


def test_time_budget_min_alone_plans_nothing(monkeypatch):
    """A limit on RL alone needs no plan: nothing is probed and the evals keep their sizes."""
    monkeypatch.setattr(budget, "probe", lambda *a, **k: pytest.fail("probed without run_budget_min"))
    assert budget.make_plan(RunBudget(time_budget_min=5), Config(), None, None, [], 0.0, 7, 3) is None


def test_without_a_budget_no_budget_code_runs(tmp_path, monkeypatch, capsys, one_thread):
    """train(..., budget=None) with no time limit in the config: no plan, no probe, no refit, no RL
    limit; the evals take their configured sizes (3 before, 7 after the warm-start and after RL)."""
    def never(*a, **k):
        raise AssertionError("budget code ran without a budget")
    for name in ("make_plan", "rl_budget", "rl_time_budget"):
        monkeypatch.setattr(trainer, name, never)
    monkeypatch.setattr(budget, "probe", never)
    monkeypatch.setattr(TimePlan, "refit", never)
    monkeypatch.setattr(TimePlan, "done", never)
    env = ToyEnv()
    env.gold_messages = lambda example: [{"role": "assistant", "content": "w0 w1 w2 w3"}]  # the warm-start's
    cfg = Config(model_path=make_toy_dir(tmp_path / "toy"), output_dir=str(tmp_path / "run"), max_steps=1,
                 prompts_per_step=2, num_generations=2, max_completion_length=8, max_prompt_length=32,
                 micro_batch_tokens=64, gen_batch=8, eval_limit=7, eval_before_limit=3, sft_steps=1, sft_batch=2,
                 save_steps=0, export=False, log_completions_steps=0, min_rl_steps=5, min_eval_questions=100)
    results = train(cfg, env, EXAMPLES, EXAMPLES, budget=None)
    assert [results[p]["questions"] for p in ("before", "warmstart", "after")] == [3, 7, 7]
    out = capsys.readouterr().out
    assert "plan, estimated" not in out and "of the budget left" not in out


@pytest.mark.parametrize("given", ["object", "flags"])
def test_a_slow_machine_shrinks_the_evals_and_still_runs_rl(given, tmp_path, monkeypatch, capsys, one_thread):
    """A whole toy run whose probe reports a very slow machine, in a 0.06 s budget that loading
    the model alone spends: the plan shrinks both evals alike (before and after on the same
    questions), says so, and RL still runs min_rl_steps steps. The budget given as the object
    (as the CPU recipe does) or as a command line's Config fields, which train() makes it from."""
    slow = Rates(decode=0.01, train=0.001)  # ~10x this toy model's real speed on any CPU
    monkeypatch.setattr(budget, "probe", lambda *a, **k: slow)
    limits = dict(run_budget_min=0.001, min_rl_steps=2)
    cfg = Config(model_path=make_toy_dir(tmp_path / "toy"), output_dir=str(tmp_path / "run"),
                 max_steps=50, prompts_per_step=2, num_generations=2, max_completion_length=16,
                 max_prompt_length=32, micro_batch_tokens=64, gen_batch=8, eval_limit=40, eval_before_limit=0,
                 save_steps=0, export=False, log_completions_steps=0, **(limits if given == "flags" else {}))
    results = train(cfg, ToyEnv(), EXAMPLES, EXAMPLES, budget=RunBudget(**limits) if given == "object" else None)
    out = capsys.readouterr().out
    assert "plan, estimated from this machine's speed" in out and "shrunk to fit" in out
    assert results["before"]["questions"] == results["after"]["questions"] == budget.MIN_EVAL
    steps = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"reward/mean"' in line]
    assert len(steps) == 2  # min_rl_steps, although the budget is spent before RL starts


# ----------------------------------------------------------------------------- CPU: precision and threads

def test_auto_chooses_fp32_where_bf16_is_slow_and_bf16_where_it_is_fast():
    avx2 = lambda: {"float32": 48.7, "bfloat16": 8.4}        # noqa: E731  (a Zen 3 machine's rates)
    avx512_bf16 = lambda: {"float32": 145.0, "bfloat16": 403.0}  # noqa: E731
    assert precision.choose("auto", avx2)[0] is False
    use, line = precision.choose("auto", avx512_bf16)
    assert use is True and "145" in line and "403" in line
    tie = lambda: {"float32": 100.0, "bfloat16": 110.0}      # noqa: E731  (within the margin: fp32)
    assert precision.choose("auto", tie)[0] is False


def test_true_and_false_force_the_choice_without_measuring():
    def never():
        raise AssertionError("forced settings must not measure")
    assert precision.choose("true", never)[0] is True and precision.choose(True, never)[0] is True
    assert precision.choose("false", never)[0] is False and precision.choose("0", never)[0] is False
    with pytest.raises(ValueError, match="autocast_bf16='maybe'"):
        precision.choose("maybe", never)


def test_real_measurement_is_consistent_with_its_choice(one_thread):
    """Whatever this CPU is, the choice follows the two rates it measured (no speed asserted)."""
    rates = precision.measure(64, 128, rows=32)
    assert rates["float32"] > 0 and rates["bfloat16"] > 0
    use, _ = precision.choose("auto", lambda: rates)
    assert use == (rates["bfloat16"] > precision.MARGIN * rates["float32"])


def test_set_autocast_on_a_model(tiny_dir, one_thread):
    from grpo.models.model import Transformer
    path, _ = tiny_dir("llama")
    model = Transformer.from_pretrained(path)
    assert "forced" in precision.set_autocast(model, "true") and model.autocast_bf16 is True
    precision.set_autocast(model, "auto", rates_fn=lambda: {"float32": 10.0, "bfloat16": 1.0})
    assert model.autocast_bf16 is False


def test_config_reads_every_spelling_of_autocast_bf16(tmp_path):
    assert parse_args(Config, ["--autocast_bf16", "auto"]).autocast_bf16 == "auto"
    assert parse_args(Config, ["--autocast_bf16=1"]).autocast_bf16 == "true"
    assert parse_args(Config, ["--autocast_bf16", "False"]).autocast_bf16 == "false"
    assert Config(autocast_bf16=True).check().autocast_bf16 == "true"   # a run recorded before "auto"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("autocast_bf16: true\n")
    assert parse_args(Config, ["--config", str(yaml_file)]).autocast_bf16 == "true"
    with pytest.raises(ValueError, match="autocast_bf16"):
        parse_args(Config, ["--autocast_bf16", "fast"])


def test_threads_per_rank_share_the_cores(monkeypatch):
    n = torch.get_num_threads()
    try:
        monkeypatch.setattr(precision.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert precision.set_threads(0) == 8          # torchrun's OMP_NUM_THREADS=1 would leave 14 cores idle
        assert precision.set_threads(3) == 3          # asked for: as asked
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        torch.set_num_threads(n)
        assert precision.set_threads(0) == n          # one process: torch's own default, unchanged
    finally:
        torch.set_num_threads(n)


def test_cpu_name_reads_the_first_model_name_and_falls_back_without_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: real_open(info if f == "/proc/cpuinfo" else f, *a, **k))
    assert precision.cpu_name() == "AMD EPYC 9R14 96-Core Processor"
    info.unlink()  # no /proc (macOS, Windows): platform's answer, never an exception
    monkeypatch.setattr(precision.platform, "processor", lambda: "arm")
    assert precision.cpu_name() == "arm"


def test_probe_times_the_sampler_and_one_backward_without_changing_the_model(tmp_path, one_thread):
    from transformers import AutoTokenizer

    from grpo.engine.sampler import Sampler
    from grpo.models.model import Transformer
    path = make_toy_dir(tmp_path / "toy")
    model, tok = Transformer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    before = [p.detach().clone() for p in model.parameters()]
    rates = budget.probe(model, Sampler(model, tok, gen_batch=8), [6, 7, 8], rows=8, train_tokens=16)
    assert rates.decode > 0 and rates.train > 0
    assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_the_line_after_the_warm_start_counts_each_phase_once():
    """After the warm-start the line adds what is left to the time spent, not the phases run."""
    cfg = Config(run_budget_min=10, sft_steps=10, min_rl_steps=1, eval_limit=100, eval_before_limit=10)
    b = plan(cfg, unit(before=1.0, per_q=1.0, sft=30.0, rl=10.0), 100, 10)
    assert "does not fit" not in b.line(spent_s=310.0)   # 310 + 2 x 100 + 10 = 520 s < 600 s
    assert "310" not in b.line() and "5.2 min spent" in b.line(spent_s=310.0)
    assert "does not fit" in b.line(spent_s=500.0)       # 500 + 200 + 10 > 600


def test_probe_times_warm_calls_between_synchronizations(monkeypatch):
    """The first sampler call and the first backward of a run compile Triton kernels and capture
    CUDA graphs (seconds, once): the probe runs each once untimed, then times the same shapes, its
    clock read after the device has finished (a synchronization each side, where the device is a GPU)."""
    import types
    clock, calls = [0.0], []
    monkeypatch.setattr(budget.time, "perf_counter", lambda: clock[0])

    def generate(prompts, params):
        calls.append(("generate", params.max_tokens))
        clock[0] += 30.0 if len(calls) == 1 else 0.8  # the first call compiles and captures

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, ids, labels=None):
            calls.append("backward")
            clock[0] += 20.0 if calls.count("backward") == 1 else 0.4
            return self.w * ids.float()

    monkeypatch.setattr(budget.dist, "device", lambda: types.SimpleNamespace(type="cuda"))
    monkeypatch.setattr(budget.torch, "tensor", lambda x, device=None: torch.ones(1, len(x[0])))
    monkeypatch.setattr(budget.torch.cuda, "synchronize", lambda: calls.append("sync"))
    sampler = types.SimpleNamespace(generate=generate, release=lambda: None)
    rates = budget.probe(Model(), sampler, [6, 7, 8], rows=4, k=8, train_tokens=16)
    assert rates.decode == pytest.approx(0.8 / (8 * 4)) and rates.train == pytest.approx(0.4 / 16)
    assert calls == [("generate", 8), "sync", ("generate", 8), "sync", "backward", "sync", "backward", "sync"]
