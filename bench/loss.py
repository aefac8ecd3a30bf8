"""Benchmark: the GRPO loss path, ours against the naive path and torch.compile of it.

Two kinds of rows:
- V, H > 0: end to end from the last hidden states: log-probs of the sampled tokens, then the
  DAPO-aggregated clipped loss with k3 KL (beta 0.04) and truncated importance weights.
  naive = reference log-probs (full logits) + grpo.loss; ours = linear_logprobs + policy_loss
  (the fused Triton token loss on GPU, the plain functions on CPU).
- V = H = 0: the token loss alone on N tokens (the fused kernel against the plain functions).

    python bench/loss.py [--quick] [--no-compile]

Same harness and columns as bench/logprobs.py (TFLOP/s counts the LM head only: 2NHV forward,
6NHV forward+backward). Last line of output: json.dumps(rows).
"""
import json
import sys

import torch

from grpo.kernels import linear_logprobs
from grpo.kernels.reference import linear_logprobs_ref
from grpo.loss import LossOptions, policy_loss
from logprobs import grid, measure, parse_args, print_table, run_cases  # bench/logprobs.py

T = 512                                                           # tokens per sequence: N = B * T


def loss_fn(logprobs_fn, backend):
    def f(hidden, weight, labels, old, ref, sampler, advantages, mask):
        logprobs = logprobs_fn(hidden, weight, labels) if weight is not None else hidden
        B, T_ = old.shape
        opts = LossOptions(loss_type="dapo", max_completion_length=T_, beta=0.04, tis_cap=2.0, backend=backend)
        loss, _ = policy_loss(logprobs.view(B, T_), old, advantages, mask, opts, num_sequences=B,
                              num_tokens=int(mask.sum()), ref_logprobs=ref, sampler_logprobs=sampler)
        return loss
    return f


def one_case(case: dict) -> dict:
    N, V, H, device = case["N"], case["V"], case["H"], case["device"]
    dtype, backward = getattr(torch, case["dtype"]), case["mode"] == "fwd+bwd"
    torch.manual_seed(0)
    B = max(1, N // T)
    tok = lambda scale: -torch.rand(B, N // B, device=device) * scale    # noqa: E731  log-probs-like
    old, ref, sampler = tok(3), tok(3), tok(3)
    mask, advantages = torch.rand(B, N // B, device=device) > 0.1, torch.randn(B, device=device)
    labels = torch.randint(0, max(V, 1), (N,), device=device)
    if V:   # end to end from hidden states
        hidden = torch.randn(N, H, device=device, dtype=dtype).requires_grad_(backward)
        weight = torch.randn(V, H, device=device, dtype=dtype).mul_(H**-0.5).requires_grad_(backward)
    else:   # the token loss alone: "hidden" is the log-probs
        hidden, weight = tok(3).view(N).requires_grad_(backward), None
    naive = loss_fn(linear_logprobs_ref, "torch")
    fn = {"naive": naive, "ours": loss_fn(linear_logprobs, None), "compiled": torch.compile(naive)}
    reps = 5 if device == "cuda" else (1 if N * V > 2**28 else 3)
    ms, peak = measure(fn[case["method"]], [hidden, weight, labels, old, ref, sampler, advantages, mask],
                       backward, reps, device)
    return {**case, "ms": ms, "peak_mib": peak}


if __name__ == "__main__":
    args = parse_args()
    if args.one:
        print(json.dumps(one_case(json.loads(args.one))))
        sys.exit()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = grid(args, device)
    token_only = [{**c, "V": 0, "H": 0} for c in cases if c["V"] == cases[-1]["V"] and c["H"] == cases[-1]["H"]]
    rows = run_cases(__file__, cases + token_only, one_case)
    print_table(rows, lambda r: (6 if r["mode"] == "fwd+bwd" else 2) * r["N"] * r["H"] * r["V"])
    print(json.dumps(rows))
