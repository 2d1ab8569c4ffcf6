"""crc32_combine: the CRC-32 of A+B from the CRC-32s of A and B, as zlib's crc32_combine (which Python's zlib does
not expose), so the ranged reads of a shard, checked in parallel, add up to the one checksum of its index."""

from __future__ import annotations

import functools


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=16)
def _zeros_operator(length: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC-32 over `length` zero bytes (zlib's crc32_combine, by squaring)."""
    op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    result: list[int] | None = None
    for _ in range(3):  # one zero byte: eight zero bits
        op = [_gf2_times(op, op[n]) for n in range(32)]
    while length:
        if length & 1:
            result = op if result is None else [_gf2_times(op, result[n]) for n in range(32)]
        length >>= 1
        if length:
            op = [_gf2_times(op, op[n]) for n in range(32)]
    return tuple(result) if result is not None else tuple(1 << n for n in range(32))


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """CRC-32 of A+B from crc32(A), crc32(B) and len(B), as zlib's crc32_combine (which Python does not expose)."""
    if length2 <= 0 or crc1 == 0:  # a zero register stays zero over zeros: nothing to advance
        return crc1 ^ crc2 if length2 > 0 else crc1
    return _gf2_times(list(_zeros_operator(length2)), crc1) ^ crc2
