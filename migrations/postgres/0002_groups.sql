-- Tenant groups (Postgres): a grant to a group lets every member tenant read the segment.
-- Membership and group grants are checked at each snapshot, so removing
-- either makes the member's next request miss.
CREATE TABLE tenant_groups (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    created_by  TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);

CREATE TABLE group_members (
    group_id    TEXT NOT NULL REFERENCES tenant_groups(id) ON DELETE CASCADE,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id),
    added_by    TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (group_id, tenant_id)
);
CREATE INDEX group_members_tenant ON group_members(tenant_id);

CREATE TABLE group_grants (
    segment_id  TEXT NOT NULL REFERENCES segments(id),
    group_id    TEXT NOT NULL REFERENCES tenant_groups(id) ON DELETE CASCADE,
    granted_by  TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (segment_id, group_id)
);
CREATE INDEX group_grants_group ON group_grants(group_id);
