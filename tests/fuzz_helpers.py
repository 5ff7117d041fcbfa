"""Seeded byte-level corruptions shared by the fuzz tests."""

from __future__ import annotations

import random
import re

GARBAGE = bytes(range(256))


def corrupt(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One random corruption of ``data``: (what was done, the corrupted bytes)."""
    kind = rng.choice(
        [
            "flip",
            "overwrite",
            "truncate",
            "delete",
            "insert",
            "duplicate-line",
            "swap-lines",
            "huge-number",
            "binary-line",
        ]
    )
    n = len(data)
    if n == 0:
        return "insert", bytes(rng.choices(GARBAGE, k=8))
    at = rng.randrange(n)
    if kind == "flip":
        out = bytearray(data)
        out[at] ^= 1 << rng.randrange(8)
        return f"flip byte {at}", bytes(out)
    if kind == "overwrite":
        span = rng.randint(1, 64)
        return f"overwrite {span} at {at}", data[:at] + bytes(rng.choices(GARBAGE, k=span)) + data[
            at + span :
        ]
    if kind == "truncate":
        return f"truncate at {at}", data[:at]
    if kind == "delete":
        span = rng.randint(1, 256)
        return f"delete {span} at {at}", data[:at] + data[at + span :]
    if kind == "insert":
        junk = bytes(rng.choices(GARBAGE, k=rng.randint(1, 32)))
        return f"insert {len(junk)} at {at}", data[:at] + junk + data[at:]
    lines = data.split(b"\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    if kind == "duplicate-line":
        return f"duplicate line {i}", b"\n".join([*lines[: i + 1], lines[i], *lines[i + 1 :]])
    if kind == "swap-lines":
        lines[i], lines[j] = lines[j], lines[i]
        return f"swap lines {i} and {j}", b"\n".join(lines)
    if kind == "binary-line":
        junk = bytes(rng.choices(GARBAGE, k=rng.randint(8, 64))).replace(b"\n", b"")
        return f"binary line at {i}", b"\n".join([*lines[:i], junk, *lines[i:]])
    numbers = list(re.finditer(rb"\d+", data))
    if not numbers:
        return "flip byte 0", bytes([data[0] ^ 1]) + data[1:]
    match = rng.choice(numbers)
    huge = str(rng.choice([2**31, 2**63, 10**30])).encode()
    return (
        f"huge number at {match.start()}",
        data[: match.start()] + huge + data[match.end() :],
    )
