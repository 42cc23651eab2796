"""Issue 13 item 5: the parity table (``bench/parity``) against real servers on the real engine.

One vLLM OpenAI server and one ``kvmeter serve`` (vLLM engine), started together for the module
on the same model and engine settings (``bench/parity/servers.py``):

* vLLM against itself, every case sent twice with no allow-list: every case must be ``same``.
  This proves the harness — that its normalisation sets aside only what legitimately differs
  between two runs, and that every case is deterministic — so a difference against kvmeter is a
  difference of kvmeter's.
* vLLM against kvmeter with the allow-list: no case may be ``different`` (kvmeter runs vLLM's
  serving layer in-process; ``bench/parity/RESULTS.md`` is the latest matrix).

Run time: 6 min for the module on this machine's 2 cores with other work running (load average
≈ 11): the two servers load in parallel (~2–4 min), then each table takes 1.5–2.5 min.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.parity.allowlist import ALLOWLIST
from bench.parity.cases import CASES, MAX_MODEL_LEN
from bench.parity.run import render_markdown, results_json, run_table
from bench.parity.servers import PARITY_KEY, EngineSettings, start_kvmeter, start_vllm, wait_all_ready

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_dir):
    """vLLM's OpenAI server and kvmeter serve, loading at the same time; both stopped (process
    groups, EngineCore included) at the end of the module."""
    from kvmeter.model import DEFAULT_MODEL_NAME

    root = tmp_path_factory.mktemp("parity")
    settings = EngineSettings(Path(model_dir), DEFAULT_MODEL_NAME, max_model_len=MAX_MODEL_LEN)
    started = [start_vllm(settings, root / "vllm"), start_kvmeter(settings, root / "kvmeter")]
    try:
        wait_all_ready(started)
        yield {s.kind: s for s in started}
    finally:
        for server in started:
            server.stop()


def _summary(outcomes) -> str:
    bad = [o for o in outcomes if o.result.verdict == "different"]
    return "\n".join(f"{o.case.name}: " + "; ".join(d.short(100) for d in o.result.differences[:4]) for o in bad)


def test_vllm_against_itself_every_case_is_the_same(servers):
    url = servers["vllm"].url
    outcomes = run_table(CASES, url, url, PARITY_KEY, allowlist=(), progress=None)
    verdicts = {o.case.name: o.result.verdict for o in outcomes}
    assert set(verdicts.values()) == {"same"}, _summary(outcomes)
    # the table exercised what it claims: real generations, real refusals, real streams
    statuses = {o.case.name: o.reference.status for o in outcomes}
    assert statuses["chat_plain"] == 200 and statuses["bad_malformed_json"] == 400
    assert sum(s == 200 for s in statuses.values()) >= 40
    streams = [o for o in outcomes if o.case.stream and o.reference.status == 200]
    assert streams and all(o.reference.kind == "sse" and o.reference.body[-1] == "[DONE]" for o in streams)
    tool = next(o for o in outcomes if o.case.name == "chat_tools_named").reference.body
    assert tool["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_kvmeter_answers_every_case_as_vllm_does(servers, tmp_path):
    outcomes = run_table(CASES, servers["vllm"].url, servers["kvmeter"].url, PARITY_KEY, allowlist=ALLOWLIST,
                         progress=None)
    meta = {"command": "pytest tests/parity", "started_utc": "-", "run_s": 0, "table_s": 0, "startup": "-",
            "load_before": "-", "machine": {"cores": "-", "cpu": "-", "platform": "-"}, "versions": {},
            "reference": servers["vllm"].url, "target": servers["kvmeter"].url, "allowlist": True}
    (tmp_path / "RESULTS.md").write_text(render_markdown(outcomes, meta))  # for a reader of a failure
    assert results_json(outcomes, meta)["counts"]["different"] == 0, _summary(outcomes)
