//! `GET /openapi.json`: the document is served without a token by the control
//! plane's router and by `hypic serve`, documents the segment, policy, audit,
//! tenant and metrics routes, and every operation it documents is a route the
//! server answers (not the 404 of an unknown path or a 405).
use crate::common;
use crate::serve_common;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use hypic_control::control_router;
use serde_json::Value;
use tower::ServiceExt;

/// (path, method) pairs every document must hold.
const CONTROL_OPS: &[(&str, &str)] = &[
    // segments
    ("/v1/segments", "post"),
    ("/v1/segments", "get"),
    ("/v1/segments/{id}", "get"),
    ("/v1/segments/{id}", "put"),
    ("/v1/segments/{id}", "delete"),
    ("/v1/segments/{id}/versions", "get"),
    ("/v1/segments/{id}/grants", "get"),
    ("/v1/segments/{id}/grants", "post"),
    ("/v1/segments/{id}/grants/{tenant}", "delete"),
    ("/v1/segments/{id}/group-grants", "post"),
    ("/v1/segments/{id}/group-grants/{group}", "delete"),
    ("/v1/snapshot", "post"),
    // policies, and their counters
    ("/v1/admin/policies", "get"),
    ("/v1/admin/policies", "post"),
    ("/v1/admin/policies/stats", "get"),
    ("/v1/admin/policies/rollback", "post"),
    ("/v1/admin/policies/{id}/activate", "post"),
    ("/v1/admin/policies/{id}/dry-run", "post"),
    ("/v1/admin/policies/{id}", "get"),
    ("/v1/admin/policies/{id}/shadow", "post"),
    ("/v1/admin/policies/shadow", "get"),
    ("/v1/admin/policies/shadow/{kind}", "get"),
    ("/v1/admin/policies/shadow/{kind}", "delete"),
    ("/v1/admin/tenants", "get"),
    ("/v1/tenants/{tenant}/usage", "get"),
    // audit
    ("/v1/admin/audit", "get"),
    // tenants and groups
    ("/v1/whoami", "get"),
    ("/v1/admin/groups", "get"),
    ("/v1/admin/groups", "post"),
    ("/v1/admin/groups/{id}", "get"),
    ("/v1/admin/groups/{id}/members/{tenant}", "put"),
    ("/v1/admin/groups/{id}/members/{tenant}", "delete"),
    ("/openapi.json", "get"),
];

const SERVE_OPS: &[(&str, &str)] = &[
    ("/metrics", "get"),
    ("/health", "get"),
    ("/ready", "get"),
    ("/v1/models", "get"),
    ("/v1/completions", "post"),
    ("/v1/chat/completions", "post"),
    ("/v1/segments/{id}/why", "get"),
    ("/v1/segments/{id}/evict", "post"),
];

fn operation<'a>(doc: &'a Value, path: &str, method: &str) -> Option<&'a Value> {
    doc["paths"].get(path)?.get(method)
}

/// Checks the document's shape and that it holds `ops`; answers every
/// documented (method, concrete path) pair, path parameters filled with `x`.
fn check_doc(doc: &Value, ops: &[(&str, &str)]) -> Vec<(Method, String)> {
    assert!(
        doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")),
        "{doc}"
    );
    for (path, method) in ops {
        let op = operation(doc, path, method)
            .unwrap_or_else(|| panic!("{method} {path} is not documented"));
        assert!(op["responses"]["200"].is_object(), "{method} {path}: {op}");
    }
    // Every `$ref` names a schema the document defines.
    let text = doc.to_string();
    for piece in text.split("\"#/components/schemas/").skip(1) {
        let name = &piece[..piece.find('"').unwrap()];
        assert!(
            doc["components"]["schemas"][name].is_object(),
            "schema {name} is referenced but not defined"
        );
    }
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let mut out = vec![];
    for (path, item) in doc["paths"].as_object().unwrap() {
        let concrete: String = path
            .split('/')
            .map(|p| if p.starts_with('{') { "x" } else { p })
            .collect::<Vec<_>>()
            .join("/");
        for m in ["get", "post", "put", "delete"] {
            if item.get(m).is_some() {
                out.push((m.to_uppercase().parse().unwrap(), concrete.clone()));
            }
        }
    }
    out
}

/// An unknown route: axum's 405, or the fallback's 404 `no such route`.
fn unrouted(status: u16, body: &str) -> bool {
    status == 405 || (status == 404 && body.contains("no such route"))
}

