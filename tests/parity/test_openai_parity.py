"""Issue 13 item 5: the parity table (``bench/parity``) against real servers on the real engine.

One vLLM OpenAI server and one ``kvmeter serve`` (vLLM engine), started together for the module
on the same model and engine settings (``bench/parity/servers.py``), and ``kvmeter serve --engine
remote`` in front of that vLLM server:

* vLLM against itself, every case sent twice with no allow-list: every case must be ``same``.
  This proves the harness — that its normalisation sets aside only what legitimately differs
  between two runs, and that every case is deterministic — so a difference against kvmeter is a
  difference of kvmeter's.
* vLLM against kvmeter with the allow-list: no case may be ``different`` (kvmeter runs vLLM's
  serving layer in-process; ``bench/parity/RESULTS.md`` is the latest matrix).
* vLLM against kvmeter ``--engine remote`` in front of it (the transparent proxy), on a subset of
  the table (:data:`REMOTE_CASES`; the full table is ``bench/parity/RESULTS-remote.md``): no case
  may be ``different``. ``-k remote`` starts only the vLLM server and the proxy.

Run time: 6 min for the module on this machine's 2 cores with other work running (load average
≈ 11): the two servers load in parallel (~2–4 min), then each table takes 1.5–2.5 min.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.parity.allowlist import ALLOWLIST
from bench.parity.cases import CASES, MAX_MODEL_LEN, case_named
from bench.parity.run import render_markdown, results_json, run_table
from bench.parity.servers import PARITY_KEY, EngineSettings, start_kvmeter, start_vllm, wait_all_ready

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def settings(model_dir):
    from kvmeter.model import DEFAULT_MODEL_NAME

    return EngineSettings(Path(model_dir), DEFAULT_MODEL_NAME, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def vllm(root, settings):
    """vLLM's OpenAI server, started (not yet ready) for the module; its process group stopped at
    the end."""
    server = start_vllm(settings, root / "vllm")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def servers(root, settings, vllm):
    """vLLM's OpenAI server and kvmeter serve (vLLM engine), loading at the same time."""
    kvmeter = start_kvmeter(settings, root / "kvmeter")
    try:
        wait_all_ready([vllm, kvmeter])
        yield {"vllm": vllm, "kvmeter": kvmeter}
    finally:
        kvmeter.stop()


@pytest.fixture(scope="module")
def remote(root, settings, vllm):
    """``kvmeter serve --engine remote`` in front of the module's vLLM server (started once that
    server answers: its engine reads the upstream's models as it starts)."""
    vllm.wait_ready()
    kvmeter = start_kvmeter(settings, root / "kvmeter-remote", remote_url=vllm.url)
    try:
        kvmeter.wait_ready()
        yield kvmeter
    finally:
        kvmeter.stop()


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


#: The remote proxy's cases in the test (the full table: ``bench/parity/run.py --remote``): every
#: feature the proxy must leave as vLLM answers it — streams with and without usage (kvmeter adds
#: and takes out include_usage), tools, n, logprobs, structured outputs, X-Request-Id, prompt lists,
#: and bad inputs kvmeter refuses itself (vLLM's models) or the upstream refuses (passed through).
REMOTE_CASES = ("chat_plain", "chat_stream", "chat_content_parts", "chat_tools_required", "chat_tools_stream_auto",
                "chat_tool_result_turn", "chat_json_schema_strict", "chat_n2", "chat_n2_stream", "chat_logprobs_stream",
                "chat_penalties", "chat_stream_include_usage", "chat_stream_continuous_usage", "chat_x_request_id",
                "chat_x_request_id_stream", "cmpl_stream_include_usage", "cmpl_stream_n2", "cmpl_echo_logprobs",
                "cmpl_prompt_list", "cmpl_token_ids", "bad_malformed_json", "bad_max_tokens_type", "bad_unknown_model",
                "bad_prompt_past_window", "bad_max_tokens_past_window", "bad_n2_greedy", "bad_tool_choice_unknown")


def test_kvmeter_remote_answers_as_the_vllm_server_behind_it(vllm, remote, tmp_path):
    cases = [case_named(name) for name in REMOTE_CASES]
    outcomes = run_table(cases, vllm.url, remote.url, PARITY_KEY, allowlist=ALLOWLIST, progress=None)
    meta = {"command": "pytest tests/parity (remote)", "started_utc": "-", "run_s": 0, "table_s": 0, "startup": "-",
            "load_before": "-", "machine": {"cores": "-", "cpu": "-", "platform": "-"}, "versions": {},
            "reference": vllm.url, "target": remote.url, "allowlist": True}
    (tmp_path / "RESULTS-remote.md").write_text(render_markdown(outcomes, meta))  # for a reader of a failure
    assert results_json(outcomes, meta)["counts"]["different"] == 0, _summary(outcomes)
    statuses = {o.case.name: o.target.status for o in outcomes}
    assert statuses["chat_n2"] == 200 and statuses["bad_n2_greedy"] == 400 and statuses["bad_unknown_model"] == 404
