"""The ledger's deterministic ids are RFC 4122 version-5 UUIDs, byte for byte ``uuid.uuid5``'s.

Rows already in ClickHouse carry ids made by ``uuid.uuid5``; the faster hand-rolled digest must
give the same string for every name, or a re-recorded attempt would get a second row.
"""

from __future__ import annotations

import uuid

import pytest

from kvmeter.events import ATTEMPT_NAMESPACE, EVENT_NAMESPACE, attempt_id_for, event_id_for

NAMES = [("acme", "r1"), ("acme", "chatcmpl-" + "x" * 300), ("tenant.with-dots", "é☃ 𝄞 key"),
         ("t", "\x00"), ("a\x1fb", "c")]


@pytest.mark.parametrize(("tenant", "name"), NAMES)
def test_ids_equal_uuid5(tenant: str, name: str) -> None:
    assert attempt_id_for(tenant, name) == str(uuid.uuid5(ATTEMPT_NAMESPACE, f"{tenant}\x1f{name}"))
    assert event_id_for(tenant, name) == str(uuid.uuid5(EVENT_NAMESPACE, f"{tenant}\x1f{name}"))
    assert event_id_for(tenant, name, "fp") == str(uuid.uuid5(EVENT_NAMESPACE, f"{tenant}\x1f{name}\x1ffp"))
    parsed = uuid.UUID(attempt_id_for(tenant, name))
    assert (parsed.version, parsed.variant) == (5, uuid.RFC_4122)


def test_many_random_names_match() -> None:
    import random
    rng = random.Random(7)
    for _ in range(2000):
        name = "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
        assert attempt_id_for("acme", name) == str(uuid.uuid5(ATTEMPT_NAMESPACE, f"acme\x1f{name}"))
