"""Parse real nvidia-smi captures into plain records (the data behind :mod:`.capture_nvml`).

Two capture formats are read:

* the ``nvidia_gpu_exporter`` capture files (``linux-x86_64__<gpu>__<driver>.txt``): sections
  headed ``# <phase> :: <name>`` (phases ``capabilities``, ``idle``, ``load``) holding the output
  of ``nvidia-smi -q``, ``-L``, ``nvlink -s`` and the ``--query-gpu`` CSV;
* ``nvidia-smi -q -x`` XML (DTD v12, as in telegraf's test data).

Both become a :class:`CapturedSystem` of :class:`CapturedGpu` records whose values are numbers
in nvidia-smi's own units (MiB, °C, W, MHz, KB/s, µs) or ``None`` where nvidia-smi printed
``N/A``, ``[N/A]``, ``Not Supported`` or "Requested functionality has been deprecated". No value
is ever guessed: a reading the capture does not hold stays ``None``.

Raises :class:`CaptureFormatError` (a ``ValueError``) on text that is not such a capture.
"""

from __future__ import annotations

import csv
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CaptureFormatError",
    "QueryNode",
    "CapturedProcess",
    "CapturedMig",
    "CapturedGpu",
    "CapturedSystem",
    "parse_na",
    "parse_quantity",
    "split_sections",
    "parse_query_tree",
    "parse_query_text",
    "parse_query_xml",
    "parse_query_gpu_csv",
    "load_capture",
]


class CaptureFormatError(ValueError):
    """The text is not a capture this module understands (names the part that failed)."""


#: What nvidia-smi prints for "no value" (bracketed in CSV output, bare in -q / XML).
_MISSING = {
    "n/a", "not supported", "requested functionality has been deprecated", "unknown error",
    "insufficient permissions", "not available", "",
}


def parse_na(raw: str | None) -> str | None:
    """``raw`` stripped, or ``None`` if it is one of nvidia-smi's "no value" spellings."""
    if raw is None:
        return None
    text = raw.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip()
    return None if text.lower() in _MISSING else text


_QUANTITY = re.compile(r"^(-?\d+(?:\.\d+)?)\s*(.*)$")


def parse_quantity(raw: str | None, unit: str | None = None) -> float | None:
    """Parse ``"53 C"`` / ``"700.00 W"`` / ``"16x"`` into a float; "no value" → ``None``.

    Args:
        raw: the printed value.
        unit: the unit the value must carry (``"MiB"``, ``"C"``, ``"W"``, ``"MHz"``, ``"KB/s"``,
            ``"us"``, ``"%"``...); ``None`` accepts any unit, ``""`` requires none.
    Raises:
        CaptureFormatError: if the text is neither a number nor a "no value" spelling, or
            carries another unit than ``unit``.
    """
    text = parse_na(raw)
    if text is None:
        return None
    m = _QUANTITY.match(text)
    if not m:
        raise CaptureFormatError(f"expected a number, got {raw!r}")
    if unit is not None and m.group(2).strip() != unit:
        raise CaptureFormatError(f"expected unit {unit!r} in {raw!r}")
    return float(m.group(1))


def _int(raw: str | None, unit: str | None = None) -> int | None:
    value = parse_quantity(raw, unit)
    return None if value is None else int(value)


def _sum_known(values: list[int | None]) -> int | None:
    """The sum of ``values``, or None when any of them is missing."""
    known = [v for v in values if v is not None]
    return sum(known) if len(known) == len(values) else None


def _yes_no(raw: str | None) -> bool | None:
    text = parse_na(raw)
    if text is None:
        return None
    low = text.lower()
    if low in ("yes", "enabled", "active"):
        return True
    if low in ("no", "disabled", "not active"):
        return False
    raise CaptureFormatError(f"expected yes/no, enabled/disabled or active/not active, got {raw!r}")


# --------------------------------------------------------------------------------------------
# records


@dataclass(slots=True)
class CapturedProcess:
    """A process line of ``nvidia-smi -q`` ("Processes")."""

    pid: int
    name: str | None
    used_memory_mib: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(slots=True)
class CapturedMig:
    """A "MIG Device" block of ``nvidia-smi -q`` (plus its ``-L`` line for UUID and profile)."""

    index: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
    sm_count: int | None
    memory_total_mib: int | None
    memory_reserved_mib: int | None
    memory_used_mib: int | None
    memory_free_mib: int | None
    uuid: str | None = None
    profile: str | None = None


