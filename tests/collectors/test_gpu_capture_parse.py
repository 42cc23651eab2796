"""Parsing of every real nvidia-smi capture: right values, "[N/A]" stays missing, quirks kept."""

from __future__ import annotations

import pytest

from kvmeter.collectors.gpu.capture import (
    CaptureFormatError,
    load_capture,
    parse_na,
    parse_quantity,
    parse_query_gpu_csv,
    split_sections,
)

H100 = "nvidia_smi/linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"
H100_MIG = "nvidia_smi/linux-x86_64__nvidia-h100-mig__590.48.01.txt"
H200 = "nvidia_smi/linux-x86_64__nvidia-h200__590.48.01.txt"
A100_XML = "nvidia_smi/telegraf_a100-sxm4-v12.xml"


def gpu0(data_dir, name, phase="load"):
    return load_capture(data_dir / "gpu" / name, phase).gpus[0]


# values read off each capture's "nvidia-smi -q" by hand
EXPECTED = {
    (H100, "idle"): dict(name="NVIDIA H100 80GB HBM3", memory_total_mib=81559, memory_reserved_mib=479,
                         memory_used_mib=0, memory_free_mib=81081, utilization_gpu_pct=0.0,
                         utilization_memory_pct=0.0, temperature_gpu_c=41.0, temperature_memory_c=48.0,
                         power_draw_w=69.85, power_limit_w=700.0, pcie_tx_kb_s=352.0, pcie_rx_kb_s=329.0,
                         pcie_replays=9, mig_current=False),
    (H100, "load"): dict(memory_used_mib=19818, memory_free_mib=61263, utilization_gpu_pct=100.0,
                         utilization_memory_pct=11.0, temperature_gpu_c=59.0, temperature_memory_c=55.0,
                         power_draw_w=629.45, pcie_tx_kb_s=3092.0, pcie_rx_kb_s=6346.0),
    (H200, "load"): dict(name="NVIDIA H200", pci_bus_id="00000000:83:00.0", memory_total_mib=143771,
                         memory_reserved_mib=614, memory_used_mib=32362, memory_free_mib=110796,
                         utilization_gpu_pct=100.0, utilization_memory_pct=7.0, temperature_gpu_c=52.0,
                         temperature_memory_c=41.0, power_draw_w=627.32, power_limit_w=700.0,
                         pcie_tx_kb_s=4217.0, pcie_rx_kb_s=8691.0, pcie_replays=0),
    (H100_MIG, "load"): dict(mig_current=True, mig_pending=True, memory_total_mib=81559,
                             memory_used_mib=11125, memory_free_mib=69956, utilization_gpu_pct=None,
                             utilization_memory_pct=None, temperature_gpu_c=53.0,
                             temperature_memory_c=58.0, power_draw_w=432.21, remapped_rows=None,
                             nvlink_link_gb_s=None, pcie_tx_kb_s=9139.0, pcie_rx_kb_s=19191.0),
    (H100_MIG, "idle"): dict(utilization_gpu_pct=None, memory_used_mib=59, power_draw_w=71.27),
    (A100_XML, "load"): dict(name="NVIDIA A100-SXM4-80GB", uuid="GPU-513536b6-7d19-9063-b049-1e69664bb298",
                             memory_total_mib=81920, memory_reserved_mib=869, memory_used_mib=50,
                             memory_free_mib=80999, utilization_gpu_pct=None, utilization_memory_pct=None,
                             temperature_gpu_c=27.0, temperature_memory_c=44.0, power_draw_w=67.03,
                             power_limit_w=500.0, remapped_rows=None, mig_current=True,
                             pcie_tx_kb_s=4000.0, pcie_rx_kb_s=0.0),
}


@pytest.mark.parametrize("name,phase", sorted(EXPECTED))
def test_values_match_the_capture(data_dir, name, phase):
    gpu = gpu0(data_dir, name, phase)
    for field, expected in EXPECTED[(name, phase)].items():
        assert getattr(gpu, field) == expected, field


def test_na_stays_missing_under_mig(data_dir):
    """utilization.gpu is [N/A] under MIG: missing, never 0 — in -q and in the CSV alike."""
    gpu = gpu0(data_dir, H100_MIG)
    assert gpu.utilization_gpu_pct is None and gpu.utilization_memory_pct is None
    text = (data_dir / "gpu" / H100_MIG).read_text()
    row = parse_query_gpu_csv(split_sections(text)[("load", "query-gpu (csv, what the exporter parses)")])[0]
    assert row["utilization.gpu"] is None and row["memory.total"] == "81559 MiB"


@pytest.mark.parametrize("name", [H100, H200, H100_MIG])
@pytest.mark.parametrize("phase", ["idle", "load"])
def test_memory_adds_up_to_total_plus_one_mib(data_dir, name, phase):
    """SOURCES.md quirk: used + reserved + free = total + 1 MiB (nvidia-smi rounds each)."""
    g = gpu0(data_dir, name, phase)
    assert g.memory_used_mib + g.memory_reserved_mib + g.memory_free_mib == g.memory_total_mib + 1


