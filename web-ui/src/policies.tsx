// Policies: active one per kind and history, upload (file picker, validated),
// dry-run against a trace shown beside the active policies, activate, roll back.
import { useState } from "preact/hooks";
import {
  api,
  POLICY_KINDS,
  type DryRunResult,
  type PolicyKind,
  type PolicyRecord,
  type PolicyStats,
  type RecordedTraffic,
} from "./api";
import { compare } from "./metrics";
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
  const [error, setError] = useState<unknown>(null);
  const [busy, setBusy] = useState(false);
  const pick = async (e: Event) => {
    const f = (e.currentTarget as HTMLInputElement).files?.[0];
    if (!f) return setFile(null);
    const b = new Uint8Array(await f.arrayBuffer());
    setFile(b);
    setError(checkWasm(b, MAX_MODULE_BYTES));
    if (!name) setName(f.name.replace(/\.wasm$/, ""));
  };
  const submit = async (e: Event) => {
    e.preventDefault();
    if (!file) return setError({ field: "wasm", message: "choose a .wasm file" });
    const bad = checkWasm(file, MAX_MODULE_BYTES);
    if (bad) return setError(bad);
    const p = parseParams(params);
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
      <label class="wide">
        parameters (JSON object of integers)
        <textarea name="params" rows={2} value={params} onInput={(e) => setParams(e.currentTarget.value)} />
      </label>
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

function DryRun({ policy }: { policy: PolicyRecord }) {
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
      setNote(`${t.requests} recorded prompts (of at most ${t.capacity})`);
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
    </form>
  );
}

export function Policies() {
  const list = useLoad(() => api<PolicyRecord[]>("GET", "/v1/admin/policies"), []);
  const stats = useLoad(() => api<PolicyStats>("GET", "/v1/admin/policies/stats"), []);
  const [error, setError] = useState<unknown>(null);
  const [trying, setTrying] = useState<PolicyRecord | null>(null);
  const reload = () => {
    list.reload();
    stats.reload();
  };
  const act = async (what: string, method: string, path: string, body?: unknown) => {
    if (!window.confirm(what)) return;
    try {
      await api(method, path, body);
      setError(null);
      reload();
    } catch (err) {
      setError(err);
    }
  };
  const all = list.data ?? [];
  return (
    <section>
      <h1>Policies</h1>
      <ErrorBox error={list.error ?? stats.error} />
      <ErrorBox error={error} />
      {POLICY_KINDS.map((k) => {
        const of = all.filter((p) => p.kind === k).sort((a, b) => b.id - a.id);
        const active = of.find((p) => p.active);
        return (
          <div class="card" key={k} data-testid={`kind-${k}`}>
            <h2>
              {k}:{" "}
              <span data-testid={`active-${k}`}>
                {active ? `#${active.id} ${active.name} v${active.version}` : "native default"}
              </span>
            </h2>
            <button
              type="button"
              onClick={() => act(`Roll back the ${k} policy to the previous one?`, "POST", "/v1/admin/policies/rollback", { kind: k })}
            >
              Roll back {k}
            </button>
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
                        <button type="button" onClick={() => setTrying(p)}>
                          Dry-run
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
      {trying ? <DryRun key={trying.id} policy={trying} /> : null}
      <Upload done={reload} />
    </section>
  );
}
