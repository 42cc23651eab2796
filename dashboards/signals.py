"""The signal names the dashboards read from the ledger's ``signals`` table.

They are written by :class:`kvmeter.collectors.signals.SignalSampler` (``kvmeter serve`` samples
every ``KVMETER_SIGNALS_INTERVAL_S``): gauges as they were at the sample, and rates already
computed over the interval (names ending ``_per_second``) — so every one is read as a gauge
(mean, max or last per bucket). Per-tenant series carry ``tier`` and ``tenant`` labels with full,
unbounded tenant detail. A name missing from a window means its source was not running (no GPU,
an engine without step stats); pages then fall back to a ledger-derived measure and say so.
"""

from __future__ import annotations

__all__ = ["ENGINE", "SCHEDULER", "TENANT", "GATEWAY", "GPU", "MIG", "ALL"]

#: Engine gauges, labels ``engine``, ``model``.
ENGINE = {
    "kv_watermark": "kvmeter_engine_kv_watermark_ratio",       # used / total KV blocks, 0–1
    "kv_used_blocks": "kvmeter_engine_kv_used_blocks",         # blocks
    "running": "kvmeter_engine_running_requests",              # requests in the batch
    "waiting": "kvmeter_engine_waiting_requests",              # requests in the engine queue
    "generation_rate": "kvmeter_engine_generation_tokens_per_second",
    "preemption_rate": "kvmeter_engine_preemptions_per_second",
}
#: Scheduler-wide gauges, no labels.
SCHEDULER = {
    "queued": "kvmeter_scheduler_queued_requests",
    "running": "kvmeter_scheduler_running_requests",
    "pressure": "kvmeter_scheduler_pressure_level",            # 0 normal, 1 elevated, 2 overload
    "jain": "kvmeter_scheduler_jain_index_ratio",              # over backlogged tenants, 0–1
    "service_gap": "kvmeter_scheduler_max_service_gap_tokens",
}
#: Per-tenant gauges, labels ``tier``, ``tenant``.
TENANT = {
    "queue_depth": "kvmeter_scheduler_queue_depth_requests",
    "oldest_wait": "kvmeter_scheduler_queue_oldest_wait_seconds",
    "active_kv": "kvmeter_tenant_active_kv_tokens",
    "running": "kvmeter_tenant_running_requests",
}
#: Gateway rates, labels ``tier`` and ``outcome`` / ``type``.
GATEWAY = {
    "requests_rate": "kvmeter_requests_per_second",
    "throughput": "kvmeter_throughput_tokens_per_second",
    "goodput": "kvmeter_goodput_tokens_per_second",
    "goodput_ratio": "kvmeter_goodput_ratio",
}
#: GPU gauges (NVML), label ``gpu`` (+ ``sensor`` for temperature).
GPU = {
    "utilization": "kvmeter_gpu_utilization_ratio",            # COARSE: any kernel running
    "sm_active": "kvmeter_gpu_sm_active_ratio",                # GPM: fraction of SMs busy
    "tensor_active": "kvmeter_gpu_tensor_active_ratio",
    "dram_bandwidth": "kvmeter_gpu_dram_bandwidth_ratio",
    "memory_used": "kvmeter_gpu_memory_used_bytes",
    "memory_total": "kvmeter_gpu_memory_total_bytes",
    "power": "kvmeter_gpu_power_watts",
    "temperature": "kvmeter_gpu_temperature_celsius",
}
#: MIG instance gauges, labels ``gpu``, ``mig`` (GPU instance id).
MIG = {
    "memory_used": "kvmeter_gpu_mig_memory_used_bytes",
    "sm_active": "kvmeter_gpu_mig_sm_active_ratio",
}
ALL: tuple[str, ...] = tuple(n for group in (ENGINE, SCHEDULER, TENANT, GATEWAY, GPU, MIG) for n in group.values())
