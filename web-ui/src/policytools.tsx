// Policies screen parts: the parameter form (from a module's declared schema),
// the parameter panel of a stored version (activate, dry-run or shadow with
// new values), the version diff, and the shadow comparison.
import { useEffect, useState } from "preact/hooks";
import { api, type PolicyDetail, type PolicyRecord, type ShadowView } from "./api";
import { lineDiff, diffStat } from "./diff";
import { describe, formText, parseForm, type ParamSchema, type ParamValue } from "./params";
import { policyLines } from "./policydiff";
import { agreement, shadowRows } from "./shadow";
import { ErrorBox, useDialog, useLoad, when } from "./ui";
import { isError, type FieldError } from "./validate";

/** Inputs for every declared parameter; `error` marks the field it names. */
export function ParamForm(props: {
  schema: ParamSchema;
  text: Record<string, string>;
  setText: (t: Record<string, string>) => void;
  error?: unknown;
}) {
  const { schema, text, setText } = props;
  const bad = (props.error as FieldError | null)?.field;
  if (schema.params.length === 0) return <p data-testid="no-params">This policy declares no parameters.</p>;
  const set = (name: string, v: string) => setText({ ...text, [name]: v });
  return (
    <fieldset class="params" data-testid="param-form">
      <legend>parameters</legend>
      {schema.params.map((p) => {
        const id = `param-${p.name}`;
        const invalid = bad === `params.${p.name}` ? true : undefined;
        const hint = (
          <small>
            {describe(p)}
            {p.description ? ` — ${p.description}` : ""}
          </small>
        );
        if (p.type === "bool")
          return (
            <label key={p.name}>
              <input
                type="checkbox"
                name={id}
                checked={text[p.name] === "true"}
                onChange={(e) => set(p.name, String(e.currentTarget.checked))}
              />{" "}
              {p.name} {hint}
            </label>
          );
        if (p.type === "enum")
          return (
            <label key={p.name}>
              {p.name}
              <select name={id} value={text[p.name]} aria-invalid={invalid} onChange={(e) => set(p.name, e.currentTarget.value)}>
                {p.choices.map((c) => (
                  <option key={c} value={c}>
                    {c}
                  </option>
                ))}
              </select>
              {hint}
            </label>
          );
        return (
          <label key={p.name}>
            {p.name}
            <input
              name={id}
              inputMode={p.type === "int" ? "numeric" : p.type === "float" ? "decimal" : undefined}
              value={text[p.name] ?? ""}
              aria-invalid={invalid}
              onInput={(e) => set(p.name, e.currentTarget.value)}
            />
            {hint}
          </label>
        );
      })}
    </fieldset>
  );
}

/** The parameter panel of a stored version: the form filled with its values, and actions. */
export function ParamPanel(props: {
  policy: PolicyRecord;
  close: () => void;
  done: () => void;
  dryRun: (params: Record<string, ParamValue>) => void;
}) {
  const { policy } = props;
  const d = useLoad(() => api<PolicyDetail>("GET", `/v1/admin/policies/${policy.id}`), [policy.id]);
  const [text, setText] = useState<Record<string, string> | null>(null);
  const [error, setError] = useState<unknown>(null);
  const [note, setNote] = useState("");
  useEffect(() => {
    if (d.data?.param_schema) setText(formText(d.data.param_schema, d.data.effective_params));
  }, [d.data]);
  const schema = d.data?.param_schema;
  const dlg = useDialog(props.close);
  const values = (): Record<string, ParamValue> | null => {
    if (!schema || !text) return null;
    const r = parseForm(schema, text);
    if (isError(r)) {
      setError(r);
      return null;
    }
    setError(null);
    return r.params;
  };
  const call = async (what: string, method: string, path: string, body: unknown, after: (v: unknown) => string) => {
    if (!window.confirm(what)) return;
    try {
      const v = await api(method, path, body);
      setError(null);
      setNote(after(v));
      props.done();
    } catch (err) {
      setError(err);
    }
  };
  return (
    <form class="card" aria-label={`parameters of policy ${policy.id}`} onSubmit={(e) => e.preventDefault()} {...dlg.panel}>
      <h3 tabIndex={-1} ref={dlg.titleRef}>
        Parameters of #{policy.id} {policy.name} v{policy.version}
      </h3>
      <ErrorBox error={d.error} />
      {d.data && !schema ? (
        <p>
          This module declares no parameter schema (ABI v1); its parameters are <code>{d.data.params}</code>.
        </p>
      ) : null}
      {schema && text ? <ParamForm schema={schema} text={text} setText={setText} error={error} /> : null}
      {schema && schema.params.length ? (
        <div class="toolbar">
          <button
            type="button"
            onClick={() => {
              const p = values();
              if (p)
                call(
                  `Activate ${policy.kind} policy #${policy.id} ${policy.name} with ${JSON.stringify(p)}? Changed parameters are stored as a new version.`,
                  "POST",
                  `/v1/admin/policies/${policy.id}/activate`,
                  { params: p },
                  (v) => {
                    const id = (v as { active: number }).active;
                    return `activated #${id}${id !== policy.id ? " (the new parameters are stored as this new version)" : ""}`;
                  },
                );
            }}
          >
            Activate with these parameters
          </button>
          <button
            type="button"
            onClick={() => {
              const p = values();
              if (p)
                call(
                  `Run #${policy.id} ${policy.name} in shadow beside the active ${policy.kind} policy with ${JSON.stringify(p)}?`,
                  "POST",
                  `/v1/admin/policies/${policy.id}/shadow`,
                  { params: p },
                  () => "shadow started",
                );
            }}
          >
            Shadow with these parameters
          </button>
          <button
            type="button"
            onClick={() => {
              const p = values();
              if (p) props.dryRun(p);
            }}
          >
            Dry-run with these parameters
          </button>
        </div>
      ) : null}
      <ErrorBox error={error} />
      {note ? <p data-testid="param-note">{note}</p> : null}
      <button type="button" onClick={props.close} aria-keyshortcuts="Escape">
        Close (Esc)
      </button>
    </form>
  );
}

