// What the console compares between two versions of a policy. A Wasm module's
// code is compiled bytecode: a byte diff of it says nothing an operator can act
// on, so a version is rendered as the lines of what it declares and contains
// (name, parameter values and schema, module hash and size, exports, sections),
// and changed code shows as a changed SHA-256 and code size.
import type { PolicyDetail } from "./api";
import { describe as describeParam } from "./params";

/** The lines of a policy version that the version diff compares. */
export function policyLines(d: PolicyDetail): string[] {
  const out = [`name: ${d.name}`, `kind: ${d.kind}`];
  const given = safeParse(d.params);
  out.push("parameter values:");
  const values = d.effective_params ?? given;
  for (const k of Object.keys(values).sort()) {
    const dflt = d.param_schema && !(k in given) ? " (default)" : "";
    out.push(`  ${k} = ${JSON.stringify(values[k])}${dflt}`);
  }
  out.push(d.param_schema ? "parameter schema:" : "parameter schema: none declared (ABI v1 integer parameters)");
  for (const p of d.param_schema?.params ?? []) {
    out.push(`  ${p.name}: ${describeParam(p)}${p.description ? ` — ${p.description}` : ""}`);
  }
  out.push(
    `module sha256: ${d.module_sha256}`,
    `module bytes: ${d.module.bytes}`,
    `functions: ${d.module.functions}, code bytes: ${d.module.code_bytes}`,
    `memory: ${d.module.memory_min_pages ?? "none"} initial pages`,
    `imports: ${d.module.imports}`,
  );
  out.push("exports:");
  for (const e of d.module.exports) out.push(`  ${e.kind} ${e.name}`);
  out.push("custom sections:");
  for (const c of d.module.custom_sections) out.push(`  ${c.name} (${c.bytes} bytes)`);
  return out;
}

function safeParse(t: string): Record<string, unknown> {
  try {
    const v = JSON.parse(t);
    return v && typeof v === "object" && !Array.isArray(v) ? v : {};
  } catch {
    return {};
  }
}
