"""An image library over files: scikit-image segments every image of a folder.

Each call gets a file name, reads the PNG (``skimage.io``), smooths it, thresholds it
(Otsu) and labels its regions; the parent writes the images first and sums what comes
back. Only names and a few numbers travel: the time is the library's, in the workers.
"""

import os
import tempfile

import numpy as np
from skimage import filters, io, measure


def make_images(folder, count, size=256):
    rng = np.random.default_rng(0)
    paths = []
    yy, xx = np.mgrid[0:size, 0:size]
    for i in range(count):
        image = rng.normal(40, 10, (size, size))
        for _ in range(12):
            cy, cx = rng.integers(20, size - 20, 2).tolist()
            r = int(rng.integers(5, 20))
            image[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] += 120
        path = os.path.join(folder, f"cells_{i:03d}.png")
        io.imsave(path, np.clip(image, 0, 255).astype(np.uint8), check_contrast=False)
        paths.append(path)
    return paths


def segment(path):
    image = io.imread(path)
    smooth = filters.gaussian(image, sigma=2, preserve_range=True)
    mask = smooth > filters.threshold_otsu(smooth)
    labels = measure.label(mask)
    areas = [region.area for region in measure.regionprops(labels) if region.area >= 30]
    return os.path.basename(path), len(areas), int(sum(areas))


def main(Executor, scale=1.0):
    with tempfile.TemporaryDirectory() as folder:
        paths = make_images(folder, max(2, round(48 * scale)))
        with Executor(2) as ex:
            found = list(ex.map(segment, paths))
    return {
        "images": len(found),
        "regions": sum(n for _, n, _ in found),
        "area": sum(a for _, _, a in found),
    }


if __name__ == "__main__":
    from harness import run

    run(main)
