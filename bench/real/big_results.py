"""Large arrays as results: Monte Carlo paths simulated by the workers.

Each of 12 calls simulates 250 geometric Brownian paths of 16,384 steps (a seeded
generator per call) and returns the whole block of paths, 31.25 MiB of float64; the
parent stacks them and prices an Asian option from the averages.
"""

import numpy as np


def simulate_paths(seed, paths, steps):
    rng = np.random.default_rng(seed)
    dt = 1.0 / steps
    increments = (0.05 - 0.5 * 0.2**2) * dt + 0.2 * np.sqrt(dt) * rng.standard_normal(
        (paths, steps)
    )
    return 100.0 * np.exp(np.cumsum(increments, axis=1))


def main(Executor, scale=1.0):
    calls, paths = 12, 250
    steps = max(100, round(16_384 * min(scale, 1.0)))
    with Executor(2) as ex:
        blocks = list(ex.map(simulate_paths, range(calls), [paths] * calls, [steps] * calls))
    prices = np.concatenate(blocks)
    payoff = np.maximum(prices.mean(axis=1) - 100.0, 0.0)
    return {
        "paths": int(prices.shape[0]),
        "steps": int(prices.shape[1]),
        "price": round(float(np.exp(-0.05) * payoff.mean()), 6),
    }


if __name__ == "__main__":
    from harness import run

    run(main)
