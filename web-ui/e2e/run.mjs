// End-to-end test of the operator console: a real `hypic serve` on loopback
// (bundled model, SQLite catalog in a temporary data directory) driven through
// Debian's chromium with playwright-core. Screenshots go to docs/ui/.
//
//   HYPIC_BIN=target/debug/hypic node web-ui/e2e/run.mjs
//
// Environment: HYPIC_BIN (the binary, default target/debug/hypic), CHROMIUM
// (default: `chromium` on PATH), SHOTS (screenshot folder, default docs/ui).
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, mkdirSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const bin = resolve(root, process.env.HYPIC_BIN ?? "target/debug/hypic");
const shots = resolve(root, process.env.SHOTS ?? "docs/ui");
const browserPath = process.env.CHROMIUM ?? execFileSync("which", ["chromium"]).toString().trim();
mkdirSync(shots, { recursive: true });

const freePort = () =>
  new Promise((ok, fail) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => ok(port));
    });
    s.on("error", fail);
  });

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
let step = "start";
const log = (m) => console.log(`e2e: ${m}`);

const dataDir = mkdtempSync(join(tmpdir(), "hypic-ui-e2e-"));
const port = await freePort();
const base = `http://127.0.0.1:${port}`;
let serverLog = "";
const server = spawn(bin, ["serve", "--data-dir", dataDir, "--bind", `127.0.0.1:${port}`], {
  cwd: root,
  stdio: ["ignore", "pipe", "pipe"],
});
server.stdout.on("data", (d) => (serverLog += d));
server.stderr.on("data", (d) => (serverLog += d));
let browser;