@dataclass(slots=True)
class CapturedGpu:
    """One GPU as nvidia-smi printed it. Units: MiB, °C, W, MHz, KB/s, µs, percent."""

    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    mig_current: bool | None = None
    mig_pending: bool | None = None
    memory_total_mib: int | None = None
    memory_reserved_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    utilization_gpu_pct: float | None = None
    utilization_memory_pct: float | None = None
    temperature_gpu_c: float | None = None
    temperature_memory_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    clocks_mhz: dict[str, float | None] = field(default_factory=dict)
    max_clocks_mhz: dict[str, float | None] = field(default_factory=dict)
    clock_event_reasons: dict[str, bool | None] = field(default_factory=dict)
    clock_event_counters_us: dict[str, float | None] = field(default_factory=dict)
    ecc_errors: dict[tuple[str, str], int | None] = field(default_factory=dict)
    remapped_rows: tuple[int | None, int | None, bool | None, bool | None] | None = None
    pcie_tx_kb_s: float | None = None
    pcie_rx_kb_s: float | None = None
    pcie_replays: int | None = None
    nvlink_link_gb_s: list[float] | None = None
    processes: list[CapturedProcess] = field(default_factory=list)
    migs: list[CapturedMig] = field(default_factory=list)


@dataclass(slots=True)
class CapturedSystem:
    """All GPUs of one capture phase.

    ``declared_gpu_count`` is the "Attached GPUs" line; captures may hold fewer GPU blocks than
    declared (telegraf's A100 file declares 4 and holds 1) — ``gpus`` is what is really there.
    """

    source: str
    phase: str
    driver_version: str | None
    cuda_version: str | None
    declared_gpu_count: int | None
    gpus: list[CapturedGpu]


# --------------------------------------------------------------------------------------------
# capture file sections

_RULE = re.compile(r"^#{20,}\s*$")
_TITLE = re.compile(r"^#\s*(?P<phase>[\w-]+)\s*::\s*(?P<name>.+?)\s*$")


def split_sections(text: str) -> dict[tuple[str, str], str]:
    """Split an nvidia_gpu_exporter capture into ``{(phase, name): body}``.

    A section starts with a ``####`` rule, one or more ``# <phase> :: <name>`` / ``# $ cmd``
    comment lines and another rule; its body runs to the next rule.
    """
    lines = text.splitlines()
    sections: dict[tuple[str, str], str] = {}
    i = 0
    current: tuple[str, str] | None = None
    body: list[str] = []
    while i < len(lines):
        if _RULE.match(lines[i]):
            j = i + 1
            title = None
            while j < len(lines) and lines[j].startswith("#") and not _RULE.match(lines[j]):
                m = _TITLE.match(lines[j])
                if m and title is None:
                    title = (m.group("phase"), m.group("name"))
                j += 1
            if j < len(lines) and _RULE.match(lines[j]):
                if current is not None:
                    sections[current] = "\n".join(body)
                current, body = title, []
                i = j + 1
                continue
        if current is not None:
            body.append(lines[i])
        i += 1
    if current is not None:
        sections[current] = "\n".join(body)
    return sections


# --------------------------------------------------------------------------------------------
# nvidia-smi -q text


@dataclass(slots=True)
class QueryNode:
    """One line of ``nvidia-smi -q``: ``key : value`` with the lines indented below it."""

    key: str
    value: str | None
    children: list["QueryNode"] = field(default_factory=list)

    def child(self, *path: str) -> "QueryNode | None":
        """The first descendant along ``path`` (keys compared exactly), or ``None``."""
        node: QueryNode | None = self
        for key in path:
            node = next((c for c in node.children if c.key == key), None) if node else None
        return node

    def get(self, *path: str) -> str | None:
        """The value at ``path`` (``None`` if the line is absent or has no value)."""
        node = self.child(*path)
        return node.value if node else None

    def all(self, key: str) -> list["QueryNode"]:
        """Every direct child called ``key``."""
        return [c for c in self.children if c.key == key]


_KV = re.compile(r"^(?P<key>\S.*?)\s+:(?:\s(?P<value>.*))?$")


