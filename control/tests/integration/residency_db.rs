//! The catalog's residency directory (`segment_residency`) and change events, on
//! SQLite and on Postgres: rows written, replaced, dropped and cleared per holder;
//! scope filtering; invalid rows refused whole; segment updates and deletions
//! delivered in process and (Postgres) through `NOTIFY` to another catalog that
//! listens, only once committed.
use std::collections::BTreeMap;
use std::time::Duration;

use hypic_control::catalog::{Backend, Catalog, NewSegment};
use hypic_control::residency::{
    CatalogEvent, HolderKind, ResidencyFilter, ResidencyRow, ResidencyWrite,
};

fn row(
    holder: &str,
    kind: HolderKind,
    key: &str,
    scope: &str,
    tier: &str,
    bytes: i64,
) -> ResidencyRow {
    ResidencyRow {
        holder: holder.into(),
        holder_kind: kind,
        entry_key: key.into(),
        segment_id: None,
        version: None,
        scope: scope.into(),
        tier: tier.into(),
        bytes,
        tokens: 12,
        updated_at: 1000,
    }
}

fn all() -> ResidencyFilter {
    ResidencyFilter {
        limit: 100,
        ..ResidencyFilter::default()
    }
}

async fn rows_written_replaced_dropped_and_cleared(c: Catalog) {
    let mut a = row(
        "replica-a",
        HolderKind::Replica,
        "aa01",
        "acct1",
        "primary",
        100,
    );
    a.segment_id = Some("~seg".into());
    a.version = Some(3);
    let b = row(
        "replica-b",
        HolderKind::Replica,
        "aa01",
        "acct1",
        "primary",
        100,
    );
    let shared = row(
        "replica-a",
        HolderKind::Replica,
        "bb02",
        "shared",
        "primary",
        50,
    );
    let n = c
        .write_residency(&[
            ResidencyWrite::Put(a.clone()),
            ResidencyWrite::Put(b.clone()),
            ResidencyWrite::Put(shared.clone()),
        ])
        .await
        .unwrap();
    assert_eq!(n, 3);
    assert_eq!(c.residency_rows(&all()).await.unwrap().len(), 3);

    // A spill of the same entry replaces tier and bytes and keeps the segment
    // the first write named.
    let mut spilled = row(
        "replica-a",
        HolderKind::Replica,
        "aa01",
        "acct1",
        "spill",
        40,
    );
    spilled.updated_at = 2000;
    c.write_residency(&[ResidencyWrite::Put(spilled)])
        .await
        .unwrap();
    let got = c
        .residency_rows(&ResidencyFilter {
            holder: Some("replica-a".into()),
            limit: 100,
            ..ResidencyFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].entry_key, "aa01", "newest first: {got:?}");
    assert_eq!(
        (
            got[0].tier.as_str(),
            got[0].bytes,
            got[0].segment_id.as_deref(),
            got[0].version
        ),
        ("spill", 40, Some("~seg"), Some(3))
    );

    // Scope filtering: a tenant's scopes see its rows and the shared ones only.
    let only = |scopes: &[&str]| ResidencyFilter {
        scopes: Some(scopes.iter().map(|s| s.to_string()).collect()),
        limit: 100,
        ..ResidencyFilter::default()
    };
    assert_eq!(
        c.residency_rows(&only(&["acct2", "shared"]))
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        c.residency_rows(&only(&["acct1", "shared"]))
            .await
            .unwrap()
            .len(),
        3
    );
    assert!(c.residency_rows(&only(&[])).await.unwrap().is_empty());
    let by_seg = c
        .residency_rows(&ResidencyFilter {
            segment_id: Some("~seg".into()),
            limit: 100,
            ..ResidencyFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(by_seg.len(), 1);

    // Eviction drops one row; the other holder's row of the same entry stays.
    let n = c
        .write_residency(&[ResidencyWrite::Drop {
            holder: "replica-a".into(),
            holder_kind: HolderKind::Replica,
            entry_key: "aa01".into(),
        }])
        .await
        .unwrap();
    assert_eq!(n, 1);
    let left = c.residency_rows(&all()).await.unwrap();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left
        .iter()
        .any(|r| r.holder == "replica-b" && r.entry_key == "aa01"));

    // A replica starting again clears its own rows only.
    let w = row(
        "replica-a",
        HolderKind::Worker,
        "cc03",
        "acct1",
        "primary",
        7,
    );
    c.write_residency(&[ResidencyWrite::Put(w)]).await.unwrap();
    assert_eq!(c.clear_holder("replica-a").await.unwrap(), 1);
    let left = c.residency_rows(&all()).await.unwrap();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left
        .iter()
        .all(|r| r.holder == "replica-b" || r.holder_kind == HolderKind::Worker));
}

