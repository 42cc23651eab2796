-- Version 5: one token vocabulary and one tenant id (issue 16).
-- Token columns take the words of the rest of kvmeter (input/output, as OpenTelemetry's gen_ai
-- names and the price list say): prompt → input, completion / generation → output. org_id, the
-- tenant's second id (always equal to tenant_id), is dropped. The renames keep the data where it
-- is (a metadata change per part); RENAME COLUMN IF EXISTS and DROP COLUMN IF EXISTS make every
-- statement safe to run again after an interruption.
ALTER TABLE usage_events$local $on_cluster
    RENAME COLUMN IF EXISTS prompt_tokens TO input_tokens,
    RENAME COLUMN IF EXISTS completion_tokens TO output_tokens,
    RENAME COLUMN IF EXISTS cached_prompt_tokens TO cached_input_tokens,
    RENAME COLUMN IF EXISTS reserved_prompt_tokens TO reserved_input_tokens,
    RENAME COLUMN IF EXISTS reserved_completion_tokens TO reserved_output_tokens;

ALTER TABLE usage_events$local $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE attempts$local $on_cluster
    RENAME COLUMN IF EXISTS reserved_prompt_tokens TO reserved_input_tokens,
    RENAME COLUMN IF EXISTS reserved_completion_tokens TO reserved_output_tokens;

ALTER TABLE attempts$local $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE engine_requests$local $on_cluster
    RENAME COLUMN IF EXISTS prompt_tokens TO input_tokens,
    RENAME COLUMN IF EXISTS generation_tokens TO output_tokens,
    RENAME COLUMN IF EXISTS cached_prompt_tokens TO cached_input_tokens;

ALTER TABLE adjustments$local $on_cluster DROP COLUMN IF EXISTS org_id;

-- The agent-run tables of version 4 follow: their records drop org_id, and the per-run rollup
-- names its token maps input/output (it is recomputed by position: the order stays the records').
ALTER TABLE tool_calls$local $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE approval_events$local $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE agent_run_stops$local $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE agent_runs$local $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE agent_runs$local $on_cluster
    RENAME COLUMN IF EXISTS prompt_tokens_by_model TO input_tokens_by_model,
    RENAME COLUMN IF EXISTS cached_prompt_tokens_by_model TO cached_input_tokens_by_model,
    RENAME COLUMN IF EXISTS completion_tokens_by_model TO output_tokens_by_model;

-- The hourly rollup keeps org_id in its sorting key, which no ALTER can change: it is rebuilt.
-- It is derived data (recomputed from usage_events FINAL, never read by billing): the writer's
-- next refresh finds the new table empty and recomputes every hour that has events.
DROP TABLE IF EXISTS usage_hourly$local $on_cluster SYNC;

CREATE TABLE IF NOT EXISTS usage_hourly$local $on_cluster (
    hour DateTime('UTC'),
    tenant_id LowCardinality(String),
    workspace_id LowCardinality(String),
    project_id LowCardinality(String),
    api_key_id LowCardinality(String),
    model LowCardinality(String),
    tier LowCardinality(String),
    requests UInt64,
    aborted_requests UInt64,
    error_requests UInt64,
    input_tokens UInt64,
    cached_input_tokens UInt64,
    output_tokens UInt64,
    reasoning_tokens UInt64,
    kv_token_seconds Float64,
    ttft_p50_s Float64,
    ttft_p95_s Float64,
    computed_at DateTime64(3, 'UTC')
) ENGINE = ${engine_prefix}ReplacingMergeTree(computed_at)
PARTITION BY toYYYYMM(hour)
ORDER BY (tenant_id, hour, workspace_id, project_id, api_key_id, model, tier);
