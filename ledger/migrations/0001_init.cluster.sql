-- Cluster mode only: one Distributed table per local table, sharded by tenant so that every
-- duplicate of (tenant_id, event_id) lands on one shard and FINAL deduplicates it there.
-- $cluster is the configured cluster name.
CREATE TABLE IF NOT EXISTS usage_events $on_cluster AS usage_events_local
ENGINE = Distributed($cluster, currentDatabase(), usage_events_local, cityHash64(tenant_id));

CREATE TABLE IF NOT EXISTS attempts $on_cluster AS attempts_local
ENGINE = Distributed($cluster, currentDatabase(), attempts_local, cityHash64(tenant_id));

CREATE TABLE IF NOT EXISTS engine_requests $on_cluster AS engine_requests_local
ENGINE = Distributed($cluster, currentDatabase(), engine_requests_local, cityHash64(request_id));

CREATE TABLE IF NOT EXISTS adjustments $on_cluster AS adjustments_local
ENGINE = Distributed($cluster, currentDatabase(), adjustments_local, cityHash64(tenant_id));

CREATE TABLE IF NOT EXISTS signals $on_cluster AS signals_local
ENGINE = Distributed($cluster, currentDatabase(), signals_local, rand());

CREATE TABLE IF NOT EXISTS usage_hourly $on_cluster AS usage_hourly_local
ENGINE = Distributed($cluster, currentDatabase(), usage_hourly_local, cityHash64(tenant_id));

CREATE TABLE IF NOT EXISTS prices $on_cluster AS prices_local
ENGINE = Distributed($cluster, currentDatabase(), prices_local, cityHash64(version));

CREATE TABLE IF NOT EXISTS price_tier_discounts $on_cluster AS price_tier_discounts_local
ENGINE = Distributed($cluster, currentDatabase(), price_tier_discounts_local, cityHash64(version));
