// The generated API types (src/api.gen.ts) must be what openapi-typescript makes
// of openapi.json, the copy of the server's /openapi.json that a Rust test
// (control/tests/integration/openapi.rs) keeps current. After the API changes:
// HYPIC_WRITE_OPENAPI=1 cargo test -p hypic-control --test integration
// openapi::the_consoles_copy, then `npm run gen:api`, and commit both files.
import openapiTS from "openapi-typescript";
import { describe, expect, it } from "vitest";
import doc from "../openapi.json?raw";
import generated from "./api.gen.ts?raw";

describe("generated API types", () => {
  it("are current against openapi.json (run `npm run gen:api`)", async () => {
    const fresh = await openapiTS(JSON.parse(doc));
    expect(generated).toBe(fresh);
  });
});
