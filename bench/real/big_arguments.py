"""Large arrays with each call: statistics of a stack of detector frames.

The parent holds 16 frames of 2048 x 2048 float64 (32 MiB each, 512 MiB in all, made
with a seeded generator) and maps a function that returns a few statistics of each
frame (mean, spread, extremes, the count of hot pixels). Each call carries 32 MiB; the
work per call is a few passes over it.
"""

import numpy as np


def frame_stats(frame):
    mean, spread = float(frame.mean()), float(frame.std())
    hot = int((frame > mean + 1.5 * spread).sum())
    return round(mean, 9), round(float(frame.max() - frame.min()), 9), hot


def main(Executor, scale=1.0):
    rng = np.random.default_rng(5)
    side = max(64, round(2048 * min(scale, 1.0) ** 0.5))
    frames = [rng.random((side, side)) for _ in range(16)]
    with Executor(2) as ex:
        stats = list(ex.map(frame_stats, frames))
    return {
        "frames": len(stats),
        "mean": round(sum(m for m, _, _ in stats) / len(stats), 9),
        "hot": sum(n for _, _, n in stats),
    }


if __name__ == "__main__":
    from harness import run

    run(main)
