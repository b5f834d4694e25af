"""A JIT-compiled kernel defined in the script: numba's ``@njit``, tile by tile.

The script defines an escape-time kernel (the Mandelbrot set) with ``numba.njit``; each
call computes one horizontal band of the picture and returns its histogram of escape
counts. Each worker compiles the kernel at its first call (as every process must); the
parent never calls it.
"""

import numba
import numpy as np


@numba.njit(cache=False)
def escape_counts(x0, x1, y0, y1, width, height, max_iter):
    out = np.zeros((height, width), dtype=np.int32)
    for j in range(height):
        y = y0 + (y1 - y0) * j / height
        for i in range(width):
            x = x0 + (x1 - x0) * i / width
            zr, zi, n = 0.0, 0.0, 0
            while n < max_iter and zr * zr + zi * zi < 4.0:
                zr, zi = zr * zr - zi * zi + x, 2.0 * zr * zi + y
                n += 1
            out[j, i] = n
    return out


def band(k, bands, width, height, max_iter):
    y0 = -1.25 + 2.5 * k / bands
    y1 = -1.25 + 2.5 * (k + 1) / bands
    counts = escape_counts(-2.0, 0.75, y0, y1, width, height // bands, max_iter)
    return k, np.bincount(counts.ravel(), minlength=max_iter + 1)


def main(Executor, scale=1.0):
    bands = max(2, round(32 * scale))
    width, height, max_iter = 1024, 24 * bands, 300
    histogram = np.zeros(max_iter + 1, dtype=np.int64)
    with Executor(2) as ex:
        futures = [ex.submit(band, k, bands, width, height, max_iter) for k in range(bands)]
        for future in futures:
            histogram += future.result()[1]
    return {
        "pixels": int(histogram.sum()),
        "inside": int(histogram[max_iter]),
        "mean_escape": round(float(histogram @ np.arange(max_iter + 1)) / histogram.sum(), 6),
    }


if __name__ == "__main__":
    from harness import run

    run(main)
