-- Segment ids scoped to their owner tenant (SQLite).
--
-- `segments.id` becomes an opaque global address (`~` + 32 hex digits) that
-- every table refers to and that is never reused; the id a client chose moves
-- to `local_id`, unique per owner among live (not deleted) segments, so a
-- deleted id can be created again by its owner and another tenant's ids are
-- neither visible nor taken. Existing rows get a fresh address; the rows that
-- refer to them follow.
PRAGMA defer_foreign_keys = ON;

ALTER TABLE segments ADD COLUMN local_id TEXT NOT NULL DEFAULT '';
UPDATE segments SET local_id = id;
UPDATE segments SET id = '~' || lower(hex(randomblob(16)));

UPDATE segment_versions SET segment_id =
    (SELECT s.id FROM segments s WHERE s.local_id = segment_versions.segment_id);
UPDATE segment_token_counts SET segment_id =
    (SELECT s.id FROM segments s WHERE s.local_id = segment_token_counts.segment_id);
UPDATE grants SET segment_id =
    (SELECT s.id FROM segments s WHERE s.local_id = grants.segment_id);
UPDATE group_grants SET segment_id =
    (SELECT s.id FROM segments s WHERE s.local_id = group_grants.segment_id);
-- Cache keys are derived from the address: rows reported under the old ids
-- can never be looked up again. Workers report their entries again as they
-- rebuild them.
DELETE FROM cache_residency;

CREATE UNIQUE INDEX segments_owner_local ON segments(owner_tenant, local_id) WHERE deleted_at IS NULL;

-- Idempotent creates: one row per (tenant, client key), kept for a bounded
-- time; `response` is the JSON answer replayed for a retry with the same body.
CREATE TABLE segment_idempotency (
    tenant_id     TEXT NOT NULL,
    idem_key      TEXT NOT NULL,
    request_hash  TEXT NOT NULL,
    response      TEXT NOT NULL,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, idem_key)
);
CREATE INDEX segment_idempotency_created ON segment_idempotency(created_at);
