"""A few real GRPO steps of the ReTool recipe on the packaged SmolLM2-135M on CPU, with real
sandboxed code_interpreter calls: the recipe's own main() (its config, its DAPO row rule, its
trainer) on a model 30x smaller than the card's. Prints seconds, samples and tokens per step.

    python bench/e2e_retool_smollm2.py --output_dir=/tmp/retool_e2e [any recipe flag]   # ~3 min on 2 cores

What differs from the recipe, and why: SmolLM2 has no tool-call template and never writes the
format from a tools block alone, so its folder gets a stand-in of Qwen3-2507's tool template and
the env puts two solved tool episodes before the question (grpo.envs.retool_small's TwoShotReTool);
the problems are "a to the power b" rows in DAPO-Math's and AIME's columns (training prompts with
DAPO's "Answer:" instruction), written here, so that a 135M model calls the tool and sometimes succeeds.
"""
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "recipes")]

import retool_qwen3_4b as recipe   # noqa: E402

from grpo.flags import parse_args   # noqa: E402
from grpo.envs.retool_small import QWEN3_TOOLS_TEMPLATE, TwoShotReTool   # noqa: E402
from grpo.envs.sandbox import run_code   # noqa: E402
from grpo.models.smollm2 import local_path   # noqa: E402

DAPO = ("Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
        'Remember to put your answer on its own line after "Answer:".')


def smollm2_with_tools(folder: Path) -> str:
    """SmolLM2's files with the stand-in tool template (weights linked, not copied)."""
    src = Path(local_path())
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "chat_template.jinja" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(QWEN3_TOOLS_TEMPLATE)
    return str(folder)


def problems(path: Path, pairs: list[tuple[int, int]], dapo: bool) -> str:
    """Training rows in DAPO-Math's columns (prompt with DAPO's instruction, solution), eval rows in
    AIME 2024's (problem, answer): the recipe's own defaults read them."""
    q = [f"What is {a} to the power {b}?" for a, b in pairs]
    rows = ([{"prompt": DAPO.format(q=x), "solution": str(a ** b)} for x, (a, b) in zip(q, pairs)] if dapo
            else [{"problem": x, "answer": str(a ** b)} for x, (a, b) in zip(q, pairs)])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def main():
    work = Path(tempfile.mkdtemp(prefix="retool_e2e_"))
    model = smollm2_with_tools(work / "smollm2-tools")
    train_file = problems(work / "train.jsonl", [(a, b) for a in (3, 4, 6, 7, 9, 11) for b in (2, 3, 4)], dapo=True)
    eval_file = problems(work / "eval.jsonl", [(2, 7), (5, 4), (8, 3), (12, 2)], dapo=False)
    # the run of docs/runs.md: 4 steps of 2 prompts x 8 (the recipe's 64 x 16 and its one-epoch
    # max_steps=0, which its main() resolves, are a GPU run's); any flag given overrides these
    defaults = [f"--model_path={model}", f"--train_data={train_file}", f"--eval_data={eval_file}",
                "--profile=none", "--dtype=float32", "--max_steps=4",
                "--prompts_per_step=2", "--num_generations=8", "--steps_per_generation=1",
                "--max_completion_length=160", "--eval_max_completion_length=160", "--max_turns=3",
                "--eval_limit=4", "--eval_n=1", "--eval_temperature=0", "--gradient_checkpointing=false",
                "--gen_batch=16", "--save_steps=0", "--export=false", "--learning_rate=1e-6", "--report_to=none",
                "--micro_batch_tokens=4096"]
    sys.argv = [sys.argv[0], *defaults, *sys.argv[1:]]
    calls = []   # (seconds, output) of every call that reached the sandbox

    def counted(code: str, timeout: float) -> str:
        start = time.perf_counter()
        out = run_code(code, timeout)
        calls.append((time.perf_counter() - start, out))
        return out

    try:  # the recipe's own main(), with the few-shot env over the real sandbox
        recipe.main(make_env=lambda cfg: TwoShotReTool(run_code=counted, timeout=cfg.tool_timeout,
                                                       max_turns=cfg.max_turns))
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the model folder and problem files written here
    cfg = parse_args(recipe.ReToolQwen3)  # the same argv: where the run wrote its metrics
    print(f"e2e sandbox: {len(calls)} calls ran, {sum(t for t, _ in calls):.1f} s in all; outputs "
          f"{[out[:40] for _, out in calls[:8]]}")
    rows = [json.loads(line) for line in open(Path(cfg.output_dir) / "metrics.jsonl") if '"reward/mean"' in line]
    samples = cfg.prompts_per_step * cfg.num_generations
    for r in rows:
        seconds = r.get("time/generate", 0) + r.get("time/update", 0)
        print(f"e2e step {r['step']}: {seconds:.1f} s (generate {r.get('time/generate', 0):.1f}, update "
              f"{r.get('time/update', 0):.1f}), {samples} samples, {r['completion/len'] * samples:.0f} completion "
              f"tokens, tool calls {r['reward/tool_calls']:.2f} a sample, correct {r['reward/correct']:.2f}")


if __name__ == "__main__":
    main()
