"""cProfile N non-streaming chat requests through ``kvmeter serve``'s app (instant engine), in-process.

Diagnosis only (bench/quota/RESULTS.md, "Where the CPU goes on vLLM's layer"): builds
``ServeRuntime`` with a chDB ledger and the memory quota, warms it with 50 requests, then
cProfiles N requests sent through ``httpx.ASGITransport`` (the event loop; the executor threads'
work items go into FILE.threads), runs N more unprofiled and prints each thread's CPU per request
from ``/proc/self/task`` and the ledger writer's inserts. ``INLINE=1`` runs vLLM's renderer pool
inline (a what-if). Works on older trees too::

    TREE=$PWD PYTHONPATH=$PWD .venv/bin/python bench/quota/profile_inprocess.py /tmp/after.prof 1000
"""
import asyncio
import collections
import concurrent.futures.thread as cft
import cProfile
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from kvmeter.ledger import drain as _drain
from kvmeter.serving.config import load_serve_config
from kvmeter.serving.runtime import ServeRuntime

# bench_gateway is a sibling script of the tree being profiled ($TREE), not an installed module
sys.path.insert(0, os.environ["TREE"] + "/bench/quota")
from bench_gateway import BODY, KEY, tenants_yaml  # noqa: E402 — importable only after the path set-up

_tl = threading.local()
TPROFS = []
PROFILING = [False]
_orig = cft._WorkItem.run
def _run(self):
    if not PROFILING[0]:
        return _orig(self)
    p = getattr(_tl, "p", None)
    if p is None:
        p = _tl.p = cProfile.Profile()
        TPROFS.append(p)
    p.enable()
    try:
        return _orig(self)
    finally:
        p.disable()
cft._WorkItem.run = _run
def tasks():
    out = {}
    for t in os.listdir("/proc/self/task"):
        f = open(f"/proc/self/task/{t}/stat").read()
        name = f[f.index("(")+1:f.rindex(")")]
        v = f[f.rindex(")")+2:].split()
        out[t] = (name, int(v[11]) + int(v[12]))
    return out
PHASE = ['warm']
INS = collections.defaultdict(lambda: [0, 0.0, 0])
MEAS = [False]
_orig_raw = _drain.Writer._raw_insert
def _raw(self, client, spec, *a, **k):
    t = time.thread_time()
    try:
        return _orig_raw(self, client, spec, *a, **k)
    finally:
        e = INS[(spec.table, PHASE[0])]
        e[0] += 1
        e[1] += time.thread_time() - t
_drain.Writer._raw_insert = _raw
_orig_round = _drain.Writer._round
ROUNDS = [0, 0.0]
def _round(self):
    t = time.thread_time()
    try:
        return _orig_round(self)
    finally:
        if MEAS[0]:
            ROUNDS[0] += 1
            ROUNDS[1] += time.thread_time() - t
_drain.Writer._round = _round
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
OUT = sys.argv[1]

async def main():
    root = Path(tempfile.mkdtemp(prefix="kvprof"))
    (root / "tenants.yaml").write_text(tenants_yaml())
    config = load_serve_config(None, {("engine", "kind"): "instant", ("tenants",): str(root / "tenants.yaml"),
                                      ("quota_store",): "memory://", ("ledger_dsn",): f"chdb://{root}/chdb",
                                      ("spool_dir",): str(root / "spool"), ("server", "log_level"): "warning"})
    rt = ServeRuntime(config, registry=CollectorRegistry())
    app = rt.app()
    await rt.start()
    if os.environ.get("INLINE"):
        from concurrent.futures import Executor, Future
        class Inline(Executor):
            def submit(self, fn, /, *a, **k):
                f = Future()
                try:
                    f.set_result(fn(*a, **k))
                except BaseException as e:
                    f.set_exception(e)
                return f
        r = rt.openai._layer.client.renderer
        print("renderer executor", type(r._executor), r._executor._max_workers)
        r._executor._inner = Inline()
    hdr = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    body = json.dumps(BODY).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for _ in range(50):
            r = await c.post("/v1/chat/completions", content=body, headers=hdr)
            assert r.status_code == 200, r.text
        # client-side cost baseline: hit /healthz? just measure
        prof = cProfile.Profile()
        t0 = time.process_time()
        w0 = time.perf_counter()
        MEAS[0] = True
        PHASE[0] = 'meas'
        PROFILING[0] = True
        prof.enable()
        for _ in range(N):
            r = await c.post("/v1/chat/completions", content=body, headers=hdr)
            assert r.status_code == 200
        prof.disable()
        PROFILING[0] = False
        t1 = time.process_time()
        w1 = time.perf_counter()
        # unprofiled
        t2 = time.process_time()
        a = tasks()
        for _ in range(N):
            r = await c.post("/v1/chat/completions", content=body, headers=hdr)
        t3 = time.process_time()
        b = tasks()
        MEAS[0] = False
        PHASE[0] = 'end'
        print(f"writer rounds {ROUNDS[0]} cpu {1e3*ROUNDS[1]/(2*N):.3f} ms/req")
        for tab, (c, cpu, _) in sorted(INS.items()):
            print(f"  insert {tab}: {c} batches, {1e3*cpu/(2*N):.3f} ms/req thread CPU")
        tck = os.sysconf("SC_CLK_TCK")
        rows = sorted(((b[k][1] - a.get(k, ("", 0))[1], b[k][0], k) for k in b), reverse=True)
        names = {str(t.native_id): t.name + ":" + getattr(getattr(t, "_target", None), "__qualname__", "?")
                 for t in threading.enumerate()}
        for d, name, k in rows[:8]:
            print(f"thread {k} {name} {names.get(k, '-')}: {1e6*d/tck/N:.0f} us/req")
    print(f"profiled: cpu {1e3*(t1-t0)/N:.3f} ms/req wall {1e3*(w1-w0)/N:.3f}; "
          f"unprofiled cpu {1e3*(t3-t2)/N:.3f} ms/req (process, all threads, incl. client)")
    prof.dump_stats(OUT)
    if TPROFS:
        st = pstats.Stats(TPROFS[0])
        for p in TPROFS[1:]:
            st.add(p)
        st.dump_stats(OUT + ".threads")
    led = rt.recorder.ledger
    print("flush", led.flush(60))
    q = led._query_holder.get()
    for tab in ("usage_events", "attempts", "engine_requests"):
        try:
            print(tab, q.query(f"SELECT count() FROM {tab}").result_rows)
        except Exception as e:
            print(tab, "ERR", str(e)[:200])
    for tab, (c, cpu, _) in sorted(INS.items()):
        print(f"  insert {tab}: {c} batches, {1e3*cpu:.1f} ms thread CPU total")
    w = led._writer
    print("writer", {k: getattr(w, k, None) for k in ("drained_total", "insert_batches_total",
                                                      "insert_retries_total", "rejected_total", "last_error")})
    await rt.stop()

asyncio.run(main())
