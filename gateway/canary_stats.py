"""The canary judge's checks: is the canary worse than the active version, how sure, and on what?

A check compares the canary's ``Arm`` with the active version's over the same window and gives
one of four verdicts:

* ``fail``: worse by more than the check's threshold *and* the test calls the difference
  significant at the policy's ``alpha``;
* ``inconclusive``: worse by more than the threshold, but not significant (yet);
* ``pass``: within the threshold, or too few events to call the canary worse;
* ``no data``: nothing to compare (no streamed answers for ``tokens_per_s``, no answers at all):
  never a pass, never a failure.

Shares (``error_rate``, ``empty_share``, ``length_share``) are counts of events among requests
(errors) or answers (empty completions, ``length`` finishes):

* a share check needs at least ``MIN_EVENTS`` events on the canary before it can fail or be
  inconclusive: one event never aborts (1 empty answer of 10 against 0 of 90 is a ratio of
  infinity and means nothing);
* ``fisher-exact`` is the one-sided hypergeometric tail, exact at any count;
  ``two-proportion-z`` (pooled, one-sided) is used only where its normal approximation holds:
  every expected cell of the 2x2 table (each arm's events and non-events under the pooled share)
  at least ``Z_MIN_EXPECTED``; below that the check runs Fisher's test and says so in ``test``.

Samples (``ttft_p99``, ``tokens_per_s`` per streamed request, ``completion_length``) use the
Mann-Whitney U test (normal approximation with the tie and continuity corrections), one-sided
toward "worse", two-sided for completion length; they need ``MIN_SAMPLES`` on each arm, fewer
is ``no data``.

A check may be judged per segment: ``{"threshold": 2.0, "segment": "metadata.topic"}`` splits
both arms by the ``topic`` key of the requests' ``metadata`` and judges each value on its own
(the most frequent ``MAX_SEGMENTS`` values; requests without the key are the segment
``(none)``), each at ``alpha`` divided by the number of segments (Bonferroni), so that a broken
topic is caught when it is a small part of the traffic, without ten topics making ten chances
of a false alarm.

``judge(policy, canary, active)`` returns one row per check and segment::

    {"check": "empty_share", "segment": "topic=refund" | None,
     "verdict": "pass" | "fail" | "inconclusive" | "no data", "failed": verdict == "fail",
     "canary": 0.25 | None, "active": 0.0 | None,         # the values compared (None: no data)
     "canary_n": 40, "active_n": 360,                    # requests, answers or samples behind them
     "canary_events": 10 | None, "active_events": 0 | None,   # shares only
     "ratio": 3.1 | "inf" | None, "threshold": 2.0, "test": "fisher-exact", "p": 1e-9 | None,
     "alpha": 0.05, "reason": "canary 10 of 40 answers vs active 0 of 360 ..."}

Pure Python: no SciPy needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MIN_EVENTS = 3
"""Events on the canary a share check needs before it can fail."""
Z_MIN_EXPECTED = 5.0
"""Least expected count in every cell of the 2x2 table for the two-proportion z test."""
MIN_SAMPLES = 5
"""Samples on each arm a sample check needs."""
MAX_SEGMENTS = 20
"""Segments judged per check (the most frequent)."""
NO_LABEL = "(none)"
SHARE_CHECKS = {"error_rate": "errors", "empty_share": "empty", "length_share": "length"}
SAMPLE_CHECKS = ("ttft_p99", "tokens_per_s", "completion_length")

Labels = dict[str, str]


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
    rows: list[tuple[bool, float, float, int, bool, bool, Labels | None]] = field(default_factory=list, repr=False)
    """Each request as added (what ``segments`` splits)."""

    def add(self, ok: bool, ttft: float, tps: float, completion: int, empty: bool, length: bool,
            labels: Labels | None = None) -> None:
        self.rows.append((ok, ttft, tps, completion, empty, length, labels))
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

    @property
    def answers(self) -> int:
        return self.requests - self.errors

    def segments(self, key: str) -> dict[str, Arm]:
        """This arm split by the value of label ``key`` (``NO_LABEL`` where a request has none)."""
        out: dict[str, Arm] = {}
        for row in self.rows:
            labels = row[6] or {}
            out.setdefault(labels.get(key, NO_LABEL), Arm()).add(*row)
        return out


# --- the tests -----------------------------------------------------------------------------------

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


def z_allowed(x1: int, n1: int, x2: int, n2: int) -> bool:
    """Whether the normal approximation holds: every expected cell at least ``Z_MIN_EXPECTED``."""
    if n1 == 0 or n2 == 0:
        return False
    p = (x1 + x2) / (n1 + n2)
    return min(n1, n2) * min(p, 1 - p) >= Z_MIN_EXPECTED


def fisher_exact(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided p-value that share 1 is higher: P(X >= x1) for X hypergeometric with the margins."""
    total, k = n1 + n2, x1 + x2
    if n1 == 0 or n2 == 0 or k == 0:
        return 1.0
    base = _log_choose(total, n1)
    hi = min(k, n1)
    p = 0.0
    for x in range(x1, hi + 1):
        term = math.exp(_log_choose(k, x) + _log_choose(total - k, n1 - x) - base)
        p += term
        if term < p * 1e-17 and x > k * n1 / total:  # past the mode the terms only shrink
            break
    return min(1.0, p)


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
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _ratio(c: float, a: float) -> float:
    if a == 0:
        return 1.0 if c == 0 else math.inf
    return c / a


