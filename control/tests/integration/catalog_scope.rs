//! Segment ids scoped to their owner (issue 15, item 4) and the catalog lows of
//! item 9: paginated listing in one query, size limits on segment names and
//! content, idempotent creates. Catalog tests run on SQLite and Postgres; the
//! HTTP tests go through the control router (tower oneshot) on both.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use hypic_control::auth::mint_token;
use hypic_control::catalog::{
    is_address, Catalog, CatalogError, CatalogLimits, NewSegment, Residency, Role,
};
use hypic_control::{control_router, ControlState};
use serde_json::{json, Value};
use sqlx::Row;
use tower::ServiceExt;

use crate::common;

both_backends!(
    ids_are_scoped_to_their_owner,
    deleted_ids_can_be_created_again,
    idempotent_creates_replay_and_expire,
    names_and_content_are_capped,
    listing_is_paginated_and_scoped,
    http_other_tenants_ids_are_no_oracle,
    http_idempotency_key,
    http_limits_and_listing,
);

fn seg(id: &str, content: &str, public: bool) -> NewSegment {
    NewSegment {
        id: id.into(),
        name: None,
        content: content.into(),
        tokens: BTreeMap::from([("tiny".to_string(), 3)]),
        public,
    }
}

async fn ids_are_scoped_to_their_owner(c: Catalog) {
    let a_doc = c
        .create_segment("a", "alice", &seg("doc", "a's doc", false))
        .await
        .unwrap();
    let a_pub = c
        .create_segment("a", "alice", &seg("handbook", "public handbook", true))
        .await
        .unwrap();
    assert!(is_address(&a_doc.address), "{a_doc:?}");
    assert_eq!(a_doc.id, "doc");
    assert_eq!(a_doc.owner_tenant.as_deref(), Some("a"));
    // B can create its own "doc": A's id is neither taken nor revealed.
    let b_doc = c
        .create_segment("b", "bob", &seg("doc", "b's doc", false))
        .await
        .unwrap();
    assert_ne!(a_doc.address, b_doc.address);
    // Each tenant's "doc" is its own.
    let sa = c.snapshot("a", &["doc".into()]).await.unwrap();
    let sb = c.snapshot("b", &["doc".into()]).await.unwrap();
    assert_eq!(sa[0].segment_id, a_doc.address);
    assert_eq!(sb[0].segment_id, b_doc.address);
    assert_eq!(
        c.find_segment("b", "doc").await.unwrap().address,
        b_doc.address
    );
    // A's private segment by address: not readable by B.
    assert!(matches!(
        c.snapshot("b", std::slice::from_ref(&a_doc.address)).await,
        Err(CatalogError::NotFound(_))
    ));
    // A's public segment: not by A's id (that is B's namespace), by address yes.
    assert!(matches!(
        c.snapshot("b", &["handbook".into()]).await,
        Err(CatalogError::NotFound(_))
    ));
    let s = c
        .snapshot("b", &[a_pub.address.clone(), "doc".into()])
        .await
        .unwrap();
    assert_eq!(s[0].segment_id, a_pub.address);
    assert_eq!(s[1].segment_id, b_doc.address);
    // A grant makes A's private segment readable by B, by address only.
    c.grant(&a_doc.address, "b", "alice").await.unwrap();
    let s = c
        .snapshot("b", std::slice::from_ref(&a_doc.address))
        .await
        .unwrap();
    assert_eq!(s[0].content_hash, a_doc.content_hash);
    assert_eq!(
        c.snapshot("b", &["doc".into()]).await.unwrap()[0].segment_id,
        b_doc.address,
        "B's own id still means B's own segment"
    );
    // The view of another tenant hides the owner and shows the address as id.
    let v = c
        .get_segment(&a_pub.address)
        .await
        .unwrap()
        .view_for("b", false);
    assert_eq!(v.id, a_pub.address);
    assert_eq!(v.owner_tenant, None);
    let json = serde_json::to_value(&v).unwrap();
    assert!(json.get("owner_tenant").is_none(), "{json}");
    assert!(!json.to_string().contains("\"a\""), "{json}");
    // Operators and the owner see everything.
    let v = c.get_segment(&a_pub.address).await.unwrap();
    assert_eq!(v.clone().view_for("ops", true), v);
    assert_eq!(v.clone().view_for("a", false), v);
}