def parse_query_tree(text: str) -> QueryNode:
    """Parse ``nvidia-smi -q`` output into a tree of :class:`QueryNode` by indentation."""
    root = QueryNode("", None)
    stack: list[tuple[int, QueryNode]] = [(-1, root)]
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("="):
            continue
        indent = len(line) - len(line.lstrip())
        m = _KV.match(stripped)
        node = (QueryNode(m.group("key").strip(), (m.group("value") or "").strip())
                if m else QueryNode(stripped, None))
        while stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return root


_CLOCK_DOMAINS = {"Graphics": "graphics", "SM": "sm", "Memory": "memory", "Video": "video"}
_REASONS = {
    "Idle": "gpu_idle",
    "Applications Clocks Setting": "applications_clocks_setting",
    "SW Power Cap": "sw_power_cap",
    "HW Slowdown": "hw_slowdown",
    "HW Thermal Slowdown": "hw_thermal_slowdown",
    "HW Power Brake Slowdown": "hw_power_brake_slowdown",
    "Sync Boost": "sync_boost",
    "SW Thermal Slowdown": "sw_thermal_slowdown",
    "Display Clock Setting": "display_clock_setting",
}
_REASON_COUNTERS = {
    "SW Power Capping": "sw_power_cap",
    "Sync Boost": "sync_boost",
    "SW Thermal Slowdown": "sw_thermal_slowdown",
    "HW Thermal Slowdown": "hw_thermal_slowdown",
    "HW Power Braking": "hw_power_brake_slowdown",
}


def _walk(node: QueryNode):
    for child in node.children:
        yield child
        yield from _walk(child)


def _gpu_from_query(index: int, node: QueryNode) -> CapturedGpu:
    gpu = CapturedGpu(index=index)
    gpu.name = parse_na(node.get("Product Name"))
    gpu.uuid = parse_na(node.get("GPU UUID"))
    gpu.pci_bus_id = parse_na(node.get("PCI", "Bus Id")) or node.key.split(" ", 1)[-1]
    gpu.mig_current = _yes_no(node.get("MIG Mode", "Current"))
    gpu.mig_pending = _yes_no(node.get("MIG Mode", "Pending"))
    fb = node.child("FB Memory Usage")
    if fb:
        gpu.memory_total_mib = _int(fb.get("Total"), "MiB")
        gpu.memory_reserved_mib = _int(fb.get("Reserved"), "MiB")
        gpu.memory_used_mib = _int(fb.get("Used"), "MiB")
        gpu.memory_free_mib = _int(fb.get("Free"), "MiB")
    gpu.utilization_gpu_pct = parse_quantity(node.get("Utilization", "GPU"), "%")
    gpu.utilization_memory_pct = parse_quantity(node.get("Utilization", "Memory"), "%")
    gpu.temperature_gpu_c = parse_quantity(node.get("Temperature", "GPU Current Temp"), "C")
    gpu.temperature_memory_c = parse_quantity(node.get("Temperature", "Memory Current Temp"), "C")
    power = node.child("GPU Power Readings")
    if power:
        # nvidia-smi's power.draw equals power.draw.average on this driver (see the CSV)
        gpu.power_draw_w = parse_quantity(power.get("Average Power Draw") or power.get("Power Draw"), "W")
        gpu.power_limit_w = parse_quantity(power.get("Current Power Limit"), "W")
    for section, target in (("Clocks", gpu.clocks_mhz), ("Max Clocks", gpu.max_clocks_mhz)):
        clocks = node.child(section)
        for child in clocks.children if clocks else ():
            if child.key in _CLOCK_DOMAINS:
                target[_CLOCK_DOMAINS[child.key]] = parse_quantity(child.value, "MHz")
    reasons = node.child("Clocks Event Reasons")
    if reasons:
        for child in _walk(reasons):
            if child.key in _REASONS:
                gpu.clock_event_reasons[_REASONS[child.key]] = _yes_no(child.value)
    counters = node.child("Clocks Event Reasons Counters")
    for child in counters.children if counters else ():
        if child.key in _REASON_COUNTERS:
            gpu.clock_event_counters_us[_REASON_COUNTERS[child.key]] = parse_quantity(child.value, "us")
    ecc = node.child("ECC Errors")
    for scope in ("Volatile", "Aggregate"):
        block = ecc.child(scope) if ecc else None
        if block is None:
            continue
        corrected = [_int(block.get(k)) for k in ("SRAM Correctable", "DRAM Correctable")]
        uncorrected = [_int(block.get(k)) for k in (
            "SRAM Uncorrectable Parity", "SRAM Uncorrectable SEC-DED", "DRAM Uncorrectable")]
        for kind, values in (("corrected", corrected), ("uncorrected", uncorrected)):
            gpu.ecc_errors[(kind, scope.lower())] = _sum_known(values)
    remap = node.child("Remapped Rows")
    if remap is not None and remap.children:
        gpu.remapped_rows = (
            _int(remap.get("Correctable Error")), _int(remap.get("Uncorrectable Error")),
            _yes_no(remap.get("Pending")), _yes_no(remap.get("Remapping Failure Occurred")))
    gpu.pcie_tx_kb_s = parse_quantity(node.get("PCI", "Tx Throughput"), "KB/s")
    gpu.pcie_rx_kb_s = parse_quantity(node.get("PCI", "Rx Throughput"), "KB/s")
    gpu.pcie_replays = _int(node.get("PCI", "Replays Since Reset"), "")
    for mig in node.all("MIG Device"):
        fbm = mig.child("Shared FB Memory Usage")
        gpu.migs.append(CapturedMig(
            index=_int(mig.get("Index"), "") or 0,
            gpu_instance_id=_int(mig.get("GPU Instance ID"), ""),
            compute_instance_id=_int(mig.get("Compute Instance ID"), ""),
            sm_count=_int(mig.get("Device Attributes", "Shared", "Multiprocessor count"), ""),
            memory_total_mib=_int(fbm.get("Total"), "MiB") if fbm else None,
            memory_reserved_mib=_int(fbm.get("Reserved"), "MiB") if fbm else None,
            memory_used_mib=_int(fbm.get("Used"), "MiB") if fbm else None,
            memory_free_mib=_int(fbm.get("Free"), "MiB") if fbm else None,
        ))
    procs = node.child("Processes")
    current: dict[str, int | None] = {}
    for child in procs.children if procs else ():
        if child.key == "GPU instance ID":
            current = {"gi": _int(child.value, "")}
        elif child.key == "Compute instance ID":
            current["ci"] = _int(child.value, "")
        elif child.key == "Process ID":
            gpu.processes.append(CapturedProcess(
                pid=int(child.value or 0),
                name=parse_na(child.get("Name")),
                used_memory_mib=_int(child.get("Used GPU Memory"), "MiB"),
                gpu_instance_id=current.get("gi"),
                compute_instance_id=current.get("ci"),
            ))
    return gpu


