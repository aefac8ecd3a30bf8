"""Accuracy of a model on an env's questions: mean@k and pass@k with 95% intervals.

    python -m grpo.cli.eval --model_path PATH --task gsm8k [--data SOURCE] [--eval_n K] [--eval_limit N]
    python -m grpo.cli.eval --run runs/NAME      # a run's export, evaluated exactly as the run evaluated it
    python -m grpo.cli.eval --model_path PATH --task calculator --protocol reference \\
        --data basic_calculations_eval.csv

Tasks and their default data (Hugging Face dataset ids) are in grpo.envs.tasks; `--data` takes a
local JSONL, CSV or Parquet file or another dataset id (grpo.infra.data.load_examples), with a
`question` (or `prompt`) column and an `answer` column unless --question_field/--answer_field
say otherwise. `--protocol reference` (calculator): the reference run's own evaluation
(grpo.envs.calculator.REFERENCE_EVAL: one sample at T 0.2, 5 calls, 1,000 tokens a turn, right within
an absolute 0.1) in place of the sampling flags. Per-sample records (prompt, completion, extracted
answer, score) go to a JSONL file. `--run` reads the run's config.json, imports the recipe that
launched it, and calls its `eval_setup(cfg) -> (env, examples)`: the same env, system prompt,
questions, samples, temperature and token budget as the run's own evals.
"""
import argparse
import json
import sys

import torch

from grpo.eval import evaluate, run_eval_settings
from grpo.fit.fallback import add_arguments, kernels_of
from grpo.fit.precision import set_autocast


def _flag(text: str) -> bool:
    """A boolean flag's value, spelled as the recipes take it (grpo.config)."""
    from grpo.flags import _convert
    try:
        return _convert("flag", text, bool)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected true or false (or 1 or 0)") from None


