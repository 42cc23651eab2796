"""Jain's index and the backlogged-service meter."""

from __future__ import annotations

import pytest

from kvmeter.serving.scheduler.fairness import BackloggedServiceMeter, jain_index


def test_jain_index_known_values():
    assert jain_index([5, 5, 5, 5]) == 1.0
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)      # 1/n: one tenant gets everything
    assert jain_index([1, 2]) == pytest.approx(9 / 10)          # (1+2)² / (2·(1+4))
    assert jain_index([]) == 1.0 and jain_index([3]) == 1.0 and jain_index([0, 0]) == 1.0


def test_jain_index_rejects_negative_and_non_finite_values():
    with pytest.raises(ValueError):
        jain_index([1, -1])
    with pytest.raises(ValueError):
        jain_index([1, float("nan")])


def test_meter_counts_only_intervals_backlogged_at_both_ends_and_normalises_by_share():
    m = BackloggedServiceMeter()
    m.sample(0.0, [("a", 0.0, True, 0.5), ("b", 0.0, True, 0.5)])
    m.sample(1.0, [("a", 10.0, True, 0.5), ("b", 10.0, False, 0.0)])   # b left: interval not counted
    m.sample(2.0, [("a", 20.0, True, 0.25), ("b", 30.0, False, 0.0)])
    assert m.rates() == {"a": pytest.approx(10 / 0.5)}
    m.sample(3.0, [("a", 60.0, True, 0.5), ("b", 30.0, True, 0.5)])     # a got 40 with share ¼
    assert m.rates() == {"a": pytest.approx((20 + 20 + 160) / 3)}
    assert m.index() == 1.0                                              # one tenant: nothing to compare
    m.sample(4.0, [("a", 70.0, True, 0.5), ("b", 70.0, True, 0.5)])     # b got 40 with share ½
    assert m.rates() == {"a": pytest.approx(220 / 4), "b": pytest.approx(80.0)}
    assert m.index() == pytest.approx(jain_index([55.0, 80.0]))
    m.reset()
    assert m.rates() == {}
    with pytest.raises(ValueError):
        m.sample(2.5, [])
