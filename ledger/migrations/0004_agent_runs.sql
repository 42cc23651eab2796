-- Version 4: agent runs. Every tool-call decision, every approval event and every run stopped by
-- a loop stop (append-only records from kvmeter.ledger.agent_records, deduplicated by record_id),
-- and the per-run rollup recomputed from them and from usage_events FINAL (ledger/agent_runs.py).

CREATE TABLE IF NOT EXISTS tool_calls$local $on_cluster (
    record_id UUID,
    tenant_id LowCardinality(String),
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    tier LowCardinality(String),
    agent_run_id String,
    source LowCardinality(String),
    tool LowCardinality(String),
    risk_class LowCardinality(String),
    decision LowCardinality(String),
    reason LowCardinality(String),
    rule String,
    tool_call_id String,
    call_id String,
    arguments_sha256 String,
    approval_id String,
    idempotency_key String,
    policy_version String,
    status_code UInt16,
    ts DateTime64(6, 'UTC'),
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX ts_minmax ts TYPE minmax GRANULARITY 4
) ENGINE = ${engine_prefix}ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (tenant_id, agent_run_id, record_id)
SETTINGS $dedup_window;

CREATE TABLE IF NOT EXISTS approval_events$local $on_cluster (
    record_id UUID,
    approval_id String,
    event LowCardinality(String),
    tenant_id LowCardinality(String),
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    tier LowCardinality(String),
    agent_run_id String,
    tool LowCardinality(String),
    risk_class LowCardinality(String),
    arguments_sha256 String,
    policy_version String,
    actor_key_id LowCardinality(String),
    reason String,
    tool_call_id String,
    expires_ts DateTime64(6, 'UTC'),
    ts DateTime64(6, 'UTC'),
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (tenant_id, approval_id, record_id)
SETTINGS $dedup_window;

CREATE TABLE IF NOT EXISTS agent_run_stops$local $on_cluster (
    record_id UUID,
    tenant_id LowCardinality(String),
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    tier LowCardinality(String),
    agent_run_id String,
    reason LowCardinality(String),
    detail String,
    tool LowCardinality(String),
    ts DateTime64(6, 'UTC'),
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (tenant_id, agent_run_id, record_id)
SETTINGS $dedup_window;

-- One row per run, recomputed (never incremented) for every run with new rows since the last
-- computation; readers use FINAL: the newest computation replaces the older one. Tokens are kept
-- per model (cost is priced at read time with the reader's price list: money is never stored
-- here). Runs are keyed by (tenant, run id): a run id is the client's, scoped by tenant.
CREATE TABLE IF NOT EXISTS agent_runs$local $on_cluster (
    tenant_id LowCardinality(String),
    agent_run_id String,
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    tier LowCardinality(String),
    first_ts DateTime64(6, 'UTC'),
    last_ts DateTime64(6, 'UTC'),
    model_calls UInt64,
    ok_model_calls UInt64,
    refused_model_calls UInt64,
    prompt_tokens_by_model Map(String, UInt64),
    cached_prompt_tokens_by_model Map(String, UInt64),
    completion_tokens_by_model Map(String, UInt64),
    reasoning_tokens_by_model Map(String, UInt64),
    tool_calls UInt64,
    tool_calls_by_tool Map(String, UInt64),
    tool_calls_by_risk_class Map(String, UInt64),
    refused_tool_calls UInt64,
    replayed_tool_calls UInt64,
    approvals_requested UInt64,
    approvals_approved UInt64,
    approvals_rejected UInt64,
    approvals_consumed UInt64,
    last_approval_expires_ts DateTime64(6, 'UTC'),
    loop_stops UInt64,
    stop_reason LowCardinality(String),
    stop_detail String,
    computed_at DateTime64(3, 'UTC')
) ENGINE = ${engine_prefix}ReplacingMergeTree(computed_at)
PARTITION BY toYYYYMM(first_ts)
ORDER BY (tenant_id, agent_run_id);
