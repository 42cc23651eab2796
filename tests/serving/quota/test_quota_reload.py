"""Reload without restart: atomic swap, in-flight reservations stay valid, bad files keep the old config."""

from __future__ import annotations

import os

import pytest

from kvmeter.bus import StatsBus
from kvmeter.serving.quota import HierarchicalQuota, QuotaRejected
from kvmeter.serving.tenancy import AuthError, ConfigError, TenantDirectory
from kvmeter.stats import ConfigReloaded
from quota_testlib import estimate, price, tree, used



def write(path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))  # distinct mtimes without waiting on the filesystem


async def test_reload_swaps_limits_and_keys_while_reservations_stay_valid(tmp_path, store, clock):
    cfg = tmp_path / "principals.yaml"
    write(cfg, tree(key_limits="{concurrent_requests: 1}"), 1_000_000_000)
    bus = StatsBus()
    events: list[ConfigReloaded] = []
    bus.subscribe(ConfigReloaded, events.append)
    directory = TenantDirectory(path=cfg, bus=bus, clock=clock)
    gate = HierarchicalQuota(directory, store, price=price, clock=clock)
    k1 = directory.authenticate("sk-test-key-one")
    held = await gate.reserve(k1, estimate("m", 10, 10, principal=k1))
    with pytest.raises(QuotaRejected):
        await gate.reserve(k1, estimate("m", 10, 10, principal=k1))

    # new file: k1's limit raised to 2, k2 removed, k9 added
    text = tree(key_limits="{concurrent_requests: 2}").replace(
        "k2: {key: sk-test-key-two", "k9: {key: sk-test-key-nine")
    write(cfg, text, 2_000_000_000)
    assert directory.poll_file() is True
    assert directory.snapshot.version == 2
    assert events[-1].ok and events[-1].version == 2
    assert directory.authenticate("sk-test-key-nine").api_key_id == "k9"
    with pytest.raises(AuthError):
        directory.authenticate("sk-test-key-two")

    second = await gate.reserve(k1, estimate("m", 10, 10, principal=k1))  # same counter, new limit 2
    with pytest.raises(QuotaRejected) as info:
        await gate.reserve(k1, estimate("m", 10, 10, principal=k1))
    assert info.value.dimension == "concurrent_requests"
    # the reservation taken under version 1 reconciles against the same counters
    await gate.reconcile(held, used(10, 0, 5))
    await gate.reconcile(second, used(10, 0, 5))
    (conc,) = await store.get_values([f"{store.key_prefix}k:{{acme}}/ws/proj/k1:conc"])
    assert conc is None


async def test_a_removed_key_is_refused_by_the_gate_with_401(store, clock):
    directory = TenantDirectory(tree(), clock=clock)
    gate = HierarchicalQuota(directory, store, price=price, clock=clock)
    k2 = directory.authenticate("sk-test-key-two")
    held = await gate.reserve(k2, estimate("m", 10, 10, principal=k2))
    directory.reload(tree().replace("k2: {key: sk-test-key-two", "k8: {key: sk-test-key-eight"))
    with pytest.raises(QuotaRejected) as info:
        await gate.reserve(k2, estimate("m", 10, 10, principal=k2))
    assert (info.value.status_code, info.value.reason) == (401, "invalid_api_key")
    await gate.reconcile(held, used(10, 0, 10))  # still settles
    assert gate.reconcile_errors == 0


def test_an_invalid_file_keeps_the_old_config_and_names_the_field(tmp_path, clock):
    cfg = tmp_path / "principals.yaml"
    write(cfg, tree(), 1_000_000_000)
    bus = StatsBus()
    events: list[ConfigReloaded] = []
    bus.subscribe(ConfigReloaded, events.append)
    directory = TenantDirectory(path=cfg, bus=bus, clock=clock)
    write(cfg, tree(key_limits="{requests_per_minute: lots}"), 2_000_000_000)
    with pytest.raises(ConfigError, match=r"api_keys\.k1\.limits\.requests_per_minute"):
        directory.reload()
    assert directory.snapshot.version == 1
    assert directory.authenticate("sk-test-key-one").api_key_id == "k1"
    assert not events[-1].ok and "requests_per_minute" in events[-1].error
    # the watcher never raises; it does not retry the same bad file
    write(cfg, tree(key_limits="{requests_per_minute: -3}"), 3_000_000_000)
    assert directory.poll_file() is False
    assert directory.poll_file() is False
    assert directory.snapshot.version == 1
    # deleting the file does not take the config away
    cfg.unlink()
    assert directory.poll_file() is False
    assert directory.authenticate("sk-test-key-one").api_key_id == "k1"


def test_touching_the_file_without_changing_it_does_not_reload(tmp_path, clock):
    cfg = tmp_path / "principals.yaml"
    write(cfg, tree(), 1_000_000_000)
    directory = TenantDirectory(path=cfg, clock=clock)
    os.utime(cfg, ns=(5_000_000_000, 5_000_000_000))
    assert directory.poll_file() is False
    assert directory.snapshot.version == 1


def test_reload_from_an_object_and_error_without_file(clock):
    directory = TenantDirectory(tree(), clock=clock)
    with pytest.raises(ValueError, match="needs a directory loaded from a file"):
        directory.reload()
    snap = directory.reload(tree(key_limits="{requests_per_minute: 5}"))
    assert snap.version == 2 and snap.keys["k1"].chain[-1].limits.requests_per_minute == 5
