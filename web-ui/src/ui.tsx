// Small shared pieces: error display, the chart, hooks.
import { useEffect, useRef, useState } from "preact/hooks";
import uPlot from "uplot";
import { ApiError } from "./api";
import type { FieldError } from "./validate";

/** An error from the API, shown verbatim: status, type, code, the field it names, message. */
export function ErrorBox({ error }: { error: unknown }) {
  if (!error) return null;
  if (error instanceof ApiError) {
    const b = error.body;
    return (
      <div class="error" role="alert" data-testid="api-error">
        <strong>
          {error.status}
          {b.type ? ` ${b.type}` : ""}
          {b.code ? ` (${b.code})` : ""}
        </strong>
        {b.param ? <span class="param"> field: {b.param}</span> : null}
        <div class="msg">{b.message}</div>
      </div>
    );
  }
  const fe = error as FieldError;
  if (fe && typeof fe === "object" && "field" in fe)
    return (
      <div class="error" role="alert" data-testid="field-error">
        <span class="param">field: {fe.field}</span>
        <div class="msg">{fe.message}</div>
      </div>
    );
  return (
    <div class="error" role="alert">
      <div class="msg">{String((error as Error)?.message ?? error)}</div>
    </div>
  );
}

/** Runs `load` now and whenever `deps` change; `reload()` runs it again. */
export function useLoad<T>(load: () => Promise<T>, deps: unknown[]) {
  const [data, setData] = useState<T | null>(null);
  const [error, setError] = useState<unknown>(null);
  const [tick, setTick] = useState(0);
  useEffect(() => {
    let live = true;
    load().then(
      (d) => live && (setData(d), setError(null)),
      (e) => live && setError(e),
    );
    return () => {
      live = false;
    };
  }, [...deps, tick]);
  return { data, error, reload: () => setTick((t) => t + 1) };
}

/** A time-series line chart (uPlot); `x` in Unix seconds. */
export function Chart(props: {
  title: string;
  x: number[];
  lines: { label: string; values: (number | null)[]; color: string }[];
  yRange?: [number, number];
}) {
  const el = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const labels = props.lines.map((l) => l.label).join("|");
  useEffect(() => {
    if (!el.current) return;
    const opts: uPlot.Options = {
      width: Math.max(320, el.current.clientWidth || 560),
      height: 180,
      legend: { show: true },
      scales: props.yRange ? { y: { range: props.yRange } } : {},
      series: [{}, ...props.lines.map((l) => ({ label: l.label, stroke: l.color, width: 2, spanGaps: true }))],
      axes: [{}, { size: 56 }],
    };
    plot.current = new uPlot(opts, [[], ...props.lines.map(() => [])], el.current);
    return () => {
      plot.current?.destroy();
      plot.current = null;
    };
  }, [labels]);
  useEffect(() => {
    plot.current?.setData([props.x, ...props.lines.map((l) => l.values)] as uPlot.AlignedData);
  });
  return (
    <figure class="chart">
      <figcaption>{props.title}</figcaption>
      <div ref={el} />
    </figure>
  );
}

/** Milliseconds since the epoch as local date and time. */
export function when(ms: number | null | undefined): string {
  if (!ms) return "—";
  return new Date(ms).toLocaleString();
}

/**
 * A panel opened over the page's flow (a diff, a parameter form): focus moves to
 * its heading when it opens, Escape closes it, and focus goes back to the control
 * that opened it when it closes. Spread `panel` on the panel's element (with
 * `role="dialog"` where it is not a form) and put `tabIndex={-1}` and `titleRef`
 * on its heading.
 */
export function useDialog(close: () => void) {
  const titleRef = useRef<HTMLHeadingElement>(null);
  // The opener is read while the panel first renders, in the same task as the
  // click or key press that opened it, not later in the effect: by then focus may
  // already have moved.
  const [opener] = useState(() => document.activeElement as HTMLElement | null);
  useEffect(() => {
    titleRef.current?.focus();
    return () => {
      if (opener && opener !== document.body && opener.isConnected) opener.focus();
    };
  }, []);
  const onKeyDown = (e: KeyboardEvent) => {
    if (e.key === "Escape") {
      e.preventDefault();
      e.stopPropagation();
      close();
    }
  };
  return { titleRef, panel: { onKeyDown } };
}
