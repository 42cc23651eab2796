"""Physical bounds on what one request's numbers can be.

Forward-pass compute of a dense decoder is ≈ ``2 · N`` FLOPs per token for ``N`` parameters
(Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1: ``C_forward ≈ 2N``; the
attention term is left out, which only lowers the bound). So:

* **TTFT floor**: a prefill of ``u`` uncached input tokens needs ≥ ``2 · N · u`` FLOPs; no device
  runs them faster than its peak, so ``TTFT ≥ 2 · N · u / peak``. A configured floor
  (``selfcheck.ttft_floor_s``) is a bound of its own: the floor is the larger of the two.
* **Output roofline**: generating one output token needs ≥ ``2 · N`` FLOPs, so no single request
  decodes faster than ``peak / (2 · N)`` tokens per second (a batch shares the peak: the bound
  holds for every request in it).

``peak_flops_per_s`` defaults to :data:`DEFAULT_PEAK_FLOPS_PER_S`, above any single accelerator's
dense peak today (H200 SXM: 989 TFLOP/s dense BF16, 1,979 TFLOP/s dense FP8, NVIDIA's datasheet),
so the default bounds hold on any device kvmeter can run on; set the device's real peak for a
tighter check. Without a parameter count (the instant engine, which computes nothing, or a remote
model of unknown size) only the configured floor applies and there is no roofline.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PhysicalBounds", "DEFAULT_PEAK_FLOPS_PER_S", "count_parameters"]

#: FLOP/s no single device reaches today (dense FP8 on an H200 is 1.979e15).
DEFAULT_PEAK_FLOPS_PER_S = 2.0e15


@dataclass(frozen=True, slots=True)
class PhysicalBounds:
    """The bounds of the module docstring.

    Attributes:
        model_params: the served model's parameter count, or ``None`` (unknown: no physics bound).
        peak_flops_per_s: the device's peak, FLOP/s (> 0).
        ttft_floor_s: a configured TTFT floor, seconds (≥ 0; 0: none).
    Raises:
        ValueError: on a non-positive peak or parameter count, or a negative floor.
    """

    model_params: int | None = None
    peak_flops_per_s: float = DEFAULT_PEAK_FLOPS_PER_S
    ttft_floor_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.peak_flops_per_s) and self.peak_flops_per_s > 0):
            raise ValueError(f"peak_flops_per_s must be > 0, got {self.peak_flops_per_s!r}")
        if self.model_params is not None and self.model_params <= 0:
            raise ValueError(f"model_params must be > 0, got {self.model_params!r}")
        if not (math.isfinite(self.ttft_floor_s) and self.ttft_floor_s >= 0):
            raise ValueError(f"ttft_floor_s must be ≥ 0, got {self.ttft_floor_s!r}")

    def ttft_floor(self, input_tokens: int, cached_input_tokens: int = 0) -> float:
        """The least TTFT, seconds, of a request with these input tokens (0 when no bound)."""
        floor = self.ttft_floor_s
        if self.model_params is not None:
            uncached = max(0, input_tokens - max(0, cached_input_tokens))
            floor = max(floor, 2.0 * self.model_params * uncached / self.peak_flops_per_s)
        return floor

    def output_roofline(self) -> float | None:
        """The most output tokens per second one request can be decoded at, or ``None``."""
        if self.model_params is None:
            return None
        return self.peak_flops_per_s / (2.0 * self.model_params)


def count_parameters(model_dir: str | Path) -> int | None:
    """The parameter count of a Hugging Face model directory, from its ``*.safetensors`` headers
    (the sum of every tensor's element count; the weights are not read), or ``None`` when the
    directory holds no readable safetensors file."""
    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for path in files:
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"])
    return total or None