def main(argv: list[str] | None = None) -> dict:
    from grpo.envs.tasks import SOURCES, TASKS, load_task
    from grpo.infra.data import DataError
    defaults = ", ".join(f"{task}: {source}" for task, source in SOURCES.items())
    p = argparse.ArgumentParser(prog="python -m grpo.cli.eval", description=__doc__.split("\n")[0])
    p.add_argument("--model_path", help="HF checkpoint folder (with --task)")
    p.add_argument("--task", choices=TASKS)
    p.add_argument("--run", help="a run's output_dir: its export, with the run's own eval settings")
    p.add_argument("--data", help=f"JSONL, CSV or Parquet file, or a dataset id name[:config[:split]] "
                                  f"(defaults: {defaults}; calculator: 200 generated questions)")
    p.add_argument("--question_field", default="question",
                   help="question column (default: question, else prompt, else problem)")
    p.add_argument("--answer_field", default="answer", help="answer column")
    # flags named as the training config's fields for the same idea
    p.add_argument("--eval_n", type=int, default=1, help="samples per question (mean@n, pass@n)")
    p.add_argument("--shots", type=int, default=0, help="few-shot examples (gsm8k)")
    p.add_argument("--fewshot_data", default=None,
                   help="GSM8K train rows for the shots (default: openai/gsm8k:main:train)")
    p.add_argument("--eval_limit", type=int, default=0, help="first N questions only; 0 = all")
    p.add_argument("--eval_temperature", type=float, default=None,
                   help="default: 0 (greedy) for eval_n=1, else 1.0")
    p.add_argument("--max_completion_length", type=int, default=1024,
                   help="completion tokens, tool output included")
    p.add_argument("--max_turns", type=int, default=0, help="0 = the env's own limit")
    p.add_argument("--enable_thinking", type=_flag, default=True, metavar="{true,false}",
                   help="chat template switch (Qwen3: false = non-thinking); true/false or 1/0, "
                        "as the recipes take")
    p.add_argument("--autocast_bf16", default="auto", choices=["auto", "true", "false"],
                   help="CPU: bf16 matmuls under autocast; "
                        "auto = where a start-up measurement finds them faster")
    p.add_argument("--protocol", choices=["default", "reference"], default="default",
                   help="calculator: 'reference' = the reference run's evaluation (one sample, T 0.2, "
                        "5 calls, 1,000 tokens a turn, right within 0.1), overriding the sampling flags")
    p.add_argument("--tool", choices=["none", "code_interpreter"], default="none",
                   help="math tasks: answer with the sandboxed Python tool (ReTool's env) or without")
    add_arguments(p, _flag, " (--run: the run's own)")
    p.add_argument("--out", default=None, help="per-sample JSONL (default: eval_<task>.jsonl)")
    args = p.parse_args(argv)
    if args.run and args.protocol != "default":
        p.error("--protocol is for --model_path and --task; --run evaluates as the run did")
    if args.run:
        return evaluate_run(args.run, args.out, args.kernels, args.cuda_graphs)
    if not (args.model_path and args.task):
        p.error("pass --model_path and --task, or --run")
    if args.data is not None and not args.data.strip():  # not the default data set, silently
        raise SystemExit("python -m grpo.cli.eval: --data is empty: "
                         "pass a file or a dataset id, or leave it out")
    try:  # the data first: a missing file or an offline hub should not wait for the model to load
        env, examples = load_task(args.task, args.data, args.shots, args.question_field, args.answer_field,
                                  args.fewshot_data)
    except DataError as e:
        raise SystemExit(f"python -m grpo.cli.eval: {e}") from None
    turn_tokens = 0  # a turn's own limit: the reference protocol's only
    if args.protocol == "reference":
        if args.task != "calculator":
            raise SystemExit("python -m grpo.cli.eval: --protocol reference is the calculator's, "
                             f"not {args.task}'s")
        from grpo.envs.calculator import REFERENCE_EVAL, CalculatorEnv
        ref = REFERENCE_EVAL
        env = CalculatorEnv(rel_tol=ref["rel_tol"], abs_tol=ref["abs_tol"])
        args.eval_n, args.eval_temperature = ref["n"], ref["temperature"]
        args.max_completion_length, args.max_turns, turn_tokens = ref["max_tokens"], ref["max_turns"], \
            ref["max_turn_tokens"]
        print(f"protocol: the reference's ({ref['n']} sample at T {ref['temperature']}, "
              f"{ref['max_turns'] - 1} calls, "
              f"{ref['max_turn_tokens']} tokens a turn, right within {ref['abs_tol']}) on "
              + (args.data if args.data else "200 generated questions (no --data: not the reference's 158)"))
    examples = examples[:args.eval_limit] if args.eval_limit else examples
    if not examples:  # an accuracy over 0 questions would print as 0.0000
        raise SystemExit("python -m grpo.cli.eval: no questions to evaluate "
                         f"(--eval_limit {args.eval_limit})")
    if args.tool == "code_interpreter":
        if args.task not in ("math500", "aime24", "aime25"):
            raise SystemExit(f"python -m grpo.cli.eval: --tool code_interpreter is for math tasks, "
                             f"not {args.task}")
        from grpo.envs.retool import ReToolEnv
        env = ReToolEnv()   # the same boxed-answer score, with the interpreter (and ReTool's system prompt)
    from transformers import AutoTokenizer

    from grpo.models.model import Transformer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Transformer.from_pretrained(args.model_path, dtype=dtype, device=device).eval()
    print(set_autocast(model, args.autocast_bf16))
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    n = args.eval_n
    temperature = args.eval_temperature if args.eval_temperature is not None else (0.0 if n == 1 else 1.0)
    with kernels_of(args):
        r = evaluate(model, tokenizer, env, examples, n=n, temperature=temperature,
                     max_tokens=args.max_completion_length, max_turns=args.max_turns,
                     max_turn_tokens=turn_tokens,
                     chat_kwargs={"enable_thinking": bool(args.enable_thinking)},
                     cuda_graphs=args.cuda_graphs is not False)
    out = write_records(args.out or f"eval_{args.task}.jsonl", r["records"])
    print(f"| task | questions | n | mean@{n} | 95% CI | pass@{n} |")
    print(f"| {args.task} | {r['questions']} | {n} | {r['mean']:.4f} | ± {r['ci95']:.4f} "
          f"| {r['pass']:.4f} |")
    print(f"per-sample records: {out}")
    return r


