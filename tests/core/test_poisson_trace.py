"""kvmeter.traces.write_poisson_trace: the kvmeter CSV it writes reads back through load_trace."""

from __future__ import annotations

import math

import pytest

from kvmeter.traces import load_trace, write_poisson_trace


def test_the_trace_reads_back_seeded_sorted_and_at_the_asked_rates(tmp_path):
    path = tmp_path / "two.csv"
    n = write_poisson_trace(path, {"A": 15.0, "B": 45.0}, 200.0, input_tokens={"B": 4000})
    rows = load_trace(path)
    assert len(rows) == n
    assert rows == sorted(rows, key=lambda r: r.arrival_s) and rows[-1].arrival_s < 200.0
    counts = {t: sum(r.tenant_id == t for r in rows) for t in ("A", "B")}
    # a Poisson count over 200 s has sd sqrt(rate * 200): within 4 sd of rate * 200
    for tenant, rate in (("A", 15.0), ("B", 45.0)):
        assert abs(counts[tenant] - rate * 200) < 4 * math.sqrt(rate * 200)
    assert {r.input_tokens for r in rows if r.tenant_id == "A"} == {256}
    assert {r.input_tokens for r in rows if r.tenant_id == "B"} == {4000}
    assert {r.output_tokens for r in rows} == {256}
    again = tmp_path / "again.csv"
    assert write_poisson_trace(again, {"A": 15.0, "B": 45.0}, 200.0, input_tokens={"B": 4000}) == n
    assert again.read_bytes() == path.read_bytes()          # same seed, same file
    assert write_poisson_trace(again, {"A": 15.0, "B": 45.0}, 200.0, seed=1) != n or \
        again.read_bytes() != path.read_bytes()


def test_an_empty_span_writes_the_header_only(tmp_path):
    path = tmp_path / "empty.csv"
    assert write_poisson_trace(path, {"A": 1.0}, 0.0) == 0
    assert path.read_text().splitlines() == ["arrival_s,input_tokens,output_tokens,tenant_id"]


@pytest.mark.parametrize("rates, seconds", [({"A": 0.0}, 1.0), ({"A": -1.0}, 1.0), ({"A": math.inf}, 1.0),
                                            ({"A": math.nan}, 1.0), ({"A": 1.0}, -1.0)])
def test_bad_rates_or_length_are_refused(tmp_path, rates, seconds):
    with pytest.raises(ValueError):
        write_poisson_trace(tmp_path / "x.csv", rates, seconds)
