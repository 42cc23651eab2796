-- Version 7: per engine step, per tenant, the engine's scheduled work and the KV held (issue 14,
-- "who is hurting whom"). One row per (step, tenant, tier) with work or KV in the step, written
-- from kvmeter.stats.EngineStepShares (kvmeter.ledger.step_records) through the spool's `steps`
-- stream; the interference read (kvmeter.ledger.interference) joins it to usage_events.
--   ts                   wall clock when the frontend received the step (epoch s in the spool)
--   replica, engine_idx  the serve process that hosts the engine, and its data-parallel index
--   duration_s           the step's span on the engine core's monotonic clock (spans never overlap)
--   prefill_tokens, decode_tokens  scheduled in the step (collectors/vllm_step_shares.py's split)
--   kv_tokens            KV positions the tenant's running requests hold once the step has run
--                        (× duration_s = its KV token-seconds in the step)
--   requests             the tenant's running requests in the step
--   prefill_request_ids  kvmeter request ids of its requests with prefill tokens in the step
-- Append-only; a re-sent spool batch is dropped by its deduplication token ($dedup_window).
CREATE TABLE IF NOT EXISTS engine_steps$local $on_cluster (
    ts DateTime64(6, 'UTC'),
    replica LowCardinality(String),
    engine_idx UInt16,
    model LowCardinality(String),
    tenant_id LowCardinality(String),
    tier LowCardinality(String),
    duration_s Float64,
    prefill_tokens UInt32,
    decode_tokens UInt32,
    kv_tokens UInt64,
    requests UInt32,
    prefill_request_ids Array(String),
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ${engine_prefix}MergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (model, replica, engine_idx, ts, tenant_id)
SETTINGS $dedup_window;