def parse_query_text(text: str, *, source: str = "", phase: str = "") -> CapturedSystem:
    """Parse the text of ``nvidia-smi -q`` (every GPU block)."""
    root = parse_query_tree(text)
    gpu_nodes = [c for c in root.children if c.key.startswith("GPU ") and c.value is None]
    if not gpu_nodes:
        raise CaptureFormatError(f"no 'GPU <bus id>' block in the -q text of {source or 'input'}")
    return CapturedSystem(
        source=source, phase=phase,
        driver_version=parse_na(root.get("Driver Version")),
        cuda_version=parse_na(root.get("CUDA Version")),
        declared_gpu_count=_int(root.get("Attached GPUs"), ""),
        gpus=[_gpu_from_query(i, n) for i, n in enumerate(gpu_nodes)],
    )


# --------------------------------------------------------------------------------------------
# other sections: -L, nvlink -s, --query-gpu CSV

_LIST_MIG = re.compile(r"^\s+MIG\s+(?P<profile>\S+)\s+Device\s+(?P<idx>\d+):\s*\(UUID:\s*(?P<uuid>[^)]+)\)")
_LIST_GPU = re.compile(r"^GPU\s+(?P<idx>\d+):.*\(UUID:\s*(?P<uuid>[^)]+)\)")
_LINK = re.compile(r"^\s*Link\s+(?P<link>\d+):\s*(?P<speed>.+?)\s*$")


def _apply_list(text: str, system: CapturedSystem) -> None:
    gpu: CapturedGpu | None = None
    for line in text.splitlines():
        if m := _LIST_GPU.match(line):
            idx = int(m.group("idx"))
            gpu = system.gpus[idx] if idx < len(system.gpus) else None
        elif (m := _LIST_MIG.match(line)) and gpu is not None:
            for mig in gpu.migs:
                if mig.index == int(m.group("idx")):
                    mig.profile, mig.uuid = m.group("profile"), m.group("uuid").strip()