/** The line diff of what two versions declare and contain (see policydiff.ts). */
export function PolicyDiff({ a, b, close }: { a: PolicyRecord; b: PolicyRecord; close: () => void }) {
  const d = useLoad(
    () =>
      Promise.all([
        api<PolicyDetail>("GET", `/v1/admin/policies/${a.id}`),
        api<PolicyDetail>("GET", `/v1/admin/policies/${b.id}`),
      ]).then(([x, y]) => lineDiff(policyLines(x).join("\n"), policyLines(y).join("\n"))),
    [a.id, b.id],
  );
  const stat = d.data ? diffStat(d.data) : null;
  const dlg = useDialog(close);
  return (
    <div class="card" data-testid="policy-diff" role="dialog" {...dlg.panel} aria-labelledby="policy-diff-title">
      <h3 id="policy-diff-title" tabIndex={-1} ref={dlg.titleRef}>
        #{a.id} {a.name} v{a.version} → #{b.id} {b.name} v{b.version}
        {stat ? ` (+${stat.added} −${stat.removed})` : ""}
      </h3>
      <p class="muted">
        Compared: parameter values and schema, module hash and size, exports and sections. The module's code is compiled
        bytecode, so a change in it shows as a changed SHA-256 and code size, not as lines.
      </p>
      <ErrorBox error={d.error} />
      <pre class="diff full">
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

/** The running shadow of a kind beside the active policy, refreshed every 2 s; stop and replay actions. */
export function ShadowPanel(props: {
  view: ShadowView;
  stopped: () => void;
  replay: (policyId: number, params: Record<string, unknown>) => void;
}) {
  const [v, setV] = useState(props.view);
  const [error, setError] = useState<unknown>(null);
  useEffect(() => setV(props.view), [props.view]);
  useEffect(() => {
    const t = setInterval(() => {
      api<ShadowView>("GET", `/v1/admin/policies/shadow/${v.kind}`).then(setV, setError);
    }, 2000);
    return () => clearInterval(t);
  }, [v.kind]);
  const stop = async () => {
    if (!window.confirm(`Stop the ${v.kind} shadow policy #${v.policy_id}?`)) return;
    try {
      await api("DELETE", `/v1/admin/policies/shadow/${v.kind}`);
      props.stopped();
    } catch (err) {
      setError(err);
    }
  };
  const share = agreement(v);
  return (
    <div class="card" data-testid={`shadow-${v.kind}`}>
      <h3>
        Shadow: #{v.policy_id} beside {v.active_policy_id === null ? "the native default" : `#${v.active_policy_id}`}
      </h3>
      <p>
        Started {when(v.started_at)} by {v.started_by}; parameters <code>{JSON.stringify(v.params)}</code>. The active
        policy's answers are applied; the shadow's are only counted.
        {v.tripped ? <strong> The shadow faulted too often and is answered by the native default.</strong> : null}
      </p>
      <table data-testid={`shadow-counts-${v.kind}`}>
        <thead>
          <tr>
            <th>answers</th>
            <th>shadow #{v.policy_id} (counted)</th>
            <th>active (applied)</th>
          </tr>
        </thead>
        <tbody>
          {shadowRows(v).map((r) => (
            <tr key={r.metric} class={r.candidate !== r.active ? "differs" : ""}>
              <td>{r.metric}</td>
              <td>{r.candidate}</td>
              <td>{r.active}</td>
            </tr>
          ))}
          <tr>
            <td>agreed / disagreed</td>
            <td colSpan={2}>
              {v.agreed} / {v.disagreed}
              {share === null ? "" : ` (${(share * 100).toFixed(1)}% alike)`}
            </td>
          </tr>
        </tbody>
      </table>
      {v.kind === "eviction" && v.agreed + v.disagreed === 0 ? (
        <p class="muted" data-testid="shadow-eviction-idle">
          No eviction yet: an eviction policy is consulted only when the public pool is full, so its counts stay at
          zero until something must leave the pool.
        </p>
      ) : null}
      <p class="muted">
        The hit ratio the shadow would have had needs the cache it would have had, which live traffic does not show:
        replay the recorded traffic with it.
      </p>
      <button type="button" onClick={() => props.replay(v.policy_id, v.params)}>
        Replay recorded traffic with #{v.policy_id}
      </button>
      <button type="button" class="danger" onClick={stop}>
        Stop shadow
      </button>
      <ErrorBox error={error} />
    </div>
  );
}
