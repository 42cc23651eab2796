-- Cluster mode: Distributed tables of the agent-run records and the run rollup, sharded by tenant.
CREATE TABLE IF NOT EXISTS tool_calls $on_cluster AS tool_calls_local
ENGINE = Distributed($cluster, currentDatabase(), tool_calls_local, cityHash64(tenant_id));

CREATE TABLE IF NOT EXISTS approval_events $on_cluster AS approval_events_local
ENGINE = Distributed($cluster, currentDatabase(), approval_events_local, cityHash64(tenant_id));

CREATE TABLE IF NOT EXISTS agent_run_stops $on_cluster AS agent_run_stops_local
ENGINE = Distributed($cluster, currentDatabase(), agent_run_stops_local, cityHash64(tenant_id));

CREATE TABLE IF NOT EXISTS agent_runs $on_cluster AS agent_runs_local
ENGINE = Distributed($cluster, currentDatabase(), agent_runs_local, cityHash64(tenant_id));
