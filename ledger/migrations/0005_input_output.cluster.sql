-- Cluster mode: the Distributed tables follow their local tables' columns; the rollup's
-- Distributed table is recreated over the rebuilt usage_hourly_local.
ALTER TABLE usage_events $on_cluster
    RENAME COLUMN IF EXISTS prompt_tokens TO input_tokens,
    RENAME COLUMN IF EXISTS completion_tokens TO output_tokens,
    RENAME COLUMN IF EXISTS cached_prompt_tokens TO cached_input_tokens,
    RENAME COLUMN IF EXISTS reserved_prompt_tokens TO reserved_input_tokens,
    RENAME COLUMN IF EXISTS reserved_completion_tokens TO reserved_output_tokens;

ALTER TABLE usage_events $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE attempts $on_cluster
    RENAME COLUMN IF EXISTS reserved_prompt_tokens TO reserved_input_tokens,
    RENAME COLUMN IF EXISTS reserved_completion_tokens TO reserved_output_tokens;

ALTER TABLE attempts $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE engine_requests $on_cluster
    RENAME COLUMN IF EXISTS prompt_tokens TO input_tokens,
    RENAME COLUMN IF EXISTS generation_tokens TO output_tokens,
    RENAME COLUMN IF EXISTS cached_prompt_tokens TO cached_input_tokens;

ALTER TABLE adjustments $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE tool_calls $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE approval_events $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE agent_run_stops $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE agent_runs $on_cluster DROP COLUMN IF EXISTS org_id;

ALTER TABLE agent_runs $on_cluster
    RENAME COLUMN IF EXISTS prompt_tokens_by_model TO input_tokens_by_model,
    RENAME COLUMN IF EXISTS cached_prompt_tokens_by_model TO cached_input_tokens_by_model,
    RENAME COLUMN IF EXISTS completion_tokens_by_model TO output_tokens_by_model;

DROP TABLE IF EXISTS usage_hourly $on_cluster SYNC;

CREATE TABLE IF NOT EXISTS usage_hourly $on_cluster AS usage_hourly_local
ENGINE = Distributed($cluster, currentDatabase(), usage_hourly_local, cityHash64(tenant_id));
