-- Cluster mode: the Distributed usage_events table exposes the same columns (its sharding key,
-- the tenant, keeps every attempt of a logical request on one shard).
ALTER TABLE usage_events $on_cluster
    ADD COLUMN IF NOT EXISTS attempt_id UUID,
    ADD COLUMN IF NOT EXISTS undelivered_cause LowCardinality(String),
    ADD COLUMN IF NOT EXISTS undelivered_billing LowCardinality(String);