def _apply_nvlink(text: str, system: CapturedSystem) -> None:
    gpu: CapturedGpu | None = None
    for line in text.splitlines():
        if m := _LIST_GPU.match(line):
            idx = int(m.group("idx"))
            gpu = system.gpus[idx] if idx < len(system.gpus) else None
            if gpu is not None:
                gpu.nvlink_link_gb_s = []
        elif gpu is not None and "not supported" in line.lower():
            gpu.nvlink_link_gb_s = None
        elif gpu is not None and gpu.nvlink_link_gb_s is not None and (m := _LINK.match(line)):
            speed = parse_quantity(m.group("speed"), "GB/s")
            if speed is not None:
                gpu.nvlink_link_gb_s.append(speed)


def parse_query_gpu_csv(text: str) -> list[dict[str, str | None]]:
    """Rows of ``nvidia-smi --query-gpu=... --format=csv``, keyed by property (unit suffix
    dropped), values stripped, "no value" spellings → ``None``."""
    rows = list(csv.reader(line for line in text.splitlines() if line.strip()))
    if not rows:
        return []
    header = [h.strip().split(" [", 1)[0] for h in rows[0]]
    out = []
    for row in rows[1:]:
        if len(row) != len(header):
            raise CaptureFormatError(f"query-gpu row has {len(row)} fields, header {len(header)}")
        out.append({k: parse_na(v) for k, v in zip(header, row, strict=True)})
    return out


# --------------------------------------------------------------------------------------------
# nvidia-smi -q -x (XML)


def _x(elem: ET.Element | None, path: str) -> str | None:
    if elem is None:
        return None
    found = elem.find(path)
    return None if found is None else (found.text or "")


def _first(elem: ET.Element, *paths: str) -> ET.Element | None:
    for path in paths:
        found = elem.find(path)
        if found is not None:
            return found
    return None


def _gpu_from_xml(index: int, g: ET.Element) -> CapturedGpu:
    gpu = CapturedGpu(index=index)
    gpu.name = parse_na(_x(g, "product_name"))
    gpu.uuid = parse_na(_x(g, "uuid"))
    gpu.pci_bus_id = parse_na(_x(g, "pci/pci_bus_id")) or g.get("id")
    gpu.mig_current = _yes_no(_x(g, "mig_mode/current_mig"))
    gpu.mig_pending = _yes_no(_x(g, "mig_mode/pending_mig"))
    gpu.memory_total_mib = _int(_x(g, "fb_memory_usage/total"), "MiB")
    gpu.memory_reserved_mib = _int(_x(g, "fb_memory_usage/reserved"), "MiB")
    gpu.memory_used_mib = _int(_x(g, "fb_memory_usage/used"), "MiB")
    gpu.memory_free_mib = _int(_x(g, "fb_memory_usage/free"), "MiB")
    gpu.utilization_gpu_pct = parse_quantity(_x(g, "utilization/gpu_util"), "%")
    gpu.utilization_memory_pct = parse_quantity(_x(g, "utilization/memory_util"), "%")
    gpu.temperature_gpu_c = parse_quantity(_x(g, "temperature/gpu_temp"), "C")
    gpu.temperature_memory_c = parse_quantity(_x(g, "temperature/memory_temp"), "C")
    power = _first(g, "gpu_power_readings", "power_readings")
    gpu.power_draw_w = parse_quantity(_x(power, "average_power_draw") or _x(power, "power_draw"), "W")
    gpu.power_limit_w = parse_quantity(_x(power, "current_power_limit") or _x(power, "power_limit"), "W")
    for section, target in (("clocks", gpu.clocks_mhz), ("max_clocks", gpu.max_clocks_mhz)):
        for tag, domain in (("graphics_clock", "graphics"), ("sm_clock", "sm"),
                            ("mem_clock", "memory"), ("video_clock", "video")):
            raw = _x(g, f"{section}/{tag}")
            if raw is not None:
                target[domain] = parse_quantity(raw, "MHz")
    reasons = _first(g, "clocks_event_reasons", "clocks_throttle_reasons")
    for elem in reasons if reasons is not None else ():
        name = re.sub(r"^clocks?_(event|throttle)_reason_", "", elem.tag)
        name = {"display_clocks_setting": "display_clock_setting"}.get(name, name)
        gpu.clock_event_reasons[name] = _yes_no(elem.text)
    for scope in ("volatile", "aggregate"):
        block = g.find(f"ecc_errors/{scope}")
        if block is None:
            continue
        def total(tags: tuple[str, ...], block: ET.Element = block) -> int | None:
            values = [_int(_x(block, t)) for t in tags if block.find(t) is not None]
            return _sum_known(values) if values else None
        gpu.ecc_errors[("corrected", scope)] = total(("sram_correctable", "dram_correctable"))
        gpu.ecc_errors[("uncorrected", scope)] = total(
            ("sram_uncorrectable", "sram_uncorrectable_parity", "sram_uncorrectable_secded",
             "dram_uncorrectable"))
    remap = g.find("remapped_rows")
    if remap is not None and len(remap):
        gpu.remapped_rows = (
            _int(_x(remap, "remapped_row_corr")), _int(_x(remap, "remapped_row_unc")),
            _yes_no(_x(remap, "remapped_row_pending")), _yes_no(_x(remap, "remapped_row_failure")))
    gpu.pcie_tx_kb_s = parse_quantity(_x(g, "pci/tx_util"), "KB/s")
    gpu.pcie_rx_kb_s = parse_quantity(_x(g, "pci/rx_util"), "KB/s")
    gpu.pcie_replays = _int(_x(g, "pci/replay_counter"), "")
    for m in g.findall("mig_devices/mig_device"):
        gpu.migs.append(CapturedMig(
            index=_int(_x(m, "index"), "") or 0,
            gpu_instance_id=_int(_x(m, "gpu_instance_id"), ""),
            compute_instance_id=_int(_x(m, "compute_instance_id"), ""),
            sm_count=_int(_x(m, "device_attributes/shared/multiprocessor_count"), ""),
            memory_total_mib=_int(_x(m, "fb_memory_usage/total"), "MiB"),
            memory_reserved_mib=_int(_x(m, "fb_memory_usage/reserved"), "MiB"),
            memory_used_mib=_int(_x(m, "fb_memory_usage/used"), "MiB"),
            memory_free_mib=_int(_x(m, "fb_memory_usage/free"), "MiB"),
        ))
    for p in g.findall("processes/process_info"):
        gpu.processes.append(CapturedProcess(
            pid=int(_x(p, "pid") or 0),
            name=parse_na(_x(p, "process_name")),
            used_memory_mib=_int(_x(p, "used_memory"), "MiB"),
            gpu_instance_id=_int(_x(p, "gpu_instance_id"), ""),
            compute_instance_id=_int(_x(p, "compute_instance_id"), ""),
        ))
    return gpu


