-- HYPIC control-plane catalog (Postgres). Times are milliseconds since the
-- Unix epoch (BIGINT) so that Postgres and SQLite share one code path.
CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);

CREATE TABLE principals (
    sub         TEXT NOT NULL,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id),
    role        TEXT NOT NULL CHECK (role IN ('tenant', 'operator')),
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, sub)
);

CREATE TABLE segments (
    id               TEXT PRIMARY KEY,
    owner_tenant     TEXT NOT NULL REFERENCES tenants(id),
    name             TEXT NOT NULL,
    public           BIGINT NOT NULL DEFAULT 0,
    current_version  BIGINT NOT NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    deleted_at       BIGINT
);

CREATE TABLE segment_versions (
    segment_id     TEXT NOT NULL REFERENCES segments(id),
    version        BIGINT NOT NULL,
    content_hash   TEXT NOT NULL,
    content        TEXT,
    byte_len       BIGINT NOT NULL,
    created_by     TEXT NOT NULL,
    created_at     BIGINT NOT NULL,
    superseded_at  BIGINT,
    PRIMARY KEY (segment_id, version)
);

CREATE TABLE segment_token_counts (
    segment_id  TEXT NOT NULL,
    version     BIGINT NOT NULL,
    model       TEXT NOT NULL,
    tokens      BIGINT NOT NULL,
    PRIMARY KEY (segment_id, version, model),
    FOREIGN KEY (segment_id, version) REFERENCES segment_versions(segment_id, version)
);

CREATE TABLE grants (
    segment_id  TEXT NOT NULL REFERENCES segments(id),
    tenant_id   TEXT NOT NULL,
    granted_by  TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (segment_id, tenant_id)
);

CREATE TABLE policies (
    id             BIGSERIAL PRIMARY KEY,
    name           TEXT NOT NULL,
    kind           TEXT NOT NULL CHECK (kind IN ('eviction', 'admission', 'invalidation', 'isolation')),
    module         BYTEA NOT NULL,
    module_sha256  TEXT NOT NULL,
    params         TEXT NOT NULL,
    version        BIGINT NOT NULL,
    created_by     TEXT NOT NULL,
    created_at     BIGINT NOT NULL,
    active         BIGINT NOT NULL DEFAULT 0,
    UNIQUE (name, version)
);

CREATE TABLE policy_activations (
    id              BIGSERIAL PRIMARY KEY,
    kind            TEXT NOT NULL,
    policy_id       BIGINT REFERENCES policies(id),
    activated_by    TEXT NOT NULL,
    activated_at    BIGINT NOT NULL,
    rolled_back_at  BIGINT
);

CREATE TABLE audit_log (
    id      BIGSERIAL PRIMARY KEY,
    at      BIGINT NOT NULL,
    actor   TEXT NOT NULL,
    tenant  TEXT,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL,
    detail  TEXT NOT NULL
);
CREATE INDEX audit_log_action ON audit_log(action, at);

CREATE TABLE cache_residency (
    worker      TEXT NOT NULL,
    cache_key   TEXT NOT NULL,
    segment_id  TEXT NOT NULL,
    version     BIGINT NOT NULL,
    tenant      TEXT,
    bytes       BIGINT NOT NULL,
    last_use    BIGINT NOT NULL,
    PRIMARY KEY (worker, cache_key)
);
CREATE INDEX cache_residency_key ON cache_residency(cache_key);
CREATE INDEX cache_residency_segment ON cache_residency(segment_id, version);
