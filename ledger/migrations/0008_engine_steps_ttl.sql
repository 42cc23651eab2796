-- Version 8: a retention limit on engine_steps (one row per engine step and tenant: it grows every
-- step). Rows go in a TTL merge once their step's ts is older than the limit; the interference
-- read (kvmeter.ledger.interference) then finds no steps for older missed requests. The limit
-- here is the default, 7 days; LedgerConfig.engine_steps_retention_days sets it (0 = keep
-- forever) and Ledger.open applies it (kvmeter.ledger.retention: ALTER ... MODIFY TTL / REMOVE
-- TTL when the table's differs), so a changed limit needs no new migration. In cluster mode the TTL
-- is on engine_steps_local, on every replica (ON CLUSTER); the Distributed table holds no rows.
ALTER TABLE engine_steps$local $on_cluster MODIFY TTL toDateTime(ts) + INTERVAL 7 DAY;
