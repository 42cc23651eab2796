"""Who is looking, and the tier promises the pages draw against.

A :class:`Viewer` is the signed-in API key as the dashboards see it: a tenant key reads only its
own tenant, an admin key reads every tenant. :class:`TierInfo` is one tier's fairness weight and
latency SLOs (from the tenancy config, :class:`~kvmeter.serving.tenancy.TierPolicy`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvmeter.serving.tenancy import Principal, TenantDirectory

__all__ = ["Viewer", "TierInfo", "tiers_of"]


@dataclass(frozen=True, slots=True)
class Viewer:
    """The principal behind the dashboard session.

    Attributes:
        tenant_id: the key's tenant (its organisation).
        tier: the key's tier.
        api_key_id: the key's public id (never the secret).
        admin: True for keys that read every tenant.
    """

    tenant_id: str
    tier: str
    api_key_id: str
    admin: bool = False

    @classmethod
    def from_principal(cls, principal: Principal) -> "Viewer":
        """The viewer of an authenticated :class:`~kvmeter.serving.tenancy.Principal`."""
        return cls(tenant_id=principal.tenant_id, tier=principal.tier, api_key_id=principal.api_key_id,
                   admin=principal.admin)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Viewer":
        return cls(tenant_id=str(data["tenant_id"]), tier=str(data.get("tier", "")),
                   api_key_id=str(data.get("api_key_id", "")), admin=bool(data.get("admin", False)))

    @property
    def label(self) -> str:
        """One line for the sidebar: ``admin (platform-admin)`` or ``acme · enterprise``."""
        return f"admin ({self.api_key_id})" if self.admin else f"{self.tenant_id} · {self.tier}"


@dataclass(frozen=True, slots=True)
class TierInfo:
    """One tier's fairness weight and latency promises.

    Attributes:
        name: tier name.
        weight: fairness weight (> 0); a tenant's fair share of service is ∝ its weight (weighted
            VTC, Sheng et al., OSDI 2024).
        ttft_slo_s: time-to-first-token SLO, seconds, or ``None`` (no promise).
        itl_slo_s: mean inter-token-latency SLO, seconds, or ``None``.
        priority: engine priority (lower runs first).
    """

    name: str
    weight: float = 1.0
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    priority: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TierInfo":
        def opt(v: Any) -> float | None:
            return None if v is None else float(v)

        return cls(name=str(data["name"]), weight=float(data.get("weight", 1.0)),
                   ttft_slo_s=opt(data.get("ttft_slo_s")), itl_slo_s=opt(data.get("itl_slo_s")),
                   priority=int(data.get("priority", 0)))


def tiers_of(directory: TenantDirectory) -> list[TierInfo]:
    """Every tier of a tenancy directory, most protected (lowest priority number) first."""
    out = []
    for name, policy in directory.snapshot.tiers.items():
        out.append(TierInfo(name=name, weight=float(policy.weight), ttft_slo_s=policy.ttft_slo_s,
                            itl_slo_s=policy.itl_slo_s, priority=int(policy.priority)))
    return sorted(out, key=lambda t: (t.priority, t.name))
