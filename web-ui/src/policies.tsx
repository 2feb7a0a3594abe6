// Policies: active one per kind and history, upload (file picker, validated;
// parameters as a form from the module's declared schema), parameters of a
// version, version diff, dry-run against a trace shown beside the active
// policies, shadow mode beside the active policy, activate, roll back.
import { useState } from "preact/hooks";
import {
  api,
  POLICY_KINDS,
  type DryRunResult,
  type PolicyKind,
  type PolicyRecord,
  type PolicyStats,
  type RecordedTraffic,
  type RolledBack,
  type ShadowView,
} from "./api";
import { bytes, compare, compareTenants, pct, type Side } from "./metrics";
import { formText, parseForm, readSchema, type ParamSchema } from "./params";
import { ParamForm, ParamPanel, PolicyDiff, ShadowPanel } from "./policytools";
import { policyName, rollbackTarget } from "./rollback";
import { ErrorBox, useLoad, when } from "./ui";
import { checkCapacity, checkTrace, checkWasm, isError, parseParams } from "./validate";

/** Module size the console accepts before upload (the server's default limit). */
const MAX_MODULE_BYTES = 4 << 20;

function toBase64(bytes: Uint8Array): string {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function Upload({ done }: { done: () => void }) {
  const [name, setName] = useState("");
  const [kind, setKind] = useState<PolicyKind>("eviction");
  const [params, setParams] = useState("{}");
  const [file, setFile] = useState<Uint8Array | null>(null);
  const [schema, setSchema] = useState<ParamSchema | null>(null);
  const [form, setForm] = useState<Record<string, string>>({});
  const [error, setError] = useState<unknown>(null);
  const [busy, setBusy] = useState(false);
  const pick = async (e: Event) => {
    const f = (e.currentTarget as HTMLInputElement).files?.[0];
    if (!f) return setFile(null);
    const b = new Uint8Array(await f.arrayBuffer());
    setFile(b);
    const bad = checkWasm(b, MAX_MODULE_BYTES);
    // The module's declared parameters (its hypic.params section) become the form.
    const sc = bad ? null : readSchema(b);
    if (isError(sc)) {
      setSchema(null);
      setError(sc);
    } else {
      setSchema(sc);
      setForm(sc ? formText(sc) : {});
      setError(bad);
    }
    if (!name) setName(f.name.replace(/\.wasm$/, ""));
  };
  const submit = async (e: Event) => {
    e.preventDefault();
    if (!file) return setError({ field: "wasm", message: "choose a .wasm file" });
    const bad = checkWasm(file, MAX_MODULE_BYTES);
    if (bad) return setError(bad);
    const p = schema ? parseForm(schema, form) : parseParams(params);
    if (isError(p)) return setError(p);
    setBusy(true);
    try {
      await api<PolicyRecord>("POST", "/v1/admin/policies", {
        name,
        kind,
        wasm_base64: toBase64(file),
        params: p.params,
      });
      setError(null);
      done();
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  return (
    <form class="card" onSubmit={submit} aria-label="upload a policy">
      <h2>Upload a policy</h2>
      <label>
        module (.wasm) <input type="file" name="wasm" accept=".wasm,application/wasm" onChange={pick} />
      </label>
      <label>
        name <input name="policy-name" value={name} onInput={(e) => setName(e.currentTarget.value)} required />
      </label>
      <label>
        kind{" "}
        <select name="kind" value={kind} onChange={(e) => setKind(e.currentTarget.value as PolicyKind)}>
          {POLICY_KINDS.map((k) => (
            <option key={k} value={k}>
              {k}
            </option>
          ))}
        </select>
      </label>
      {schema ? (
        <ParamForm schema={schema} text={form} setText={setForm} error={error} />
      ) : (
        <label class="wide">
          parameters (JSON object of integers: the module declares no parameter schema)
          <textarea name="params" rows={2} value={params} onInput={(e) => setParams(e.currentTarget.value)} />
        </label>
      )}
      <button type="submit" disabled={busy}>
        {busy ? "Uploading…" : "Upload"}
      </button>
      <ErrorBox error={error} />
    </form>
  );
}

const SAMPLE_TRACE = [
  '{"tenant":"acme","segments":["a","b"],"tokens":[500,300],"bytes":[4000,2400]}',
  '{"tenant":"acme","segments":["a","c"],"tokens":[500,200],"bytes":[4000,1600]}',
  '{"tenant":"globex","segments":["b","a"],"tokens":[300,500],"bytes":[2400,4000]}',
].join("\n");

function DryRun({ policy, params }: { policy: PolicyRecord; params?: Record<string, unknown> }) {
  const [trace, setTrace] = useState(SAMPLE_TRACE);
  const [cap, setCap] = useState("8000");
  const [result, setResult] = useState<DryRunResult | null>(null);
  const [error, setError] = useState<unknown>(null);
  const run = async (e: Event) => {
    e.preventDefault();
    const t = checkTrace(trace);
    if (isError(t)) return setError(t);
    const c = checkCapacity(cap);
    if (isError(c)) return setError(c);
    try {
      setResult(
        await api<DryRunResult>("POST", `/v1/admin/policies/${policy.id}/dry-run`, {
          trace,
          capacity_bytes: c.bytes,
          ...(params ? { params } : {}),
        }),
      );
      setError(null);
    } catch (err) {
      setError(err);
    }
  };
  const [note, setNote] = useState("");
  const recorded = async () => {
    try {
      const t = await api<RecordedTraffic>("GET", "/v1/admin/traffic");
      if (t.requests === 0) return setError({ field: "trace", message: "no traffic recorded yet" });
      setTrace(t.trace);
      // Replay through a cache the size of the server's own public pool.
      setCap(String(t.public_pool_bytes));
      setNote(`${t.requests} recorded prompts (of at most ${t.capacity}); capacity set to the server's public pool, ${bytes(t.public_pool_bytes)}`);
      setError(null);
    } catch (err) {
      setError(err);
    }
  };
  const loadFile = async (e: Event) => {
    const f = (e.currentTarget as HTMLInputElement).files?.[0];
    if (f) setTrace(await f.text());
  };
  return (
    <form class="card" onSubmit={run} aria-label={`dry-run policy ${policy.id}`}>
      <h3>
        Dry-run #{policy.id} {policy.name} v{policy.version}
        {params ? (
          <>
            {" "}
            with <code data-testid="dry-run-params">{JSON.stringify(params)}</code>
          </>
        ) : null}
      </h3>
      <label class="wide">
        trace (JSONL) <input type="file" name="trace-file" accept=".jsonl,.json,.txt" onChange={loadFile} />
        <textarea
          name="trace"
          rows={4}
          value={trace}
          onInput={(e) => (setTrace(e.currentTarget.value), setNote(""))}
        />
      </label>
      <button type="button" onClick={recorded}>
        Use recorded traffic
      </button>
      {note ? <span data-testid="trace-note">{note}</span> : null}{" "}
      <label>
        capacity bytes <input name="capacity" value={cap} onInput={(e) => setCap(e.currentTarget.value)} />
      </label>
      <button type="submit">Run dry-run</button>
      <ErrorBox error={error} />
      {result ? (
        <table data-testid="dry-run-result">
          <thead>
            <tr>
              <th>metric</th>
              <th>candidate #{result.policy_id}</th>
              <th>active</th>
              <th>Δ</th>
            </tr>
          </thead>
          <tbody>
            {compare(result).map((r) => (
              <tr key={r.metric} class={r.better === "same" ? "" : `better-${r.better}`}>
                <td>{r.metric}</td>
                <td>{Number.isInteger(r.candidate) ? r.candidate : r.candidate.toFixed(3)}</td>
                <td>{Number.isInteger(r.active) ? r.active : r.active.toFixed(3)}</td>
                <td>{Number.isInteger(r.delta) ? r.delta : r.delta.toFixed(3)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : null}
      {result ? <TenantBreakdown result={result} /> : null}
    </form>
  );
}

function num(v: number): string {
  return Number.isInteger(v) ? String(v) : v.toFixed(3);
}

/** Candidate / active cell of the per-tenant table, marked on the better side. */
function Cell({ s, fmt = num }: { s: Side; fmt?: (v: number) => string }) {
  return (
    <td
      class={s.better === "same" ? "" : `better-${s.better}`}
      title={s.better === "same" ? "the same" : s.better === "candidate" ? "better with the candidate" : "worse with the candidate"}
    >
      {fmt(s.candidate)} / {fmt(s.active)}
    </td>
  );
}

function TenantBreakdown({ result }: { result: DryRunResult }) {
  const rows = compareTenants(result);
  if (rows.length === 0) return null;
  return (
    <>
      <h4>Per tenant (candidate / active)</h4>
      <p class="muted">
        Tenants by pseudonym; the tenants the candidate costs most hit ratio come first. Evictions and evicted bytes are
        of the tenant's own entries. Green: better with the candidate; red: worse.
      </p>
      <table data-testid="dry-run-tenants">
        <thead>
          <tr>
            <th scope="col">tenant</th>
            <th scope="col">requests</th>
            <th scope="col">hit ratio</th>
            <th scope="col">Δ hit ratio</th>
            <th scope="col">bytes from cache</th>
            <th scope="col">bytes evicted</th>
            <th scope="col">evictions</th>
            <th scope="col">rejections</th>
          </tr>
        </thead>
        <tbody>
          {rows.map((r) => (
            <tr key={r.tenant} data-testid={`dry-run-tenant-${r.tenant}`}>
              <th scope="row">
                <code>{r.tenant}</code>
              </th>
              <td>{r.requests}</td>
              <Cell s={r.hitRatio} fmt={(v) => pct(v)} />
              <td>{(r.hitRatio.delta * 100).toFixed(1)} pt</td>
              <Cell s={r.bytesHit} fmt={bytes} />
              <Cell s={r.bytesEvicted} fmt={bytes} />
              <Cell s={r.evictions} />
              <Cell s={r.rejected} />
            </tr>
          ))}
        </tbody>
      </table>
    </>
  );
}

export function Policies() {
  const list = useLoad(() => api<PolicyRecord[]>("GET", "/v1/admin/policies"), []);
  const stats = useLoad(() => api<PolicyStats>("GET", "/v1/admin/policies/stats"), []);
  const shadows = useLoad(() => api<ShadowView[]>("GET", "/v1/admin/policies/shadow"), []);
  const [error, setError] = useState<unknown>(null);
  const [trying, setTrying] = useState<{ policy: PolicyRecord; params?: Record<string, unknown> } | null>(null);
  const [editing, setEditing] = useState<PolicyRecord | null>(null);
  const [diffing, setDiffing] = useState<[PolicyRecord, PolicyRecord] | null>(null);
  const [pair, setPair] = useState<Record<string, [string, string]>>({});
  const reload = () => {
    list.reload();
    stats.reload();
    shadows.reload();
  };
  const [rolled, setRolled] = useState<Record<string, string>>({});
  const act = async (what: string, method: string, path: string, body?: unknown) => {
    if (!window.confirm(what)) return null;
    try {
      const r = await api<unknown>(method, path, body);
      setError(null);
      reload();
      return r;
    } catch (err) {
      setError(err);
      return null;
    }
  };
  const rollback = async (k: string, to: string) => {
    const r = await act(`Roll back the ${k} policy to ${to}?`, "POST", "/v1/admin/policies/rollback", { kind: k });
    if (r) {
      const b = r as RolledBack;
      setRolled({ ...rolled, [k]: `Rolled back ${k}: ${policyName(b.from, all)} → ${policyName(b.active, all)}.` });
    }
  };
  const all = list.data ?? [];
  return (
    <section>
      <h1>Policies</h1>
      <ErrorBox error={list.error ?? stats.error ?? shadows.error} />
      <ErrorBox error={error} />
      {POLICY_KINDS.map((k) => {
        const of = all.filter((p) => p.kind === k).sort((a, b) => b.id - a.id);
        const active = of.find((p) => p.active);
        const shadow = (shadows.data ?? []).find((v) => v.kind === k);
        // The versions the diff compares: chosen, else the two newest.
        const [from, to] = pair[k] ?? [String(of[1]?.id ?? ""), String(of[0]?.id ?? "")];
        const byId = (id: string) => of.find((p) => String(p.id) === id);
        return (
          <div class="card" key={k} data-testid={`kind-${k}`}>
            <h2>
              {k}:{" "}
              <span data-testid={`active-${k}`}>
                {active ? `#${active.id} ${active.name} v${active.version}` : "native default"}
              </span>
            </h2>
            {(() => {
              const rb = rollbackTarget(k, stats.data, all);
              return rb.possible ? (
                <button type="button" data-testid={`rollback-${k}`} onClick={() => rollback(k, rb.to)}>
                  Roll back {k} to {rb.to}
                </button>
              ) : (
                <span class="muted" data-testid={`rollback-${k}`}>
                  Nothing to roll back to.
                </span>
              );
            })()}
            {rolled[k] ? (
              <p role="status" data-testid={`rolled-back-${k}`}>
                {rolled[k]}
              </p>
            ) : null}
            {of.length >= 2 ? (
              <form class="inline" aria-label={`compare ${k} versions`} onSubmit={(e) => e.preventDefault()}>
                compare{" "}
                <select name={`diff-from-${k}`} value={from} onChange={(e) => setPair({ ...pair, [k]: [e.currentTarget.value, to] })}>
                  {of.map((p) => (
                    <option key={p.id} value={String(p.id)}>
                      #{p.id} {p.name} v{p.version}
                    </option>
                  ))}
                </select>{" "}
                with{" "}
                <select name={`diff-to-${k}`} value={to} onChange={(e) => setPair({ ...pair, [k]: [from, e.currentTarget.value] })}>
                  {of.map((p) => (
                    <option key={p.id} value={String(p.id)}>
                      #{p.id} {p.name} v{p.version}
                    </option>
                  ))}
                </select>{" "}
                <button
                  type="button"
                  onClick={() => {
                    const a = byId(from);
                    const b = byId(to);
                    if (a && b) setDiffing([a, b]);
                  }}
                >
                  Diff
                </button>
              </form>
            ) : null}
            {shadow ? (
              <ShadowPanel
                view={shadow}
                stopped={reload}
                replay={(id, params) => {
                  const p = all.find((x) => x.id === id);
                  if (p) setTrying({ policy: p, params });
                }}
              />
            ) : null}
            {of.length ? (
              <table>
                <thead>
                  <tr>
                    <th>id</th>
                    <th>name</th>
                    <th>version</th>
                    <th>params</th>
                    <th>sha256</th>
                    <th>by</th>
                    <th>uploaded</th>
                    <th />
                  </tr>
                </thead>
                <tbody>
                  {of.map((p) => (
                    <tr key={p.id} class={p.active ? "active" : ""}>
                      <td>{p.id}</td>
                      <td>{p.name}</td>
                      <td>{p.version}</td>
                      <td>
                        <code>{p.params}</code>
                      </td>
                      <td>
                        <code>{p.module_sha256.slice(0, 12)}</code>
                      </td>
                      <td>{p.created_by}</td>
                      <td>{when(p.created_at)}</td>
                      <td>
                        <button type="button" onClick={() => setTrying({ policy: p })}>
                          Dry-run
                        </button>{" "}
                        <button type="button" onClick={() => setEditing(p)}>
                          Parameters
                        </button>{" "}
                        <button
                          type="button"
                          onClick={() =>
                            act(
                              `Run ${p.kind} policy #${p.id} ${p.name} v${p.version} in shadow beside the active one?`,
                              "POST",
                              `/v1/admin/policies/${p.id}/shadow`,
                            )
                          }
                        >
                          Shadow #{p.id}
                        </button>{" "}
                        {p.active ? (
                          <strong>active</strong>
                        ) : (
                          <button
                            type="button"
                            onClick={() =>
                              act(`Activate ${p.kind} policy #${p.id} ${p.name} v${p.version}?`, "POST", `/v1/admin/policies/${p.id}/activate`)
                            }
                          >
                            Activate #{p.id}
                          </button>
                        )}
                      </td>
                    </tr>
                  ))}
                </tbody>
              </table>
            ) : (
              <p>No uploaded {k} policy.</p>
            )}
          </div>
        );
      })}
      {diffing ? <PolicyDiff key={`${diffing[0].id}-${diffing[1].id}`} a={diffing[0]} b={diffing[1]} close={() => setDiffing(null)} /> : null}
      {editing ? (
        <ParamPanel
          key={editing.id}
          policy={editing}
          close={() => setEditing(null)}
          done={reload}
          dryRun={(params) => setTrying({ policy: editing, params })}
        />
      ) : null}
      {trying ? (
        <DryRun key={`${trying.policy.id}:${JSON.stringify(trying.params ?? null)}`} policy={trying.policy} params={trying.params} />
      ) : null}
      <Upload done={reload} />
    </section>
  );
}
