// The HYPIC operator console: sign-in, navigation (hash routes), screens.
import { render, type ComponentChildren } from "preact";
import { useEffect, useRef, useState } from "preact/hooks";
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { refusalProbe, signInErrorAfterInput } from "./access";
import { api, getToken, setToken, type Principal } from "./api";
import { Audit } from "./audit";
import { Groups } from "./groups";
import { Overview } from "./overview";
import { Policies } from "./policies";
import { SegmentDetail, Segments } from "./segments";
import { segmentIdOf } from "./validate";
import { Tenants } from "./tenants";
import { ErrorBox, useLoad } from "./ui";

function SignIn({ done, initialError }: { done: (p: Principal) => void; initialError: unknown }) {
  const [token, setTok] = useState("");
  const [error, setError] = useState<unknown>(initialError);
  const submit = async (e: Event) => {
    e.preventDefault();
    setToken(token.trim());
    try {
      done(await api<Principal>("GET", "/v1/whoami"));
    } catch (err) {
      setToken(null);
      setError(err);
    }
  };
  return (
    <main class="signin">
      <form class="card" onSubmit={submit} aria-label="sign in">
        <h1>HYPIC console</h1>
        <p>
          Paste an operator or tenant token (the server prints both at its first start;{" "}
          <code>hypic token --data-dir DIR</code>, with the server's data directory, mints more). It is kept in this
          tab's session storage only.
        </p>
        <label class="wide">
          token
          <textarea
            name="token"
            rows={4}
            autocomplete="off"
            spellcheck={false}
            value={token}
            onInput={(e) => {
              const v = e.currentTarget.value;
              setTok(v);
              setError((prev: unknown) => signInErrorAfterInput(prev, v));
            }}
            onKeyDown={(e) => {
              // A token is one line: Enter signs in (Shift+Enter is a newline).
              if (e.key === "Enter" && !e.shiftKey) {
                e.preventDefault();
                e.currentTarget.form?.requestSubmit();
              }
            }}
            aria-describedby="token-help"
            required
          />
        </label>
        <p id="token-help" class="muted">
          Enter signs in.
        </p>
        <button type="submit">Sign in</button>
        <ErrorBox error={error} />
      </form>
    </main>
  );
}

function useHash(): [string, (h: string) => void] {
  const [hash, setHash] = useState(location.hash);
  useEffect(() => {
    const on = () => setHash(location.hash);
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return [hash, (h: string) => (location.hash = h)];
}

/**
 * An operator screen opened with a tenant token: the API's answer to the one route
 * standing for the screen (a 403), shown once, instead of every panel failing.
 */
function Refused({ probe, title, children }: { probe: string; title: string; children: () => ComponentChildren }) {
  const r = useLoad(() => api<unknown>("GET", probe), [probe]);
  if (r.data !== null) return <>{children()}</>;
  return (
    <section>
      <h1>{title}</h1>
      {r.error ? <ErrorBox error={r.error} /> : <p>Checking access…</p>}
    </section>
  );
}

function Screen({ hash, go, me }: { hash: string; go: (h: string) => void; me: Principal }) {
  const parts = hash.replace(/^#\/?/, "").split("/");
  const probe = refusalProbe(parts[0] || "overview", me.role);
  if (probe) {
    const title = (parts[0] || "overview").replace(/^./, (c) => c.toUpperCase());
    return (
      <Refused key={probe} probe={probe} title={title}>
        {() => <ScreenFor parts={parts} go={go} me={me} />}
      </Refused>
    );
  }
  return <ScreenFor parts={parts} go={go} me={me} />;
}

function ScreenFor({ parts, go, me }: { parts: string[]; go: (h: string) => void; me: Principal }) {
  switch (parts[0]) {
    case "segments": {
      if (!parts[1]) return <Segments go={go} me={me} />;
      const id = segmentIdOf(parts[1]);
      if (id === null) {
        return (
          <section>
            <h1 tabIndex={-1}>Segments</h1>
            <p class="error" role="alert" data-testid="bad-segment-id">
              “{parts[1]}” is not a segment id.
            </p>
          </section>
        );
      }
      return <SegmentDetail key={id} id={id} go={go} me={me} />;
    }
    case "policies":
      return <Policies />;
    case "audit":
      return <Audit />;
    case "groups":
      return <Groups />;
    case "tenants":
      return <Tenants me={me} />;
    default:
      return <Overview />;
  }
}

function App() {
  const [me, setMe] = useState<Principal | null>(null);
  const [error, setError] = useState<unknown>(null);
  const [checking, setChecking] = useState(!!getToken());
  const [hash, go] = useHash();
  const mainRef = useRef<HTMLElement>(null);
  const first = useRef(true);
  // After a navigation, focus goes to the new screen (its first heading), so a
  // keyboard user continues there instead of at the top of the page.
  useEffect(() => {
    if (first.current) {
      first.current = false;
      return;
    }
    const h = mainRef.current?.querySelector("h1") as HTMLElement | null;
    if (h) {
      h.tabIndex = -1;
      h.focus();
    }
  }, [hash]);
  useEffect(() => {
    if (!getToken()) return;
    api<Principal>("GET", "/v1/whoami").then(
      (p) => (setMe(p), setChecking(false)),
      (e) => (setToken(null), setError(e), setChecking(false)),
    );
  }, []);
  if (checking) return <p>Checking the token…</p>;
  if (!me)
    return <SignIn done={setMe} initialError={error} />;
  // A tenant's token is refused the operator screens by the API (403); the
  // navigation offers them to operators only, and a tenant starts at Segments.
  const op = me.role === "operator";
  const nav = op
    ? [
        ["#/overview", "Overview"],
        ["#/segments", "Segments"],
        ["#/policies", "Policies"],
        ["#/groups", "Groups"],
        ["#/tenants", "Tenants"],
        ["#/audit", "Audit"],
      ]
    : [
        ["#/segments", "Segments"],
        ["#/tenants", "Usage"],
      ];
  const shown = hash && hash !== "#/" ? hash : op ? "#/overview" : "#/segments";
  const section = "#/" + shown.replace(/^#\/?/, "").split("/")[0];
  return (
    <>
      <a
        class="skip"
        href="#main"
        onClick={(e) => {
          // Not a hash route: move focus to the screen instead.
          e.preventDefault();
          mainRef.current?.focus();
        }}
      >
        Skip to the screen
      </a>
      <header>
        <span class="brand">HYPIC</span>
        <nav aria-label="screens">
          {nav.map(([h, label]) => (
            <a key={h} href={h} aria-current={section === h ? "page" : undefined}>
              {label}
            </a>
          ))}
        </nav>
        <span class="who" data-testid="whoami">
          {me.sub} · {me.tenant} · {me.role}
        </span>
        <button
          type="button"
          onClick={() => {
            setToken(null);
            setError(null);
            setMe(null);
          }}
        >
          Sign out
        </button>
      </header>
      <main id="main" ref={mainRef} tabIndex={-1}>
        <Screen hash={shown} go={go} me={me} />
      </main>
    </>
  );
}

render(<App />, document.getElementById("app")!);
