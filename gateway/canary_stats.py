"""The canary judge's statistics: is the canary worse than the active version, and how sure?

Two tests, named in a binding's canary policy (``registry.canary``):

* shares (error rate, empty completions, ``length`` finishes): ``two-proportion-z`` (pooled
  z-test, one-sided: the canary's share is higher) or ``fisher-exact`` (one-sided
  hypergeometric tail, exact for small counts);
* samples (TTFT, tokens/s per request, completion length): ``mann-whitney-u`` (normal
  approximation with the tie correction), one-sided toward "worse", two-sided for completion
  length (a version that answers much longer is as suspect as one that answers much shorter).

``judge(policy, canary, active)`` runs the policy's checks on two ``Arm`` samples and returns
one result per check: the two values, their ratio, the p-value, and whether it failed (worse
by more than the threshold *and* significant at ``alpha``). Pure Python: no SciPy needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Arm:
    """One version's requests in the window."""

    requests: int = 0
    errors: int = 0
    empty: int = 0
    length: int = 0
    ttft: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    completion: list[float] = field(default_factory=list)
    """Completion tokens of each successful request."""

    def add(self, ok: bool, ttft: float, tps: float, completion: int, empty: bool, length: bool) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
            return
        self.ttft.append(ttft)
        self.completion.append(float(completion))
        if tps > 0:
            self.tokens_per_s.append(tps)
        self.empty += empty
        self.length += length


def _norm_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def two_proportion_z(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided p-value that share 1 (x1/n1) is higher than share 2 (pooled z-test)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    p = (x1 + x2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0
    return _norm_sf((x1 / n1 - x2 / n2) / se)


def fisher_exact(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided p-value that share 1 is higher: P(X >= x1) for X hypergeometric with the margins."""
    total, k = n1 + n2, x1 + x2
    if n1 == 0 or n2 == 0 or k == 0:
        return 1.0

    def log_pmf(x: int) -> float:
        return (_log_choose(k, x) + _log_choose(total - k, n1 - x)) - _log_choose(total, n1)

    hi = min(k, n1)
    return min(1.0, sum(math.exp(log_pmf(x)) for x in range(x1, hi + 1)))


def _log_choose(n: int, r: int) -> float:
    if r < 0 or r > n:
        return -math.inf
    return math.lgamma(n + 1) - math.lgamma(r + 1) - math.lgamma(n - r + 1)


def mann_whitney_u(a: list[float], b: list[float], alternative: str = "greater") -> float:
    """p-value of the Mann-Whitney U test that ``a`` tends to be greater than ``b``
    (``alternative``: ``greater``, ``less`` or ``two-sided``), normal approximation with the
    tie correction and a continuity correction."""
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    rank_sum_a = 0.0
    ties = 0.0
    i = 0
    n = n1 + n2
    while i < n:
        j = i
        while j + 1 < n and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        rank = (i + j) / 2 + 1  # average rank of the tied run
        t = j - i + 1
        ties += t ** 3 - t
        rank_sum_a += rank * sum(1 for k in range(i, j + 1) if pooled[k][1] == 0)
        i = j + 1
    u = rank_sum_a - n1 * (n1 + 1) / 2
    mean = n1 * n2 / 2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0
    sd = math.sqrt(var)
    if alternative == "greater":
        return _norm_sf((u - mean - 0.5) / sd)
    if alternative == "less":
        return _norm_sf((mean - u - 0.5) / sd)
    return min(1.0, 2 * _norm_sf((abs(u - mean) - 0.5) / sd))


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)] if s else 0.0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _ratio(c: float, a: float) -> float:
    if a == 0:
        return 1.0 if c == 0 else math.inf
    return c / a


def judge(policy: dict[str, Any], canary: Arm, active: Arm) -> list[dict[str, Any]]:
    """One result per check of ``policy`` (module docstring)."""
    alpha = policy["alpha"]
    share_test = fisher_exact if policy["proportion_test"] == "fisher-exact" else two_proportion_z
    out = []
    for name, threshold in policy["checks"].items():
        if name in ("error_rate", "empty_share", "length_share"):
            attr = {"error_rate": "errors", "empty_share": "empty", "length_share": "length"}[name]
            n_c = canary.requests if name == "error_rate" else canary.requests - canary.errors
            n_a = active.requests if name == "error_rate" else active.requests - active.errors
            x_c, x_a = getattr(canary, attr), getattr(active, attr)
            c, a = (x_c / n_c if n_c else 0.0), (x_a / n_a if n_a else 0.0)
            ratio = _ratio(c, a)
            p = share_test(x_c, n_c, x_a, n_a)
            worse = ratio > threshold
            test = policy["proportion_test"]
        elif name == "ttft_p99":
            c, a = _p99(canary.ttft), _p99(active.ttft)
            ratio = _ratio(c, a)
            p = mann_whitney_u(canary.ttft, active.ttft, "greater")
            worse = ratio > threshold
            test = policy["sample_test"]
        elif name == "tokens_per_s":
            c, a = _mean(canary.tokens_per_s), _mean(active.tokens_per_s)
            ratio = _ratio(c, a)
            p = mann_whitney_u(canary.tokens_per_s, active.tokens_per_s, "less")
            worse = ratio < threshold
            test = policy["sample_test"]
        else:  # completion_length
            c, a = _mean(canary.completion), _mean(active.completion)
            ratio = _ratio(c, a)
            p = mann_whitney_u(canary.completion, active.completion, "two-sided")
            worse = ratio > threshold or ratio < 1 / threshold
            test = policy["sample_test"]
        out.append({"check": name, "canary": round(c, 6), "active": round(a, 6),
                    "ratio": round(ratio, 4) if math.isfinite(ratio) else None, "threshold": threshold,
                    "test": test, "p": round(p, 6), "failed": bool(worse and p < alpha)})
    return out
