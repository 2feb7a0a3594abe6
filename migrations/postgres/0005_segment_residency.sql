-- The residency directory: which holder keeps which segment entry, in which
-- tier, how many bytes. Written by every serving replica from its public pool's
-- events (insert, spill, restore, eviction, removal) and from the entries its
-- segment-parallel workers ship; read for holder affinity and residency views.
--
-- `holder_kind`: 'replica' (the public pool of the serving replica `holder`) or
-- 'worker' (the segment-parallel worker `holder`, as the replica names it).
-- `entry_key`: the content digest the holder keys the entry by (hex): the
-- public-pool key (content, isolation, body start) for a replica, the segment
-- digest (tokens, isolation) for a worker. Inline segments have rows too;
-- `segment_id` and `version` are set when the entry is a catalog segment's
-- version the replica knows. `scope`: the namespace the entry belongs to,
-- `shared` or the owner's account pseudonym (never the tenant id), so a tenant
-- is shown only rows of its own namespace and of the shared one.
-- `tier`: 'primary' (the pool's own memory: device or host) or 'spill' (host
-- spill tier). Times are milliseconds since the Unix epoch.
CREATE TABLE segment_residency (
    holder       TEXT NOT NULL,
    holder_kind  TEXT NOT NULL CHECK (holder_kind IN ('replica', 'worker')),
    entry_key    TEXT NOT NULL,
    segment_id   TEXT,
    version      BIGINT,
    scope        TEXT NOT NULL,
    tier         TEXT NOT NULL CHECK (tier IN ('primary', 'spill')),
    bytes        BIGINT NOT NULL,
    tokens       BIGINT NOT NULL,
    updated_at   BIGINT NOT NULL,
    PRIMARY KEY (holder, entry_key)
);
CREATE INDEX segment_residency_key ON segment_residency(entry_key);
CREATE INDEX segment_residency_segment ON segment_residency(segment_id, version);
