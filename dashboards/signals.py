"""The signal names the dashboards read from the ledger's ``signals`` table.

They are written by :class:`kvmeter.exporters.signals.SignalSampler` (``kvmeter serve`` samples
every ``KVMETER_SIGNALS_INTERVAL_S``): gauges as they were at the sample, and rates already
computed over the interval (names ending ``_per_second``) — so every one is read as a gauge
(mean, max or last per bucket). Per-tenant series carry ``tier`` and ``tenant`` labels with full,
unbounded tenant detail. A name missing from a window means its source was not running (no GPU,
an engine without step stats); pages then fall back to a ledger-derived measure and say so.

Every name is looked up in the one name table (:data:`kvmeter.exporters.prometheus.names.SIGNAL_SERIES`,
where each series is tied to the Prometheus metric of the same quantity), so a name the sampler
does not write fails here at import instead of drawing an empty chart.
"""

from __future__ import annotations

from kvmeter.exporters.prometheus.names import rate_series, series

__all__ = ["ENGINE", "ENGINE_TENANT", "PROMPT_CACHE", "SCHEDULER", "TENANT", "GATEWAY", "REPLICA", "GPU", "MIG",
           "ALL"]

#: Engine gauges, labels ``engine``, ``model``.
ENGINE = {
    "kv_watermark": series("kvmeter_engine_kv_watermark_ratio"),        # used / total KV blocks, 0–1
    "kv_used_blocks": series("kvmeter_engine_kv_used_blocks"),          # blocks
    "running": series("kvmeter_engine_running_requests"),               # requests in the batch
    "waiting": series("kvmeter_engine_waiting_requests"),               # requests in the engine queue
    "output_rate": rate_series("kvmeter_engine_output_tokens_total"),
    "preemption_rate": rate_series("kvmeter_engine_preemptions_total"),
}
#: Per-tenant engine work rates (vLLM step shares), labels ``engine``, ``model``, ``tier``, ``tenant``.
ENGINE_TENANT = {
    "prefill_rate": rate_series("kvmeter_engine_tenant_scheduled_prefill_tokens_total"),  # tokens / s
    "decode_rate": rate_series("kvmeter_engine_tenant_scheduled_decode_tokens_total"),    # tokens / s
}
#: The gateway's prompt-cache thrash measure, labels ``tenant``, ``model`` (tenants that re-prefilled).
PROMPT_CACHE = {
    "reprefill_rate": rate_series("kvmeter_prompt_reprefill_tokens_total"),  # tokens / s
}
#: Scheduler-wide gauges, no labels.
SCHEDULER = {
    "queued": series("kvmeter_scheduler_queued_requests"),
    "running": series("kvmeter_scheduler_running_requests"),
    "pressure": series("kvmeter_scheduler_pressure_level"),             # 0 normal, 1 elevated, 2 overload
    "jain": series("kvmeter_scheduler_jain_index_ratio"),               # over backlogged tenants, 0–1
    "service_gap": series("kvmeter_scheduler_max_service_gap_tokens"),
}
#: Per-tenant gauges, labels ``tier``, ``tenant``.
TENANT = {
    "queue_depth": series("kvmeter_scheduler_queue_depth_requests"),
    "oldest_wait": series("kvmeter_scheduler_queue_oldest_wait_seconds"),
    "active_kv": series("kvmeter_tenant_active_kv_tokens"),
    "running": series("kvmeter_tenant_running_requests"),
}
#: Gateway rates, labels ``tier`` and ``outcome`` / ``type``.
GATEWAY = {
    "requests_rate": rate_series("kvmeter_requests_total"),
    "throughput": rate_series("kvmeter_throughput_tokens_total"),
    "goodput": rate_series("kvmeter_goodput_tokens_total"),
    "goodput_ratio": series("kvmeter_goodput_ratio"),
}
#: Engine-pool series, labels ``model``, ``replica`` (its URL); decisions ``model``, ``policy``, ``outcome``.
REPLICA = {
    "up": series("kvmeter_replica_up"),                                 # 1 answers, 0 down
    "available": series("kvmeter_replica_available"),                   # 1 takes new requests (up, not draining)
    "routed_rate": rate_series("kvmeter_replica_routed_requests_total"),          # requests / s
    "decision_rate": rate_series("kvmeter_router_decisions_requests_total"),      # decisions / s by outcome
}
#: GPU gauges (NVML), label ``gpu`` (+ ``sensor`` for temperature).
GPU = {
    "utilization": series("kvmeter_gpu_utilization_ratio"),             # COARSE: any kernel running
    "sm_active": series("kvmeter_gpu_sm_active_ratio"),                 # GPM: fraction of SMs busy
    "tensor_active": series("kvmeter_gpu_tensor_active_ratio"),
    "dram_bandwidth": series("kvmeter_gpu_dram_bandwidth_ratio"),
    "memory_used": series("kvmeter_gpu_memory_used_bytes"),
    "memory_total": series("kvmeter_gpu_memory_total_bytes"),
    "power": series("kvmeter_gpu_power_watts"),
    "temperature": series("kvmeter_gpu_temperature_celsius"),
}
#: MIG instance gauges, labels ``gpu``, ``mig`` (GPU instance id).
MIG = {
    "memory_used": series("kvmeter_gpu_mig_memory_used_bytes"),
    "sm_active": series("kvmeter_gpu_mig_sm_active_ratio"),
}
ALL: tuple[str, ...] = tuple(n for group in (ENGINE, ENGINE_TENANT, PROMPT_CACHE, SCHEDULER, TENANT, GATEWAY,
                                                      REPLICA, GPU, MIG)
                             for n in group.values())