async function main() {
  step = "wait for /ready";
  for (let i = 0; ; i++) {
    try {
      if ((await fetch(`${base}/ready`)).ok) break;
    } catch {
      // not listening yet
    }
    if (server.exitCode !== null || i > 600) throw new Error(`server did not get ready:\n${serverLog}`);
    await sleep(250);
  }
  const token = (tenant, role) =>
    execFileSync(bin, ["token", "--data-dir", dataDir, "--tenant", tenant, "--role", role, "--sub", `${tenant}-ui`])
      .toString()
      .trim();
  const op = token("ops", "operator");
  const tenant = token("demo", "tenant");
  const call = (tok, method, path, body) =>
    fetch(`${base}${path}`, {
      method,
      headers: { authorization: `Bearer ${tok}`, "content-type": "application/json" },
      body: body ? JSON.stringify(body) : undefined,
    });

  step = "the console's API types are current against the server's /openapi.json";
  {
    // web-ui/openapi.json is the document src/api.gen.ts is generated from
    // (`npm run gen:api`; src/api.gen.test.ts checks that step).
    const live = await (await fetch(`${base}/openapi.json`)).json();
    const copy = JSON.parse(readFileSync(join(root, "web-ui/openapi.json"), "utf8"));
    assert.deepEqual(copy, live, "web-ui/openapi.json is stale: write it from the server's /openapi.json and run `npm run gen:api`");
  }

  step = "API: a tenant token gets 403 on operator routes";
  for (const [m, p, b] of [
    ["GET", "/v1/metrics/history"],
    ["GET", "/v1/admin/policies"],
    ["GET", "/v1/admin/audit"],
    ["GET", "/v1/admin/policies/stats"],
    ["POST", "/v1/admin/policies/rollback", { kind: "eviction" }],
  ]) {
    const r = await call(tenant, m, p, b);
    assert.equal(r.status, 403, `${m} ${p}`);
    assert.equal((await r.json()).error.code, "operator_required");
  }
  assert.equal((await call(op, "GET", "/v1/metrics/history")).status, 200);

  step = "the page and its headers";
  browser = await chromium.launch({
    executablePath: browserPath,
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--disable-component-update",
      "--no-first-run",
    ],
  });
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await ctx.newPage();
  const problems = [];
  page.on("console", (m) => m.type() === "error" && problems.push(m.text()));
  page.on("pageerror", (e) => problems.push(String(e)));
  const requests = [];
  page.on("request", (r) => requests.push(r.url()));
  const resp = await page.goto(`${base}/ui/`);
  const csp = resp.headers()["content-security-policy"];
  assert.ok(csp?.includes("script-src 'self'") && csp.includes("default-src 'none'"), csp);

  step = "the console's icon is embedded and served (the CSP allows it)";
  {
    assert.ok(csp.includes("img-src 'self'"), csp);
    const href = await page.evaluate(() => document.querySelector("link[rel=icon]")?.getAttribute("href"));
    assert.equal(href, "/ui/favicon.svg");
    for (const [path, type] of [
      [href, "image/svg+xml"],
      ["/ui/favicon.ico", "image/x-icon"],
      ["/favicon.ico", "image/x-icon"],
    ]) {
      const r = await fetch(`${base}${path}`);
      assert.equal(r.status, 200, path);
      assert.equal(r.headers.get("content-type"), type, path);
      assert.ok((await r.arrayBuffer()).byteLength > 0, path);
    }
  }

  step = "sign in: a refused token's 401 goes away when the field is emptied";
  await page.fill("textarea[name=token]", "not-a-token");
  await page.click("button:has-text('Sign in')");
  await page.getByTestId("api-error").filter({ hasText: "401" }).waitFor();
  await page.fill("textarea[name=token]", "");
  await page.getByTestId("api-error").waitFor({ state: "detached" });

  step = "sign in (operator)";
  await page.fill("textarea[name=token]", op);
  await page.click("button:has-text('Sign in')");
  await page.getByTestId("whoami").filter({ hasText: "operator" }).waitFor();
  assert.equal(await page.evaluate(() => sessionStorage.getItem("hypic.token")), op);

  step = "overview moves after completions";
  for (let i = 0; i < 3; i++) {
    const r = await call(tenant, "POST", "/v1/completions", {
      prompt: "Zentrix was founded by Mara Quell.<<PIC_SEP>>Question: who founded Zentrix?",
      max_tokens: 4,
      temperature: 0,
    });
    assert.equal(r.status, 200, await r.text());
  }
  await page.getByTestId("stat-finished").locator(".value").filter({ hasText: /^[3-9]|\d\d/ }).waitFor({ timeout: 15000 });
  await page.getByTestId("ttft").waitFor();
  const finished = Number(await page.getByTestId("stat-finished").locator(".value").textContent());
  assert.ok(finished >= 3, `finished ${finished}`);

  step = "overview: seam tokens and pools by tier";
  {
    // Two documents after a system prompt, then reordered: each document is a
    // middle segment with a seam window (a miss, then a hit).
    const sys = "You answer from the documents below.";
    const docs = [
      "Zentrix makes tidal turbines for harbours along the north sea coast.",
      "The Lyon office of Zentrix opened in 1990 with twelve engineers.",
    ];
    let seam = 0;
    for (const order of [docs, [...docs].reverse()]) {
      const r = await call(tenant, "POST", "/v1/completions", {
        segments: [{ text: sys }, ...order.map((text) => ({ text })), { text: "Question: where is the office?" }],
        max_tokens: 2,
        temperature: 0,
      });
      const v = await r.json();
      assert.equal(r.status, 200, JSON.stringify(v));
      seam += v.hypic.segments.reduce((a, x) => a + x.seam, 0);
    }
    assert.ok(seam > 0, "the documents had seam windows");
    const hist = await (await call(op, "GET", "/v1/metrics/history")).json();
    const now = hist.samples[hist.samples.length - 1];
    assert.ok(now.seam_tokens >= seam, `history seam_tokens ${now.seam_tokens} < ${seam}`);
    // The stat shows the server's total (it polls every 2 s).
    const seamStat = page.getByTestId("stat-seam").locator(".value");
    await seamStat.filter({ hasText: new RegExp(`/ ${now.seam_tokens}$`) }).waitFor({ timeout: 15000 });
    // Tiers: what the server reports, and "absent" for the tiers it does not
    // have (the CPU backend has no GPU tier; this server has no spill tier).
    for (const pool of ["public", "private"]) {
      const tiers = now.pools[pool].tiers;
      assert.ok(!("gpu" in tiers) && "host" in tiers, JSON.stringify(tiers));
      for (const tier of ["gpu", "host", "spill"]) {
        const cell = page.getByTestId(`tier-${pool}-${tier}`);
        if (tier in tiers) assert.match(await cell.textContent(), /entr(y|ies)$/, `${pool} ${tier}`);
        else assert.equal(await cell.textContent(), "absent", `${pool} ${tier}`);
      }
    }
    await page.getByTestId("tier-public-host").filter({ hasText: /[1-9]\d* entr/ }).waitFor({ timeout: 15000 });
  }
  await page.screenshot({ path: join(shots, "overview.png"), fullPage: true });

  step = "register a segment and see its residency";
  await page.click("nav >> text=Segments");
  await page.fill("form[aria-label='register a segment'] input[name=id]", "zentrix");
  await page.fill("form[aria-label='register a segment'] input[name=name]", "Zentrix fact sheet");
  await page.fill("form[aria-label='register a segment'] textarea[name=content]", "Zentrix was founded by Mara Quell in 1987.");
  await page.click("form[aria-label='register a segment'] button[type=submit]");
  await page.waitForURL(/#\/segments\/zentrix$/);
  await page.getByTestId("residency").filter({ hasText: "resident" }).waitFor();
  assert.match(await page.getByTestId("residency").textContent(), /^resident/);
  await page.fill("textarea[name=new-content]", "Zentrix was founded by Mara Quell in 1987, in Lyon.");
  await page.click("button:has-text('Save as version 2')");
  await page.getByTestId("versions").locator("tbody tr").nth(1).waitFor();
  await page.click("button[aria-label='diff version 1 to 2']");
  const diff = page.getByTestId("version-diff");
  await diff.locator(".diff-add").waitFor();
  assert.equal(await diff.locator(".diff-del").textContent(), "- Zentrix was founded by Mara Quell in 1987.");
  assert.equal(await diff.locator(".diff-add").textContent(), "+ Zentrix was founded by Mara Quell in 1987, in Lyon.");
  assert.match(await diff.locator("h2").textContent(), /\+1 −1 lines/);
  await page.screenshot({ path: join(shots, "segment.png"), fullPage: true });
  step = "prefill an existing segment from its screen";
  {
    const r = await call(op, "POST", "/v1/segments", {
      id: "warm-me",
      content: "Warm me: the Zentrix turbine manual, chapter one, installation and safety.",
      prefill: false,
    });
    assert.equal(r.status, 200, await r.text());
    await page.goto(`${base}/ui/#/segments/warm-me`);
    await page.getByTestId("residency").filter({ hasText: "not resident" }).waitFor();
    await page.click("button:has-text('Prefill now')");
    const note = page.getByTestId("prefill-note");
    await note.filter({ hasText: "stored" }).waitFor();
    assert.match(await note.textContent(), /^Prefilled v1 for tenant ops, \d+ ms — body start 0: stored \([\d.]+ (B|KiB|MiB)\); body start 8: stored/);
    await page.getByTestId("residency").filter({ hasText: /^resident/ }).waitFor();
    // Again: the entries are there already, and the server says so.
    await page.click("button:has-text('Prefill now')");
    await note.filter({ hasText: "body start 0: already resident" }).waitFor();
    const again = await (await call(op, "POST", "/v1/segments/warm-me/prefill")).json();
    assert.deepEqual(again.prefill.entries.map((e) => e.status), ["present", "present"]);
    await page.screenshot({ path: join(shots, "segment-prefill.png"), fullPage: true });
  }
  await page.click("text=← Segments");
  await page.fill("input[name=search]", "zentr");
  await page.getByTestId("segments").locator("tbody tr", { hasText: "Zentrix fact sheet" }).waitFor();

  step = "an API error is shown verbatim";
  await page.fill("form[aria-label='register a segment'] input[name=id]", "zentrix");
  await page.fill("form[aria-label='register a segment'] textarea[name=content]", "again");
  await page.click("form[aria-label='register a segment'] button[type=submit]");
  const err = page.getByTestId("api-error");
  await err.waitFor();
  const direct = await (await call(op, "POST", "/v1/segments", { id: "zentrix", content: "again" })).json();
  assert.ok((await err.textContent()).includes(direct.error.message), await err.textContent());
  await page.screenshot({ path: join(shots, "segments.png"), fullPage: true });

  step = "the same segment id owned by two tenants: two rows, each opens its own segment";
  {
    const acme = token("acme", "tenant");
    for (const [tok, content] of [
      [acme, "Acme's twin: the warehouse opens at seven."],
      [op, "Ops's twin: the night shift ends at six."],
    ]) {
      const r = await call(tok, "POST", "/v1/segments", { id: "twin", content, prefill: false });
      assert.equal(r.status, 200, await r.text());
    }
    await page.click("button:has-text('Refresh')");
    await page.fill("input[name=search]", "twin");
    const twins = page.getByTestId("segments").locator("tbody tr", { hasText: "twin" });
    await twins.nth(1).waitFor();
    assert.deepEqual((await twins.evaluateAll((rows) => rows.map((r) => r.dataset.key))).sort(), ["acme/twin", "ops/twin"]);
    await page.getByTestId("segments").locator("tbody tr[data-key='acme/twin'] a").click();
    await page.locator("h1", { hasText: "Segment acme/twin" }).waitFor();
    await page.getByTestId("segment-detail").filter({ hasText: "acme" }).waitFor();
    await page.locator("text=← Segments").click();
    await page.fill("input[name=search]", "twin");
    await page.getByTestId("segments").locator("tbody tr[data-key='ops/twin'] a").click();
    await page.waitForURL(/#\/segments\/twin$/);
    await page.locator("h1", { hasText: /^Segment twin$/ }).waitFor();
  }

  step = "a reordered request hits; the why view explains a forced miss";
  {
    // Two operator-owned segments, not prefilled: the first request builds them.
    const docA = "Zentrix makes tidal turbines for harbours in the north sea region.";
    const docB = "Mara Quell ran Zentrix engineering from its Lyon office for ten years.";
    for (const [id, content] of [
      ["why-a", docA],
      ["why-b", docB],
    ]) {
      const r = await call(op, "POST", "/v1/segments", { id, content, prefill: false });
      assert.equal(r.status, 200, await r.text());
    }
    const ask = async (ids, question = "Question: who ran Zentrix engineering?") => {
      const r = await call(op, "POST", "/v1/completions", {
        segments: [...ids.map((id) => (id.startsWith("text:") ? { text: id.slice(5) } : { id })), { text: question }],
        max_tokens: 2,
        temperature: 0,
      });
      const v = await r.json();
      assert.equal(r.status, 200, JSON.stringify(v));
      return v;
    };
    const first = await ask(["why-a", "why-b"]);
    assert.deepEqual(first.hypic.segments.map((x) => x.outcome), ["miss", "miss", "computed"], JSON.stringify(first.hypic));
    const swapped = await ask(["why-b", "why-a"]);
    assert.deepEqual(swapped.hypic.segments.map((x) => x.outcome), ["hit", "hit", "computed"], JSON.stringify(swapped.hypic));
    const cached = swapped.usage.prompt_tokens_details.cached_tokens;
    assert.ok(cached > 0, `cached tokens ${cached}`);
    log(`reordered request: ${cached} of ${swapped.usage.prompt_tokens} prompt tokens cached`);

    // The list shows each row's hits and last use, not only the why view.
    await page.goto(`${base}/ui/#/segments`);
    const rowB = page.getByTestId("segments").locator("tbody tr[data-key='ops/why-b']");
    await rowB.getByTestId("row-hits").filter({ hasText: /^[1-9]\d*$/ }).waitFor();
    assert.notEqual(await rowB.getByTestId("row-last-use").textContent(), "—");
    assert.match(await rowB.getByTestId("row-residency").textContent(), /^resident/);

    // The segment screen: resident, with hits, in the operator's namespace.
    await page.goto(`${base}/ui/#/segments/why-a`);
    await page.getByTestId("residency").filter({ hasText: "resident" }).waitFor();
    const why = page.getByTestId("why");
    await why.locator("button[type=submit]").click();
    await why.getByTestId("why-verdict").filter({ hasText: "Resident for ops" }).waitFor();
    const hits = await why.getByTestId("why-entries").locator("tbody tr").evaluateAll((rows) =>
      rows.map((r) => Number(r.children[3].textContent)),
    );
    assert.ok(hits.some((h) => h >= 1), `hits ${hits}`);
    assert.match(await why.getByTestId("why-recent").textContent(), /request v1: hit/);

    // Another tenant: no permission, said in words.
    await why.locator("input[name=why-tenant]").fill("demo");
    await why.locator("button[type=submit]").click();
    await why.getByTestId("why-reasons").locator("li[data-code=no_permission]").waitFor();

    // Force a miss: evict through the UI, then the same request misses and says why.
    await why.locator("input[name=why-tenant]").fill("");
    page.once("dialog", (d) => d.accept());
    await page.click("button:has-text('Evict cache entries')");
    await page.getByTestId("evicted-note").filter({ hasText: /[1-9]\d* cache entries evicted/ }).waitFor();
    await page.getByTestId("residency").filter({ hasText: "not resident" }).waitFor();
    // A new preface: no snapshot of the running state covers this prefix, so why-a
    // (after another segment) is looked up in the public pool.
    const missed = await ask(["text:Preface: notes for the quarterly review.", "why-a"], "Question: what does Zentrix make?");
    assert.equal(missed.hypic.segments[1].outcome, "miss", JSON.stringify(missed.hypic));
    assert.equal(missed.hypic.segments[1].miss_reason, "invalidated", JSON.stringify(missed.hypic));
    // The miss rebuilt the entries; evict again so the view shows the entries gone.
    page.once("dialog", (d) => d.accept());
    await page.click("button:has-text('Evict cache entries')");
    await page.getByTestId("residency").filter({ hasText: "not resident" }).waitFor();
    await why.locator("button[type=submit]").click();
    const reasons = why.getByTestId("why-reasons");
    await reasons.locator("li[data-code=evicted_on_request]").first().waitFor();
    assert.match(await reasons.locator("li").first().textContent(), /Evicted on request.*by ops-ui/s);
    assert.ok((await reasons.locator("li[data-code=invalidated]").count()) >= 1);
    assert.match(await why.getByTestId("why-recent").textContent(), /request v1: miss \(invalidated\)/);
    assert.match(await why.getByTestId("why-verdict").textContent(), /^Evicted on request/);
    // An API error in the view is shown verbatim, naming the field.
    await why.locator("input[name=why-version]").fill("7");
    await why.locator("button[type=submit]").click();
    const werr = why.getByTestId("api-error");
    await werr.waitFor();
    const direct = await (await call(op, "GET", "/v1/segments/why-a/why?version=7")).json();
    assert.ok((await werr.textContent()).includes(direct.error.message), await werr.textContent());
    assert.match(await werr.textContent(), /field: version/);
    await why.locator("input[name=why-version]").fill("");
    await why.locator("button[type=submit]").click();
    await why.getByTestId("why-reasons").waitFor();
    await why.scrollIntoViewIfNeeded();
    await page.screenshot({ path: join(shots, "why.png"), fullPage: true });
  }

  step = "upload, dry-run, activate, audit, roll back a policy";
  await page.click("nav >> text=Policies");
  await page.getByTestId("active-eviction").waitFor();
  assert.equal(await page.getByTestId("active-eviction").textContent(), "native default");
  // A file that is not Wasm is refused before upload, naming the field.
  await page.setInputFiles("input[name=wasm]", {
    name: "bad.wasm",
    mimeType: "application/wasm",
    buffer: Buffer.from("(module)"),
  });
  await page.getByTestId("field-error").filter({ hasText: "not a WebAssembly binary module" }).waitFor();
  await page.setInputFiles("input[name=wasm]", join(root, "policies/dist/lru.wasm"));
  await page.fill("input[name=policy-name]", "lru-ui");
  await page.selectOption("select[name=kind]", "eviction");
  await page.click("form[aria-label='upload a policy'] button[type=submit]");
  const row = page.getByTestId("kind-eviction").locator("tbody tr", { hasText: "lru-ui" });
  await row.waitFor();
  const id = Number(await row.locator("td").first().textContent());
  await row.locator("button:has-text('Dry-run')").click();
  await page.click("button:has-text('Run dry-run')");
  const dry = page.getByTestId("dry-run-result");
  await dry.waitFor();
  assert.ok((await dry.textContent()).includes("hit ratio"));
  // The server's recorded traffic: the completions above, tenants pseudonymised.
  await page.click("button:has-text('Use recorded traffic')");
  await page.getByTestId("trace-note").filter({ hasText: "recorded prompts" }).waitFor();
  const recorded = await page.inputValue("textarea[name=trace]");
  assert.ok(recorded.split("\n").filter(Boolean).length >= 3, recorded);
  assert.ok(!recorded.includes('"demo"') && recorded.includes('"tenant":"t-'), recorded);
  // The capacity follows the server's public pool (hypic serve's default here).
  const capacity = Number(await page.inputValue("input[name=capacity]"));
  assert.ok(capacity >= 1 << 20 && capacity % (1 << 20) === 0, `capacity ${capacity}`);
  await page.click("button:has-text('Run dry-run')");
  await dry.locator("tr", { hasText: "hit ratio" }).waitFor();
  // Per tenant, beside the aggregate: one row per pseudonymised tenant of the
  // recorded traffic (demo's completions and the operator's), no real names.
  {
    const traced = [...new Set(recorded.split("\n").filter(Boolean).map((l) => JSON.parse(l).tenant))].sort();
    assert.ok(traced.length >= 2 && traced.every((t) => /^t-[0-9a-f]{12}$/.test(t)), JSON.stringify(traced));
    const per = page.getByTestId("dry-run-tenants");
    await per.waitFor();
    const shown = (await per.locator("tbody th").allTextContents()).sort();
    assert.deepEqual(shown, traced);
    const text = await per.textContent();
    assert.ok(!text.includes("demo") && !text.includes("ops"), text);
    // The rows add up to what the aggregate table shows for requests.
    const perRequests = (await per.locator("tbody tr").evaluateAll((rows) => rows.map((r) => Number(r.children[1].textContent)))).reduce((a, b) => a + b, 0);
    assert.equal(perRequests, recorded.split("\n").filter(Boolean).length);
    // Each cell is candidate / active.
    assert.match(await per.locator("tbody tr").first().locator("td").nth(1).textContent(), /^[\d.]+ % \/ [\d.]+ %$/);
  }
  await page.screenshot({ path: join(shots, "policies-dry-run.png"), fullPage: true });
  page.once("dialog", (d) => d.accept());
  await row.locator(`button:has-text('Activate #${id}')`).click();
  await page.getByTestId("active-eviction").filter({ hasText: `#${id} lru-ui` }).waitFor();
  await page.screenshot({ path: join(shots, "policies.png"), fullPage: true });

  await page.click("nav >> text=Audit");
  await page.fill("input[name=action]", "policy.activate");
  await page.click("button:has-text('Filter')");
  const audit = page.getByTestId("audit").locator("tbody tr", { hasText: "policy.activate" });
  await audit.first().waitFor();
  assert.ok((await audit.first().textContent()).includes("ops-ui"), "audit names the operator");
  await page.fill("input[name=action]", "");
  await page.fill("input[name=actor]", "ops-ui");
  await page.click("button:has-text('Filter')");
  await page.getByTestId("audit").locator("tbody tr", { hasText: "policy.dry_run" }).first().waitFor();
  await page.screenshot({ path: join(shots, "audit.png"), fullPage: true });

  await page.click("nav >> text=Policies");
  page.once("dialog", (d) => d.accept());
  await page.click("button:has-text('Roll back eviction')");
  await page.getByTestId("active-eviction").filter({ hasText: "native default" }).waitFor();

  step = "policy parameters through the form (declared schema), validated";
  await page.setInputFiles("input[name=wasm]", join(root, "policies/dist/ttl.wasm"));
  const ttlInput = page.locator("form[aria-label='upload a policy'] input[name=param-ttl_ms]");
  await ttlInput.waitFor();
  assert.equal(await ttlInput.inputValue(), "3600000", "the form starts at the declared default");
  await page.fill("input[name=policy-name]", "ttl-ui");
  await page.selectOption("select[name=kind]", "invalidation");
  await ttlInput.fill("-5");
  await page.click("form[aria-label='upload a policy'] button[type=submit]");
  await page
    .locator("form[aria-label='upload a policy']")
    .getByTestId("field-error")
    .filter({ hasText: "params.ttl_ms" })
    .filter({ hasText: "ttl_ms is below the minimum 0" })
    .waitFor();
  await ttlInput.fill("600000");
  await page.click("form[aria-label='upload a policy'] button[type=submit]");
  const ttlRow = page.getByTestId("kind-invalidation").locator("tbody tr", { hasText: "ttl-ui" });
  await ttlRow.waitFor();
  assert.ok((await ttlRow.textContent()).includes('{"ttl_ms":600000}'), await ttlRow.textContent());
  // v1 active first, so that a rollback from v2 has an earlier version to go to.
  page.once("dialog", (d) => d.accept());
  await ttlRow.locator("button:has-text('Activate #')").click();
  await page.getByTestId("active-invalidation").filter({ hasText: "ttl-ui v1" }).waitFor();
  await ttlRow.locator("button:has-text('Parameters')").click();
  const panel = page.locator("form[aria-label^='parameters of policy']");
  const panelTtl = panel.locator("input[name=param-ttl_ms]");
  await panelTtl.waitFor();
  assert.equal(await panelTtl.inputValue(), "600000");
  // The server's answer to a value its schema refuses is shown with the field it names.
  await panelTtl.fill("1.5");
  await panel.locator("button:has-text('Activate with these parameters')").click();
  await panel.getByTestId("field-error").filter({ hasText: "ttl_ms must be an integer" }).waitFor();
  const rejected = await call(op, "POST", `/v1/admin/policies/${Number(await ttlRow.locator("td").first().textContent())}/activate`, {
    params: { ttl_ms: 1.5 },
  });
  assert.equal(rejected.status, 400);
  assert.equal((await rejected.json()).error.param, "params.ttl_ms");
  await panelTtl.fill("120000");
  page.once("dialog", (d) => d.accept());
  await panel.locator("button:has-text('Activate with these parameters')").click();
  await panel.getByTestId("param-note").filter({ hasText: "activated #" }).waitFor();
  await page.getByTestId("active-invalidation").filter({ hasText: "ttl-ui v2" }).waitFor();
  await page.screenshot({ path: join(shots, "policies-params.png"), fullPage: true });
  await panel.locator("button:has-text('Close')").click();

  step = "activating the active version again is a 409; rollback goes to the earlier different version";
  {
    const activeRow = page.getByTestId("kind-invalidation").locator("tbody tr.active");
    await activeRow.filter({ hasText: "120000" }).waitFor();
    await activeRow.locator("button:has-text('Parameters')").click();
    const again = page.locator("form[aria-label^='parameters of policy']");
    await again.locator("input[name=param-ttl_ms]").waitFor();
    page.once("dialog", (d) => d.accept());
    await again.locator("button:has-text('Activate with these parameters')").click();
    await again.getByTestId("api-error").filter({ hasText: "409" }).filter({ hasText: "already_active" }).waitFor();
    assert.match(await again.getByTestId("api-error").textContent(), /ttl-ui v2 is already the active one/);
    await again.locator("button:has-text('Close')").click();
    const rb = page.getByTestId("rollback-invalidation");
    await rb.filter({ hasText: /^Roll back invalidation to #\d+ ttl-ui v1$/ }).waitFor();
    page.once("dialog", (d) => d.accept());
    await rb.click();
    await page.getByTestId("rolled-back-invalidation").filter({ hasText: /^Rolled back invalidation: #\d+ ttl-ui v2 → #\d+ ttl-ui v1\.$/ }).waitFor();
    await page.getByTestId("active-invalidation").filter({ hasText: "ttl-ui v1" }).waitFor();
    await rb.filter({ hasText: "Roll back invalidation to the native default" }).waitFor();
  }

  step = "a diff between two policy versions";
  // The compare selects start at the two newest versions of the kind: v1 and v2 of ttl-ui.
  await page.getByTestId("kind-invalidation").locator("button:has-text('Diff')").click();
  const pdiff = page.getByTestId("policy-diff");
  await pdiff.locator(".diff-add").first().waitFor();
  assert.deepEqual(await pdiff.locator(".diff-del").allTextContents(), ["-   ttl_ms = 600000"]);
  assert.deepEqual(await pdiff.locator(".diff-add").allTextContents(), ["+   ttl_ms = 120000"]);
  assert.match(await pdiff.locator("h3").textContent(), /ttl-ui v1 → .*ttl-ui v2 \(\+1 −1\)/);
  await page.screenshot({ path: join(shots, "policies-diff.png"), fullPage: true });
  await pdiff.locator("button:has-text('Close diff')").click();

  step = "a shadow policy beside the active one, its counts on live traffic";
  await page.setInputFiles("input[name=wasm]", join(root, "policies/dist/second_sighting.wasm"));
  await page.locator("form[aria-label='upload a policy'] input[name=param-min_sightings]").waitFor();
  await page.fill("input[name=policy-name]", "sighting-ui");
  await page.selectOption("select[name=kind]", "admission");
  await page.click("form[aria-label='upload a policy'] button[type=submit]");
  const sRow = page.getByTestId("kind-admission").locator("tbody tr", { hasText: "sighting-ui" });
  await sRow.waitFor();
  const sid = Number(await sRow.locator("td").first().textContent());
  page.once("dialog", (d) => d.accept());
  await sRow.locator(`button:has-text('Shadow #${sid}')`).click();
  const shadowCard = page.getByTestId("shadow-admission");
  await shadowCard.waitFor();
  for (let i = 0; i < 3; i++) {
    const r = await call(tenant, "POST", "/v1/completions", {
      prompt: `Shadow note ${i}: the ferry leaves at ${i + 6} o'clock.<<PIC_SEP>>Question: when does the ferry leave?`,
      max_tokens: 2,
      temperature: 0,
    });
    assert.equal(r.status, 200, await r.text());
  }
  // The panel refreshes itself: the candidate's rejections (first sightings)
  // beside the active native default's admissions.
  const counts = page.getByTestId("shadow-counts-admission");
  const rejectedRow = counts.locator("tr", { hasText: /^rejected/ });
  await rejectedRow.locator("td").nth(1).filter({ hasText: /^[1-9]\d*$/ }).waitFor({ timeout: 15000 });
  assert.equal(await rejectedRow.locator("td").nth(2).textContent(), "0", "the active policy rejected nothing");
  const callsRow = counts.locator("tr", { hasText: /^calls/ });
  assert.equal(await callsRow.locator("td").nth(1).textContent(), await callsRow.locator("td").nth(2).textContent());
  const api = await (await call(op, "GET", "/v1/admin/policies/shadow/admission")).json();
  assert.equal(api.policy_id, sid);
  assert.ok(api.candidate.rejected >= 1 && api.active.rejected === 0, JSON.stringify(api));
  assert.equal((await call(tenant, "GET", "/v1/admin/policies/shadow")).status, 403);
  await page.screenshot({ path: join(shots, "policies-shadow.png"), fullPage: true });
  page.once("dialog", (d) => d.accept());
  await shadowCard.locator("button:has-text('Stop shadow')").click();
  await shadowCard.waitFor({ state: "detached" });
  assert.equal((await call(op, "GET", "/v1/admin/policies/shadow/admission")).status, 404);

  step = "groups: create one, add a member";
  await page.click("nav >> text=Groups");
  await page.fill("input[name=group-id]", "research");
  await page.click("button:has-text('Create group')");
  const grow = page.getByTestId("groups").locator("tbody tr", { hasText: "research" });
  await grow.waitFor();
  await grow.locator("input[name=member-research]").fill("demo");
  await grow.locator("button:has-text('Add')").click();
  await grow.locator(".chip", { hasText: "demo" }).waitFor();
  await page.screenshot({ path: join(shots, "groups.png"), fullPage: true });

  step = "tenants: principals, groups and usage per tenant";
  await page.click("nav >> text=Tenants");
  const demo = page.getByTestId("tenant-demo");
  await demo.waitFor();
  const demoRequests = Number(await demo.getByTestId("requests").textContent());
  assert.ok(demoRequests >= 6, `demo made at least 6 completions, the screen says ${demoRequests}`);
  assert.ok((await demo.textContent()).includes("research"), "the group joined above");
  const usage = await (await call(op, "GET", "/v1/admin/tenants")).json();
  assert.equal(usage.find((t) => t.tenant === "demo").serving.requests, demoRequests);
  await page.screenshot({ path: join(shots, "tenants.png"), fullPage: true });

  step = "a tenant sees 403 on the operator screens";
  const tctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const tpage = await tctx.newPage();
  tpage.on("request", (r) => requests.push(r.url()));
  await tpage.goto(`${base}/ui/#/policies`);
  await tpage.fill("textarea[name=token]", tenant);
  await tpage.click("button:has-text('Sign in')");
  await tpage.getByTestId("whoami").filter({ hasText: "tenant" }).waitFor();
  const terr = tpage.getByTestId("api-error").first();
  await terr.waitFor();
  assert.match(await terr.textContent(), /403.*operator_required.*this endpoint needs the operator role/s);
  // One message, not one per panel; the same on every operator screen.
  await tpage.waitForTimeout(500);
  assert.equal(await tpage.getByTestId("api-error").count(), 1);
  for (const screen of ["overview", "audit", "groups"]) {
    await tpage.goto(`${base}/ui/#/${screen}`);
    await tpage.getByTestId("api-error").filter({ hasText: "403" }).waitFor();
    await tpage.waitForTimeout(300);
    assert.equal(await tpage.getByTestId("api-error").count(), 1, screen);
  }
  await tpage.goto(`${base}/ui/#/policies`);
  await tpage.getByTestId("api-error").filter({ hasText: "403" }).waitFor();
  await tpage.screenshot({ path: join(shots, "tenant-403.png"), fullPage: true });
  // A tenant's navigation offers Segments only, where the operator's private
  // segment is not listed.
  assert.deepEqual(await tpage.locator("header nav a").allTextContents(), ["Segments", "Usage"]);
  await tpage.click("nav >> text=Segments");
  await tpage.getByText("No segment.").waitFor();
  assert.equal(await tpage.getByTestId("segments").locator("tbody tr").count(), 0);
  // Its usage screen: its own row only; another tenant's usage is refused.
  await tpage.click("nav >> text=Usage");
  await tpage.getByTestId("tenant-demo").waitFor();
  assert.equal(await tpage.getByTestId("tenants").locator("tbody tr").count(), 1);
  assert.equal((await call(tenant, "GET", "/v1/tenants/ops/usage")).status, 403);

  step = "keyboard only: sign in, open a segment, prefill it, a diff opens and Escape closes it";
  {
    for (const [i, content] of ["Keyboard doc, first text.", "Keyboard doc, second text."].entries()) {
      const r = i === 0
        ? await call(op, "POST", "/v1/segments", { id: "kb-doc", content, prefill: false })
        : await call(op, "PUT", "/v1/segments/kb-doc", { content, prefill: false });
      assert.equal(r.status, 200, await r.text());
    }
    const kctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
    const kp = await kctx.newPage();
    kp.on("pageerror", (e) => problems.push(String(e)));
    await kp.goto(`${base}/ui/`);
    const focused = () =>
      kp.evaluate(() => {
        const e = document.activeElement;
        return e ? `${e.tagName.toLowerCase()}|${e.getAttribute("name") ?? ""}|${(e.textContent ?? "").trim()}` : "";
      });
    // Presses Tab until the focused element matches, at most 80 times.
    const tabTo = async (want, what) => {
      for (let i = 0; i < 80; i++) {
        await kp.keyboard.press("Tab");
        if (want.test(await focused())) return;
      }
      throw new Error(`Tab never reached ${what} (last: ${await focused()})`);
    };
    await tabTo(/^textarea\|token\|/, "the token field");
    await kp.keyboard.insertText(op);
    await kp.keyboard.press("Enter");
    await kp.getByTestId("whoami").filter({ hasText: "operator" }).waitFor();
    // The focused control shows a visible focus ring.
    await tabTo(/^a\|\|Segments$/, "the Segments link");
    const ring = await kp.evaluate(() => getComputedStyle(document.activeElement).outlineStyle);
    assert.notEqual(ring, "none", "no visible focus on the nav link");
    await kp.keyboard.press("Enter");
    await kp.waitForURL(/#\/segments$/);
    // Focus moved to the new screen's heading.
    await kp.waitForFunction(() => document.activeElement?.tagName === "H1");
    assert.match(await focused(), /^h1\|\|Segments/);
    await kp.getByTestId("segments").locator("a", { hasText: "kb-doc" }).waitFor();
    await tabTo(/^a\|\|kb-doc$/, "the kb-doc link");
    await kp.keyboard.press("Enter");
    await kp.waitForURL(/#\/segments\/kb-doc$/);
    await kp.getByTestId("residency").filter({ hasText: "not resident" }).waitFor();
    await tabTo(/^button\|\|Prefill now$/, "Prefill now");
    await kp.keyboard.press("Space");
    await kp.getByTestId("prefill-note").filter({ hasText: "v2 for tenant ops" }).waitFor();
    await kp.getByTestId("residency").filter({ hasText: /^resident/ }).waitFor();
    await tabTo(/^button\|\|diff from v1$/, "the diff button");
    await kp.keyboard.press("Enter");
    const kdiff = kp.getByTestId("version-diff");
    await kdiff.locator(".diff-add").waitFor();
    await kp.waitForFunction(() => document.activeElement?.tagName === "H2");
    assert.match(await focused(), /^h2\|\|Version 1 → 2/, "focus moves into the opened diff");
    await kp.keyboard.press("Escape");
    await kdiff.waitFor({ state: "detached" });
    // Focus moves back in the close's own render; the wait only absorbs a slow
    // machine's scheduling, a wrong target still fails with what has focus.
    await kp
      .waitForFunction(() => document.activeElement?.textContent?.trim() === "diff from v1", null, { timeout: 5000 })
      .catch(() => {});
    assert.equal(await focused(), "button||diff from v1", "focus returns to the button that opened it");
    // Readable at 1280 px: nothing wider than the window.
    const wide = await kp.evaluate(() => document.documentElement.scrollWidth);
    assert.ok(wide <= 1280, `page is ${wide} px wide at a 1280 px window`);
    await kp.screenshot({ path: join(shots, "keyboard.png"), fullPage: true });
    const audit = await (await call(op, "GET", "/v1/admin/audit?action=segment.prefill")).json();
    assert.ok(audit.some((r) => r.target.length > 0 && r.actor === "ops-ui"), JSON.stringify(audit));
    await kctx.close();
  }

  step = "every request the console made is logged with its route";
  {
    const unmatched = serverLog.split("\n").filter((l) => l.includes("route=unmatched"));
    assert.deepEqual(unmatched, []);
    assert.ok(/route=\/ui\/ /.test(serverLog) && /route=\/ui\/\{\*path\} /.test(serverLog), "the console's routes in the log");
  }

  step = "no token in a URL or the server log, no console error";
  for (const t of [op, tenant]) {
    assert.ok(!requests.some((u) => u.includes(t)), "a request URL carries the token");
    assert.ok(!serverLog.includes(t), "the server log carries the token");
  }
  assert.ok(requests.every((u) => u.startsWith(base)), `off-origin request: ${requests.filter((u) => !u.startsWith(base))}`);
  // 4xx answers the test provoked show as console errors ("Failed to load
  // resource"); anything else (a CSP violation, an exception) fails.
  const unexpected = problems.filter((p) => !/Failed to load resource: the server responded with a status of 4\d\d/.test(p));
  assert.deepEqual(unexpected, []);
  log(`ok (${readFileSync(join(shots, "overview.png")).length} byte overview screenshot)`);
}

try {
  await main();
} catch (e) {
  console.error(`e2e: FAILED at step "${step}": ${e.stack ?? e}`);
  console.error(`--- server log ---\n${serverLog.slice(-4000)}`);
  process.exitCode = 1;
} finally {
  await browser?.close();
  server.kill("SIGINT");
  await new Promise((r) => (server.exitCode !== null ? r() : server.on("exit", r)));
  rmSync(dataDir, { recursive: true, force: true });
}
