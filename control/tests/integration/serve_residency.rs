//! The residency directory end to end: two `hypic serve` replicas over one
//! Postgres catalog (each its own connection pool and `LISTEN` connection, as two
//! processes have) stay consistent through `NOTIFY` (no polling is configured
//! anywhere); rows appear when a replica builds entries and disappear when it
//! evicts them; a tenant sees only its own namespace's rows. The SQLite variant
//! covers the single replica, whose events go through the in-process channel.
use crate::common;
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{metric, start, Srv};
use std::time::{Duration, Instant};

const SYS: &str = "You are a careful assistant that answers from the given documents only.";
const DOC_1: &str =
    "Document one. The river flows north through the old city and the market square.";
const DOC_2: &str = "Document two. The bright green light over the harbour turned on every night.";
const Q: &str = "Question: where does the river flow?";

/// Polls `f` every 20 ms until it is true or `within` passed; returns whether it
/// became true. Used only to wait for the directory's asynchronous writes.
async fn eventually(within: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if f().await {
            return true;
        }
        if t0.elapsed() > within {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn m(s: &Srv, name: &str) -> f64 {
    metric(&s.metrics().await, name, "").unwrap_or(-1.0)
}

/// The directory's rows `token` may see, filtered by `query` (`holder=…`).
async fn rows(s: &Srv, token: &str, query: &str) -> Vec<Value> {
    let (st, v) = s
        .get_as(Some(token), &format!("/v1/residency?{query}"))
        .await;
    assert_eq!(st, 200, "{v}");
    v["data"].as_array().cloned().unwrap_or_default()
}

async fn put(s: &Srv, id: &str, content: &str) -> Value {
    let r = s
        .client
        .put(format!("{}/v1/segments/{id}", s.url))
        .bearer_auth(&s.token)
        .json(&json!({"content": content}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn request(id: &str) -> Value {
    request_after(SYS, id)
}

/// A request with `sys` before the segment: another first segment makes the
/// segment's outcome come from the public pool, not from a cached prefix.
fn request_after(sys: &str, id: &str) -> Value {
    json!({"segments": [{"text": sys}, {"id": id}, {"text": Q}], "max_tokens": 2})
}

fn outcome(v: &Value, i: usize) -> String {
    v["hypic"]["segments"][i]["outcome"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_residency_two_replicas_over_postgres_stay_consistent() {
    let (_cat, schema) = common::pg_catalog().await;
    let url = format!(
        "{}?options=-c%20search_path%3D{}",
        common::pg_url(),
        schema.name
    );
    let (ua, ub) = (url.clone(), url);
    let a = start(move |c| {
        c.database_url = Some(ua);
        c.replica_id = Some("replica-a".into());
    })
    .await;
    let b = start(move |c| {
        c.database_url = Some(ub);
        c.replica_id = Some("replica-b".into());
    })
    .await;
    for s in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(10), async || m(
                s,
                "hypic_catalog_listener_connects_total"
            )
            .await
                >= 1.0)
            .await,
            "a replica's catalog listener never connected"
        );
    }

    // A registers the segment and prefills it: replica-a's rows name it.
    let (st, created) = a
        .post("/v1/segments", &json!({"id": "doc", "content": DOC_1}))
        .await;
    assert_eq!(st, 200, "{created}");
    let address = created["address"].as_str().unwrap().to_string();
    assert!(
        eventually(Duration::from_secs(5), async || {
            rows(&a, &a.op_token, "holder=replica-a")
                .await
                .iter()
                .any(|r| {
                    r["segment_id"] == address.as_str()
                        && r["version"] == 1
                        && r["tier"] == "primary"
                        && r["bytes"].as_i64().unwrap_or(0) > 0
                })
        })
        .await,
        "no row of replica-a for the prefilled segment: {:?}",
        rows(&a, &a.op_token, "").await
    );

    // B serves it (a miss: B's pool is its own) and writes rows of its own.
    let (st, r) = b
        .post_as(&b.token, "/v1/completions", &request("doc"))
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(outcome(&r, 1), "miss", "{r}");
    assert_eq!(r["hypic"]["segments"][1]["version"], 1, "{r}");
    let b_rows_v1 = async || {
        rows(&b, &b.op_token, "holder=replica-b")
            .await
            .iter()
            .filter(|r| r["segment_id"] == address.as_str() && r["version"] == 1)
            .count()
    };
    assert!(
        eventually(Duration::from_secs(5), async || b_rows_v1().await > 0).await,
        "no row of replica-b after it built the segment's entries"
    );

    // A second request on B, after another first segment, hits the entries
    // resident there.
    let (_, r) = b
        .post_as(
            &b.token,
            "/v1/completions",
            &request_after("Answer briefly and cite the document.", "doc"),
        )
        .await;
    assert_eq!(outcome(&r, 1), "hit", "{r}");

    // Update through A: B hears of it at once (no poll interval exists) and
    // evicts its version-1 entries.
    let received = m(&b, "hypic_catalog_notifications_received_total").await;
    let evicted = m(&b, "hypic_residency_event_evictions_total").await;
    let sent = m(&a, "hypic_catalog_notifications_sent_total").await;
    let t0 = Instant::now();
    let updated = put(&a, "doc", DOC_2).await;
    assert_eq!(updated["segment"]["current_version"], 2, "{updated}");
    assert!(
        eventually(Duration::from_secs(1), async || {
            m(&b, "hypic_residency_event_evictions_total").await > evicted
        })
        .await,
        "replica-b did not evict its superseded entries within 1 s of the update"
    );
    let took = t0.elapsed();
    assert!(m(&b, "hypic_catalog_notifications_received_total").await > received);
    assert!(m(&a, "hypic_catalog_notifications_sent_total").await > sent);
    assert!(took < Duration::from_secs(1), "{took:?}");

    // B answers with the new version right away: its pool has none of it (a miss).
    let (st, r) = b
        .post_as(&b.token, "/v1/completions", &request("doc"))
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["hypic"]["segments"][1]["version"], 2, "{r}");
    assert_eq!(outcome(&r, 1), "miss", "{r}");
    let (_, g) = b.get_as(Some(&b.token), "/v1/segments/doc").await;
    assert_eq!(g["current_version"], 2, "{g}");

    // The evicted entries' rows are gone; version 2's are there.
    assert!(
        eventually(Duration::from_secs(5), async || b_rows_v1().await == 0).await,
        "replica-b's rows of version 1 stayed after the eviction"
    );
    // (Rows are written by the directory's batched writer, after the answer.)
    assert!(
        eventually(Duration::from_secs(5), async || {
            rows(&b, &b.op_token, "holder=replica-b")
                .await
                .iter()
                .any(|r| r["segment_id"] == address.as_str() && r["version"] == 2)
        })
        .await,
        "{:?}",
        rows(&b, &b.op_token, "holder=replica-b").await
    );

    // Scoping: the owner sees its rows, another tenant none of them.
    let mine = rows(&b, &b.token, "").await;
    assert!(!mine.is_empty());
    let theirs = rows(&b, &b.token_b, "").await;
    assert!(
        theirs.iter().all(|r| r["segment_id"] != address.as_str()),
        "{theirs:?}"
    );
    let (st, _) = b
        .get_as(Some(&b.token_b), "/v1/residency?segment=doc")
        .await;
    assert_eq!(st, 404);

    // A restarted replica clears the rows its id left.
    b.server.stop().await;
    let before = rows(&a, &a.op_token, "holder=replica-b").await.len();
    assert!(before > 0);
    let uc = format!(
        "{}?options=-c%20search_path%3D{}",
        common::pg_url(),
        schema.name
    );
    let b2 = start(move |c| {
        c.database_url = Some(uc);
        c.replica_id = Some("replica-b".into());
    })
    .await;
    assert!(
        eventually(Duration::from_secs(5), async || {
            rows(&a, &a.op_token, "holder=replica-b").await.is_empty()
        })
        .await,
        "a restarted replica left its earlier rows"
    );
    b2.server.stop().await;
    a.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_residency_single_replica_on_sqlite() {
    let s = start(|c| c.replica_id = Some("solo".into())).await;
    let (st, created) = s
        .post("/v1/segments", &json!({"id": "doc", "content": DOC_1}))
        .await;
    assert_eq!(st, 200, "{created}");
    let address = created["address"].as_str().unwrap().to_string();
    let of_doc = async || {
        rows(&s, &s.op_token, "holder=solo")
            .await
            .into_iter()
            .filter(|r| r["segment_id"] == address.as_str())
            .collect::<Vec<_>>()
    };
    assert!(
        eventually(Duration::from_secs(5), async || !of_doc().await.is_empty()).await,
        "no row after the prefill"
    );
    for r in of_doc().await {
        assert_eq!(r["holder_kind"], "replica");
        assert_eq!(r["version"], 1);
        assert!(r["tokens"].as_i64().unwrap() > 8, "{r}");
    }
    // The segment filter answers the same rows, by the tenant's id.
    let by_id = rows(&s, &s.token, "segment=doc").await;
    assert_eq!(by_id.len(), of_doc().await.len());
    // A tenant sees no holder names and may not filter by them.
    assert!(by_id.iter().all(|r| r["holder"] == ""), "{by_id:?}");
    let (st, e) = s.get_as(Some(&s.token), "/v1/residency?holder=solo").await;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "holder");
    // Bad input is named.
    let (st, e) = s.get_as(Some(&s.token), "/v1/residency?limit=0").await;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "limit");

    // Deletion: the entries are evicted and their rows deleted; the in-process
    // channel delivered the event (nothing is sent with NOTIFY on SQLite).
    let r = s
        .client
        .delete(format!("{}/v1/segments/doc", s.url))
        .bearer_auth(&s.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        eventually(Duration::from_secs(5), async || of_doc().await.is_empty()).await,
        "rows stayed after the segment's entries were evicted"
    );
    assert!(m(&s, "hypic_residency_segment_events_total").await >= 1.0);
    assert_eq!(m(&s, "hypic_catalog_notifications_sent_total").await, 0.0);
    assert!(m(&s, "hypic_residency_rows_written_total").await >= 2.0);
    assert_eq!(m(&s, "hypic_residency_queue_drops_total").await, 0.0);
    s.server.stop().await;
}
