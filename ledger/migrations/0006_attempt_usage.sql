-- Version 6: every attempt's engine work is its own usage row (issue 15).
-- Until 5 the table kept, per (tenant_id, event_id), the row of the highest attempt, so a retry
-- that failed replaced a billed success (after a restart of the in-memory idempotency store the
-- retry is attempt 1 again, and the later insert won). Each row now also carries its attempt's
-- id (attempt_id_for(tenant, request id), the attempts table's key), and the sorting key gains it:
-- rows of one logical request no longer replace each other; re-sends of one attempt still do.
-- Rows written before this version keep the nil attempt id (they were one row per logical request
-- already). An attempt that did not complete says why its work reached no client
-- (undelivered_cause) and whether its tier billed it or the platform absorbed it
-- (undelivered_billing); '' on rows written before (billed as they were). Which rows make the
-- logical request's bill is decided when the ledger is read (ledger/queries.py, classified_usage_sql).
-- MODIFY ORDER BY may only append columns added in the same statement, without a default
-- expression (a UUID column's own default is the nil UUID); it is a metadata change.
-- Run again, the columns exist and the key is already this one: nothing changes.
ALTER TABLE usage_events$local $on_cluster
    ADD COLUMN IF NOT EXISTS attempt_id UUID,
    ADD COLUMN IF NOT EXISTS undelivered_cause LowCardinality(String) DEFAULT '',
    ADD COLUMN IF NOT EXISTS undelivered_billing LowCardinality(String) DEFAULT '',
    MODIFY ORDER BY (tenant_id, event_id, attempt_id);