def test_a100_xml_memory_rounding_differs(data_dir):
    """The A100 XML rounds the other way (−2 MiB), and its MIG slices −1 MiB: kept as printed."""
    g = gpu0(data_dir, A100_XML)
    assert g.memory_used_mib + g.memory_reserved_mib + g.memory_free_mib == g.memory_total_mib - 2
    assert [m.memory_used_mib + m.memory_free_mib - m.memory_total_mib for m in g.migs] == [-1] * 4


@pytest.mark.parametrize("name,used", [(H100, 19818), (H200, 32362), (H100_MIG, 11125)])
def test_per_process_memory_sums_below_device_used(data_dir, name, used):
    g = gpu0(data_dir, name)
    assert len(g.processes) == 3
    assert sum(p.used_memory_mib for p in g.processes) < used == g.memory_used_mib


def test_processes_of_the_h200(data_dir):
    procs = gpu0(data_dir, H200).processes
    assert [(p.pid, p.name, p.used_memory_mib, p.gpu_instance_id) for p in procs] == [
        (10291, "/root/tools/memhog", 2566, None),
        (10293, "/root/tools/memhog", 1542, None),
        (10309, "./gpu_burn", 28234, None)]


def test_mig_devices_with_profiles_from_the_listing(data_dir):
    g = gpu0(data_dir, H100_MIG)
    assert [(m.index, m.gpu_instance_id, m.profile, m.sm_count, m.memory_total_mib) for m in g.migs] == [
        (0, 2, "3g.40gb", 60, 40448), (1, 3, "2g.20gb", 32, 20096),
        (2, 9, "1g.10gb", 16, 9984), (3, 10, "1g.10gb", 16, 9984)]
    assert g.migs[0].memory_used_mib == 11091 and g.migs[0].uuid == "MIG-00000000-0000-0000-0000-000000000000"
    assert {p.gpu_instance_id for p in g.processes} == {2}


def test_a100_xml_declares_four_gpus_but_holds_one(data_dir):
    system = load_capture(data_dir / "gpu" / A100_XML)
    assert system.declared_gpu_count == 4 and len(system.gpus) == 1
    assert system.driver_version == "535.54.03"
    g = system.gpus[0]
    assert g.clocks_mhz == {"graphics": 1275.0, "sm": 1275.0, "memory": 1593.0, "video": 1275.0}
    assert g.max_clocks_mhz["sm"] == 1410.0
    assert g.clock_event_counters_us == {}  # v12 XML has no counters: absent, not 0
    assert [m.gpu_instance_id for m in g.migs] == [3, 4, 5, 6] and g.migs[0].profile is None


def test_clock_event_reasons_idle_vs_load(data_dir):
    idle, load = gpu0(data_dir, H200, "idle"), gpu0(data_dir, H200, "load")
    assert idle.clock_event_reasons["gpu_idle"] is True
    assert not any(load.clock_event_reasons.values())
    assert load.clock_event_counters_us["hw_thermal_slowdown"] == 0.0


def test_nvlink_links_only_outside_mig(data_dir):
    assert gpu0(data_dir, H200).nvlink_link_gb_s == [26.562] * 18
    assert gpu0(data_dir, H100_MIG).nvlink_link_gb_s is None


@pytest.mark.parametrize("name", [H100, H200, H100_MIG])
def test_query_text_agrees_with_query_gpu_csv(data_dir, name):
    """Two views of the same GPU in one capture: identity and static limits must agree."""
    text = (data_dir / "gpu" / name).read_text()
    row = parse_query_gpu_csv(split_sections(text)[("load", "query-gpu (csv, what the exporter parses)")])[0]
    g = gpu0(data_dir, name)
    assert row["name"] == g.name and row["pci.bus_id"] == g.pci_bus_id
    assert parse_quantity(row["memory.total"], "MiB") == g.memory_total_mib
    assert parse_quantity(row["memory.reserved"], "MiB") == g.memory_reserved_mib
    assert parse_quantity(row["enforced.power.limit"], "W") == g.power_limit_w
    assert parse_quantity(row["clocks.max.sm"], "MHz") == g.max_clocks_mhz["sm"]


def test_value_parsing():
    assert parse_na("[N/A]") is None and parse_na(" N/A ") is None
    assert parse_na("[Requested functionality has been deprecated]") is None
    assert parse_na("P0") == "P0"
    assert parse_quantity("53 C", "C") == 53.0 and parse_quantity("16x") == 16.0
    assert parse_quantity("[Not Supported]", "W") is None
    with pytest.raises(CaptureFormatError, match="unit"):
        parse_quantity("700.00 W", "MiB")
    with pytest.raises(CaptureFormatError, match="number"):
        parse_quantity("hot", "C")


def test_bad_input_is_a_clear_error(tmp_path, data_dir):
    junk = tmp_path / "junk.txt"
    junk.write_text("this is not a capture\n")
    with pytest.raises(CaptureFormatError, match="no 'load :: query"):
        load_capture(junk)
    bad_xml = tmp_path / "bad.xml"
    bad_xml.write_text("<?xml version='1.0'?><nvidia_smi_log><gpu>")
    with pytest.raises(CaptureFormatError, match="not XML"):
        load_capture(bad_xml)
    with pytest.raises(CaptureFormatError, match="have \\['idle', 'load'\\]"):
        load_capture(data_dir / "gpu" / H200, phase="burst")
