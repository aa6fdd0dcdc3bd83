"""How skewed adapter popularity is: the exponent of a Zipf law fitted to the trace.

Maximum likelihood over the ranks: adapter k-th most requested has probability
``k**-s / H(N, s)`` over the N adapters seen; ``s`` maximises the trace's log-likelihood
(golden-section search on [0, 4]). About 1 is typical of per-tenant traffic; 0 is uniform.
"""

from __future__ import annotations

import math

import numpy as np


def fit_zipf(counts: np.ndarray) -> float:
    """The Zipf exponent of per-adapter request ``counts`` (0 for fewer than two adapters)."""
    c = np.sort(np.asarray(counts, np.float64)[np.asarray(counts) > 0])[::-1]
    if c.size < 2:
        return 0.0
    logk = np.log(np.arange(1, c.size + 1, dtype=np.float64))
    n, weighted = c.sum(), float((c * logk).sum())

    def nll(s: float) -> float:
        return s * weighted + n * math.log(float(np.exp(-s * logk).sum()))

    lo, hi = 0.0, 4.0
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(60):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = nll(b)
    return round((lo + hi) / 2, 3)
