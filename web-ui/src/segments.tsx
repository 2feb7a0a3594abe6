// Segments: the catalog browser (list, search, register) and one segment's
// detail (residency, versions and their line diff, grants, new version, delete).
import { useState } from "preact/hooks";
import {
  api,
  type Evicted,
  type Grants as GrantList,
  type GroupGrants,
  type Prefilled,
  type NewSegment,
  type Principal,
  type Segment,
  type SegmentList,
  type SegmentRow,
  type SegmentVersion,
  type VersionContent,
  type WhyAnswer,
  query,
} from "./api";
import { diffStat, lineDiff } from "./diff";
import { bytes } from "./metrics";
import { ErrorBox, useDialog, useLoad, when } from "./ui";
import { checkId } from "./validate";
import { hitsText, residencyText, rowKey, rowRef, segmentLabel, segmentResidency } from "./segrows";
import { entryText, policyText, prefillText, reasonTitle, verdict } from "./why";

async function loadAll(): Promise<SegmentRow[]> {
  const out: SegmentRow[] = [];
  let after: string | undefined;
  // At most 10 pages of 1000: the browser filters what it loaded.
  for (let i = 0; i < 10; i++) {
    const page = await api<SegmentList>("GET", `/v1/segments${query({ limit: 1000, after })}`);
    out.push(...page.data);
    if (!page.next) break;
    after = page.next;
  }
  return out;
}

