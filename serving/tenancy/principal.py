"""Principals and authentication: who is calling, and on whose bill.

A :class:`Principal` is the resolved identity of an API key: its path org → workspace → project →
key and its tier. The billed *tenant* is the organisation at the top of that path; its id is
``tenant_id`` (the one id of the tenant). :meth:`Principal.attribution` builds a request's
:class:`~kvmeter.attribution.Attribution` from it. API keys are kept only as SHA-256
digests and compared in constant time; the plain key never leaves :meth:`Authenticator.authenticate`.

This module holds the shape every other part relies on; :mod:`kvmeter.serving.tenancy.directory`
grows the configuration (limits per node, tier defaults, reload) behind the same
:class:`Authenticator` protocol.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Protocol

from kvmeter.attribution import Attribution
from kvmeter.errors import Refusal
from kvmeter.serving.tenancy.tiers import DEFAULT_TIERS

__all__ = ["Principal", "Authenticator", "AuthError", "TIERS", "hash_api_key", "constant_time_lookup"]

#: Tiers known out of the box, most protected first (the keys of :data:`~.tiers.DEFAULT_TIERS`).
TIERS = tuple(DEFAULT_TIERS)


class AuthError(Refusal):
    """Missing or unknown API key (HTTP 401; ``code`` ``missing_api_key`` or ``invalid_api_key``).
    The message never contains the key."""

    status_code = 401

    def __init__(self, message: str, *, code: str = "invalid_api_key") -> None:
        super().__init__(message, code=code)


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller.

    Attributes:
        tenant_id: the billed tenant: the organisation at the top of the key's path.
        tier: tier name (see :data:`TIERS`).
        workspace_id, project_id: the hierarchy between the organisation and the key.
        api_key_id: the key's public id (safe to log and bill; never the secret).
        admin: True for keys allowed to read every tenant's usage.
    """

    tenant_id: str
    tier: str
    workspace_id: str
    project_id: str
    api_key_id: str
    admin: bool = False

    def attribution(self, *, model: str = "", endpoint: str = "", agent_run_id: str = "") -> Attribution:
        """The attribution of a request this principal sends (built once per request).

        Args:
            model: the served model name.
            endpoint: ``chat.completions``, ``completions`` or ``agent_runs.tool_calls``.
            agent_run_id: the request's ``X-Agent-Run-Id``, or ``""``.
        """
        return Attribution(tenant_id=self.tenant_id, workspace_id=self.workspace_id,
                           project_id=self.project_id, api_key_id=self.api_key_id, tier=self.tier,
                           agent_run_id=agent_run_id, model=model, endpoint=endpoint)


def hash_api_key(secret: str) -> str:
    """Hex SHA-256 digest of an API key (what config files and memory hold)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class Authenticator(Protocol):
    """Maps a presented API key to a :class:`Principal`."""

    def authenticate(self, presented_key: str | None) -> Principal:
        """Raises :class:`AuthError` if the key is missing or unknown."""


def constant_time_lookup(digests: dict[str, Principal], presented_key: str) -> Principal | None:
    """Find the principal whose key digest equals the presented key's, comparing every digest in
    constant time (``hmac.compare_digest``) so timing reveals nothing about near misses."""
    digest = hash_api_key(presented_key)
    found: Principal | None = None
    for known, principal in digests.items():
        if hmac.compare_digest(known, digest):
            found = principal
    return found
