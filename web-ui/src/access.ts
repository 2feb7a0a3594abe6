// What a token may open: the operator screens and the one API route that stands
// for each, and the sign-in form's error state.

/**
 * The operator screens (hash section → the route the API refuses a tenant token
 * with 403). A tenant token that opens one is shown that single 403, asked once,
 * instead of the screen whose every panel would fail alike.
 */
export const OPERATOR_SCREENS: Readonly<Record<string, string>> = {
  overview: "/v1/metrics/history",
  policies: "/v1/admin/policies/stats",
  groups: "/v1/admin/groups",
  audit: "/v1/admin/audit?limit=1",
};

/** The route to ask before showing `section` to `role`; null when the screen is shown as it is. */
export function refusalProbe(section: string, role: string): string | null {
  if (role === "operator") return null;
  return OPERATOR_SCREENS[section] ?? null;
}

/**
 * The sign-in form's error after the token field changed to `token`: an emptied
 * field clears the previous answer (a 401 is about a token no longer there).
 */
export function signInErrorAfterInput<E>(error: E | null, token: string): E | null {
  return token.trim() === "" ? null : error;
}
