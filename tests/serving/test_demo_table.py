"""The demo's per-tenant table and headline count shares of what the replay *sent*.

A newcomer read "umbrella sent 1 % of the requests" when umbrella had sent 23 of 300: the share
was of the requests the ledger recorded (2 of 143 admitted), most of umbrella's being refused.
"""

from __future__ import annotations

from kvmeter.serving.demo import print_table
from kvmeter.serving.replay.client import ReplayResult


def _row(tenant: str, requests: int, input_tokens: int, output_tokens: int) -> dict:
    return {"tenant_id": tenant, "requests": requests, "input_tokens": input_tokens, "cached_input_tokens": 0,
            "output_tokens": output_tokens, "ttft_p50_s": 0.5, "ttft_p95_s": 1.0, "itl_p50_s": 0.05,
            "itl_p95_s": 0.1}


def test_shares_are_of_the_requests_sent(capsys) -> None:
    results = ([ReplayResult(index=i, tenant="acme", status=200) for i in range(277)]
               + [ReplayResult(index=277 + i, tenant="umbrella", status=200 if i < 2 else 429, code="projected_wait")
                  for i in range(23)])
    rows = [_row("acme", 277, 6_000, 3_000), _row("umbrella", 2, 4_000, 100)]
    print_table(rows, results)
    out = capsys.readouterr().out
    assert "umbrella sent 8% of the requests" in out  # 23 of 300 sent (was "1%": 2 of 279 recorded)
    assert "31% of the tokens" in out  # 4,100 of 13,100 recorded tokens
    [line] = [ln for ln in out.splitlines() if ln.startswith("umbrella ")]
    assert line.split()[2:6] == ["23", "8%", "21", "2"]  # sent, sent%, refused, recorded
