// Tenants (operator): every tenant's principals, groups, segments, grants and
// serving usage (`GET /v1/admin/tenants`). A tenant token sees its own row only
// (`GET /v1/tenants/{tenant}/usage`).
import { api, type Principal, type TenantView } from "./api";
import { ErrorBox, useLoad, when } from "./ui";

/** Share of prompt tokens served from the cache, as a percentage text. */
export function cachedShare(v: TenantView): string {
  const s = v.serving;
  return s.prompt_tokens > 0 ? `${((100 * s.cached_tokens) / s.prompt_tokens).toFixed(1)}%` : "—";
}

function Rows({ rows }: { rows: TenantView[] }) {
  return (
    <table data-testid="tenants">
      <thead>
        <tr>
          <th>tenant</th>
          <th>principals</th>
          <th>groups</th>
          <th>segments</th>
          <th>segment bytes</th>
          <th>granted (direct / via groups)</th>
          <th>requests</th>
          <th>prompt tokens</th>
          <th>cached tokens</th>
          <th>completion tokens</th>
          <th>segment hits / misses</th>
          <th>last request</th>
        </tr>
      </thead>
      <tbody>
        {rows.map((t) => (
          <tr key={t.tenant} data-testid={`tenant-${t.tenant}`}>
            <td>{t.tenant}</td>
            <td>
              {t.principals.map((p) => (
                <div key={p.sub}>
                  {p.sub} <small>({p.role})</small>
                </div>
              ))}
            </td>
            <td>{t.groups.length ? t.groups.join(", ") : "—"}</td>
            <td>{t.catalog.segments}</td>
            <td>{t.catalog.segment_bytes}</td>
            <td>
              {t.catalog.granted_segments} / {t.catalog.group_granted_segments}
            </td>
            <td data-testid="requests">{t.serving.requests}</td>
            <td>{t.serving.prompt_tokens}</td>
            <td>
              {t.serving.cached_tokens} <small>({cachedShare(t)})</small>
            </td>
            <td>{t.serving.completion_tokens}</td>
            <td>
              {t.serving.segment_hits} / {t.serving.segment_misses}
            </td>
            <td>{when(t.serving.last_request_at)}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

export function Tenants({ me }: { me: Principal }) {
  const op = me.role === "operator";
  const list = useLoad(
    () =>
      op
        ? api<TenantView[]>("GET", "/v1/admin/tenants")
        : api<TenantView>("GET", `/v1/tenants/${encodeURIComponent(me.tenant)}/usage`).then((v) => [v]),
    [op, me.tenant],
  );
  return (
    <section>
      <h1>{op ? "Tenants" : "Usage"}</h1>
      <p>
        Principals are the token subjects seen for a tenant; groups and grants come from the catalog; requests and
        tokens are counted by this server since it started.
      </p>
      <button type="button" onClick={list.reload}>
        Refresh
      </button>
      <ErrorBox error={list.error} />
      <Rows rows={list.data ?? []} />
    </section>
  );
}