async fn invalid_rows_are_refused_whole(c: Catalog) {
    let good = row(
        "replica-a",
        HolderKind::Replica,
        "aa01",
        "acct1",
        "primary",
        1,
    );
    for (bad, what) in [
        (
            row("", HolderKind::Replica, "aa01", "s", "primary", 1),
            "holder",
        ),
        (
            row("r", HolderKind::Replica, "zz", "s", "primary", 1),
            "entry_key",
        ),
        (row("r", HolderKind::Replica, "aa", "s", "gpu", 1), "tier"),
        (
            row("r", HolderKind::Replica, "aa", "s", "primary", -1),
            "negative",
        ),
    ] {
        let e = c
            .write_residency(&[ResidencyWrite::Put(good.clone()), ResidencyWrite::Put(bad)])
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(what), "{what}: {e}");
    }
    assert!(c.residency_rows(&all()).await.unwrap().is_empty());
}

async fn worker_holdings_are_events_and_resync_rows(c: Catalog) {
    let mut rx = c.subscribe();
    let w = row(
        "10.0.0.1:9101",
        HolderKind::Worker,
        "0123abcd",
        "acct1",
        "primary",
        9,
    );
    c.write_residency(&[ResidencyWrite::Put(w)]).await.unwrap();
    assert_eq!(
        rx.recv().await.unwrap(),
        CatalogEvent::Holder {
            segment: "0123abcd".into(),
            worker: "10.0.0.1:9101".into(),
            held: true
        }
    );
    assert_eq!(
        c.worker_holders(10).await.unwrap(),
        vec![("0123abcd".to_string(), "10.0.0.1:9101".to_string())]
    );
    c.write_residency(&[ResidencyWrite::Drop {
        holder: "10.0.0.1:9101".into(),
        holder_kind: HolderKind::Worker,
        entry_key: "0123abcd".into(),
    }])
    .await
    .unwrap();
    assert!(matches!(
        rx.recv().await.unwrap(),
        CatalogEvent::Holder { held: false, .. }
    ));
    assert!(c.worker_holders(10).await.unwrap().is_empty());
}

async fn new_segment(c: &Catalog) -> String {
    c.ensure_tenant("acme", "acme").await.unwrap();
    let s = c
        .create_segment(
            "acme",
            "u",
            &NewSegment {
                id: "doc".into(),
                name: None,
                content: "one".into(),
                public: false,
                tokens: BTreeMap::new(),
            },
        )
        .await
        .unwrap();
    s.address
}

async fn segment_changes_are_events(c: Catalog) {
    let address = new_segment(&c).await;
    let mut rx = c.subscribe();
    c.update_segment(&address, "u", "two", &BTreeMap::new())
        .await
        .unwrap();
    assert_eq!(
        rx.recv().await.unwrap(),
        CatalogEvent::Segment {
            address: address.clone(),
            version: 2,
            deleted: false
        }
    );
    c.delete_segment(&address, "u").await.unwrap();
    assert_eq!(
        rx.recv().await.unwrap(),
        CatalogEvent::Segment {
            address: address.clone(),
            version: 2,
            deleted: true
        }
    );
    // A failed change sends nothing.
    assert!(c.delete_segment(&address, "u").await.is_err());
    assert!(rx.try_recv().is_err());
    let sent = c.notifications_sent();
    match c.backend() {
        Backend::Postgres => assert_eq!(sent, 2),
        Backend::Sqlite => assert_eq!(sent, 0),
    }
}

both_backends!(
    rows_written_replaced_dropped_and_cleared,
    invalid_rows_are_refused_whole,
    worker_holdings_are_events_and_resync_rows,
    segment_changes_are_events,
);

/// Another catalog over the same schema (another replica) hears a change
/// through `NOTIFY` once it committed, and nothing of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_notify_reaches_another_replica() {
    let (a, schema) = crate::common::pg_catalog().await;
    let b = Catalog::connect_in_schema(&crate::common::pg_url(), Some(&schema.name))
        .await
        .unwrap();
    assert_eq!(a.channel(), b.channel());
    assert_ne!(a.origin(), b.origin());
    let mut rx = b.subscribe();
    let (conn_tx, mut conn_rx) = tokio::sync::mpsc::unbounded_channel();
    let got = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let got2 = got.clone();
    let lb = b.clone();
    let listener = tokio::spawn(async move {
        lb.listen(
            move || {
                let _ = conn_tx.send(());
            },
            move |_| {
                got2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            },
            || {},
        )
        .await
    });
    tokio::time::timeout(Duration::from_secs(10), conn_rx.recv())
        .await
        .expect("listener connects")
        .unwrap();
    let address = new_segment(&a).await;
    a.update_segment(&address, "u", "two", &BTreeMap::new())
        .await
        .unwrap();
    let e = tokio::time::timeout(Duration::from_secs(1), rx.recv())
        .await
        .expect("the notification arrives within a second")
        .unwrap();
    assert_eq!(
        e,
        CatalogEvent::Segment {
            address: address.clone(),
            version: 2,
            deleted: false
        }
    );
    assert_eq!(got.load(std::sync::atomic::Ordering::Relaxed), 1);
    // B's own change reaches B once (in process), not a second time through
    // its listener.
    b.delete_segment(&address, "u").await.unwrap();
    let e = rx.recv().await.unwrap();
    assert!(matches!(e, CatalogEvent::Segment { deleted: true, .. }));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(rx.try_recv().is_err());
    assert_eq!(got.load(std::sync::atomic::Ordering::Relaxed), 1);
    listener.abort();
}
