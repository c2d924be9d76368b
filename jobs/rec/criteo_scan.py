"""The compiled scan of a block of Criteo-format lines: one pass over the bytes, numba-compiled.

`scan_block` reads lines in their plain form, the form of every line of the Criteo releases:

- the label `0` or `1`;
- 13 integer fields, each empty or an optional sign and 1 to 18 ASCII digits;
- 26 category fields of any bytes but tab, line feed and carriage return (the caller has checked the
  block is UTF-8 text, so a field's bytes are its text's `encode()`);
- tabs between the 40 fields, and a line end of `\\n`, `\\r\\n`, or the end of the block.

It writes what `read_criteo_tsv` gives for such a line: label 0/1, float32 log1p(max(x, 0)) (missing 0),
and 1 + crc32(value) % buckets[c] (missing 0) in column c. Any other line (a damaged one, or one Python's `int()`
reads and this does not: " 5", "1_000", "0x1f"'s refusal, a 19-digit count) stops the scan; the caller then
applies the line-by-line rules to the block. Imported only where a block is parsed: numba takes a quarter
of a second to import, which the submit side and the trainer do not pay.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

_TAB, _LINE_FEED, _RETURN, _ZERO, _NINE, _MINUS, _PLUS = 9, 10, 13, 48, 57, 45, 43
_MAX_DIGITS = 18  # 10**18 - 1 < 2**63: the count fits int64, and its float64 is Python's float(int(text))


def _crc32_table() -> np.ndarray:
    """The byte table of the reflected CRC-32 (polynomial 0xEDB88320) that zlib.crc32 computes, as int64."""
    crc = np.arange(256, dtype=np.int64)
    for _ in range(8):
        crc = np.where(crc & 1, (crc >> 1) ^ 0xEDB88320, crc >> 1)
    return crc


CRC_TABLE = _crc32_table()
#: log1p of the small counts, most of a day's, as `read_criteo_tsv` computes them (math.log1p, then float32).
LOG1P_TABLE = np.array([math.log1p(count) for count in range(4096)], dtype=np.float32)


def _compile(function: Callable[..., Any]) -> Any:
    """`function` compiled without the GIL (prepare's threads scan blocks side by side), its machine code
    cached beside this file or in the user's cache; where neither can be written (a read-only install, no
    home), compiled afresh in each process (about half a second)."""
    try:
        return numba.njit(nogil=True, cache=True)(function)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return numba.njit(nogil=True)(function)


@_compile
def scan_block(data: np.ndarray, buckets: np.ndarray, crc_table: np.ndarray, log1p_table: np.ndarray,
               label: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> int:
    """Scan the uint8 `data` into `label` [rows] |u1, `dense` [rows, 13] <f4, `sparse` [rows, 26] <i4, column
    c's categories hashed into `buckets[c]` (int64 [26]).

    Returns the lines read, or -1 at the first line not in the plain form (or past `rows` lines).
    """
    end = data.shape[0]
    small = log1p_table.shape[0]
    pos = 0
    row = 0
    while pos < end:
        if row == label.shape[0]:
            return -1
        if pos + 1 >= end or data[pos + 1] != _TAB or (data[pos] != _ZERO and data[pos] != _ZERO + 1):
            return -1
        label[row] = data[pos] - _ZERO
        pos += 2
        for column in range(13):
            negative = False
            if pos < end and (data[pos] == _MINUS or data[pos] == _PLUS):
                negative = data[pos] == _MINUS
                pos += 1
                if pos == end or data[pos] < _ZERO or data[pos] > _NINE:
                    return -1  # a sign alone
            count = 0
            digits = 0
            while pos < end and _ZERO <= data[pos] <= _NINE:
                count = count * 10 + (data[pos] - _ZERO)
                digits += 1
                pos += 1
            if digits > _MAX_DIGITS or pos == end or data[pos] != _TAB:
                return -1
            pos += 1
            if negative:  # log1p(max(x, 0))
                dense[row, column] = 0.0
            elif count < small:
                dense[row, column] = log1p_table[count]
            else:
                dense[row, column] = np.float32(math.log1p(np.float64(count)))
        for column in range(26):
            crc = np.int64(0xFFFFFFFF)
            length = 0
            while pos < end:
                byte = data[pos]
                if byte in (_TAB, _LINE_FEED, _RETURN):
                    break
                crc = crc_table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
                length += 1
                pos += 1
            if column < 25:
                if pos == end or data[pos] != _TAB:
                    return -1
            else:
                if pos < end and data[pos] == _RETURN:  # "\r\n" or a last "\r": read_criteo_tsv strips it
                    pos += 1
                if pos < end and data[pos] != _LINE_FEED:
                    return -1  # a 41st field, or a "\r" inside the line (data, which the line rules keep)
            pos += 1  # past the tab or the line end (or past the end of the block)
            sparse[row, column] = 0 if length == 0 else 1 + (crc ^ 0xFFFFFFFF) % buckets[column]
        row += 1
    return row if row == label.shape[0] else -1
