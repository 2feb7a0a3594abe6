// Overview: live numbers and the last hour from `GET /v1/metrics/history`.
import { useEffect, useState } from "preact/hooks";
import { api, ApiError, type MetricsHistory } from "./api";
import { bytes, pct, rates, series, tierCells, TIERS, totals } from "./metrics";
import { Chart, ErrorBox } from "./ui";

const POLL_MS = 2000;

function Stat(p: { label: string; value: string; id: string }) {
  return (
    <div class="stat" data-testid={`stat-${p.id}`}>
      <div class="label">{p.label}</div>
      <div class="value">{p.value}</div>
    </div>
  );
}

export function Overview() {
  const [h, setH] = useState<MetricsHistory | null>(null);
  const [error, setError] = useState<unknown>(null);
  useEffect(() => {
    let live = true;
    const poll = () =>
      api<MetricsHistory>("GET", "/v1/metrics/history").then(
        (d) => live && (setH(d), setError(null)),
        (e) => live && setError(e),
      );
    poll();
    const t = setInterval(poll, POLL_MS);
    return () => {
      live = false;
      clearInterval(t);
    };
  }, []);
  if (error instanceof ApiError && error.status === 404)
    return (
      <section>
        <h1>Overview</h1>
        <p>This server has no serving metrics (a control plane alone). Run <code>hypic serve</code>.</p>
        <ErrorBox error={error} />
      </section>
    );
  if (!h)
    return (
      <section>
        <h1>Overview</h1>
        {error ? <ErrorBox error={error} /> : <p>Loading…</p>}
      </section>
    );
  const s = h.samples;
  const now = s[s.length - 1];
  const prev = s.length > 1 ? s[s.length - 2] : null;
  const r = prev ? rates(prev, now) : null;
  const t = totals(now);
  const ser = series(s);
  const modes = Object.entries(h.ttft_window_ms).filter(([, q]) => q.count > 0);
  const f1 = (v: number | null | undefined) => (v === null || v === undefined ? "—" : v.toFixed(1));
  return (
    <section>
      <h1>Overview</h1>
      <ErrorBox error={error} />
      <div class="stats">
        <Stat id="requests" label="requests (total)" value={String(now.requests)} />
        <Stat id="rps" label="requests/s (last interval)" value={r ? r.requestsPerS.toFixed(2) : "—"} />
        <Stat id="finished" label="completions finished" value={String(now.finished)} />
        <Stat id="cached-share" label="cached-token share" value={pct(t.cachedShare)} />
        <Stat id="hit-ratio" label="segment hit ratio" value={pct(t.hitRatio)} />
        <Stat
          id="seam"
          label="seam tokens/s (last interval) / total"
          value={`${r ? r.seamPerS.toFixed(1) : "—"} / ${now.seam_tokens}`}
        />
        <Stat id="queue" label="queue depth / running" value={`${now.queue_depth} / ${now.running}`} />
        <Stat id="errors" label="429 / 408" value={`${now.rejected_429} / ${now.timeouts_408}`} />
        <Stat
          id="policy"
          label="policy calls / faults / fallbacks"
          value={`${now.policy_calls} / ${now.policy_faults} / ${now.policy_fallbacks}`}
        />
      </div>
      <h2>Pools by tier</h2>
      <p class="muted">Bytes and entries each pool holds per storage tier; a tier this backend does not have is marked absent.</p>
      <table data-testid="pools">
        <thead>
          <tr>
            <th scope="col">pool</th>
            {TIERS.map((t) => (
              <th scope="col" key={t}>
                {t}
              </th>
            ))}
          </tr>
        </thead>
        <tbody>
          {Object.entries(now.pools).map(([name, p]) => (
            <tr key={name} data-testid={`pool-${name}`}>
              <th scope="row">{name}</th>
              {tierCells(p).map((c) =>
                c.usage ? (
                  <td key={c.tier} data-testid={`tier-${name}-${c.tier}`}>
                    {bytes(c.usage.bytes)} · {c.usage.entries} {c.usage.entries === 1 ? "entry" : "entries"}
                  </td>
                ) : (
                  <td key={c.tier} class="absent" data-testid={`tier-${name}-${c.tier}`} title={`this backend has no ${c.tier} tier`}>
                    absent
                  </td>
                ),
              )}
            </tr>
          ))}
        </tbody>
      </table>
      <h2>Time to first token (window of {s.length - 1} samples)</h2>
      {modes.length === 0 ? (
        <p>No request has had its first token yet.</p>
      ) : (
        <table data-testid="ttft">
          <thead>
            <tr>
              <th>mode</th>
              <th>requests</th>
              <th>p50 ms</th>
              <th>p95 ms</th>
              <th>p99 ms</th>
            </tr>
          </thead>
          <tbody>
            {modes.map(([m, q]) => (
              <tr key={m}>
                <td>{m}</td>
                <td>{q.count}</td>
                <td>{f1(q.p50)}</td>
                <td>{f1(q.p95)}</td>
                <td>{f1(q.p99)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <h2>Last hour (one sample every {h.interval_ms / 1000} s)</h2>
      <div class="charts">
        <Chart title="requests/s" x={ser.x} lines={[{ label: "requests/s", values: ser.y.rps, color: "#2563eb" }]} />
        <Chart
          title="reuse"
          x={ser.x}
          yRange={[0, 1]}
          lines={[
            { label: "segment hit ratio", values: ser.y.hit, color: "#16a34a" },
            { label: "cached-token share", values: ser.y.cached, color: "#9333ea" },
          ]}
        />
        <Chart
          title="seam tokens/s"
          x={ser.x}
          lines={[{ label: "seam tokens/s", values: ser.y.seam, color: "#ea580c" }]}
        />
        <Chart
          title="scheduler"
          x={ser.x}
          lines={[
            { label: "queue depth", values: ser.y.queue, color: "#dc2626" },
            { label: "running", values: ser.y.running, color: "#0891b2" },
          ]}
        />
      </div>
    </section>
  );
}
