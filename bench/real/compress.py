"""A compression library over chunks: zlib, bz2 and lzma, one chunk per call.

The parent builds 12 MiB of log-like text (seeded), cuts it into 1 MiB chunks and maps a
function that compresses each chunk with the three codecs of the standard library and
returns their sizes and a checksum. Each call carries 1 MiB of ``bytes`` (not an array).
"""

import bz2
import lzma
import random
import zlib

WORDS = ["GET", "POST", "PUT", "200", "404", "500", "user", "session", "cache", "miss", "hit"]


def make_log(size, seed=3):
    rng = random.Random(seed)
    lines = []
    for _ in range(4096):
        ip = ".".join(str(rng.randrange(256)) for _ in range(3))
        words = " ".join(rng.choices(WORDS, k=5))
        lines.append(f"{rng.randrange(10**9):09d} 10.{ip} {words} {rng.expovariate(0.05):.3f}ms\n")
    average = sum(map(len, lines)) / len(lines)
    text = "".join(rng.choices(lines, k=int(size / average) + 100))
    return text.encode()[:size]


def compress_chunk(chunk):
    return (
        len(zlib.compress(chunk, 6)),
        len(bz2.compress(chunk, 9)),
        len(lzma.compress(chunk, preset=0)),
        zlib.crc32(chunk),
    )


def main(Executor, scale=1.0):
    chunk = 1 << 20
    data = make_log(max(2, round(12 * scale)) * chunk)
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    with Executor(2) as ex:
        sizes = list(ex.map(compress_chunk, chunks))
    return {
        "chunks": len(sizes),
        "zlib": sum(s[0] for s in sizes),
        "bz2": sum(s[1] for s in sizes),
        "lzma": sum(s[2] for s in sizes),
        "crc": sum(s[3] for s in sizes) % 2**32,
    }


if __name__ == "__main__":
    from harness import run

    run(main)
