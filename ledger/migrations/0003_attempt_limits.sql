-- Version 3: which limit refused an attempt — the principal level (org, workspace, project,
-- api_key, agent_run, global) and the dimension (requests_per_minute, spend_per_day, ...) that a
-- quota rejection named; '' for attempts no limit decided.
ALTER TABLE attempts$local $on_cluster
    ADD COLUMN IF NOT EXISTS level LowCardinality(String) DEFAULT '',
    ADD COLUMN IF NOT EXISTS dimension LowCardinality(String) DEFAULT '';
