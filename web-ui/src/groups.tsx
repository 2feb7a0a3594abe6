// Groups (operator): tenants grouped for segment grants; create, delete, members.
import { useState } from "preact/hooks";
import { api, type Group } from "./api";
import { ErrorBox, useLoad, when } from "./ui";
import { checkId } from "./validate";

export function Groups() {
  const list = useLoad(() => api<Group[]>("GET", "/v1/admin/groups"), []);
  const [id, setId] = useState("");
  const [member, setMember] = useState<Record<string, string>>({});
  const [error, setError] = useState<unknown>(null);
  const act = async (method: string, path: string, body?: unknown) => {
    try {
      await api(method, path, body);
      setError(null);
      list.reload();
    } catch (e) {
      setError(e);
    }
  };
  const create = (e: Event) => {
    e.preventDefault();
    const bad = checkId("id", id);
    if (bad) return setError(bad);
    act("POST", "/v1/admin/groups", { id }).then(() => setId(""));
  };
  const g = (x: string) => `/v1/admin/groups/${encodeURIComponent(x)}`;
  return (
    <section>
      <h1>Groups</h1>
      <p>A grant of a segment to a group lets every member tenant read it, in the member's own cache namespace.</p>
      <ErrorBox error={list.error} />
      <ErrorBox error={error} />
      <table data-testid="groups">
        <thead>
          <tr>
            <th>group</th>
            <th>name</th>
            <th>members</th>
            <th>created</th>
            <th />
          </tr>
        </thead>
        <tbody>
          {(list.data ?? []).map((x) => (
            <tr key={x.id}>
              <td>{x.id}</td>
              <td>{x.name}</td>
              <td>
                {x.members.map((m) => (
                  <span key={m} class="chip">
                    {m}{" "}
                    <button type="button" aria-label={`remove ${m} from ${x.id}`} onClick={() => act("DELETE", `${g(x.id)}/members/${encodeURIComponent(m)}`)}>
                      ×
                    </button>
                  </span>
                ))}
                <form
                  class="inline"
                  onSubmit={(e) => {
                    e.preventDefault();
                    const t = (member[x.id] ?? "").trim();
                    const bad = checkId("tenant", t);
                    if (bad) return setError(bad);
                    act("PUT", `${g(x.id)}/members/${encodeURIComponent(t)}`).then(() => setMember({ ...member, [x.id]: "" }));
                  }}
                >
                  <input
                    name={`member-${x.id}`}
                    aria-label={`add a tenant to ${x.id}`}
                    placeholder="tenant"
                    size={12}
                    value={member[x.id] ?? ""}
                    onInput={(e) => setMember({ ...member, [x.id]: e.currentTarget.value })}
                  />{" "}
                  <button type="submit">Add</button>
                </form>
              </td>
              <td>
                {when(x.created_at)} by {x.created_by}
              </td>
              <td>
                <button
                  type="button"
                  class="danger"
                  onClick={() => window.confirm(`Delete group ${x.id}?`) && act("DELETE", g(x.id))}
                >
                  Delete
                </button>
              </td>
            </tr>
          ))}
        </tbody>
      </table>
      <form class="card" onSubmit={create} aria-label="create a group">
        <label>
          new group id <input name="group-id" value={id} onInput={(e) => setId(e.currentTarget.value)} required />
        </label>
        <button type="submit">Create group</button>
      </form>
    </section>
  );
}
