import { describe, expect, it } from "vitest";
import { OPERATOR_SCREENS, refusalProbe, signInErrorAfterInput } from "./access";

describe("operator screens", () => {
  it("asks one route for a tenant on an operator screen, none for an operator", () => {
    for (const section of ["overview", "policies", "groups", "audit"]) {
      expect(refusalProbe(section, "tenant")).toBe(OPERATOR_SCREENS[section]);
      expect(refusalProbe(section, "operator")).toBeNull();
    }
    // A tenant's own screens are shown as they are.
    expect(refusalProbe("segments", "tenant")).toBeNull();
    expect(refusalProbe("tenants", "tenant")).toBeNull();
  });
});

describe("sign-in error", () => {
  it("is cleared when the token field is emptied, kept while it holds text", () => {
    const e = { status: 401 };
    expect(signInErrorAfterInput(e, "")).toBeNull();
    expect(signInErrorAfterInput(e, "  \n")).toBeNull();
    expect(signInErrorAfterInput(e, "eyJ")).toBe(e);
    expect(signInErrorAfterInput(null, "eyJ")).toBeNull();
  });
});
