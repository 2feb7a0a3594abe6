-- Segment ids scoped to their owner tenant (Postgres).
--
-- `segments.id` becomes an opaque global address (`~` + 32 hex digits) that
-- every table refers to and that is never reused; the id a client chose moves
-- to `local_id`, unique per owner among live (not deleted) segments, so a
-- deleted id can be created again by its owner and another tenant's ids are
-- neither visible nor taken. Existing rows get a fresh address; the rows that
-- refer to them follow.
ALTER TABLE segment_token_counts DROP CONSTRAINT segment_token_counts_segment_id_version_fkey;
ALTER TABLE segment_versions DROP CONSTRAINT segment_versions_segment_id_fkey;
ALTER TABLE grants DROP CONSTRAINT grants_segment_id_fkey;
ALTER TABLE group_grants DROP CONSTRAINT group_grants_segment_id_fkey;

ALTER TABLE segments ADD COLUMN local_id TEXT;
UPDATE segments SET local_id = id;
ALTER TABLE segments ALTER COLUMN local_id SET NOT NULL;
UPDATE segments SET id = '~' || md5(random()::text || clock_timestamp()::text || local_id);

UPDATE segment_versions v SET segment_id = s.id FROM segments s WHERE s.local_id = v.segment_id;
UPDATE segment_token_counts t SET segment_id = s.id FROM segments s WHERE s.local_id = t.segment_id;
UPDATE grants g SET segment_id = s.id FROM segments s WHERE s.local_id = g.segment_id;
UPDATE group_grants g SET segment_id = s.id FROM segments s WHERE s.local_id = g.segment_id;
-- Cache keys are derived from the address: rows reported under the old ids
-- can never be looked up again. Workers report their entries again as they
-- rebuild them.
DELETE FROM cache_residency;

ALTER TABLE segment_versions ADD CONSTRAINT segment_versions_segment_id_fkey
    FOREIGN KEY (segment_id) REFERENCES segments(id);
ALTER TABLE segment_token_counts ADD CONSTRAINT segment_token_counts_segment_id_version_fkey
    FOREIGN KEY (segment_id, version) REFERENCES segment_versions(segment_id, version);
ALTER TABLE grants ADD CONSTRAINT grants_segment_id_fkey
    FOREIGN KEY (segment_id) REFERENCES segments(id);
ALTER TABLE group_grants ADD CONSTRAINT group_grants_segment_id_fkey
    FOREIGN KEY (segment_id) REFERENCES segments(id);

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
