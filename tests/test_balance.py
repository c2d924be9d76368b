"""Split plans (torch-free): counts, floors, the dynamic update, replay and what a checkpoint carries over."""

from __future__ import annotations

import dataclasses

import pytest

from gpujobs.config.load import TrainerConfig
from gpujobs.rank.balance import BalanceError, Balancer, SplitPlan, counts_from_shares


def _cfg(**changes: object) -> TrainerConfig:
    return dataclasses.replace(TrainerConfig(), **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shares", "total", "expected"),
    [([0.5, 0.5], 10, [5, 5]), ([1, 1, 1], 128, [43, 43, 42]), ([0.8, 0.2], 10, [8, 2]), ([0.999, 0.001], 10, [9, 1])],
)
def test_counts_follow_the_shares_sum_to_the_batch_and_give_every_rank_a_row(
    shares: list[float], total: int, expected: list[int]
) -> None:
    assert counts_from_shares(shares, total) == expected


def test_a_micro_batch_smaller_than_the_world_cannot_be_split() -> None:
    with pytest.raises(BalanceError, match="cannot give 3 ranks"):
        counts_from_shares([1, 1, 1], 2)


def test_plan_offsets_and_weights_make_the_mean_loss_of_the_global_batch() -> None:
    plan = SplitPlan([6, 2])
    assert [plan.offset(r) for r in range(2)] == [0, 6]
    # sum over ranks of weight * mean = 2 * (6 * mean0 + 2 * mean1) / 8: what DDP's division by 2 turns
    # into the global batch's mean loss
    assert [plan.weight(r, 8) for r in range(2)] == [1.5, 0.5]


def test_off_is_equal_and_static_follows_the_configured_weights() -> None:
    assert Balancer(_cfg(), 3, 128).plan.counts == [43, 43, 42]
    static = Balancer(_cfg(balance="static", balance_shares=[3.0, 1.0]), 2, 100)
    assert static.plan.counts == [75, 25]
    weights = {"A": 2.0, "B": 1.0}
    by_gpu = Balancer(_cfg(balance="static", balance_gpu_weights=weights), 3, 100, gpu_names=["A", "B", "B"])
    assert by_gpu.plan.counts == [50, 25, 25]
    with pytest.raises(BalanceError, match="no weight for \\['C'\\]"):
        Balancer(_cfg(balance="static", balance_gpu_weights={"A": 1.0}), 2, 100, gpu_names=["A", "C"])
    with pytest.raises(BalanceError, match="3 weights for 2 ranks"):
        Balancer(_cfg(balance="static", balance_shares=[1.0, 1.0, 1.0]), 2, 100)


def test_dynamic_converges_to_the_measured_speeds_in_bounded_steps() -> None:
    balancer = Balancer(_cfg(balance="dynamic", balance_smoothing=0.5, balance_max_change=0.1), 2, 400)
    per_row = [1.0, 3.0]  # rank 1 is 3x slower per row
    moves = []
    for update in range(12):
        rows = list(balancer.plan.counts)
        before = list(balancer.shares)
        balancer.update(update, [n * t for n, t in zip(rows, per_row, strict=True)], rows)
        moves.append(max(abs(a - b) for a, b in zip(balancer.shares, before, strict=True)))
    assert max(moves) <= 0.1 + 1e-12
    assert balancer.plan.counts == [300, 100]  # 1/1 : 1/3 of the speed
    assert [entry["reason"] for entry in balancer.history].count("update") >= 3


def test_dynamic_keeps_every_rank_above_the_minimum_share() -> None:
    cfg = _cfg(balance="dynamic", balance_smoothing=1.0, balance_max_change=1.0, balance_min_share=0.2)
    balancer = Balancer(cfg, 2, 1000)
    balancer.update(1, [1.0, 1000.0], [500, 500])  # rank 1 is 1000x slower
    assert balancer.shares[1] == pytest.approx(0.1)  # 0.2 of the equal share 1/2
    assert balancer.plan.counts == [900, 100]


def test_dynamic_ignores_an_empty_window_and_off_never_moves() -> None:
    dynamic = Balancer(_cfg(balance="dynamic"), 2, 100)
    assert dynamic.update(1, [0.0, 1.0], [50, 50]) is None
    off = Balancer(_cfg(), 2, 100)
    assert off.update(1, [1.0, 3.0], [50, 50]) is None and off.plan.counts == [50, 50]


def test_replay_applies_the_recorded_plans_at_their_steps() -> None:
    history = [
        {"step": 0, "reason": "start", "shares": [0.5, 0.5], "counts": [50, 50]},
        {"step": 20, "reason": "update", "shares": [0.6, 0.4], "counts": [60, 40]},
        {"step": 40, "reason": "update", "shares": [0.7, 0.3], "counts": [70, 30]},
    ]
    replay = Balancer(_cfg(balance="replay", balance_replay="x"), 2, 100, replay=history)
    replay.start(0, resumed=False)
    plans = {}
    for step in range(60):
        replay.replay_at(step)
        plans[step] = list(replay.plan.counts)
    assert plans[19] == [50, 50] and plans[20] == [60, 40] and plans[59] == [70, 30]
    resumed = Balancer(_cfg(balance="replay", balance_replay="x"), 2, 100, replay=history)
    assert resumed.start(45, resumed=True).counts == [70, 30]  # a resume picks up the plan of its step
    with pytest.raises(BalanceError, match="over 2 ranks; this run has 100 rows per micro-batch over 3"):
        Balancer(_cfg(balance="replay", balance_replay="x"), 3, 100, replay=history).replay_at(20)


def test_a_saved_plan_carries_over_to_the_same_world_and_starts_over_at_another() -> None:
    saved = Balancer(_cfg(balance="dynamic"), 2, 100)
    saved.update(10, [1.0, 3.0], [50, 50])
    state = saved.state_dict()
    same = Balancer(_cfg(balance="dynamic"), 2, 100)
    assert same.load_state_dict(state) and same.plan.counts == saved.plan.counts
    other = Balancer(_cfg(balance="dynamic"), 3, 100)
    assert not other.load_state_dict(state)
    assert other.plan.counts == [34, 33, 33] and other.history == saved.history
