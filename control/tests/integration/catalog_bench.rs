//! Timing of `GET /v1/segments` over 10,000 segments of one tenant on SQLite
//! (issue 15, item 9). Ignored by default (the setup takes a while); run with
//! `cargo test --workspace --test integration -- catalog_bench:: --ignored --nocapture`.

use std::collections::BTreeMap;
use std::time::Instant;

use hypic_control::catalog::{Catalog, NewSegment};
use serde_json::Value;

use crate::serve_common::start;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn list_10k_segments_timing() {
    const N: usize = 10_000;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_path_buf();
    let s = start(|c| {
        c.data_dir = data.clone();
        c.invalidation_sweep_ms = 0;
    })
    .await;
    let url = format!("sqlite://{}", data.join("catalog.sqlite").display());
    let cat = Catalog::connect(&url).await.unwrap();
    let t = Instant::now();
    for i in 0..N {
        let content = format!("Segment number {i} of the listing benchmark.");
        cat.create_segment(
            "acme",
            "bench",
            &NewSegment {
                id: format!("seg-{i:05}"),
                name: None,
                tokens: BTreeMap::from([("tiny".to_string(), 9)]),
                content,
                public: false,
            },
        )
        .await
        .unwrap();
    }
    eprintln!("setup: {N} segments in {:.1} s", t.elapsed().as_secs_f64());
    // The default request (first page, or everything where there are no pages).
    let t = Instant::now();
    let (st, v) = s.get("/v1/segments").await;
    let first = t.elapsed().as_secs_f64();
    assert_eq!(st, 200, "{v}");
    let n_first = v["data"].as_array().map(|a| a.len()).unwrap_or(0);
    eprintln!("GET /v1/segments: {n_first} items in {:.3} s", first);
    // Every segment, in pages of 1000 where pages exist.
    let t = Instant::now();
    let mut total = 0;
    let mut pages = 0;
    let mut uri = "/v1/segments?limit=1000".to_string();
    loop {
        let (st, v) = s.get(&uri).await;
        assert_eq!(st, 200, "{v}");
        pages += 1;
        total += v["data"].as_array().map(|a| a.len()).unwrap_or(0);
        match v.get("next").and_then(Value::as_str) {
            Some(n) => uri = format!("/v1/segments?limit=1000&after={n}"),
            None => break,
        }
    }
    eprintln!(
        "all {total} segments in {pages} request(s): {:.3} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(total, N);
    s.server.stop().await;
}
