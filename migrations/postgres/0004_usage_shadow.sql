-- Serving usage per tenant and shadow-mode counts, kept across restarts (Postgres).
--
-- `tenant_usage`: each server adds what it counted since its last write
-- (requests, tokens, segment hits and misses), so servers sharing a catalog
-- sum up; `tenant` is the token's tenant (not a foreign key: usage is counted
-- for any verified tenant, also one the catalog has no row of yet).
CREATE TABLE tenant_usage (
    tenant             TEXT PRIMARY KEY,
    requests           BIGINT NOT NULL DEFAULT 0,
    prompt_tokens      BIGINT NOT NULL DEFAULT 0,
    cached_tokens      BIGINT NOT NULL DEFAULT 0,
    completion_tokens  BIGINT NOT NULL DEFAULT 0,
    segment_hits       BIGINT NOT NULL DEFAULT 0,
    segment_misses     BIGINT NOT NULL DEFAULT 0,
    last_request_at    BIGINT
);

-- `policy_shadows`: the shadow run of each hook kind, its counts as last
-- written; `stopped_at` is null while it runs (a restarted server resumes it
-- with these counts). `candidate` and `active` are JSON objects of decision
-- counts; `params` the candidate's effective parameters (JSON).
CREATE TABLE policy_shadows (
    kind          TEXT PRIMARY KEY CHECK (kind IN ('eviction', 'admission', 'invalidation', 'isolation')),
    policy_id     BIGINT NOT NULL REFERENCES policies(id),
    params        TEXT NOT NULL,
    started_at    BIGINT NOT NULL,
    started_by    TEXT NOT NULL,
    candidate     TEXT NOT NULL,
    active        TEXT NOT NULL,
    agreed        BIGINT NOT NULL DEFAULT 0,
    disagreed     BIGINT NOT NULL DEFAULT 0,
    updated_at    BIGINT NOT NULL,
    stopped_at    BIGINT
);
