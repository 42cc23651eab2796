"""DCGM exporter expositions (real captures) → GpuSample; DCGM blank sentinels stay missing."""

from __future__ import annotations

import pytest

from kvmeter.collectors.gpu.dcgm import DcgmParseError, gpu_samples_from_dcgm, is_dcgm_blank


def _readme_exposition(text: str) -> str:
    """The README sample is Markdown around two exposition excerpts: keep the exposition lines."""
    return "\n".join(line for line in text.splitlines()
                     if line.startswith(("# HELP", "# TYPE", "DCGM_")))


def test_v100_issue_capture(data_dir):
    samples = gpu_samples_from_dcgm((data_dir / "gpu/dcgm/dcgm_v100_4gpu_issue250.prom").read_text())
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert {s.name for s in samples} == {"Tesla V100-SXM2-32GB"}
    assert samples[1].uuid == "GPU-8d5053b3-9280-7d1a-751b-4fd2fdd547c5"
    assert [s.power_limit_watts for s in samples] == [None, None, 300.0, 300.0]  # excerpt: only GPUs 2, 3
    assert [s.pcie_replays for s in samples] == [0, 0, 0, 0]
    assert samples[0].utilization_gpu_ratio == 0.0  # a real 0 %
    assert samples[1].utilization_gpu_ratio is None  # not in the excerpt: missing


def test_readme_sample_blank_memory_temperature(data_dir):
    text = _readme_exposition((data_dir / "gpu/dcgm/dcgm-exporter_README_sample_metrics.txt").read_text())
    (sample,) = gpu_samples_from_dcgm(text)
    assert sample.uuid == "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
    assert sample.clocks_hz == {"sm": 139e6, "memory": 405e6}  # MHz → Hz, same as the NVML path
    assert sample.temperature_memory_celsius is None  # 9223372036854775794 = DCGM NOT_SUPPORTED


def test_blank_sentinels():
    assert is_dcgm_blank(9223372036854775794)  # INT64_BLANK + 2, exact int from the parser
    assert is_dcgm_blank(float(9223372036854775794))
    assert is_dcgm_blank(0x7FFFFFF0) and is_dcgm_blank(0x7FFFFFF2)  # INT32 blank / not supported
    assert is_dcgm_blank(140737488355328.0)  # FP64 blank
    assert not is_dcgm_blank(300.0) and not is_dcgm_blank(0) and not is_dcgm_blank(2**31 - 100)


def test_units_are_converted():
    text = "\n".join([
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-x"} 1024',
        'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-x"} 2048',
        'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-x"} 1500000',
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-x"} 37',
        'DCGM_FI_PROF_SM_ACTIVE{gpu="0",UUID="GPU-x"} 0.62',
        'DCGM_FI_DEV_NEW_THING{gpu="0",UUID="GPU-x"} 5',
        'unrelated_metric 1', ''])
    (s,) = gpu_samples_from_dcgm(text, wall_ts=12.0)
    assert s.memory_used_bytes == 1024 * 2**20 and s.memory_free_bytes == 2048 * 2**20
    assert s.energy_joules == 1500.0 and s.utilization_gpu_ratio == pytest.approx(0.37)
    assert s.sm_active_ratio == 0.62 and s.wall_ts == 12.0


def test_garbage_is_a_clear_error():
    with pytest.raises(DcgmParseError):
        gpu_samples_from_dcgm('DCGM_FI_DEV_GPU_TEMP{gpu="0" 41\n')