async fn deleted_ids_can_be_created_again(c: Catalog) {
    let first = c
        .create_segment("a", "alice", &seg("doc", "first", true))
        .await
        .unwrap();
    c.grant(&first.address, "b", "alice").await.unwrap();
    c.delete_segment(&first.address, "alice").await.unwrap();
    let again = c
        .create_segment("a", "alice", &seg("doc", "second", false))
        .await
        .unwrap();
    assert_ne!(again.address, first.address, "a new address, never reused");
    assert_eq!(again.current_version, 1);
    assert_eq!(c.versions(&again.address).await.unwrap().len(), 1);
    assert_eq!(
        c.snapshot("a", &["doc".into()]).await.unwrap()[0].segment_id,
        again.address
    );
    // Nothing of the deleted segment carries over: not the grant, not the
    // public flag, and the old address stays dead.
    assert!(!c.can_read("b", &again.address).await.unwrap());
    assert!(matches!(
        c.get_segment(&first.address).await,
        Err(CatalogError::NotFound(_))
    ));
    // A live id is still a conflict for its owner.
    assert!(matches!(
        c.create_segment("a", "alice", &seg("doc", "third", false))
            .await,
        Err(CatalogError::Conflict(_))
    ));
}

async fn idempotent_creates_replay_and_expire(c: Catalog) {
    let c = c.with_limits(CatalogLimits {
        idempotency_ttl_ms: 400,
        ..CatalogLimits::default()
    });
    let body = seg("doc", "content", false);
    let first = c
        .create_segment_idempotent("a", "alice", &body, Some("k-1"))
        .await
        .unwrap();
    assert!(!first.replayed);
    // The retry of a create whose answer was lost: same answer, no 409.
    let retry = c
        .create_segment_idempotent("a", "alice", &body, Some("k-1"))
        .await
        .unwrap();
    assert!(retry.replayed);
    assert_eq!(retry.segment, first.segment);
    // Same key, other request: refused, naming the key.
    let other = seg("doc", "other content", false);
    match c
        .create_segment_idempotent("a", "alice", &other, Some("k-1"))
        .await
    {
        Err(e @ CatalogError::IdempotencyMismatch(_)) => {
            assert!(e.to_string().contains("k-1"), "{e}")
        }
        other => panic!("want IdempotencyMismatch, got {other:?}"),
    }
    // Without the key, the retry is the plain conflict it always was.
    assert!(matches!(
        c.create_segment_idempotent("a", "alice", &body, None).await,
        Err(CatalogError::Conflict(_))
    ));
    // Keys are per tenant: B's "k-1" is its own.
    let b = c
        .create_segment_idempotent("b", "bob", &body, Some("k-1"))
        .await
        .unwrap();
    assert!(!b.replayed);
    assert_ne!(b.segment.address, first.segment.address);
    // A failed create records nothing: the key stays usable.
    assert!(matches!(
        c.create_segment_idempotent("a", "alice", &body, Some("k-2"))
            .await,
        Err(CatalogError::Conflict(_))
    ));
    let fresh = seg("doc-2", "x", false);
    assert!(
        !c.create_segment_idempotent("a", "alice", &fresh, Some("k-2"))
            .await
            .unwrap()
            .replayed
    );
    // Bad keys are refused, naming the header.
    for k in ["", "k\n", &"k".repeat(256)] {
        match c
            .create_segment_idempotent("a", "alice", &seg("doc-3", "x", false), Some(k))
            .await
        {
            Err(e) => assert_eq!(e.field(), Some("Idempotency-Key"), "{e}"),
            Ok(_) => panic!("key {k:?} accepted"),
        }
    }
    // Past the lifetime the record is gone: the retry is a conflict again, and
    // expired records are purged.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(matches!(
        c.create_segment_idempotent("a", "alice", &body, Some("k-1"))
            .await,
        Err(CatalogError::Conflict(_))
    ));
    let left: i64 = sqlx::query("SELECT COUNT(*) FROM segment_idempotency")
        .fetch_one(c.pool())
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "expired idempotency records are purged");
}

