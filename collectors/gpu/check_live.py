"""Check the live NVML collector on a real GPU machine (no GPU exists where kvmeter is built).

    python -m kvmeter.collectors.gpu.check_live [--interval 2] [--xid-wait-ms 1000]

Reads every GPU twice (GPM metrics need two samples), checks the readings for consistency, and —
when ``nvidia-smi`` is on PATH — compares them with ``nvidia-smi -q`` parsed by the same parser
the capture tests use. Prints one line per check and exits 0 if all pass, 1 if any fails, 3 if
no GPU can be read.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time

from kvmeter.stats import GpuSample

from .capture import parse_query_text
from .nvml_collector import NvmlCollector

MIB = 1024 * 1024


def _ratio_ok(value: float | None) -> bool:
    return value is None or 0.0 <= value <= 1.0


def check_sample(s: GpuSample) -> list[tuple[str, bool, str]]:
    """Consistency checks on one live sample: (name, passed, detail)."""
    out: list[tuple[str, bool, str]] = []
    parts = (s.memory_total_bytes, s.memory_used_bytes, s.memory_free_bytes)
    total, used, free = parts
    if total is not None and used is not None and free is not None:
        gap = total - used - free - (s.memory_reserved_bytes or 0)
        out.append(("memory used+free+reserved ≈ total", abs(gap) <= 2 * MIB, f"gap {gap / MIB:.1f} MiB"))
    else:
        out.append(("memory readable", False, f"{parts}"))
    for name in ("utilization_gpu_ratio", "utilization_memory_ratio", "sm_active_ratio",
                 "sm_occupancy_ratio", "tensor_active_ratio", "dram_bandwidth_ratio"):
        value = getattr(s, name)
        out.append((f"{name} in [0, 1] or missing", _ratio_ok(value), f"{value}"))
    if s.mig_enabled is False:
        out.append(("utilization readable outside MIG", s.utilization_gpu_ratio is not None, ""))
    out.append(("temperature plausible", s.temperature_gpu_celsius is not None
                and 0 < s.temperature_gpu_celsius < 120, f"{s.temperature_gpu_celsius}"))
    out.append(("power within limit", s.power_watts is not None and s.power_limit_watts is not None
                and 0 < s.power_watts <= 1.2 * s.power_limit_watts,
                f"{s.power_watts} / {s.power_limit_watts} W"))
    out.append(("energy counter readable", s.energy_joules is not None, f"{s.energy_joules} J"))
    out.append(("clocks readable", bool(s.clocks_hz), f"{s.clocks_hz}"))
    used_by_procs = sum(p.used_memory_bytes or 0 for p in s.processes)
    if s.memory_used_bytes is not None:
        out.append(("per-process memory ≤ device used", used_by_procs <= s.memory_used_bytes,
                    f"{used_by_procs / MIB:.0f} ≤ {s.memory_used_bytes / MIB:.0f} MiB"))
    for m in s.mig:
        total, used, free = m.memory_total_bytes, m.memory_used_bytes, m.memory_free_bytes
        if total is not None and used is not None and free is not None:
            gap = total - used - free - (m.memory_reserved_bytes or 0)
            out.append((f"MIG {m.mig_index} memory adds up", abs(gap) <= 2 * MIB, f"gap {gap / MIB:.1f} MiB"))
    return out


def compare_with_nvidia_smi(samples: list[GpuSample]) -> list[tuple[str, bool, str]]:
    """Cross-check names, memory totals and MIG layout with ``nvidia-smi -q``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [("nvidia-smi cross-check", True, "skipped: nvidia-smi not on PATH")]
    text = subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=60, check=True).stdout
    captured = parse_query_text(text, source="nvidia-smi -q (live)")
    out = [("same GPU count as nvidia-smi", len(captured.gpus) == len(samples),
            f"{len(captured.gpus)} vs {len(samples)}")]
    for cap, s in zip(captured.gpus, samples, strict=False):  # a count mismatch is reported above
        out.append((f"GPU {s.index} name matches", cap.name == s.name, f"{cap.name!r} vs {s.name!r}"))
        if cap.memory_total_mib is not None and s.memory_total_bytes is not None:
            out.append((f"GPU {s.index} memory total matches",
                        abs(cap.memory_total_mib - s.memory_total_bytes / MIB) <= 1,
                        f"{cap.memory_total_mib} MiB vs {s.memory_total_bytes / MIB:.0f} MiB"))
        out.append((f"GPU {s.index} MIG devices match", len(cap.migs) == len(s.mig),
                    f"{len(cap.migs)} vs {len(s.mig)}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between the two reads")
    parser.add_argument("--xid-wait-ms", type=int, default=1000, help="how long to wait for XID events")
    args = parser.parse_args(argv)
    collector = NvmlCollector()
    status = collector.start()
    print(f"status: {status}")
    if status.state != "ok":
        return 3
    collector.collect()
    time.sleep(args.interval)  # a live machine check, not a test: GPM needs two samples apart
    samples = collector.collect()
    events = collector.poll_xid(timeout_ms=args.xid_wait_ms)
    results = [check for s in samples for check in check_sample(s)]
    results += compare_with_nvidia_smi(samples)
    results.append(("no unimplemented NVML functions", not collector.missing_functions,
                    f"{sorted(collector.missing_functions)}"))
    results.append(("no NVML read errors", not collector.status.read_errors, f"{collector.status.read_errors}"))
    for s in samples:
        print(f"GPU {s.index}: {s}")
        print(f"  GPM: sm_active={s.sm_active_ratio} occupancy={s.sm_occupancy_ratio} "
              f"tensor={s.tensor_active_ratio} dram_bw={s.dram_bandwidth_ratio}")
    print(f"XID events: {events}")
    for name, passed, detail in results:
        print(f"{'PASS' if passed else 'FAIL'}  {name}  {detail}")
    collector.close()
    return 0 if all(p for _, p, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
