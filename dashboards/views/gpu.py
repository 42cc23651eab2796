"""GPU: NVML signals per device and per MIG instance — SM activity (GPM) beside the coarse
"utilization", memory, power and temperature. Platform-wide: admin keys only."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvmeter.scalars import number

from .. import charts
from ..signals import GPU, MIG
from ..ui import PageContext
from .common import chart, pct

TITLE = "GPU"
CAPTION = ("NVML's utilization only says a kernel was running; SM activity (GPM) says how much of the "
           "GPU it used. A GPU can read 100 % utilized while most SMs idle — or look idle while KV "
           "memory is full.")

GIB = 1024 ** 3


def _gpu_label(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(("GPU " + pl.col("gpu")).alias("device"))


def render(ctx: PageContext) -> None:
    if not ctx.admin:
        st.info("GPU signals describe the shared platform, not a tenant's own data: sign in with an admin key "
                "to see them.")
        return
    w = ctx.window
    names = ctx.signal_names()
    if not (set(GPU.values()) & names):
        st.info("No GPU signals in this window: no NVIDIA GPU on the serving hosts (NVML reports no device), or "
                "the serve process's signal recorder was not running.")
        return
    util = ctx.gauge(GPU["utilization"], ("gpu",), "avg") if GPU["utilization"] in names else None
    sm = ctx.gauge(GPU["sm_active"], ("gpu",), "avg") if GPU["sm_active"] in names else None
    mem = ctx.gauge(GPU["memory_used"], ("gpu",), "max") if GPU["memory_used"] in names else pl.DataFrame()
    total = ctx.gauge(GPU["memory_total"], ("gpu",), "max") if GPU["memory_total"] in names else pl.DataFrame()
    power = ctx.gauge(GPU["power"], ("gpu",), "avg") if GPU["power"] in names else None
    devices = sorted(set().union(*(set(f.get_column("gpu").to_list()) for f in (util, sm, mem, power)
                                   if f is not None and f.height)), key=lambda g: (len(g), g))

    c = st.columns(4)
    c[0].metric("GPUs reporting", f"{len(devices)}")
    c[1].metric("Mean utilization (coarse)", pct(util.get_column("value").mean()) if util is not None and util.height
                else "—", help="NVML utilization.gpu: fraction of time any kernel ran. Absent under MIG.")
    c[2].metric("Mean SM active (GPM)", pct(sm.get_column("value").mean()) if sm is not None and sm.height else "—",
                help="Fraction of SMs busy — the honest compute-load figure (GPM: Hopper and later).")
    peak = number(mem.get_column("value").max()) if mem.height else None
    c[3].metric("Peak memory used", "—" if peak is None else f"{peak / GIB:,.1f} GiB",
                help="Highest device memory in use of any GPU (vLLM pre-allocates its KV cache here).")

    def per_gpu(frame: pl.DataFrame | None, title: str, y_title: str, y_format: str, value: str = "value") -> None:
        if frame is not None and frame.height:
            chart(charts.timeseries(_gpu_label(frame), value, title=title, y_title=y_title, window=w, color="device",
                                    color_title="device", y_format=y_format, color_domain=labels,
                                    height=max(260, 22 * len(labels) + 90)))

    labels = [f"GPU {d}" for d in devices]
    left, right = st.columns(2)
    with left:
        per_gpu(util, "Utilization (coarse: a kernel was running)", "fraction of time", ".0%")
    with right:
        if sm is not None and sm.height:
            per_gpu(sm, "SM active (GPM: fraction of SMs busy)", "fraction of SMs", ".0%")
        else:
            st.info("SM activity (GPM) is not reported by these GPUs: GPM needs Hopper or later and a driver "
                    "that exposes it. Without it, 'utilization' above cannot tell a saturated GPU from one "
                    "running a single small kernel.")
    left, right = st.columns(2)
    with left:
        used = mem.with_columns((pl.col("value") / GIB).alias("gib")) if mem.height else None
        per_gpu(used, "Device memory used (max per bucket)", "memory used (GiB)", ",.0f", value="gib")
        cap = number(total.get_column("value").max()) if total.height else None
        if cap is not None:
            st.caption(f"Capacity {cap / GIB:,.0f} GiB per GPU. An engine such as vLLM pre-allocates its KV cache at "
                       "start, so device memory stays flat while the KV watermark (KV cache page) moves.")
    with right:
        per_gpu(power, "Board power (mean per bucket)", "power (W)", ",.0f")
    left, right = st.columns(2)
    with left:
        if GPU["tensor_active"] in names:
            per_gpu(ctx.gauge(GPU["tensor_active"], ("gpu",), "avg"), "Tensor cores active (GPM)",
                    "fraction of time", ".0%")
    with right:
        if GPU["dram_bandwidth"] in names:
            per_gpu(ctx.gauge(GPU["dram_bandwidth"], ("gpu",), "avg"), "DRAM bandwidth used (GPM) — decode is "
                    "bandwidth-bound", "fraction of peak", ".0%")
    if GPU["temperature"] in names:
        temp = ctx.gauge(GPU["temperature"], ("gpu", "sensor"), "max").filter(pl.col("sensor") == "gpu")
        per_gpu(temp, "GPU temperature (max per bucket)", "temperature (°C)", ",.0f")

    if MIG["memory_used"] in names or MIG["sm_active"] in names:
        st.subheader("MIG instances")
        key = ("gpu", "mig")
        if MIG["memory_used"] in names:
            mig_mem = ctx.gauge(MIG["memory_used"], key, "max").with_columns(
                ("GPU " + pl.col("gpu") + " · GI " + pl.col("mig")).alias("instance"),
                (pl.col("value") / GIB).alias("gib"))
            chart(charts.timeseries(mig_mem, "gib", title="MIG instance memory used (max per bucket)",
                                    y_title="memory used (GiB)", window=w, color="instance",
                                    color_title="MIG instance", y_format=",.1f"))
        if MIG["sm_active"] in names:
            mig_sm = ctx.gauge(MIG["sm_active"], key, "avg").with_columns(
                ("GPU " + pl.col("gpu") + " · GI " + pl.col("mig")).alias("instance"))
            chart(charts.timeseries(mig_sm, "value", title="MIG instance SM activity (GPM, mean per bucket)",
                                    y_title="instance SMs busy (%)", window=w, color="instance",
                                    color_title="MIG instance", y_format=".0%"))
        st.caption("Under MIG, NVML reports no device-level utilization: per-instance SM activity (GPM) is the "
                   "measure of compute load.")