async fn names_and_content_are_capped(c: Catalog) {
    let c = c.with_limits(CatalogLimits {
        max_content_bytes: 1000,
        ..CatalogLimits::default()
    });
    let long_name = NewSegment {
        name: Some("n".repeat(257)),
        ..seg("doc", "x", false)
    };
    let e = c.create_segment("a", "u", &long_name).await.unwrap_err();
    assert!(matches!(e, CatalogError::InvalidField("name", _)), "{e:?}");
    let ok_name = NewSegment {
        name: Some("n".repeat(256)),
        ..seg("doc", "x", false)
    };
    let s = c.create_segment("a", "u", &ok_name).await.unwrap();
    let e = c
        .create_segment("a", "u", &seg(&"i".repeat(129), "x", false))
        .await
        .unwrap_err();
    assert_eq!(e.field(), Some("id"), "{e:?}");
    let e = c
        .create_segment("a", "u", &seg("big", &"x".repeat(1001), false))
        .await
        .unwrap_err();
    assert!(matches!(e, CatalogError::TooLarge("content", _)), "{e:?}");
    c.create_segment("a", "u", &seg("fits", &"x".repeat(1000), false))
        .await
        .unwrap();
    let e = c
        .update_segment(&s.address, "u", &"x".repeat(1001), &BTreeMap::new())
        .await
        .unwrap_err();
    assert!(matches!(e, CatalogError::TooLarge("content", _)), "{e:?}");
    assert_eq!(c.get_segment(&s.address).await.unwrap().current_version, 1);
}

