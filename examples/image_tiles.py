"""
Process an image tile by tile
=============================

An image-tile pipeline whose results are as large as its inputs.

A large RGB image is cut into tiles; each worker sharpens one tile and returns it, and
the parent puts the tiles back together. Each tile goes to its worker through shared
memory (copied once, no pickling through the pipe) and each sharpened tile comes back
the same way. The filter needs each pixel's neighbours, so every tile is sent with a
one-pixel border (its halo): the result is exactly the one of filtering the whole image
at once. (To skip the copy of the results, workers could instead write their tiles into
an output from ``sharexec.empty``, as in the example that fills one array from many
workers.)

Run: ``python examples/image_tiles.py`` (``--fast``: a small image).
"""

from __future__ import annotations

import argparse

import numpy as np

import sharexec


def synthetic_image(size: int, seed: int = 0) -> np.ndarray:
    """A ``size`` x ``size`` RGB image (uint8): gradients, a checkerboard and noise."""
    y, x = np.ogrid[0:size, 0:size]
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[..., 0] = x * 200 // size
    image[..., 1] = y * 200 // size
    image[..., 2] = ((x // 64 + y // 64) % 2) * 200
    noise = np.random.default_rng(seed).integers(0, 56, image.shape, dtype=np.uint8)
    image += noise  # at most 199 + 55: no overflow
    return image


def sharpen(padded: np.ndarray) -> np.ndarray:
    """Unsharp mask ``2 * pixel - mean of its 3x3 neighbourhood``, in integers.

    ``padded`` has a one-pixel border around the tile; the result has the tile's shape.
    """
    h, w = padded.shape[0] - 2, padded.shape[1] - 2
    p = padded.astype(np.int16)  # 9 * 255 fits
    box = sum(p[i : i + h, j : j + w] for i in range(3) for j in range(3))
    return np.clip(2 * p[1 : h + 1, 1 : w + 1] - box // 9, 0, 255).astype(np.uint8)


def main(size: int = 4096, tile: int = 1024) -> None:
    image = synthetic_image(size)  # 48 MB for 4096 x 4096, ordinary memory
    padded = np.pad(image, ((1, 1), (1, 1), (0, 0)), mode="edge")
    corners = [(y, x) for y in range(0, size, tile) for x in range(0, size, tile)]
    out = np.empty_like(image)
    with sharexec.SharedProcessPoolExecutor() as ex:
        futures = {
            (y, x): ex.submit(sharpen, padded[y : y + tile + 2, x : x + tile + 2])
            for y, x in corners
        }
        for (y, x), future in futures.items():
            out[y : y + tile, x : x + tile] = future.result()
        stats = ex.statistics()
    assert np.array_equal(out, sharpen(padded))  # the whole image at once, in this process
    print(
        f"sharpened a {size}x{size} RGB image in {len(corners)} tiles of {tile}x{tile}: "
        f"{stats.bytes_copied / 1e6:.0f} MB of tiles out and {out.nbytes / 1e6:.0f} MB of "
        f"results back through shared memory, equal to the serial result"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Process an image tile by tile.")
    parser.add_argument("--fast", action="store_true", help="a small image (as the tests run)")
    if parser.parse_args().fast:
        main(size=1024, tile=512)
    else:
        main()
