-- kvmeter ledger schema, version 1.
-- Rendered by kvmeter.ledger.schema: $local is "" (single node) or "_local" (cluster mode, where
-- 0001_init.cluster.sql adds a Distributed table of each name), $on_cluster is "" or
-- "ON CLUSTER <name>", $engine_prefix is "" or "Replicated", $dedup_window the block-dedup setting.
-- Money is Decimal(38, 18). Times are DateTime64 in UTC; wall-clock epoch seconds in the spool.

-- One billable record per logical request. Deduplicated by (tenant_id, event_id): billing reads
-- FINAL. The version column `attempt` keeps the latest attempt of a retried logical request.
CREATE TABLE IF NOT EXISTS usage_events$local $on_cluster (
    event_id UUID,
    tenant_id LowCardinality(String),
    request_id String,
    tier LowCardinality(String),
    model LowCardinality(String),
    endpoint LowCardinality(String),
    outcome LowCardinality(String),
    finish_reason LowCardinality(String),
    arrival_ts DateTime64(6, 'UTC'),
    finish_ts DateTime64(6, 'UTC'),
    prompt_tokens UInt32,
    completion_tokens UInt32,
    cached_prompt_tokens UInt32,
    reasoning_tokens UInt32,
    reserved_prompt_tokens UInt32,
    reserved_completion_tokens UInt32,
    idempotency_key String,
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    agent_run_id String,
    status_code UInt16,
    stream Bool,
    queue_s Nullable(Float64),
    ttft_s Nullable(Float64),
    prefill_s Nullable(Float64),
    decode_s Nullable(Float64),
    e2e_s Nullable(Float64),
    itl_mean_s Nullable(Float64),
    kv_token_seconds Float64,
    token_source LowCardinality(String),
    attempt UInt32,
    preemptions UInt32,
    schema_version UInt16,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX finish_ts_minmax finish_ts TYPE minmax GRANULARITY 4
) ENGINE = ${engine_prefix}ReplacingMergeTree(attempt)
PARTITION BY toYYYYMM(finish_ts)
ORDER BY (tenant_id, event_id)
SETTINGS $dedup_window;

-- Every HTTP attempt as the gateway decided it (admitted, rejected + reason, replayed, ...).
CREATE TABLE IF NOT EXISTS attempts$local $on_cluster (
    attempt_id UUID,
    event_id UUID,
    tenant_id LowCardinality(String),
    request_id String,
    status LowCardinality(String),
    reason LowCardinality(String),
    status_code UInt16,
    ts DateTime64(6, 'UTC'),
    tier LowCardinality(String),
    model LowCardinality(String),
    endpoint LowCardinality(String),
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    agent_run_id String,
    idempotency_key String,
    reserved_prompt_tokens UInt32,
    reserved_completion_tokens UInt32,
    attempt UInt32,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX ts_minmax ts TYPE minmax GRANULARITY 4
) ENGINE = ${engine_prefix}ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (tenant_id, attempt_id)
SETTINGS $dedup_window;

-- The engine's own account of each finished request (vLLM FinishedRequestStats via the bus).
-- Aborted requests never appear here (vLLM issue 55634): reconciliation explains them.
CREATE TABLE IF NOT EXISTS engine_requests$local $on_cluster (
    request_id String,
    finish_reason LowCardinality(String),
    prompt_tokens UInt32,
    generation_tokens UInt32,
    cached_prompt_tokens UInt32,
    queued_s Float64,
    prefill_s Float64,
    decode_s Float64,
    inference_s Float64,
    e2e_s Float64,
    mean_tpot_s Float64,
    preemptions UInt32,
    wall_ts DateTime64(6, 'UTC'),
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}ReplacingMergeTree
PARTITION BY toYYYYMM(wall_ts)
ORDER BY request_id
SETTINGS $dedup_window;

-- Signed money corrections (credit < 0, debit > 0), deduplicated by their deterministic id.
CREATE TABLE IF NOT EXISTS adjustments$local $on_cluster (
    adjustment_id UUID,
    tenant_id LowCardinality(String),
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    ts DateTime64(6, 'UTC'),
    amount Decimal(38, 18),
    currency LowCardinality(String),
    reason String,
    reference String,
    created_by String,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}ReplacingMergeTree
ORDER BY (tenant_id, adjustment_id)
SETTINGS $dedup_window;

-- Generic signal time series (the exporters' ClickHouse sink).
CREATE TABLE IF NOT EXISTS signals$local $on_cluster (
    ts DateTime64(3, 'UTC'),
    name LowCardinality(String),
    labels Map(LowCardinality(String), String),
    value Float64
) ENGINE = ${engine_prefix}MergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (name, ts);

-- Hourly per-tenant rollups, recomputed from deduplicated usage_events (never from raw rows).
-- Readers use FINAL: the newest computation of an hour replaces the older one.
CREATE TABLE IF NOT EXISTS usage_hourly$local $on_cluster (
    hour DateTime('UTC'),
    tenant_id LowCardinality(String),
    org_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    model LowCardinality(String),
    tier LowCardinality(String),
    requests UInt64,
    aborted_requests UInt64,
    error_requests UInt64,
    prompt_tokens UInt64,
    cached_prompt_tokens UInt64,
    completion_tokens UInt64,
    reasoning_tokens UInt64,
    kv_token_seconds Float64,
    ttft_p50_s Float64,
    ttft_p95_s Float64,
    computed_at DateTime64(3, 'UTC')
) ENGINE = ${engine_prefix}ReplacingMergeTree(computed_at)
PARTITION BY toYYYYMM(hour)
ORDER BY (tenant_id, hour, org_id, workspace_id, project_id, api_key_id, model, tier);

-- Price lists in effect (audit; billing itself prices with the file it is given).
CREATE TABLE IF NOT EXISTS prices$local $on_cluster (
    version String,
    currency LowCardinality(String),
    model String,
    token_type LowCardinality(String),
    price_per_million Decimal(38, 18),
    loaded_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}ReplacingMergeTree(loaded_at)
ORDER BY (version, model, token_type);

CREATE TABLE IF NOT EXISTS price_tier_discounts$local $on_cluster (
    version String,
    tier LowCardinality(String),
    discount_ratio Decimal(38, 18),
    loaded_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}ReplacingMergeTree(loaded_at)
ORDER BY (version, tier);