function NewSegmentForm({ done }: { done: (id: string) => void }) {
  const [f, setF] = useState<NewSegment>({ id: "", name: "", content: "", public: false, prefill: true });
  const [error, setError] = useState<unknown>(null);
  const [busy, setBusy] = useState(false);
  const submit = async (e: Event) => {
    e.preventDefault();
    const bad = checkId("id", f.id);
    if (bad) return setError(bad);
    setBusy(true);
    try {
      const body: NewSegment = { ...f, name: f.name || undefined };
      const s = await api<Segment>("POST", "/v1/segments", body);
      setError(null);
      done(s.id);
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  return (
    <form class="card" onSubmit={submit} aria-label="register a segment">
      <h2>Register a segment</h2>
      <label>
        id <input name="id" value={f.id} onInput={(e) => setF({ ...f, id: e.currentTarget.value })} required />
      </label>
      <label>
        name <input name="name" value={f.name ?? ""} onInput={(e) => setF({ ...f, name: e.currentTarget.value })} />
      </label>
      <label class="wide">
        content
        <textarea
          name="content"
          rows={4}
          value={f.content}
          onInput={(e) => setF({ ...f, content: e.currentTarget.value })}
          required
        />
      </label>
      <label>
        <input type="checkbox" name="public" checked={f.public} onChange={(e) => setF({ ...f, public: e.currentTarget.checked })} />{" "}
        public (every tenant may read it)
      </label>
      <label>
        <input type="checkbox" name="prefill" checked={f.prefill ?? true} onChange={(e) => setF({ ...f, prefill: e.currentTarget.checked })} />{" "}
        prefill now
      </label>
      <button type="submit" disabled={busy}>
        {busy ? "Registering…" : "Register"}
      </button>
      <ErrorBox error={error} />
    </form>
  );
}

export function Segments({ go, me }: { go: (hash: string) => void; me: Principal }) {
  const { data, error, reload } = useLoad(loadAll, []);
  const [q, setQ] = useState("");
  const needle = q.trim().toLowerCase();
  const rows = (data ?? []).filter(
    (s) =>
      !needle ||
      s.id.toLowerCase().includes(needle) ||
      s.name.toLowerCase().includes(needle) ||
      (s.owner_tenant ?? "").toLowerCase().includes(needle),
  );
  return (
    <section>
      <h1>Segments</h1>
      <div class="toolbar">
        <label>
          search <input type="search" name="search" value={q} onInput={(e) => setQ(e.currentTarget.value)} placeholder="id, name or owner" />
        </label>
        <button type="button" onClick={reload}>
          Refresh
        </button>
      </div>
      <ErrorBox error={error} />
      <table data-testid="segments">
        <thead>
          <tr>
            <th>id</th>
            <th>name</th>
            <th>owner</th>
            <th>public</th>
            <th>version</th>
            <th>bytes</th>
            <th>tokens</th>
            <th>residency</th>
            <th>hits</th>
            <th>last use</th>
            <th>updated</th>
          </tr>
        </thead>
        <tbody>
          {rows.map((s) => (
            <tr key={rowKey(s)} data-key={rowKey(s)}>
              <td>
                <a href={`#/segments/${encodeURIComponent(rowRef(s, me))}`}>{s.id}</a>
              </td>
              <td>{s.name}</td>
              <td>{s.owner_tenant ?? "—"}</td>
              <td>{s.public ? "yes" : "no"}</td>
              <td>{s.version}</td>
              <td>{bytes(s.byte_len)}</td>
              <td>{s.tokens ?? "—"}</td>
              <td data-testid="row-residency">{residencyText(s.residency)}</td>
              <td data-testid="row-hits">{hitsText(s)}</td>
              <td data-testid="row-last-use">{when(s.last_use_ms)}</td>
              <td>{when(s.updated_at)}</td>
            </tr>
          ))}
        </tbody>
      </table>
      {data && rows.length === 0 ? <p>No segment{needle ? " matches" : ""}.</p> : null}
      <NewSegmentForm done={(id) => go(`#/segments/${encodeURIComponent(id)}`)} />
    </section>
  );
}

function Grants({ id }: { id: string }) {
  const path = `/v1/segments/${encodeURIComponent(id)}`;
  const g = useLoad(
    () => Promise.all([api<GrantList>("GET", `${path}/grants`), api<GroupGrants>("GET", `${path}/group-grants`)]),
    [id],
  );
  const [tenant, setTenant] = useState("");
  const [error, setError] = useState<unknown>(null);
  const act = async (method: string, p: string, body?: unknown) => {
    try {
      await api(method, p, body);
      setError(null);
      g.reload();
    } catch (e) {
      setError(e);
    }
  };
  return (
    <div class="card">
      <h2>Grants</h2>
      <ErrorBox error={g.error} />
      {g.data ? (
        <ul>
          {g.data[0].map((t) => (
            <li key={`t-${t}`}>
              tenant {t}{" "}
              <button type="button" onClick={() => act("DELETE", `${path}/grants/${encodeURIComponent(t)}`)}>
                Revoke
              </button>
            </li>
          ))}
          {g.data[1].map((t) => (
            <li key={`g-${t}`}>
              group {t}{" "}
              <button type="button" onClick={() => act("DELETE", `${path}/group-grants/${encodeURIComponent(t)}`)}>
                Revoke
              </button>
            </li>
          ))}
          {g.data[0].length + g.data[1].length === 0 ? <li>No grant.</li> : null}
        </ul>
      ) : null}
      <form
        onSubmit={(e) => {
          e.preventDefault();
          act("POST", `${path}/grants`, { tenant });
        }}
      >
        <label>
          grant to tenant <input name="grant-tenant" value={tenant} onInput={(e) => setTenant(e.currentTarget.value)} />
        </label>{" "}
        <button type="submit">Grant</button>
      </form>
      <ErrorBox error={error} />
    </div>
  );
}

/** The line diff of a segment's version `newer` against the version before it. */
function VersionDiff({ path, newer, close }: { path: string; newer: number; close: () => void }) {
  const d = useLoad(async () => {
    const [a, b] = await Promise.all([
      api<VersionContent>("GET", `${path}/versions/${newer - 1}`),
      api<VersionContent>("GET", `${path}/versions/${newer}`),
    ]);
    return lineDiff(a.content, b.content);
  }, [path, newer]);
  const stat = d.data ? diffStat(d.data) : null;
  const dlg = useDialog(close);
  return (
    <div class="card" data-testid="version-diff" role="dialog" {...dlg.panel} aria-labelledby="version-diff-title">
      <h2 id="version-diff-title" tabIndex={-1} ref={dlg.titleRef}>
        Version {newer - 1} → {newer}
        {stat ? ` (+${stat.added} −${stat.removed} lines)` : ""}
      </h2>
      <ErrorBox error={d.error} />
      <pre class="diff">
        {(d.data ?? []).map((l, i) => (
          <div key={i} class={`diff-${l.kind}`}>
            {l.kind === "add" ? "+ " : l.kind === "del" ? "- " : "  "}
            {l.text}
          </div>
        ))}
      </pre>
      <button type="button" onClick={close} aria-keyshortcuts="Escape">
        Close diff (Esc)
      </button>
    </div>
  );
}

/**
 * "Why did it miss?": the segment's entries in a tenant's namespace (tier, bytes,
 * hits, history) and the reasons a lookup misses, from GET /v1/segments/{id}/why.
 */
function Why({ path, evicted }: { path: string; evicted: number }) {
  const [tenant, setTenant] = useState("");
  const [version, setVersion] = useState("");
  const [data, setData] = useState<WhyAnswer | null>(null);
  const [error, setError] = useState<unknown>(null);
  const [busy, setBusy] = useState(false);
  const ask = async (e?: Event) => {
    e?.preventDefault();
    setBusy(true);
    try {
      setData(await api<WhyAnswer>("GET", `${path}/why${query({ tenant: tenant.trim(), version: version.trim() })}`));
      setError(null);
    } catch (err) {
      setData(null);
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  return (
    <form class="card" onSubmit={ask} aria-label="why did it miss" data-testid="why">
      <h2>Why did it miss?</h2>
      <label>
        tenant <input name="why-tenant" value={tenant} onInput={(e) => setTenant(e.currentTarget.value)} placeholder="yours by default" />
      </label>
      <label>
        version used <input name="why-version" value={version} inputMode="numeric" onInput={(e) => setVersion(e.currentTarget.value)} placeholder="current" size={8} />
      </label>
      <button type="submit" disabled={busy}>
        {busy ? "Asking…" : "Why did it miss?"}
      </button>
      {evicted >= 0 ? <span data-testid="evicted-note"> {evicted} cache entries evicted.</span> : null}
      <ErrorBox error={error} />
      {data ? (
        <div data-testid="why-answer">
          <p data-testid="why-verdict">
            <strong>{verdict(data)}</strong>
          </p>
          <h3>Reasons (newest first)</h3>
          {data.reasons.length ? (
            <ol data-testid="why-reasons">
              {data.reasons.map((r, i) => (
                <li key={i} data-code={r.code}>
                  <strong>{reasonTitle(r)}</strong> <code>{r.code}</code>
                  {r.at_ms ? ` · ${when(r.at_ms)}` : ""}
                  {r.body_start != null ? ` · ${entryText(r.body_start)}` : ""}
                  {r.decided_by ? ` · by ${policyText(r.decided_by)}` : ""}
                  <div>{r.message}</div>
                </li>
              ))}
            </ol>
          ) : (
            <p>None: every cacheable entry is resident.</p>
          )}
          <h3>
            Entries of version {data.version ?? "—"} for tenant {data.tenant}
            {data.shared ? " (shared namespace)" : ""}
          </h3>
          <table data-testid="why-entries">
            <thead>
              <tr>
                <th>role</th>
                <th>tier</th>
                <th>bytes</th>
                <th>hits</th>
                <th>last use</th>
                <th>history</th>
              </tr>
            </thead>
            <tbody>
              {data.entries.map((e) => (
                <tr key={e.body_start}>
                  <td>{entryText(e.body_start)}</td>
                  <td>{e.cacheable ? (e.tier ?? "not resident") : "never cached (too short)"}</td>
                  <td>{e.bytes != null ? bytes(e.bytes) : "—"}</td>
                  <td>{e.hits ?? "—"}</td>
                  <td>{when(e.last_use_ms)}</td>
                  <td>
                    {e.events.map((ev, i) => (
                      <div key={i}>
                        {when(ev.at_ms)} {ev.event} ({ev.tier}){ev.decided_by ? ` by ${policyText(ev.decided_by)}` : ""}
                      </div>
                    ))}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
          {data.recent.length ? (
            <>
              <h3>Recent requests and events</h3>
              <ul data-testid="why-recent">
                {data.recent.map((o, i) => (
                  <li key={i}>
                    {when(o.at_ms)} {o.event}
                    {o.version != null ? ` v${o.version}` : ""}
                    {o.outcome ? `: ${o.outcome}` : ""}
                    {o.miss_reason ? ` (${o.miss_reason})` : ""}
                    {o.detail ? ` — ${o.detail}` : ""}
                  </li>
                ))}
              </ul>
            </>
          ) : null}
        </div>
      ) : null}
    </form>
  );
}

export function SegmentDetail({ id, go, me }: { id: string; go: (hash: string) => void; me: Principal }) {
  const path = `/v1/segments/${encodeURIComponent(id)}`;
  const seg = useLoad(() => api<Segment>("GET", path), [id]);
  const versions = useLoad(() => api<SegmentVersion[]>("GET", `${path}/versions`), [id]);
  const [content, setContent] = useState("");
  const [error, setError] = useState<unknown>(null);
  const [diffOf, setDiffOf] = useState<number | null>(null);
  const [evicted, setEvicted] = useState(-1);
  const [prefilled, setPrefilled] = useState<Prefilled | null>(null);
  const [busy, setBusy] = useState(false);
  const s = seg.data;
  const prefill = async () => {
    setBusy(true);
    try {
      const r = await api<Prefilled>("POST", `${path}/prefill`);
      setError(null);
      setPrefilled(r);
      seg.reload();
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  const evict = async () => {
    if (!window.confirm(`Evict the cache entries of segment ${id}? The next request using it misses.`)) return;
    try {
      const r = await api<Evicted>("POST", `${path}/evict`);
      setError(null);
      setEvicted(r.evicted_entries);
      seg.reload();
    } catch (err) {
      setError(err);
    }
  };
  const update = async (e: Event) => {
    e.preventDefault();
    try {
      await api("PUT", path, { content });
      setError(null);
      setContent("");
      seg.reload();
      versions.reload();
    } catch (err) {
      setError(err);
    }
  };
  const del = async () => {
    if (!window.confirm(`Delete segment ${id}? Its cache entries are evicted.`)) return;
    try {
      await api("DELETE", path);
      go("#/segments");
    } catch (err) {
      setError(err);
    }
  };
  return (
    <section>
      <p>
        <a href="#/segments">← Segments</a>
      </p>
      <h1>Segment {seg.data ? segmentLabel(seg.data, me) : id}</h1>
      <ErrorBox error={seg.error} />
      {s ? (
        <dl class="facts" data-testid="segment-detail">
          <dt>name</dt>
          <dd>{s.name}</dd>
          <dt>address</dt>
          <dd>
            <code>{s.address}</code>
          </dd>
          <dt>owner</dt>
          <dd>{s.owner_tenant ?? "—"}</dd>
          <dt>public</dt>
          <dd>{s.public ? "yes" : "no"}</dd>
          <dt>version</dt>
          <dd>{s.current_version}</dd>
          <dt>bytes</dt>
          <dd>{bytes(s.byte_len)}</dd>
          <dt>tokens ({s.hypic?.model ?? "model"})</dt>
          <dd>{s.hypic?.tokens ?? "—"}</dd>
          <dt>residency</dt>
          <dd data-testid="residency">
            {segmentResidency(s)}
            {s.hypic?.residency?.entries.length ? (
              <ul>
                {s.hypic.residency.entries.map((e) => (
                  <li key={e.body_start}>
                    body start {e.body_start}:{" "}
                    {e.resident
                      ? `resident, ${bytes(e.bytes)}${e.hits != null ? `, ${e.hits} hits` : ""}${e.last_use_ms ? `, last used ${when(e.last_use_ms)}` : ""}`
                      : "not resident"}
                  </li>
                ))}
              </ul>
            ) : null}
            {s.hypic?.error ? <div class="error">{s.hypic.error}</div> : null}
          </dd>
          <dt>updated</dt>
          <dd>{when(s.updated_at)}</dd>
        </dl>
      ) : null}
      <h2>Versions</h2>
      <ErrorBox error={versions.error} />
      <table data-testid="versions">
        <thead>
          <tr>
            <th>version</th>
            <th>content hash</th>
            <th>bytes</th>
            <th>by</th>
            <th>created</th>
            <th>superseded</th>
            <th>changes</th>
          </tr>
        </thead>
        <tbody>
          {(versions.data ?? []).map((v) => (
            <tr key={v.version}>
              <td>{v.version}</td>
              <td>
                <code>{v.content_hash.slice(0, 16)}</code>
              </td>
              <td>{v.byte_len}</td>
              <td>{v.created_by}</td>
              <td>{when(v.created_at)}</td>
              <td>{when(v.superseded_at)}</td>
              <td>
                {v.version > 1 ? (
                  <button type="button" aria-label={`diff version ${v.version - 1} to ${v.version}`} onClick={() => setDiffOf(v.version)}>
                    diff from v{v.version - 1}
                  </button>
                ) : null}
              </td>
            </tr>
          ))}
        </tbody>
      </table>
      {diffOf ? <VersionDiff path={path} newer={diffOf} close={() => setDiffOf(null)} /> : null}
      <form class="card" onSubmit={update} aria-label="new version">
        <h2>New version</h2>
        <label class="wide">
          content
          <textarea name="new-content" rows={3} value={content} onInput={(e) => setContent(e.currentTarget.value)} required />
        </label>
        <button type="submit">Save as version {s ? s.current_version + 1 : ""}</button>
        <button type="button" onClick={prefill} disabled={busy}>
          {busy ? "Prefilling…" : "Prefill now"}
        </button>
        <button type="button" onClick={evict}>
          Evict cache entries
        </button>
        <button type="button" class="danger" onClick={del}>
          Delete segment
        </button>
        {prefilled ? (
          <p data-testid="prefill-note" role="status">
            Prefilled {prefillText(prefilled)}
          </p>
        ) : null}
        <ErrorBox error={error} />
      </form>
      <Why path={path} evicted={evicted} />
      <Grants id={id} />
    </section>
  );
}