def ratio_text(ratio: float | str | None) -> str:
    """A ratio as people read it: ``inf`` for infinity, ``-`` for none."""
    if ratio is None:
        return "-"
    if ratio == "inf" or (isinstance(ratio, float) and math.isinf(ratio)):
        return "inf"
    return f"{ratio:.3g}"


# --- the checks ----------------------------------------------------------------------------------

def check_spec(value: float | dict[str, Any]) -> tuple[float, str | None]:
    """A policy's check value: (threshold, the label key it is segmented by, or None)."""
    if isinstance(value, dict):
        seg = value.get("segment")
        return float(value["threshold"]), (seg.removeprefix("metadata.") if seg else None)
    return float(value), None


def _row(name: str, segment: str | None, threshold: float, alpha: float, **kw: Any) -> dict[str, Any]:
    row = {"check": name, "segment": segment, "verdict": "no data", "failed": False, "canary": None, "active": None,
           "canary_n": 0, "active_n": 0, "canary_events": None, "active_events": None, "ratio": None,
           "threshold": threshold, "test": None, "p": None, "alpha": alpha, "reason": ""}
    row.update(kw)
    row["failed"] = row["verdict"] == "fail"
    return row


def _significance(p: float, alpha: float, test: str) -> str:
    return f"{test} p={p:.2g} {'<' if p < alpha else '>='} {alpha:g}"


def _share(name: str, segment: str | None, threshold: float, alpha: float, test: str, canary: Arm,
           active: Arm) -> dict[str, Any]:
    attr = SHARE_CHECKS[name]
    what = "requests" if name == "error_rate" else "answers"
    n_c = canary.requests if name == "error_rate" else canary.answers
    n_a = active.requests if name == "error_rate" else active.answers
    x_c, x_a = getattr(canary, attr), getattr(active, attr)
    base: dict[str, Any] = {"canary_n": n_c, "active_n": n_a, "canary_events": x_c, "active_events": x_a}
    if n_c == 0 or n_a == 0:
        side = "the canary" if n_c == 0 else "the active version"
        return _row(name, segment, threshold, alpha, **base, reason=f"no data: no {what} on {side}")
    c, a = x_c / n_c, x_a / n_a
    ratio = _ratio(c, a)
    counts = f"canary {x_c} of {n_c} {what} vs active {x_a} of {n_a} (ratio {ratio_text(ratio)}, limit {threshold:g})"
    base |= {"canary": round(c, 6), "active": round(a, 6), "ratio": round(ratio, 4) if math.isfinite(ratio) else "inf"}
    if ratio <= threshold:
        return _row(name, segment, threshold, alpha, **base, verdict="pass", reason=f"{counts}: within the limit")
    if x_c < MIN_EVENTS:
        return _row(name, segment, threshold, alpha, **base, verdict="pass",
                    reason=f"{counts}: {x_c} event{'s' if x_c != 1 else ''} on the canary, fewer than "
                           f"{MIN_EVENTS}: too few to call it worse")
    if test == "two-proportion-z" and z_allowed(x_c, n_c, x_a, n_a):
        p = two_proportion_z(x_c, n_c, x_a, n_a)
    else:
        test = "fisher-exact"
        p = fisher_exact(x_c, n_c, x_a, n_a)
    sig = _significance(p, alpha, test)
    verdict, words = ("fail", "worse") if p < alpha else ("inconclusive", "worse by the ratio, not significant yet")
    return _row(name, segment, threshold, alpha, **base, verdict=verdict, test=test, p=float(f"{p:.6g}"),
                reason=f"{counts}, {sig}: {words}")


