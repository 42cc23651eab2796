"""``kvmeter gpu`` — read the GPUs once through NVML (or a capture) and print them.

    kvmeter gpu                                  # live NVML; "no GPU" is a state, exit 0
    kvmeter gpu --capture FILE [--phase load]    # drive the same collector from a capture
    kvmeter gpu --json --xid-wait-ms 1000        # JSON, and wait up to 1 s for XID events
    kvmeter gpu --require-gpu                    # exit 3 when no GPU (for scripts and CI)

Exit status: 0 ok (also "no GPU" without ``--require-gpu``); 2 bad arguments (an unreadable or
malformed capture, or a directory — the error lists its files: one ``kvmeter gpu: error: ...``
line); 3 no GPU with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvmeter.cliargs import non_negative_int as _non_negative_int

__all__ = ["add_arguments", "run", "EXIT_NO_GPU", "EXIT_USAGE"]

#: exit status of ``--require-gpu`` on a machine without a usable GPU
EXIT_NO_GPU = 3
#: exit status for a bad argument (an unreadable or malformed ``--capture`` file)
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capture", metavar="FILE",
                        help="read an nvidia-smi capture (.txt phase file or -q -x XML) instead of NVML")
    parser.add_argument("--phase", default="load", choices=("idle", "load"),
                        help="capture phase for .txt captures (default load)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--xid-wait-ms", type=_non_negative_int, default=0,
                        help="wait this long for XID events after reading (ms, ≥ 0; default 0)")
    parser.add_argument("--require-gpu", action="store_true",
                        help=f"exit {EXIT_NO_GPU} if no GPU can be read")


def _fmt(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value * scale:.{digits}f}{unit}"


#: Most file names a ``--capture DIRECTORY`` error lists.
_LISTED_FILES = 12


def _directory_error(path: Path) -> str:
    """The one-line error for ``--capture`` naming a directory: a file is expected; the files in it."""
    try:
        names = sorted(p.name for p in path.iterdir() if p.is_file())
    except OSError as exc:
        names, why = [], f" (cannot list it: {exc.strerror or exc})"
    else:
        why = ""
    if names:
        shown = ", ".join(names[:_LISTED_FILES])
        more = f" and {len(names) - _LISTED_FILES} more" if len(names) > _LISTED_FILES else ""
        held = f"; files in it: {shown}{more}"
    else:
        held = why or "; it holds no files"
    return (f"is a directory, not a capture file: --capture takes one nvidia-smi capture "
            f"(an nvidia_gpu_exporter .txt or an nvidia-smi -q -x .xml){held}")


def run(args: argparse.Namespace) -> int:
    from .gpu import CaptureNvml, NvmlCollector  # imported only when the command runs

    if args.capture and Path(args.capture).is_dir():
        print(f"kvmeter gpu: error: --capture {args.capture}: {_directory_error(Path(args.capture))}",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        nvml = CaptureNvml.from_file(args.capture, args.phase) if args.capture else None
    except OSError as exc:  # missing, unreadable
        print(f"kvmeter gpu: error: --capture {args.capture}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # CaptureFormatError: not an nvidia-smi capture
        print(f"kvmeter gpu: error: --capture {args.capture}: not an nvidia-smi capture ({exc})", file=sys.stderr)
        return EXIT_USAGE
    collector = NvmlCollector(nvml)
    status = collector.start()
    samples = collector.collect()
    events = collector.poll_xid(timeout_ms=args.xid_wait_ms)
    collector.close()
    if args.json:
        json.dump({"status": dataclasses.asdict(status),
                   "gpus": [dataclasses.asdict(s) for s in samples],
                   "xid_events": [dataclasses.asdict(e) for e in events]},
                  sys.stdout, indent=2, default=str)
        print()
    else:
        print(f"NVML: {status.state}" + (f" ({status.reason})" if status.reason else "")
              + (f", driver {status.driver_version}" if status.driver_version else ""))
        for s in samples:
            print(f"GPU {s.index} {s.name} {s.uuid}")
            print(f"  memory used/free/reserved/total: {_fmt(s.memory_used_bytes, ' GiB', 2**-30, 2)} / "
                  f"{_fmt(s.memory_free_bytes, ' GiB', 2**-30, 2)} / "
                  f"{_fmt(s.memory_reserved_bytes, ' GiB', 2**-30, 2)} / "
                  f"{_fmt(s.memory_total_bytes, ' GiB', 2**-30, 2)}")
            print(f"  utilization (coarse): {_fmt(s.utilization_gpu_ratio, '%', 100)}  "
                  f"SM active: {_fmt(s.sm_active_ratio, '%', 100)}  "
                  f"DRAM bw: {_fmt(s.dram_bandwidth_ratio, '%', 100)}")
            print(f"  power {_fmt(s.power_watts, ' W')} / {_fmt(s.power_limit_watts, ' W')}  "
                  f"temp {_fmt(s.temperature_gpu_celsius, ' C', digits=0)} "
                  f"(mem {_fmt(s.temperature_memory_celsius, ' C', digits=0)})  "
                  f"clock events: {', '.join(s.active_clock_event_reasons or ()) or 'none'}")
            for m in s.mig:
                print(f"  MIG {m.mig_index} {m.profile} GI {m.gpu_instance_id}: "
                      f"{_fmt(m.memory_used_bytes, ' GiB', 2**-30, 2)} / "
                      f"{_fmt(m.memory_total_bytes, ' GiB', 2**-30, 2)}, {m.sm_count} SMs")
            for p in s.processes:
                print(f"  pid {p.pid} {p.name}: {_fmt(p.used_memory_bytes, ' MiB', 2**-20, 0)}")
        for e in events:
            print(f"XID {e.xid} on GPU {e.gpu_index}")
    if args.require_gpu and status.state != "ok":
        return EXIT_NO_GPU
    return 0
