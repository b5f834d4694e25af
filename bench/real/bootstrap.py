"""A statistics library's bootstrap: confidence intervals for many small samples.

``scipy.stats.bootstrap`` (BCa, 999 resamples) of the median difference of two groups,
once per site of a made-up survey: one submit per site, each carrying two arrays of a
few hundred values (below any shared-memory threshold). Many calls of tens of
milliseconds; the parent keeps the intervals.
"""

import numpy as np
from scipy import stats


def median_difference(x, y, axis=-1):
    return np.median(x, axis=axis) - np.median(y, axis=axis)


def interval(site, treated, control):
    rng = np.random.default_rng(site)
    res = stats.bootstrap(
        (treated, control),
        median_difference,
        n_resamples=999,
        vectorized=True,
        rng=rng,
    )
    low, high = res.confidence_interval
    return site, round(float(low), 9), round(float(high), 9)


def main(Executor, scale=1.0):
    rng = np.random.default_rng(1)
    sites = []
    for site in range(max(2, round(96 * scale))):
        n = int(rng.integers(80, 300))
        sites.append((site, rng.normal(1.0, 2.0, n), rng.normal(0.5, 2.0, n)))
    with Executor(2) as ex:
        futures = [ex.submit(interval, *s) for s in sites]
        intervals = [f.result() for f in futures]
    significant = [site for site, low, high in intervals if low > 0 or high < 0]
    return {
        "sites": len(intervals),
        "significant": len(significant),
        "mean_width": round(sum(h - lo for _, lo, h in intervals) / len(intervals), 6),
    }


if __name__ == "__main__":
    from harness import run

    run(main)
