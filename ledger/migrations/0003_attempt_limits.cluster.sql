-- Cluster mode: the Distributed attempts table exposes the same columns.
ALTER TABLE attempts $on_cluster
    ADD COLUMN IF NOT EXISTS level LowCardinality(String), ADD COLUMN IF NOT EXISTS dimension LowCardinality(String);
