//! The tenant and usage SQL on SQLite and on Postgres: the tenant views of
//! `GET /v1/admin/tenants` and `GET /v1/tenants/{tenant}/usage` (principals,
//! groups, owned segments and their bytes, direct and group grants) through
//! the control router, and the usage and shadow rows of [`hypic_control::persist`]
//! (increments of several servers add up; a restart reads the totals back; a
//! shadow row is running until stopped).

use std::collections::BTreeMap;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use hypic_control::auth::mint_token;
use hypic_control::catalog::{Catalog, NewSegment, Role};
use hypic_control::persist;
use hypic_control::policy::{DecisionCounts, ShadowView};
use hypic_control::{control_router, ControlState};
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::common;

both_backends!(
    tenant_views_count_segments_bytes_and_grants,
    usage_increments_add_up_and_survive_a_restart,
    shadow_rows_run_until_stopped,
);

fn tok(tenant: &str, role: Role) -> String {
    mint_token(
        common::SECRET,
        "hypic",
        tenant,
        &format!("{}@{tenant}", role.as_str()),
        role,
        3600,
    )
    .unwrap()
}

async fn call(
    state: &ControlState,
    method: Method,
    uri: &str,
    token: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let b = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {token}"));
    let req = match body {
        Some(v) => b
            .header("content-type", "application/json")
            .body(Body::from(v.to_string())),
        None => b.body(Body::empty()),
    }
    .unwrap();
    let r = control_router(state.clone()).oneshot(req).await.unwrap();
    let st = r.status();
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    (st, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn seg(id: &str, content: &str) -> NewSegment {
    NewSegment {
        id: id.into(),
        name: None,
        content: content.into(),
        tokens: BTreeMap::new(),
        public: false,
    }
}

async fn tenant_views_count_segments_bytes_and_grants(c: Catalog) {
    let s = common::state(c.clone());
    let (acme, globex, op) = (
        tok("acme", Role::Tenant),
        tok("globex", Role::Tenant),
        tok("ops", Role::Operator),
    );
    // Principals are recorded on authenticated requests.
    for t in [&acme, &globex, &op] {
        let (st, v) = call(&s, Method::GET, "/v1/whoami", t, None).await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    let a1 = c
        .create_segment("acme", "u", &seg("a1", "12345"))
        .await
        .unwrap();
    let a2 = c
        .create_segment("acme", "u", &seg("a2", "1234567"))
        .await
        .unwrap();
    let gone = c
        .create_segment("acme", "u", &seg("gone", "xx"))
        .await
        .unwrap();
    c.delete_segment(&gone.address, "u").await.unwrap();
    // A new version counts with its own length.
    c.update_segment(&a2.address, "u", "123456789", &BTreeMap::new())
        .await
        .unwrap();
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/segments/a1/grants",
        &acme,
        Some(json!({"tenant": "globex"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/admin/groups",
        &op,
        Some(json!({"id": "readers"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = call(
        &s,
        Method::PUT,
        "/v1/admin/groups/readers/members/globex",
        &op,
        None,
    )
    .await;
    assert!(st.is_success(), "{st} {v}");
    for id in ["a1", "a2"] {
        let (st, v) = call(
            &s,
            Method::POST,
            &format!("/v1/segments/{id}/group-grants"),
            &acme,
            Some(json!({"group": "readers"})),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    let _ = a1;

    let (st, all) = call(&s, Method::GET, "/v1/admin/tenants", &op, None).await;
    assert_eq!(st, StatusCode::OK, "{all}");
    let rows = all.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["tenant"].as_str().unwrap()).collect();
    assert_eq!(names, ["acme", "globex", "ops"], "{all}");
    assert_eq!(
        rows[0]["catalog"],
        json!({"segments": 2, "segment_bytes": 5 + 9, "granted_segments": 0, "group_granted_segments": 0})
    );
    assert_eq!(
        rows[1]["catalog"],
        json!({"segments": 0, "segment_bytes": 0, "granted_segments": 1, "group_granted_segments": 2})
    );
    assert_eq!(rows[1]["groups"], json!(["readers"]));
    assert_eq!(
        rows[2]["principals"],
        json!([{"sub": "operator@ops", "role": "operator"}])
    );
    // One tenant's own view is its row of the list.
    let (st, own) = call(&s, Method::GET, "/v1/tenants/globex/usage", &globex, None).await;
    assert_eq!(st, StatusCode::OK, "{own}");
    assert_eq!(own, rows[1]);
    let (st, v) = call(&s, Method::GET, "/v1/tenants/nobody/usage", &op, None).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
}

fn counted(s: &ControlState, tenant: &str, prompt: usize, completion: usize) {
    let out = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(completion));
    drop(s.usage().start(tenant, prompt, 1, 1, 0, out));
}

async fn usage_increments_add_up_and_survive_a_restart(c: Catalog) {
    // Two servers on one catalog write what each counted.
    let (s1, s2) = (common::state(c.clone()), common::state(c.clone()));
    counted(&s1, "acme", 10, 3);
    counted(&s1, "acme", 20, 4);
    counted(&s2, "acme", 5, 1);
    counted(&s2, "globex", 7, 2);
    assert_eq!(persist::flush_usage(&s1).await.unwrap(), 1);
    assert_eq!(persist::flush_usage(&s1).await.unwrap(), 0, "nothing new");
    assert_eq!(persist::flush_usage(&s2).await.unwrap(), 2);
    counted(&s1, "acme", 1, 0);
    persist::flush(&s1).await.unwrap();

    // A restart reads the totals back.
    let s3 = common::state(c.clone());
    persist::restore(&s3).await.unwrap();
    let a = s3.usage().of("acme");
    assert_eq!(
        (
            a.requests,
            a.prompt_tokens,
            a.completion_tokens,
            a.cached_tokens,
            a.segment_hits
        ),
        (4, 36, 8, 4, 4)
    );
    let g = s3.usage().of("globex");
    assert_eq!(
        (g.requests, g.prompt_tokens, g.completion_tokens),
        (1, 7, 2)
    );
    let latest = s1
        .usage()
        .of("acme")
        .last_request_at
        .max(s2.usage().of("acme").last_request_at);
    assert_eq!(a.last_request_at, latest);
    // Stored totals are not written again by the restarted server.
    assert_eq!(persist::flush_usage(&s3).await.unwrap(), 0);
    let s4 = common::state(c);
    persist::restore(&s4).await.unwrap();
    assert_eq!(s4.usage().of("acme"), a);
}

async fn shadow_rows_run_until_stopped(c: Catalog) {
    let s = common::state(c.clone());
    let module = hypic_control::policy::builtin::module("second_sighting").unwrap();
    let rec = c
        .insert_policy("second", "admission", module, "{}", "ops")
        .await
        .unwrap();
    let mut v = ShadowView {
        kind: "admission".into(),
        policy_id: rec.id,
        params: json!({"min_sightings": 2}),
        started_at: 1_000,
        started_by: "operator@ops".into(),
        active_policy_id: None,
        candidate: DecisionCounts::default(),
        active: DecisionCounts::default(),
        agreed: 0,
        disagreed: 0,
        tripped: false,
    };
    persist::shadow_started(&s, &v).await.unwrap();
    v.candidate.calls = 7;
    v.candidate.rejected = 5;
    v.active.calls = 7;
    v.active.admitted = 7;
    v.agreed = 2;
    v.disagreed = 5;
    persist::shadow_counts(&s, &v, false).await.unwrap();
    let running = persist::running_shadows(&s).await.unwrap();
    assert_eq!(running, vec![v.clone()]);
    // A count write for another run of the kind changes nothing.
    let other = ShadowView {
        started_at: 2_000,
        agreed: 99,
        ..v.clone()
    };
    persist::shadow_counts(&s, &other, true).await.unwrap();
    assert_eq!(persist::running_shadows(&s).await.unwrap(), vec![v.clone()]);

    // A restart resumes it with its counts.
    let s2 = common::state(c.clone());
    persist::restore(&s2).await.unwrap();
    let resumed = s2
        .policies()
        .shadow(hypic_control::policy::PolicyKind::Admission);
    let resumed = resumed.expect("the shadow is resumed");
    assert_eq!(
        (
            &resumed.candidate,
            &resumed.active,
            resumed.agreed,
            resumed.started_at
        ),
        (&v.candidate, &v.active, v.agreed, v.started_at)
    );

    // Stopped: not running, and not resumed.
    persist::shadow_counts(&s, &v, true).await.unwrap();
    assert!(persist::running_shadows(&s).await.unwrap().is_empty());
    let s3 = common::state(c);
    persist::restore(&s3).await.unwrap();
    assert!(s3
        .policies()
        .shadow(hypic_control::policy::PolicyKind::Admission)
        .is_none());
}