def parse_query_xml(text: str, *, source: str = "") -> CapturedSystem:
    """Parse ``nvidia-smi -q -x`` output."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise CaptureFormatError(f"not XML ({source or 'input'}): {exc}") from exc
    if root.tag != "nvidia_smi_log":
        raise CaptureFormatError(f"root element is <{root.tag}>, expected <nvidia_smi_log>")
    return CapturedSystem(
        source=source, phase="",
        driver_version=parse_na(_x(root, "driver_version")),
        cuda_version=parse_na(_x(root, "cuda_version")),
        declared_gpu_count=_int(_x(root, "attached_gpus"), ""),
        gpus=[_gpu_from_xml(i, g) for i, g in enumerate(root.findall("gpu"))],
    )


# --------------------------------------------------------------------------------------------


def load_capture(path: str | Path, phase: str = "load") -> CapturedSystem:
    """Load one capture file.

    Args:
        path: an nvidia_gpu_exporter ``.txt`` capture or an ``nvidia-smi -q -x`` ``.xml`` file.
        phase: for ``.txt`` captures, ``idle`` or ``load`` (ignored for XML).
    Raises:
        CaptureFormatError: unknown format or missing ``<phase> :: query (-q)`` section.
        OSError: the file cannot be read.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("<?xml") or text.lstrip().startswith("<nvidia_smi_log"):
        return parse_query_xml(text, source=path.name)
    sections = split_sections(text)
    query = sections.get((phase, "query (-q)"))
    if query is None:
        phases = sorted({p for p, n in sections if n == "query (-q)"})
        raise CaptureFormatError(f"{path.name}: no '{phase} :: query (-q)' section (have {phases})")
    system = parse_query_text(query, source=path.name, phase=phase)
    if (listing := sections.get(("capabilities", "list (-L)"))) is not None:
        _apply_list(listing, system)
    if (nvlink := sections.get(("capabilities", "nvlink -s"))) is not None:
        _apply_nvlink(nvlink, system)
    return system
