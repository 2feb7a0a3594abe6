// Audit: the control plane's audit log, filtered by action, actor and time.
import { useState } from "preact/hooks";
import { api, type AuditEntry, type AuditQuery, query } from "./api";
import { ErrorBox, useLoad, when } from "./ui";

function ms(local: string): number | undefined {
  if (!local) return undefined;
  const t = new Date(local).getTime();
  return Number.isNaN(t) ? undefined : t;
}

export function Audit() {
  const [form, setForm] = useState({ action: "", actor: "", since: "", until: "", limit: "100" });
  const [q, setQ] = useState<AuditQuery>({ limit: 100 });
  const rows = useLoad(
    () =>
      api<AuditEntry[]>(
        "GET",
        `/v1/admin/audit${query({ action: q.action, actor: q.actor, since_ms: q.since_ms, until_ms: q.until_ms, limit: q.limit })}`,
      ),
    [JSON.stringify(q)],
  );
  const apply = (e: Event) => {
    e.preventDefault();
    setQ({
      action: form.action.trim() || undefined,
      actor: form.actor.trim() || undefined,
      since_ms: ms(form.since),
      until_ms: ms(form.until),
      limit: Number(form.limit) || 100,
    });
    rows.reload();
  };
  const set = (k: keyof typeof form) => (e: Event) => setForm({ ...form, [k]: (e.currentTarget as HTMLInputElement).value });
  return (
    <section>
      <h1>Audit</h1>
      <form class="toolbar" onSubmit={apply} aria-label="audit filters">
        <label>
          action <input name="action" value={form.action} onInput={set("action")} placeholder="policy.activate" />
        </label>
        <label>
          actor <input name="actor" value={form.actor} onInput={set("actor")} />
        </label>
        <label>
          since <input type="datetime-local" name="since" value={form.since} onInput={set("since")} />
        </label>
        <label>
          until <input type="datetime-local" name="until" value={form.until} onInput={set("until")} />
        </label>
        <label>
          limit <input name="limit" size={5} value={form.limit} onInput={set("limit")} />
        </label>
        <button type="submit">Filter</button>
      </form>
      <ErrorBox error={rows.error} />
      <table data-testid="audit">
        <thead>
          <tr>
            <th>id</th>
            <th>time</th>
            <th>actor</th>
            <th>tenant</th>
            <th>action</th>
            <th>target</th>
            <th>detail</th>
          </tr>
        </thead>
        <tbody>
          {(rows.data ?? []).map((r) => (
            <tr key={r.id}>
              <td>{r.id}</td>
              <td>{when(r.at)}</td>
              <td>{r.actor}</td>
              <td>{r.tenant ?? "—"}</td>
              <td>{r.action}</td>
              <td>{r.target}</td>
              <td>
                <code>{r.detail}</code>
              </td>
            </tr>
          ))}
        </tbody>
      </table>
      {rows.data && rows.data.length === 0 ? <p>No audit row matches.</p> : null}
    </section>
  );
}
