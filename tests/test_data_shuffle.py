"""The epoch shuffle: a keyed bijection of [0, rows) computed per position, with no per-row state."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from gpujobs.data.shuffle import IndexShuffle

CRITEO_1TB_ROWS = 4_400_000_000
KEYS = (0, 1, 2026, 2**64 - 1, -7)


@pytest.mark.parametrize("key", KEYS)
def test_every_small_row_count_is_permuted_exactly(key: int) -> None:
    for rows in range(1, 301):
        order = IndexShuffle(rows, key)(np.arange(rows, dtype=np.int64))
        assert order.dtype == np.int64
        assert np.array_equal(np.sort(order), np.arange(rows)), f"rows={rows} key={key}"


def test_a_sample_of_four_billion_rows_stays_in_range_without_collisions() -> None:
    shuffle = IndexShuffle(CRITEO_1TB_ROWS, 2026)
    positions = np.unique(np.random.default_rng(0).integers(0, CRITEO_1TB_ROWS, 10**5))
    rows = shuffle(positions)
    assert rows.min() >= 0 and rows.max() < CRITEO_1TB_ROWS
    assert np.unique(rows).size == positions.size
    # the order is spread over the whole range, not a local reshuffle
    assert rows.min() < CRITEO_1TB_ROWS // 100 and rows.max() > CRITEO_1TB_ROWS * 99 // 100


def test_step_0_and_step_ten_million_cost_no_per_row_memory() -> None:
    tracemalloc.start()
    try:
        shuffle = IndexShuffle(CRITEO_1TB_ROWS, 2026)
        first = shuffle(np.arange(0, 4096, dtype=np.int64))
        late = shuffle(np.arange(10**7, 10**7 + 4096, dtype=np.int64))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20  # a per-row array of 4.4e9 rows would be 35 GB
    assert np.unique(np.concatenate([first, late])).size == 2 * 4096


def test_the_same_key_gives_the_same_order_on_every_platform() -> None:
    """Fixed values: a change of platform, numpy or the network itself would change them."""
    shuffle = IndexShuffle(CRITEO_1TB_ROWS, 2026)
    assert shuffle(np.array([0, 1, 10**7, CRITEO_1TB_ROWS - 1])).tolist() == [
        2675084764, 3295394036, 3231374618, 852861832]
    assert IndexShuffle(300, 5)(np.arange(10)).tolist() == [101, 163, 160, 277, 1, 86, 297, 83, 281, 217]
    assert IndexShuffle(2**62, 1)(np.array([0, 2**62 - 1])).tolist() == [1836050246195427243, 3800013249194785693]
    again = IndexShuffle(CRITEO_1TB_ROWS, 2026)
    positions = np.arange(1000, dtype=np.int64)
    assert np.array_equal(shuffle(positions), again(positions))


def test_different_keys_give_different_orders() -> None:
    positions = np.arange(1000, dtype=np.int64)
    orders = [IndexShuffle(1000, key)(positions) for key in range(20)]
    for i, first in enumerate(orders):
        for second in orders[i + 1:]:
            assert np.mean(first == second) < 0.05  # about 1/1000 by chance
    assert np.mean(orders[0] == positions) < 0.05  # and none is near the identity


def test_a_key_is_taken_modulo_two_to_the_64() -> None:
    positions = np.arange(100, dtype=np.int64)
    assert np.array_equal(IndexShuffle(100, -1)(positions), IndexShuffle(100, 2**64 - 1)(positions))


def test_positions_keep_their_shape() -> None:
    shuffle = IndexShuffle(50, 3)
    grid = np.arange(50, dtype=np.int64).reshape(5, 10)
    assert np.array_equal(shuffle(grid), shuffle(grid.ravel()).reshape(5, 10))
    assert shuffle(np.array([], dtype=np.int64)).shape == (0,)


@pytest.mark.parametrize("rows", [0, -1, 2**62 + 1])
def test_impossible_row_counts_are_refused(rows: int) -> None:
    with pytest.raises(ValueError, match="rows="):
        IndexShuffle(rows, 0)


@pytest.mark.parametrize("position", [-1, 10])
def test_positions_outside_the_rows_are_refused(position: int) -> None:
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        IndexShuffle(10, 0)(np.array([0, position]))
