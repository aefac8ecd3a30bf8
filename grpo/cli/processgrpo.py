"""`python -m grpo.envs.processgrpo`: the ProcessGRPO reference's eval of a model (and its paired
gain over a base model) on the fresh multi-step problems, by operation count.

    python -m grpo.envs.processgrpo --model_path PATH [--base Qwen/Qwen2.5-0.5B-Instruct] [--data SOURCE]
evaluates the 700 fresh multi-step problems (or SOURCE) greedily with up to 3,072 new tokens,
by operation count, with the paired gain over --base and its paired bootstrap 95% interval
(grpo.infra.stats.paired_bootstrap, as the reference reports).
"""
import argparse
import json

from grpo.envs.processgrpo import OneShotMathEnv, accuracy_by_ops, load_sources
from grpo.infra.data import DataError


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m grpo.envs.processgrpo", description=__doc__.split("\n")[0])
    p.add_argument("--model_path", required=True, help="HF checkpoint folder (e.g. a run's export)")
    p.add_argument("--base", default=None, help="a second model for the paired gain (e.g. the base model)")
    p.add_argument("--data", default="multistep:test:100", help="sources as load_sources reads them")
    p.add_argument("--max_completion_length", type=int, default=3072)
    p.add_argument("--out", default="eval_processgrpo.jsonl", help="per-question records")
    from grpo.cli.eval import _flag
    from grpo.fit.fallback import add_arguments, kernels_of
    add_arguments(p, _flag)
    args = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from grpo.eval import evaluate
    from grpo.fit.precision import set_autocast
    from grpo.infra.stats import paired_bootstrap
    from grpo.models.model import Transformer
    try:
        examples = load_sources(args.data)
    except DataError as e:
        raise SystemExit(f"python -m grpo.envs.processgrpo: {e}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = {}   # "model" / "base" -> evaluate(...)
    for role, name in (("model", args.model_path), ("base", args.base)):
        if name is None:
            continue
        model = Transformer.from_pretrained(name, dtype=dtype, device=device).eval()
        print(set_autocast(model, "auto"))
        with kernels_of(args):
            r = results[role] = evaluate(model, AutoTokenizer.from_pretrained(name), OneShotMathEnv(),
                                         examples, max_tokens=args.max_completion_length,
                                         cuda_graphs=args.cuda_graphs is not False)
        by_ops = " ".join(f"{k}:{v:.3f}" for k, v in accuracy_by_ops(examples, r["per_question"]).items())
        print(f"{role} {name}: {r['mean']:.4f} ± {r['ci95']:.4f} ({r['questions']} questions) | "
              f"by operation count {by_ops}")
        del model
    if args.base:
        gain, lo, hi = paired_bootstrap(results["base"]["per_question"], results["model"]["per_question"])
        print(f"gain over the base: {100 * gain:+.1f} points, "
              f"95% interval [{100 * lo:+.1f}, {100 * hi:+.1f}] "
              "(paired bootstrap)")
    with open(args.out, "w") as f:
        f.writelines(json.dumps({"model": role, **rec}) + "\n"
                     for role, r in results.items() for rec in r["records"])
    return results
