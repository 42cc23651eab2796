-- Version 2, for reconciliation: 64-bit keys computed at insert (grouping by UInt64 instead of
-- hashing request-id strings at query time), and the tenant of each engine record, attributed by
-- the ledger from the request's admitted attempt ('' when unknown).
-- cityHash64 collisions among 10 million keys have a probability of about 3e-6; a collision could
-- only merge two requests in a reconciliation report, never in billing (which never uses these).
ALTER TABLE usage_events$local $on_cluster
    ADD COLUMN IF NOT EXISTS request_key UInt64 MATERIALIZED cityHash64(request_id),
    ADD COLUMN IF NOT EXISTS event_key UInt64 MATERIALIZED cityHash64(event_id);

ALTER TABLE attempts$local $on_cluster
    ADD COLUMN IF NOT EXISTS request_key UInt64 MATERIALIZED cityHash64(request_id),
    ADD COLUMN IF NOT EXISTS event_key UInt64 MATERIALIZED cityHash64(event_id);

ALTER TABLE engine_requests$local $on_cluster
    ADD COLUMN IF NOT EXISTS request_key UInt64 MATERIALIZED cityHash64(request_id),
    ADD COLUMN IF NOT EXISTS tenant_id LowCardinality(String) DEFAULT '';