def _samples(name: str, segment: str | None, threshold: float, alpha: float, test: str, canary: Arm,
             active: Arm) -> dict[str, Any]:
    if name == "ttft_p99":
        xs, ys, stat, unit, alt, what = canary.ttft, active.ttft, _p99, " s", "greater", "p99 TTFT"
    elif name == "tokens_per_s":
        xs, ys, stat, unit, alt, what = canary.tokens_per_s, active.tokens_per_s, _mean, "", "less", \
            "mean tokens/s (streamed answers)"
    else:
        xs, ys, stat, unit, alt, what = canary.completion, active.completion, _mean, "", "two-sided", \
            "mean completion tokens"
    base: dict[str, Any] = {"canary_n": len(xs), "active_n": len(ys)}
    if not xs or not ys:
        kind = "streamed answers" if name == "tokens_per_s" else "answers"
        side = "either arm" if not xs and not ys else ("the canary" if not xs else "the active version")
        return _row(name, segment, threshold, alpha, **base, reason=f"no data: no {kind} on {side}")
    if min(len(xs), len(ys)) < MIN_SAMPLES:
        return _row(name, segment, threshold, alpha, **base,
                    reason=f"no data: {len(xs)} samples on the canary and {len(ys)} on the active version, "
                           f"fewer than {MIN_SAMPLES} on each")
    c, a = stat(xs), stat(ys)
    ratio = _ratio(c, a)
    if name == "tokens_per_s":
        worse = ratio < threshold
    elif name == "completion_length":
        worse = ratio > threshold or ratio < 1 / threshold
    else:
        worse = ratio > threshold
    base |= {"canary": round(c, 6), "active": round(a, 6), "ratio": round(ratio, 4) if math.isfinite(ratio) else "inf"}
    values = (f"canary {what} {c:.4g}{unit} on {len(xs)} vs active {a:.4g}{unit} on {len(ys)} "
              f"(ratio {ratio_text(ratio)}, limit {threshold:g})")
    if not worse:
        return _row(name, segment, threshold, alpha, **base, verdict="pass", reason=f"{values}: within the limit")
    p = mann_whitney_u(xs, ys, alt)
    sig = _significance(p, alpha, test)
    verdict, words = ("fail", "worse") if p < alpha else ("inconclusive", "worse by the ratio, not significant yet")
    return _row(name, segment, threshold, alpha, **base, verdict=verdict, test=test, p=float(f"{p:.6g}"),
                reason=f"{values}, {sig}: {words}")


def _check(policy: dict[str, Any], name: str, threshold: float, alpha: float, segment: str | None, canary: Arm,
           active: Arm) -> dict[str, Any]:
    if name in SHARE_CHECKS:
        return _share(name, segment, threshold, alpha, policy["proportion_test"], canary, active)
    return _samples(name, segment, threshold, alpha, policy["sample_test"], canary, active)


def judge(policy: dict[str, Any], canary: Arm, active: Arm) -> list[dict[str, Any]]:
    """One row per check of ``policy`` and segment (module docstring)."""
    alpha = policy["alpha"]
    out = []
    for name, value in policy["checks"].items():
        threshold, key = check_spec(value)
        if key is None:
            out.append(_check(policy, name, threshold, alpha, None, canary, active))
            continue
        cs, as_ = canary.segments(key), active.segments(key)
        values = sorted(set(cs) | set(as_), key=lambda v: (-(len(cs.get(v, Arm()).rows) + len(as_.get(v, Arm()).rows)), v))
        values = values[:MAX_SEGMENTS]
        seg_alpha = alpha / max(1, len(values))
        for v in values:
            out.append(_check(policy, name, threshold, seg_alpha, f"{key}={v}", cs.get(v, Arm()), as_.get(v, Arm())))
    return out


def row_name(row: dict[str, Any]) -> str:
    """A check row's name as people read it: ``empty_share`` or ``empty_share[topic=refund]``."""
    return f"{row['check']}[{row['segment']}]" if row.get("segment") else row["check"]
