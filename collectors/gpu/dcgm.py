"""Read a DCGM exporter's ``/metrics`` exposition into :class:`~kvmeter.stats.GpuSample` objects.

For fleets that already run NVIDIA's dcgm-exporter, and as a second, independent source to check
kvmeter's own unit conversions against. Parsing is prometheus-client's text parser.

DCGM marks "no value" with *blank sentinels* instead of omitting the series (dcgm_structs.h):
``DCGM_INT32_BLANK`` = 0x7ffffff0, ``DCGM_INT64_BLANK`` = 0x7ffffffffffffff0 and
``DCGM_FP64_BLANK`` = 140737488355328.0, each followed by a few "not found / not supported / no
permission" codes just above it. dcgm-exporter prints them verbatim (its README shows
``DCGM_FI_DEV_MEMORY_TEMP ... 9223372036854775794``, i.e. INT64_BLANK + 2 = NOT_SUPPORTED); they
become ``None`` here, never a temperature of 9.2e18 °C.

Units: DCGM's MHz, MiB ("MB" in its help text), W, mJ and percent are converted to the sample's
Hz, bytes, W, J and 0.0–1.0 ratios.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvmeter.stats import GpuSample

__all__ = ["gpu_samples_from_dcgm", "is_dcgm_blank", "DcgmParseError"]


class DcgmParseError(ValueError):
    """The text is not a valid Prometheus exposition."""


_INT32_BLANK = 0x7FFFFFF0
_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
_FP64_BLANK = 140737488355328.0
_MIB = 1024 * 1024

#: DCGM field → (GpuSample attribute or "dict:key", scale to the sample's unit)
_FIELDS: dict[str, tuple[str, float]] = {
    "DCGM_FI_DEV_SM_CLOCK": ("clocks_hz:sm", 1e6),
    "DCGM_FI_DEV_MEM_CLOCK": ("clocks_hz:memory", 1e6),
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_gpu_celsius", 1.0),
    "DCGM_FI_DEV_MEMORY_TEMP": ("temperature_memory_celsius", 1.0),
    "DCGM_FI_DEV_POWER_USAGE": ("power_watts", 1.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("power_limit_watts", 1.0),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("energy_joules", 1e-3),
    "DCGM_FI_DEV_GPU_UTIL": ("utilization_gpu_ratio", 0.01),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("utilization_memory_ratio", 0.01),
    "DCGM_FI_DEV_FB_FREE": ("memory_free_bytes", _MIB),
    "DCGM_FI_DEV_FB_USED": ("memory_used_bytes", _MIB),
    "DCGM_FI_DEV_FB_RESERVED": ("memory_reserved_bytes", _MIB),
    "DCGM_FI_DEV_FB_TOTAL": ("memory_total_bytes", _MIB),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replays", 1),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("remapped_rows_correctable", 1),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("remapped_rows_uncorrectable", 1),
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active_ratio", 1.0),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("sm_occupancy_ratio", 1.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("tensor_active_ratio", 1.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_bandwidth_ratio", 1.0),
}
_INT_FIELDS = {"memory_free_bytes", "memory_used_bytes", "memory_reserved_bytes",
               "memory_total_bytes", "pcie_replays", "remapped_rows_correctable",
               "remapped_rows_uncorrectable"}


def is_dcgm_blank(value: float) -> bool:
    """True if ``value`` is one of DCGM's blank / not-found / not-supported sentinels."""
    return (_INT32_BLANK <= value <= 0x7FFFFFFF
            or value >= _INT64_BLANK  # int comparison: exact even for 2**63 - 14
            or _FP64_BLANK <= value <= _FP64_BLANK + 16)


def gpu_samples_from_dcgm(text: str, *, wall_ts: float = 0.0) -> list[GpuSample]:
    """Parse a dcgm-exporter exposition into one :class:`GpuSample` per ``gpu`` label.

    Fields DCGM did not report, or reported as a blank sentinel, stay ``None``. Series without a
    ``gpu`` label and fields kvmeter does not map are ignored.

    Args:
        text: the exposition text (``# HELP``/``# TYPE`` lines optional).
        wall_ts: timestamp to stamp on the samples (wall-clock epoch seconds).
    Returns:
        Samples sorted by GPU index.
    Raises:
        DcgmParseError: if the text is not a Prometheus exposition.
    """
    samples: dict[int, GpuSample] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise DcgmParseError(f"not a Prometheus exposition: {exc}") from exc
    for family in families:
        for sample in family.samples:
            # the parser names counter samples "<family>_total"; "_created" series are skipped
            if sample.name not in (family.name, family.name + "_total"):
                continue
            target = _FIELDS.get(family.name)
            gpu = sample.labels.get("gpu")
            if target is None or gpu is None or not gpu.isdigit():
                continue
            s = samples.setdefault(int(gpu), GpuSample(wall_ts=wall_ts, index=int(gpu)))
            s.uuid = s.uuid or sample.labels.get("UUID")
            s.name = s.name or sample.labels.get("modelName")
            attr, scale = target
            if is_dcgm_blank(sample.value):
                continue  # stays None
            value = sample.value * scale
            if ":" in attr:
                name, key = attr.split(":")
                getattr(s, name)[key] = value
            else:
                setattr(s, attr, int(value) if attr in _INT_FIELDS else value)
    return [samples[i] for i in sorted(samples)]