async fn listing_is_paginated_and_scoped(c: Catalog) {
    for i in 0..23 {
        c.create_segment("a", "alice", &seg(&format!("a-{i:02}"), "x", false))
            .await
            .unwrap();
    }
    let public = c
        .create_segment("c", "carol", &seg("shared", "y", true))
        .await
        .unwrap();
    let granted = c
        .create_segment("c", "carol", &seg("granted", "z", false))
        .await
        .unwrap();
    c.create_segment("c", "carol", &seg("hidden", "w", false))
        .await
        .unwrap();
    c.grant(&granted.address, "a", "carol").await.unwrap();
    let deleted = c
        .create_segment("a", "alice", &seg("a-gone", "x", false))
        .await
        .unwrap();
    c.delete_segment(&deleted.address, "alice").await.unwrap();

    let page_all = |viewer: &'static str, all: bool, limit: usize| {
        let c = c.clone();
        async move {
            let mut seen = vec![];
            let mut after: Option<String> = None;
            let mut pages = 0;
            loop {
                let p = c
                    .list_segments(viewer, all, after.as_deref(), limit)
                    .await
                    .unwrap();
                assert!(p.items.len() <= limit);
                pages += 1;
                seen.extend(p.items.into_iter().map(|s| s.view_for(viewer, all)));
                match p.next {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
            (seen, pages)
        }
    };
    let (a, pages) = page_all("a", false, 10).await;
    assert_eq!(pages, 3);
    let ids: Vec<String> = a.iter().map(|s| s.id.clone()).collect();
    let mut want: Vec<String> = (0..23).map(|i| format!("a-{i:02}")).collect();
    // Own ids first, then the others by address.
    let mut others = vec![public.address.clone(), granted.address.clone()];
    others.sort();
    want.extend(others);
    assert_eq!(ids, want);
    assert!(a[23..].iter().all(|s| s.owner_tenant.is_none()));
    assert_eq!(a[0].tokens.get("tiny"), Some(&3), "token counts come along");
    // One page of everything gives the same list.
    let one = c.list_segments("a", false, None, 1000).await.unwrap();
    assert_eq!(one.next, None);
    assert_eq!(one.items.len(), 25);
    // Another tenant sees only the public one; an operator all 26 live ones.
    let (b, _) = page_all("b", false, 7).await;
    assert_eq!(
        b.iter().map(|s| s.id.clone()).collect::<Vec<_>>(),
        vec![public.address.clone()]
    );
    let (ops, _) = page_all("ops", true, 7).await;
    assert_eq!(ops.len(), 26);
    assert!(ops.iter().all(|s| s.owner_tenant.is_some()));
}

// ---- HTTP ---------------------------------------------------------------------------

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
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (StatusCode, axum::http::HeaderMap, Value) {
    let mut b = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {token}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = match body {
        Some(v) => b
            .header("content-type", "application/json")
            .body(Body::from(v.to_string()))
            .unwrap(),
        None => b.body(Body::empty()).unwrap(),
    };
    let resp = control_router(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let h = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, h, v)
}

/// The error part that must not differ between "exists but not yours" and
/// "does not exist" (the message names the id the caller sent).
fn error_shape(st: StatusCode, v: &Value) -> (StatusCode, Value, Value) {
    (st, v["error"]["type"].clone(), v["error"]["code"].clone())
}

async fn http_other_tenants_ids_are_no_oracle(c: Catalog) {
    let s = common::state(c);
    let (a, b, ops) = (
        tok("a", Role::Tenant),
        tok("b", Role::Tenant),
        tok("ops", Role::Operator),
    );
    let post = |t: &str, body: Value| {
        let (s, t) = (s.clone(), t.to_string());
        async move { call(&s, Method::POST, "/v1/segments", &t, &[], Some(body)).await }
    };
    let get = |t: &str, path: String| {
        let (s, t) = (s.clone(), t.to_string());
        async move { call(&s, Method::GET, &path, &t, &[], None).await }
    };
    let (st, _, av) = post(&a, json!({"id": "secret", "content": "a's secret"})).await;
    assert_eq!(st, StatusCode::OK, "{av}");
    let a_addr = av["address"].as_str().unwrap().to_string();
    assert_eq!(av["id"], "secret");
    assert_eq!(av["owner_tenant"], "a");
    let (st, _, pv) = post(
        &a,
        json!({"id": "handbook", "content": "public text", "public": true}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{pv}");
    let pub_addr = pv["address"].as_str().unwrap().to_string();

    // GET of A's id and of an unused id: the same answer for B.
    let (st1, _, v1) = get(&b, "/v1/segments/secret".into()).await;
    let (st2, _, v2) = get(&b, "/v1/segments/never-used".into()).await;
    assert_eq!(st1, StatusCode::NOT_FOUND, "{v1}");
    assert_eq!(error_shape(st1, &v1), error_shape(st2, &v2));
    // By address too: a private address answers like a made-up one.
    let (st1, _, v1) = get(&b, format!("/v1/segments/{a_addr}")).await;
    let made_up = format!("~{}", "0".repeat(32));
    let (st2, _, v2) = get(&b, format!("/v1/segments/{made_up}")).await;
    assert_eq!(st1, StatusCode::NOT_FOUND, "{v1}");
    assert_eq!(error_shape(st1, &v1), error_shape(st2, &v2));
    for path in ["versions", "grants"] {
        let (st, _, _) = get(&b, format!("/v1/segments/{a_addr}/{path}")).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{path}");
    }
    // POST of A's id and of an unused id: the same answer for B (it gets its own).
    let (st1, _, v1) = post(&b, json!({"id": "secret", "content": "b's own"})).await;
    let (st2, _, v2) = post(&b, json!({"id": "fresh", "content": "b's other"})).await;
    assert_eq!((st1, st2), (StatusCode::OK, StatusCode::OK), "{v1} {v2}");
    assert_ne!(v1["address"], json!(a_addr));
    assert_eq!(v1["owner_tenant"], "b");
    // Each tenant reads its own "secret".
    let (_, _, v) = get(&a, "/v1/segments/secret".into()).await;
    assert_eq!(v["content_hash"], av["content_hash"]);
    let (_, _, v) = get(&b, "/v1/segments/secret".into()).await;
    assert_eq!(v["content_hash"], v1["content_hash"]);

    // The public segment: B reads it by address, without learning the owner.
    let (st, _, v) = get(&b, format!("/v1/segments/{pub_addr}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["id"], json!(pub_addr));
    assert!(v.get("owner_tenant").is_none(), "{v}");
    // Nor the owner's id through the default name.
    assert_eq!(v["name"], json!(pub_addr), "{v}");
    let (_, _, ov) = get(&a, format!("/v1/segments/{pub_addr}")).await;
    assert_eq!(ov["name"], "handbook", "the owner sees its name: {ov}");
    assert!(!v.to_string().contains("\"a\""), "{v}");
    let (st, _, v) = get(&b, "/v1/segments/handbook".into()).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "only by address: {v}");
    let (st, _, v) = call(
        &s,
        Method::POST,
        "/v1/snapshot",
        &b,
        &[],
        Some(json!({"segments": [pub_addr, "secret"]})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["segments"][0]["segment_id"], json!(pub_addr));
    assert_eq!(v["segments"][0]["shared"], true);
    assert_eq!(v["segments"][1]["address"], v1["address"]);
    // B may read but not modify it.
    let (st, _, _) = call(
        &s,
        Method::PUT,
        &format!("/v1/segments/{pub_addr}"),
        &b,
        &[],
        Some(json!({"content": "defaced"})),
    )
    .await;
    assert_eq!(st, StatusCode::FORBIDDEN);

    // A grant: B reads A's private segment by address.
    let (st, _, _) = call(
        &s,
        Method::POST,
        "/v1/segments/secret/grants",
        &a,
        &[],
        Some(json!({"tenant": "b"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let (st, _, v) = get(&b, format!("/v1/segments/{a_addr}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v.get("owner_tenant").is_none(), "{v}");
    let (st, _, v) = get(&b, format!("/v1/segments/{a_addr}/versions")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v[0]["segment_id"], json!(a_addr));

    // Operators: every segment by address, with its owner; their own ids by id.
    let (st, _, v) = get(&ops, format!("/v1/segments/{a_addr}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["owner_tenant"], "a");
    assert_eq!(v["id"], "secret");
    let (st, _, v) = get(&ops, "/v1/segments?limit=1000".into()).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["data"].as_array().unwrap().len(), 4, "{v}");
    let (st, _, _) = call(
        &s,
        Method::PUT,
        &format!("/v1/segments/{a_addr}"),
        &ops,
        &[],
        Some(json!({"content": "rewritten by ops"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK);

    // Delete, then create again with the same id: a new segment, version 1.
    let (st, _, v) = call(&s, Method::DELETE, "/v1/segments/secret", &a, &[], None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["address"], json!(a_addr));
    let (st, _, v) = post(&a, json!({"id": "secret", "content": "again"})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["current_version"], 1);
    assert_ne!(v["address"], json!(a_addr));
    let (st, _, _) = get(&b, format!("/v1/segments/{a_addr}")).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "the old address stays dead");
}

async fn http_idempotency_key(c: Catalog) {
    let s = common::state(c);
    let a = tok("a", Role::Tenant);
    let body = json!({"id": "doc", "content": "text", "public": true});
    let key = [("Idempotency-Key", "create-doc-1")];
    let (st1, h1, v1) = call(
        &s,
        Method::POST,
        "/v1/segments",
        &a,
        &key,
        Some(body.clone()),
    )
    .await;
    assert_eq!(st1, StatusCode::OK, "{v1}");
    assert!(h1.get("idempotent-replayed").is_none());
    // The retry (answer lost, e.g. a crash after the commit): the same answer.
    let (st2, h2, v2) = call(
        &s,
        Method::POST,
        "/v1/segments",
        &a,
        &key,
        Some(body.clone()),
    )
    .await;
    assert_eq!(st2, StatusCode::OK, "{v2}");
    assert_eq!(v2, v1);
    assert_eq!(h2.get("idempotent-replayed").unwrap(), "true");
    // Same key, different body: 422 naming the header.
    let (st, _, v) = call(
        &s,
        Method::POST,
        "/v1/segments",
        &a,
        &key,
        Some(json!({"id": "doc", "content": "other"})),
    )
    .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_eq!(v["error"]["code"], "idempotency_key_reused");
    assert_eq!(v["error"]["param"], "Idempotency-Key");
    // No key: a retry is a conflict, as before.
    let (st, _, _) = call(&s, Method::POST, "/v1/segments", &a, &[], Some(body)).await;
    assert_eq!(st, StatusCode::CONFLICT);
}

async fn http_limits_and_listing(c: Catalog) {
    let s = common::state(c);
    let a = tok("a", Role::Tenant);
    let post = |body: Value| {
        let (s, a) = (s.clone(), a.clone());
        async move { call(&s, Method::POST, "/v1/segments", &a, &[], Some(body)).await }
    };
    // A name of 1 MB was accepted: now 400 naming `name`.
    let (st, _, v) = post(json!({"id": "d", "content": "x", "name": "n".repeat(1 << 20)})).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "name");
    let (st, _, v) = post(json!({"id": "i".repeat(300), "content": "x"})).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "id");
    // Content over the default limit (1 MiB): 413 naming `content`, on create and update.
    let big = "x".repeat((1 << 20) + 1);
    let (st, _, v) = post(json!({"id": "d", "content": big})).await;
    assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(v["error"]["param"], "content");
    assert_eq!(v["error"]["code"], "too_large");
    let (st, _, v) = post(json!({"id": "d", "content": "x".repeat(1 << 20)})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, _, v) = call(
        &s,
        Method::PUT,
        "/v1/segments/d",
        &a,
        &[],
        Some(json!({"content": big})),
    )
    .await;
    assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(v["error"]["param"], "content");

    // Listing: pages with a cursor; bad limits are 400s naming `limit`.
    for i in 0..4 {
        let (st, _, _) = post(json!({"id": format!("e{i}"), "content": "x"})).await;
        assert_eq!(st, StatusCode::OK);
    }
    let mut ids = vec![];
    let mut uri = "/v1/segments?limit=2".to_string();
    loop {
        let (st, _, v) = call(&s, Method::GET, &uri, &a, &[], None).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["object"], "list");
        let data = v["data"].as_array().unwrap();
        assert!(data.len() <= 2);
        ids.extend(data.iter().map(|x| x["id"].as_str().unwrap().to_string()));
        match v["next"].as_str() {
            Some(n) => uri = format!("/v1/segments?limit=2&after={n}"),
            None => break,
        }
    }
    assert_eq!(ids, ["d", "e0", "e1", "e2", "e3"]);
    for bad in ["limit=0", "limit=1001", "limit=x", "after=bad%20id"] {
        let (st, _, v) = call(
            &s,
            Method::GET,
            &format!("/v1/segments?{bad}"),
            &a,
            &[],
            None,
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{bad}: {v}");
    }
    let (_, _, v) = call(&s, Method::GET, "/v1/segments?limit=0", &a, &[], None).await;
    assert_eq!(v["error"]["param"], "limit");
}

// ---- migration of existing rows ---------------------------------------------------------

/// A catalog written before ids were scoped (global ids, migrations 1 and 2)
/// migrates: every row gets an address, versions, token counts and grants
/// follow it, ids become the owners' ids, and residency rows keyed by the old
/// ids are dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_keeps_existing_segments_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("c.sqlite").display()
    );
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("PRAGMA foreign_keys = ON")
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap();
    old_catalog(&pool, "sqlite").await;
    let fk_rows = {
        pool.close().await;
        let c = Catalog::connect(&url).await.unwrap();
        check_migrated(&c).await;
        sqlx::query("PRAGMA foreign_key_check")
            .fetch_all(c.pool())
            .await
            .unwrap()
            .len()
    };
    assert_eq!(fk_rows, 0, "foreign keys hold after the migration");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_keeps_existing_segments_postgres() {
    // A fresh schema (dropped by the guard), migrated to version 2 by hand.
    let (c, guard) = common::pg_catalog().await;
    let schema = guard.name.clone();
    c.pool().close().await;
    drop(c);
    let url = common::pg_url();
    sqlx::any::install_default_drivers();
    let sp = format!("SET search_path TO {schema}");
    let pool = sqlx::any::AnyPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let sp = sp.clone();
            Box::pin(async move {
                sqlx::query(&sp).execute(&mut *conn).await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap();
    for t in [
        "_sqlx_migrations",
        "segment_residency",
        "policy_shadows",
        "tenant_usage",
        "segment_idempotency",
        "group_grants",
        "group_members",
        "tenant_groups",
        "cache_residency",
        "audit_log",
        "policy_activations",
        "policies",
        "grants",
        "segment_token_counts",
        "segment_versions",
        "segments",
        "principals",
        "tenants",
    ] {
        sqlx::query(&format!("DROP TABLE IF EXISTS {t} CASCADE"))
            .execute(&pool)
            .await
            .unwrap();
    }
    old_catalog(&pool, "postgres").await;
    pool.close().await;
    let c = Catalog::connect_in_schema(&url, Some(&schema))
        .await
        .unwrap();
    check_migrated(&c).await;
    drop(c);
    drop(guard);
}

/// Applies migrations 1 and 2 of `backend` to `pool` and writes rows the way
/// the catalog did before ids were scoped.
async fn old_catalog(pool: &sqlx::AnyPool, backend: &str) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../migrations")
        .join(backend);
    let mut m = sqlx::migrate::Migrator::new(dir).await.unwrap();
    m.migrations = m
        .migrations
        .iter()
        .filter(|x| x.version <= 2)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    m.run(pool).await.unwrap();
    for sql in [
        "INSERT INTO tenants (id, name, created_at) VALUES ('a', 'a', 1), ('b', 'b', 1)",
        "INSERT INTO segments (id, owner_tenant, name, public, current_version, created_at, updated_at) \
         VALUES ('doc', 'a', 'Doc', 0, 2, 1, 2), ('pub', 'a', 'pub', 1, 1, 1, 1), \
                ('gone', 'b', 'gone', 0, 1, 1, 1)",
        "UPDATE segments SET deleted_at = 3 WHERE id = 'gone'",
        "INSERT INTO segment_versions (segment_id, version, content_hash, content, byte_len, created_by, created_at, superseded_at) \
         VALUES ('doc', 1, 'h1', 'one', 3, 'u', 1, 2), ('doc', 2, 'h2', 'two', 3, 'u', 2, NULL), \
                ('pub', 1, 'hp', 'pub text', 8, 'u', 1, NULL), ('gone', 1, 'hg', 'g', 1, 'u', 1, 3)",
        "INSERT INTO segment_token_counts (segment_id, version, model, tokens) VALUES ('doc', 2, 'tiny', 7)",
        "INSERT INTO grants (segment_id, tenant_id, granted_by, created_at) VALUES ('doc', 'b', 'u', 1)",
        "INSERT INTO tenant_groups (id, name, created_by, created_at) VALUES ('g', 'g', 'ops', 1)",
        "INSERT INTO group_grants (segment_id, group_id, granted_by, created_at) VALUES ('pub', 'g', 'u', 1)",
        "INSERT INTO cache_residency (worker, cache_key, segment_id, version, tenant, bytes, last_use) \
         VALUES ('w', 'k', 'doc', 2, 'a', 10, 1)",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

async fn check_migrated(c: &Catalog) {
    assert_eq!(c.applied_migrations().await.unwrap(), vec![1, 2, 3, 4, 5]);
    let doc = c.find_segment("a", "doc").await.unwrap();
    assert!(is_address(&doc.address), "{doc:?}");
    assert_eq!(doc.id, "doc");
    assert_eq!(doc.name, "Doc");
    assert_eq!(doc.current_version, 2);
    assert_eq!(doc.content_hash, "h2");
    assert_eq!(doc.tokens.get("tiny"), Some(&7));
    assert_eq!(c.versions(&doc.address).await.unwrap().len(), 2);
    assert_eq!(
        c.version_content(&doc.address, 1).await.unwrap().as_deref(),
        Some("one")
    );
    // The grant follows the segment: B reads it by address, not by A's id.
    assert_eq!(c.grants(&doc.address).await.unwrap(), vec!["b".to_string()]);
    assert!(c.can_read("b", &doc.address).await.unwrap());
    assert!(c.snapshot("b", &["doc".into()]).await.is_err());
    let pubs = c.find_segment("a", "pub").await.unwrap();
    assert_ne!(pubs.address, doc.address);
    assert_eq!(
        c.group_grants(&pubs.address).await.unwrap(),
        vec!["g".to_string()]
    );
    // The deleted segment stays deleted, and its id is free for its owner again.
    assert!(c.find_segment("b", "gone").await.is_err());
    c.create_segment("b", "u", &seg("gone", "new", false))
        .await
        .unwrap();
    // Residency keyed by old ids is gone; new reports work.
    assert!(c.residency_of("k").await.unwrap().is_empty());
    c.report_residency(&Residency {
        worker: "w".into(),
        cache_key: "k2".into(),
        segment_id: doc.address.clone(),
        version: 2,
        tenant: None,
        bytes: 1,
        last_use: 1,
    })
    .await
    .unwrap();
    // Scoped ids after the migration: B may now use the id "doc" too.
    c.create_segment("b", "u", &seg("doc", "b's", false))
        .await
        .unwrap();
}