#[tokio::test]
async fn the_control_plane_documents_and_serves_its_routes() {
    let (c, _d) = common::sqlite_catalog().await;
    let s = common::state(c);
    let get = |uri: &str, m: Method| {
        Request::builder()
            .method(m)
            .uri(uri)
            .body(Body::empty())
            .unwrap()
    };
    let r = control_router(s.clone())
        .oneshot(get("/openapi.json", Method::GET))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let doc: Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let mut ops = CONTROL_OPS.to_vec();
    ops.push(("/ready", "get"));
    let routed = check_doc(&doc, &ops);
    assert!(
        operation(&doc, "/v1/completions", "post").is_none(),
        "the control plane serves no completions"
    );
    let create = operation(&doc, "/v1/segments", "post").unwrap();
    assert_eq!(create["operationId"], "create_segment");
    assert_eq!(
        create["requestBody"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/NewSegment"
    );
    // The routes the document names are the router's (`/ready` is the
    // standalone server's, added beside the router).
    for (m, uri) in routed.into_iter().filter(|(_, u)| u != "/ready") {
        let r = control_router(s.clone())
            .oneshot(get(&uri, m.clone()))
            .await
            .unwrap();
        let st = r.status().as_u16();
        let body =
            String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).to_string();
        assert!(
            !unrouted(st, &body),
            "{m} {uri} is documented but not routed: {st} {body}"
        );
    }
    // Control: an undocumented path is still the fallback's 404.
    let r = control_router(s)
        .oneshot(get("/v1/nowhere", Method::GET))
        .await
        .unwrap();
    let st = r.status().as_u16();
    let body =
        String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).to_string();
    assert!(unrouted(st, &body), "{st} {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hypic_serve_documents_and_serves_its_routes() {
    let s = serve_common::start(|_| {}).await;
    let (st, doc) = s.get_as(None, "/openapi.json").await;
    assert_eq!(st, 200, "{doc}");
    let ops: Vec<_> = CONTROL_OPS.iter().chain(SERVE_OPS).copied().collect();
    let routed = check_doc(&doc, &ops);
    // The segment routes are the serving ones (prefill, token counts, residency).
    let create = operation(&doc, "/v1/segments", "post").unwrap();
    assert_eq!(create["operationId"], "create_segment");
    assert!(
        create["requestBody"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("prefill")),
        "{create}"
    );
    let metrics = operation(&doc, "/metrics", "get").unwrap();
    assert!(
        metrics["responses"]["200"]["content"]["text/plain"].is_object(),
        "{metrics}"
    );
    let mut ids = std::collections::HashSet::new();
    for item in doc["paths"].as_object().unwrap().values() {
        for op in item.as_object().unwrap().values() {
            if let Some(id) = op["operationId"].as_str() {
                assert!(ids.insert(id.to_string()), "operationId {id} twice");
            }
        }
    }
    for (m, uri) in routed {
        let r = s
            .client
            .request(m.as_str().parse().unwrap(), format!("{}{uri}", s.url))
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        let body = r.text().await.unwrap_or_default();
        assert!(
            !unrouted(st, &body),
            "{m} {uri} is documented but not routed: {st} {body}"
        );
    }
}

/// The console's request and response types are generated from `web-ui/openapi.json`
/// (`npm run gen:api`, checked by `web-ui/src/api.gen.test.ts`); this test fails when
/// that copy is stale against the document `hypic serve` publishes. Run with
/// `HYPIC_WRITE_OPENAPI=1` to rewrite it, then `npm run gen:api` in `web-ui/`.
#[test]
fn the_consoles_copy_of_the_document_is_current() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../web-ui/openapi.json");
    let fresh = serde_json::to_value(hypic_control::serve::routes::openapi()).unwrap();
    let text = format!("{}\n", serde_json::to_string_pretty(&fresh).unwrap());
    if std::env::var_os("HYPIC_WRITE_OPENAPI").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let committed: Value = serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap();
    assert!(
        committed == fresh,
        "web-ui/openapi.json is stale against the server's /openapi.json: run \
         HYPIC_WRITE_OPENAPI=1 cargo test -p hypic-control --test integration \
         openapi::the_consoles_copy, then `npm run gen:api` in web-ui/ and commit both"
    );
}
