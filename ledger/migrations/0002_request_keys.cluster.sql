-- Cluster mode: the Distributed tables expose the same columns.
ALTER TABLE usage_events $on_cluster
    ADD COLUMN IF NOT EXISTS request_key UInt64, ADD COLUMN IF NOT EXISTS event_key UInt64;

ALTER TABLE attempts $on_cluster
    ADD COLUMN IF NOT EXISTS request_key UInt64, ADD COLUMN IF NOT EXISTS event_key UInt64;

ALTER TABLE engine_requests $on_cluster
    ADD COLUMN IF NOT EXISTS request_key UInt64, ADD COLUMN IF NOT EXISTS tenant_id LowCardinality(String);