def run_config(run_dir: str):
    """(recipe module, its config object) from a run's config.json."""
    import dataclasses
    import importlib.util
    import os
    path = os.path.join(run_dir, "config.json")
    try:
        fields = json.load(open(path))
    except (OSError, ValueError) as e:
        raise SystemExit(f"python -m grpo.cli.eval: {path}: {e}") from None
    meta = fields.pop("_meta", {})
    recipe, name = meta.get("recipe"), meta.get("config_class")
    if not recipe or not os.path.exists(recipe) or not name:
        raise SystemExit(f"python -m grpo.cli.eval: {path} names no recipe file that exists ({recipe}): "
                         "use --model_path and --task")
    sys.path.insert(0, os.path.dirname(recipe))     # recipes import their siblings
    spec = importlib.util.spec_from_file_location("grpo_run_recipe", recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)                 # its main() runs only as __main__
    cls = getattr(module, name)
    known = {f.name for f in dataclasses.fields(cls)}
    return module, cls(**{k: v for k, v in fields.items() if k in known})


def evaluate_run(run_dir: str, out: str | None = None, kernels: str | None = None,
                 cuda_graphs: bool | None = None) -> dict:
    """The run's export on the run's eval questions with the run's settings (one process);
    `kernels`, `cuda_graphs`: in place of the run's, when given."""
    import os

    from transformers import AutoTokenizer

    from grpo.models.model import Transformer
    module, cfg = run_config(run_dir)
    cfg.kernels = kernels or getattr(cfg, "kernels", "auto")
    cfg.cuda_graphs = getattr(cfg, "cuda_graphs", True) if cuda_graphs is None else cuda_graphs
    if not hasattr(module, "eval_setup"):
        raise SystemExit(f"python -m grpo.cli.eval: {module.__file__} defines no eval_setup(cfg): use --task")
    env, examples = module.eval_setup(cfg)
    meta = json.load(open(os.path.join(run_dir, "config.json"))).get("_meta", {})
    # as many as the run's budget asked
    examples = list(examples[:meta.get("eval_questions", cfg.eval_limit)])
    if not examples:  # an accuracy over 0 questions would print as 0.0000
        raise SystemExit("python -m grpo.cli.eval: the run has no eval questions "
                         f"(eval_limit={cfg.eval_limit})")
    export = os.path.join(run_dir, "export")
    if not os.path.exists(os.path.join(export, "config.json")):   # export=False, or stopped by SIGTERM
        raise SystemExit(f"python -m grpo.cli.eval: {export} not found: make one from a checkpoint with "
                         f"python -m grpo.cli.export {run_dir}/checkpoints/step_NNNNNN {export}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Transformer.from_pretrained(export, dtype=dtype, device=device).eval()
    # the precision the run's evals used ("auto" resolved at its start), so the records repeat exactly
    chosen = meta.get("autocast_bf16_chosen")
    setting = getattr(cfg, "autocast_bf16", "false") if chosen is None else chosen
    print(set_autocast(model, setting) + ("" if chosen is None else " (as the run chose)"))
    with kernels_of(cfg):
        r = evaluate(model, AutoTokenizer.from_pretrained(export), env, examples, **run_eval_settings(cfg),
                     cuda_graphs=cfg.cuda_graphs)
    out = write_records(out or os.path.join(run_dir, "eval_rerun.jsonl"), r["records"])
    print(f"| run | questions | n | T | mean@{cfg.eval_n} | 95% CI | pass@{cfg.eval_n} |")
    print(f"| {run_dir} | {r['questions']} | {cfg.eval_n} | {cfg.eval_temperature} | {r['mean']:.4f} | "
          f"± {r['ci95']:.4f} | {r['pass']:.4f} |")
    print(f"per-sample records: {out}")
    return r


def write_records(path: str, records: list[dict]) -> str:
    """Per-sample records, one JSON line each; returns the path."""
    with open(path, "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
