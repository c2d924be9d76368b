"""The epoch order of a store's rows without per-row state (torch-free): a keyed bijection of [0, rows).

A balanced Feistel network permutes the integers of `bits` bits (the smallest even number of bits that
covers `rows`); values that land at or above `rows` are encrypted again until they fall inside (cycle
walking), which keeps it a bijection of [0, rows). The domain is less than 4 x rows, so a position needs
fewer than 4 encryptions on average. Everything is numpy uint64 arithmetic with wrap-around, so the same
key gives the same order on every platform and run; memory is O(len(positions)), whatever `rows` is.
"""

from __future__ import annotations

import numpy as np

#: Feistel rounds: 4 make a keyed pseudo-random permutation (Luby-Rackoff); 2 more for margin.
ROUNDS = 6
MAX_ROWS = 2**62
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise over uint64 (multiplication wraps modulo 2**64)."""
    z = values ^ (values >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _round_keys(key: int) -> tuple[int, ...]:
    """ROUNDS 64-bit keys from `key` (any int, masked to 64 bits): splitmix64's stream seeded by it."""
    state = key & _MASK64
    keys = []
    for _ in range(ROUNDS):
        state = (state + _GOLDEN) & _MASK64
        keys.append(int(_mix64(np.array([state], dtype=np.uint64))[0]))
    return tuple(keys)


class IndexShuffle:
    """A pseudo-random permutation of [0, rows), keyed by `key`, computed per position."""

    def __init__(self, rows: int, key: int) -> None:
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows={rows} is out of range: allowed 1..2**62")
        self.rows = rows
        self.key = key & _MASK64
        bits = max(2, (rows - 1).bit_length())
        bits += bits % 2  # balanced: two halves of the same width
        self._half_bits = np.uint64(bits // 2)
        self._half_mask = np.uint64((1 << (bits // 2)) - 1)
        self._round_keys = tuple(np.uint64(k) for k in _round_keys(key))

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The rows at `positions` (int64 in [0, rows)) of this order, as int64, in the same shape."""
        positions = np.asarray(positions)
        if positions.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers, got {positions.dtype}")
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= self.rows):
            raise IndexError(f"positions must lie in [0, {self.rows}), got {int(positions.min())}.."
                             f"{int(positions.max())}")
        values = self._encrypt(positions.astype(np.uint64).ravel())
        outside = np.flatnonzero(values >= np.uint64(self.rows))
        while outside.size:  # cycle-walk only those still out of range
            walked = self._encrypt(values[outside])
            values[outside] = walked
            outside = outside[walked >= np.uint64(self.rows)]
        return values.astype(np.int64).reshape(positions.shape)

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over uint64 `values` of 2 x half_bits bits."""
        left = values >> self._half_bits
        right = values & self._half_mask
        for round_key in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ round_key) & self._half_mask)
        return (left << self._half_bits) | right
