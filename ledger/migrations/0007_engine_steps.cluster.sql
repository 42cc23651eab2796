-- Cluster mode: the Distributed engine_steps table, sharded by replica (one engine's steps on one
-- shard).
CREATE TABLE IF NOT EXISTS engine_steps $on_cluster AS engine_steps_local
ENGINE = Distributed($cluster, currentDatabase(), engine_steps_local, cityHash64(replica));
