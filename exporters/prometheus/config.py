"""Settings of the Prometheus exporter: explicit argument, then environment variable, then default."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

__all__ = ["PrometheusConfig"]

_ENV = {
    "top_k_tenants": "KVMETER_PROM_TOP_K_TENANTS",
    "tenant_half_life_s": "KVMETER_PROM_TENANT_HALF_LIFE_S",
    "tenant_refresh_s": "KVMETER_PROM_TENANT_REFRESH_S",
    "tenant_hysteresis": "KVMETER_PROM_TENANT_HYSTERESIS",
    "model": "KVMETER_PROM_MODEL",
}


@dataclass(frozen=True, slots=True)
class PrometheusConfig:
    """How the exporter labels and bounds its series.

    Attributes:
        top_k_tenants: tenants with their own ``tenant`` label (the rest are ``other``); ≥ 0.
        tenant_half_life_s: half-life of the tenant work score, seconds.
        tenant_refresh_s: how often the top-K set is recomputed, seconds.
        tenant_hysteresis: how much an incumbent may fall below the K-th score before losing
            its label (0.2 = 20 %).
        model: ``model`` label value of the locally hosted engine (its served model name).
    """

    top_k_tenants: int = 20
    tenant_half_life_s: float = 300.0
    tenant_refresh_s: float = 15.0
    tenant_hysteresis: float = 0.2
    model: str = ""

    def __post_init__(self) -> None:
        if self.top_k_tenants < 0:
            raise ValueError(f"top_k_tenants must be >= 0, got {self.top_k_tenants}")
        if self.tenant_half_life_s <= 0 or self.tenant_refresh_s < 0 or self.tenant_hysteresis < 0:
            raise ValueError(f"invalid tenant settings in {self}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "PrometheusConfig":
        """Build from ``overrides``, then ``KVMETER_PROM_*`` variables, then the defaults.

        Raises:
            ValueError: naming the variable whose value is not a number.
        """
        env = os.environ if env is None else env
        values = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, var in _ENV.items():
            if name in overrides:
                values[name] = overrides[name]
            elif var in env:
                raw = env[var]
                kind = {"int": int, "float": float}.get(str(types[name]), str)
                try:
                    values[name] = kind(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not a valid {kind.__name__}") from None
        return cls(**values)
