"""Interval statistics for evals: a mean and its 95% interval, and the paired gain of two evals of the
same questions (normal, and percentile bootstrap)."""
import math

import torch


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% normal interval (per-question values)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, 1.96 * math.sqrt(var / n)


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean per-question gain and its paired 95% half-width: the same questions, scored twice."""
    assert len(before) == len(after), "paired comparison needs the same questions"
    return mean_ci95([a - b for a, b in zip(after, before)])


def paired_bootstrap(before: list[float], after: list[float], resamples: int = 10_000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean per-question gain and its paired percentile-bootstrap 95% interval (lo, hi): the
    questions resampled with replacement, each keeping its own before/after pair."""
    assert len(before) == len(after) and before, "paired comparison needs the same questions"
    d = torch.tensor([a - b for a, b in zip(after, before)], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = d[torch.randint(len(d), (resamples, len(d)), generator=g)].mean(1)   # (resamples,)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(d.mean()), lo, hi
