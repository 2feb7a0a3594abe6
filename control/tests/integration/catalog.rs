//! Catalog tests, each run against SQLite (temp file) and Postgres (fresh
//! schema): migrations, versions, grants, audit log, policies, concurrency.

use std::collections::BTreeMap;
use std::sync::Arc;

use hypic_control::catalog::{content_hash, Catalog, CatalogError, NewSegment, Residency, Role};

both_backends!(
    migrations,
    versions,
    grants_and_snapshots,
    audit_log,
    policies_activate_rollback,
    residency,
    concurrent_updates_never_mix_versions,
    group_grants_follow_membership_and_revocation,
    groups_bad_input_and_deletion
);

fn seg(id: &str, content: &str, public: bool) -> NewSegment {
    NewSegment {
        id: id.into(),
        name: None,
        content: content.into(),
        tokens: BTreeMap::from([("qwen3".to_string(), content.len() as i64 / 4)]),
        public,
    }
}

async fn migrations(c: Catalog) {
    assert_eq!(c.applied_migrations().await.unwrap(), vec![1, 2, 3, 4, 5]);
    // Applying again is a no-op.
    c.migrate().await.unwrap();
    assert_eq!(c.applied_migrations().await.unwrap(), vec![1, 2, 3, 4, 5]);
    c.upsert_principal("acme", "alice", Role::Tenant)
        .await
        .unwrap();
    c.upsert_principal("acme", "alice", Role::Operator)
        .await
        .unwrap();
    assert_eq!(
        c.principal_role("acme", "alice").await.unwrap(),
        Some(Role::Operator)
    );
    assert_eq!(c.principal_role("acme", "bob").await.unwrap(), None);
    assert_eq!(c.tenants().await.unwrap(), vec!["acme".to_string()]);
}

async fn versions(c: Catalog) {
    let s = c
        .create_segment(
            "acme",
            "alice",
            &seg("sys-prompt", "You are helpful.", false),
        )
        .await
        .unwrap();
    assert_eq!(s.current_version, 1);
    assert_eq!(s.content_hash, content_hash("You are helpful."));
    assert_eq!(s.tokens.get("qwen3"), Some(&4));
    assert_eq!(s.owner_tenant.as_deref(), Some("acme"));
    let addr = s.address.clone();
    // Duplicate id is a conflict, bad ids are rejected.
    assert!(matches!(
        c.create_segment("acme", "alice", &seg("sys-prompt", "x", false))
            .await,
        Err(CatalogError::Conflict(_))
    ));
    assert!(matches!(
        c.create_segment("acme", "alice", &seg("bad id!", "x", false))
            .await,
        Err(CatalogError::InvalidField("id", _))
    ));

    let tokens = BTreeMap::from([("qwen3".to_string(), 7i64), ("llama".to_string(), 8)]);
    let s2 = c
        .update_segment(&addr, "bob", "You are very helpful.", &tokens)
        .await
        .unwrap();
    assert_eq!(s2.current_version, 2);
    assert_eq!(s2.content_hash, content_hash("You are very helpful."));
    assert_eq!(s2.tokens, tokens);
    let vs = c.versions(&addr).await.unwrap();
    assert_eq!(vs.len(), 2);
    assert_eq!(vs[0].version, 1);
    assert!(
        vs[0].superseded_at.is_some(),
        "old version must be superseded"
    );
    assert_eq!(vs[1].version, 2);
    assert_eq!(vs[1].superseded_at, None);
    assert_eq!(vs[1].created_by, "bob");
    assert_eq!(
        c.version_content(&addr, 1).await.unwrap().as_deref(),
        Some("You are helpful.")
    );
    // Negative token counts and unknown segments are rejected.
    let bad = BTreeMap::from([("m".to_string(), -1i64)]);
    assert!(matches!(
        c.update_segment(&addr, "bob", "x", &bad).await,
        Err(CatalogError::InvalidField("tokens", _))
    ));
    assert!(matches!(
        c.update_segment("nope", "bob", "x", &tokens).await,
        Err(CatalogError::NotFound(_))
    ));

    // Snapshot pins the current version.
    let snap = c.snapshot("acme", &["sys-prompt".into()]).await.unwrap();
    assert_eq!(snap[0].version, 2);
    assert_eq!(snap[0].content_hash, content_hash("You are very helpful."));

    c.delete_segment(&addr, "alice").await.unwrap();
    assert!(matches!(
        c.get_segment(&addr).await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(c.snapshot("acme", &["sys-prompt".into()]).await.is_err());
    assert!(c.versions(&addr).await.unwrap()[1].superseded_at.is_some());
}

async fn grants_and_snapshots(c: Catalog) {
    let doc_a = c
        .create_segment("a", "alice", &seg("doc-a", "private doc of a", false))
        .await
        .unwrap()
        .address;
    let pub_ = c
        .create_segment("a", "alice", &seg("pub", "public doc", true))
        .await
        .unwrap()
        .address;
    assert!(c.can_read("a", &doc_a).await.unwrap());
    assert!(!c.can_read("b", &doc_a).await.unwrap());
    assert!(c.can_read("b", &pub_).await.unwrap());
    assert!(matches!(
        c.snapshot("b", &["doc-a".into()]).await,
        Err(CatalogError::NotFound(_))
    ));

    c.grant(&doc_a, "b", "alice").await.unwrap();
    c.grant(&doc_a, "b", "alice").await.unwrap(); // idempotent
    assert_eq!(c.grants(&doc_a).await.unwrap(), vec!["b".to_string()]);
    let snap = c
        .snapshot("b", &[pub_.clone(), doc_a.clone()])
        .await
        .unwrap();
    assert_eq!(
        snap.iter()
            .map(|e| e.segment_id.as_str())
            .collect::<Vec<_>>(),
        vec![pub_.as_str(), doc_a.as_str()]
    );
    assert!(snap[0].public && !snap[1].public);

    c.revoke(&doc_a, "b", "alice").await.unwrap();
    assert!(!c.can_read("b", &doc_a).await.unwrap());
    assert!(matches!(
        c.snapshot("b", std::slice::from_ref(&doc_a)).await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(matches!(
        c.revoke(&doc_a, "b", "alice").await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(matches!(
        c.grant("missing", "b", "alice").await,
        Err(CatalogError::NotFound(_))
    ));
}

async fn audit_log(c: Catalog) {
    let s1 = c
        .create_segment("a", "alice", &seg("s1", "v1", false))
        .await
        .unwrap()
        .address;
    c.update_segment(&s1, "alice", "v2", &BTreeMap::new())
        .await
        .unwrap();
    c.grant(&s1, "b", "alice").await.unwrap();
    c.revoke(&s1, "b", "alice").await.unwrap();
    c.audit(
        "ops",
        None,
        "custom.event",
        "x",
        &serde_json::json!({"k": 1}),
    )
    .await
    .unwrap();
    let log = c.audit_log(None, 100).await.unwrap();
    let actions: Vec<&str> = log.iter().rev().map(|e| e.action.as_str()).collect();
    assert_eq!(
        actions,
        vec![
            "segment.create",
            "segment.update",
            "grant.add",
            "grant.revoke",
            "custom.event"
        ]
    );
    let upd = c.audit_log(Some("segment.update"), 10).await.unwrap();
    assert_eq!(upd.len(), 1);
    assert_eq!(upd[0].target, "s1");
    assert_eq!(upd[0].tenant.as_deref(), Some("a"));
    let d: serde_json::Value = serde_json::from_str(&upd[0].detail).unwrap();
    assert_eq!(d["version"], 2);
    assert_eq!(d["content_hash"], content_hash("v2"));
    assert_eq!(d["address"], s1.as_str());
    assert!(log.windows(2).all(|w| w[0].id > w[1].id), "newest first");
}

async fn policies_activate_rollback(c: Catalog) {
    let p1 = c
        .insert_policy("evict", "eviction", b"\0asm-one", "{}", "ops")
        .await
        .unwrap();
    let p2 = c
        .insert_policy("evict", "eviction", b"\0asm-two", "{\"x\":1}", "ops")
        .await
        .unwrap();
    assert_eq!((p1.version, p2.version), (1, 2));
    assert_eq!(c.policy(p2.id).await.unwrap().module, b"\0asm-two".to_vec());
    assert_eq!(c.active_policy("eviction").await.unwrap(), None);
    c.activate_policy("eviction", Some(p1.id), "ops")
        .await
        .unwrap();
    c.activate_policy("eviction", Some(p2.id), "ops")
        .await
        .unwrap();
    assert_eq!(
        c.active_policy("eviction").await.unwrap().unwrap().id,
        p2.id
    );
    // A policy of another kind cannot be activated for this hook.
    assert!(matches!(
        c.activate_policy("admission", Some(p1.id), "ops").await,
        Err(CatalogError::Invalid(_))
    ));
    assert_eq!(
        c.rollback_policy("eviction", "ops").await.unwrap(),
        Some(p1.id)
    );
    assert_eq!(
        c.active_policy("eviction").await.unwrap().unwrap().id,
        p1.id
    );
    assert_eq!(c.rollback_policy("eviction", "ops").await.unwrap(), None);
    assert_eq!(c.active_policy("eviction").await.unwrap(), None);
    assert!(matches!(
        c.rollback_policy("eviction", "ops").await,
        Err(CatalogError::NotFound(_))
    ));
    let listed = c.policies().await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|p| !p.active && p.module.is_empty()));
    let n = c
        .audit_log(Some("policy.activate"), 10)
        .await
        .unwrap()
        .len();
    assert_eq!(n, 2);
    assert_eq!(
        c.audit_log(Some("policy.rollback"), 10)
            .await
            .unwrap()
            .len(),
        2
    );
}

async fn residency(c: Catalog) {
    let s = c
        .create_segment("a", "alice", &seg("s", "one", false))
        .await
        .unwrap()
        .address;
    let r = |w: &str, v: i64| Residency {
        worker: w.into(),
        cache_key: format!("key-{w}-{v}"),
        segment_id: s.clone(),
        version: v,
        tenant: Some("a".into()),
        bytes: 100,
        last_use: 5,
    };
    c.report_residency(&r("w1", 1)).await.unwrap();
    c.report_residency(&r("w2", 1)).await.unwrap();
    c.report_residency(&Residency {
        bytes: 200,
        ..r("w1", 1)
    })
    .await
    .unwrap();
    let rows = c.residency_of("key-w1-1").await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].bytes, 200);
    c.update_segment(&s, "alice", "two", &BTreeMap::new())
        .await
        .unwrap();
    c.report_residency(&r("w1", 2)).await.unwrap();
    assert_eq!(c.drop_superseded_residency(&s).await.unwrap(), 2);
    let left = c.residency_of_segment(&s).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].version, 2);
}

/// Writers update a batch of segments atomically (all to generation g)
/// while readers take snapshots. Every snapshot must show one generation
/// for the whole batch, each entry's hash must be the hash of the content of
/// exactly its version, and versions never go backwards.
async fn concurrent_updates_never_mix_versions(c: Catalog) {
    let ids: Vec<String> = (0..4).map(|i| format!("src-{i}")).collect();
    let content = |id: &str, g: i64| format!("{id} generation {g}");
    // Address -> id, to know each snapshot entry's content.
    let mut local = std::collections::HashMap::new();
    let mut addrs = vec![];
    for id in &ids {
        let a = c
            .create_segment("t", "w", &seg(id, &content(id, 1), false))
            .await
            .unwrap()
            .address;
        local.insert(a.clone(), id.clone());
        addrs.push(a);
    }
    let c = Arc::new(c);
    let writer = {
        let c = c.clone();
        let ids = ids.clone();
        let addrs = addrs.clone();
        tokio::spawn(async move {
            for g in 2..=25i64 {
                let batch: Vec<(String, String, BTreeMap<String, i64>)> = ids
                    .iter()
                    .zip(&addrs)
                    .map(|(id, a)| (a.clone(), content(id, g), BTreeMap::new()))
                    .collect();
                let vs = c.update_segments("w", &batch).await.unwrap();
                assert!(
                    vs.iter().all(|&v| v == g),
                    "versions {vs:?} at generation {g}"
                );
            }
        })
    };
    // A second writer on a separate segment concurrently: single-segment updates.
    let solo = c
        .create_segment("t", "w", &seg("solo", &content("solo", 1), false))
        .await
        .unwrap()
        .address;
    local.insert(solo.clone(), "solo".to_string());
    let local = Arc::new(local);
    let writer2 = {
        let c = c.clone();
        let solo = solo.clone();
        tokio::spawn(async move {
            for g in 2..=25i64 {
                let s = c
                    .update_segment(&solo, "w", &content("solo", g), &BTreeMap::new())
                    .await
                    .unwrap();
                assert_eq!(s.current_version, g);
            }
        })
    };
    let mut readers = vec![];
    for _ in 0..3 {
        let c = c.clone();
        let local = local.clone();
        let mut want: Vec<String> = ids.clone();
        want.push("solo".into());
        readers.push(tokio::spawn(async move {
            let mut last = 0i64;
            let mut snapshots = 0;
            for _ in 0..60 {
                let snap = c.snapshot("t", &want).await.unwrap();
                let g = snap[0].version;
                for e in &snap {
                    assert_eq!(
                        e.content_hash,
                        content_hash(&content(&local[&e.segment_id], e.version)),
                        "hash of {} does not match its version {}",
                        e.segment_id,
                        e.version
                    );
                }
                for e in &snap[..4] {
                    assert_eq!(e.version, g, "snapshot mixes generations: {snap:?}");
                }
                assert!(g >= last, "versions went backwards: {last} -> {g}");
                last = g;
                snapshots += 1;
            }
            snapshots
        }));
    }
    writer.await.unwrap();
    writer2.await.unwrap();
    for r in readers {
        assert_eq!(r.await.unwrap(), 60);
    }
    let snap = c.snapshot("t", &ids).await.unwrap();
    assert!(snap.iter().all(|e| e.version == 25));
    assert_eq!(c.versions(&addrs[0]).await.unwrap().len(), 25);
    assert_eq!(
        c.versions(&solo)
            .await
            .unwrap()
            .iter()
            .filter(|v| v.superseded_at.is_none())
            .count(),
        1
    );
}

fn ids(v: &[hypic_control::catalog::SnapshotEntry]) -> Vec<String> {
    v.iter().map(|e| e.segment_id.clone()).collect()
}

async fn group_grants_follow_membership_and_revocation(c: Catalog) {
    let handbook = c
        .create_segment("acme", "alice", &seg("handbook", "team handbook", false))
        .await
        .unwrap()
        .address;
    let other = c
        .create_segment("acme", "alice", &seg("other", "other doc", false))
        .await
        .unwrap()
        .address;
    let g = c
        .create_group("partners", Some("Partner tenants"), "ops")
        .await
        .unwrap();
    assert_eq!(g.id, "partners");
    assert_eq!(g.name, "Partner tenants");
    assert!(g.members.is_empty());
    c.add_member("partners", "globex", "ops").await.unwrap();
    c.add_member("partners", "initech", "ops").await.unwrap();
    // Adding twice is a no-op.
    c.add_member("partners", "globex", "ops").await.unwrap();
    assert_eq!(
        c.group("partners").await.unwrap().members,
        vec!["globex".to_string(), "initech".to_string()]
    );
    assert_eq!(
        c.groups_of("globex").await.unwrap(),
        vec!["partners".to_string()]
    );

    // Membership alone grants nothing.
    assert!(!c.can_read("globex", &handbook).await.unwrap());
    c.grant_group(&handbook, "partners", "alice").await.unwrap();
    assert_eq!(
        c.group_grants(&handbook).await.unwrap(),
        vec!["partners".to_string()]
    );
    // Every member reads it, a non-member does not, nor a segment not granted.
    for t in ["globex", "initech"] {
        assert!(c.can_read(t, &handbook).await.unwrap(), "{t}");
        let snap = c
            .snapshot(t, std::slice::from_ref(&handbook))
            .await
            .unwrap();
        assert_eq!(ids(&snap), vec![handbook.clone()]);
        assert_eq!(snap[0].owner_tenant, "acme");
        assert!(!snap[0].public);
    }
    assert!(!c.can_read("hooli", &handbook).await.unwrap());
    assert!(!c.can_read("globex", &other).await.unwrap());
    assert!(matches!(
        c.snapshot("hooli", std::slice::from_ref(&handbook)).await,
        Err(CatalogError::NotFound(_))
    ));

    // Removing a membership: that member's next snapshot fails; the other keeps access.
    c.remove_member("partners", "initech", "ops").await.unwrap();
    assert!(matches!(
        c.snapshot("initech", std::slice::from_ref(&handbook)).await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(c.can_read("globex", &handbook).await.unwrap());
    assert!(matches!(
        c.remove_member("partners", "initech", "ops").await,
        Err(CatalogError::NotFound(_))
    ));

    // A direct tenant grant and a group grant are independent.
    c.grant(&handbook, "globex", "alice").await.unwrap();
    c.revoke_group(&handbook, "partners", "alice")
        .await
        .unwrap();
    assert!(c.can_read("globex", &handbook).await.unwrap());
    c.revoke(&handbook, "globex", "alice").await.unwrap();
    assert!(!c.can_read("globex", &handbook).await.unwrap());
    assert!(matches!(
        c.snapshot("globex", std::slice::from_ref(&handbook)).await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(matches!(
        c.revoke_group(&handbook, "partners", "alice").await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(c.group_grants(&handbook).await.unwrap().is_empty());

    // Every step is audited.
    let actions: Vec<String> = c
        .audit_log(None, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.action)
        .collect();
    for a in [
        "group.create",
        "group.member.add",
        "group.member.remove",
        "grant.group.add",
        "grant.group.revoke",
    ] {
        assert!(actions.iter().any(|x| x == a), "missing {a} in {actions:?}");
    }
}

async fn groups_bad_input_and_deletion(c: Catalog) {
    assert!(matches!(
        c.create_group("bad id!", None, "ops").await,
        Err(CatalogError::InvalidField("id", _))
    ));
    assert!(matches!(
        c.create_group("", None, "ops").await,
        Err(CatalogError::InvalidField("id", _))
    ));
    let g = c.create_group("team", None, "ops").await.unwrap();
    assert_eq!(g.name, "team", "name defaults to the id");
    assert!(matches!(
        c.create_group("team", None, "ops").await,
        Err(CatalogError::Conflict(_))
    ));
    assert!(matches!(
        c.add_member("nope", "globex", "ops").await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(matches!(
        c.add_member("team", "bad tenant!", "ops").await,
        Err(CatalogError::InvalidField("tenant", _))
    ));
    let doc = c
        .create_segment("acme", "alice", &seg("doc", "a doc", false))
        .await
        .unwrap()
        .address;
    assert!(matches!(
        c.grant_group(&doc, "nope", "alice").await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(matches!(
        c.grant_group("missing", "team", "alice").await,
        Err(CatalogError::NotFound(_))
    ));

    // Deleting a group removes its memberships and grants.
    c.add_member("team", "globex", "ops").await.unwrap();
    c.grant_group(&doc, "team", "alice").await.unwrap();
    assert!(c.can_read("globex", &doc).await.unwrap());
    c.delete_group("team", "ops").await.unwrap();
    assert!(!c.can_read("globex", &doc).await.unwrap());
    assert!(c.group_grants(&doc).await.unwrap().is_empty());
    assert!(c.groups_of("globex").await.unwrap().is_empty());
    assert!(matches!(
        c.group("team").await,
        Err(CatalogError::NotFound(_))
    ));
    assert!(matches!(
        c.delete_group("team", "ops").await,
        Err(CatalogError::NotFound(_))
    ));
    // A new group of the same name starts empty: nothing is inherited.
    c.create_group("team", None, "ops").await.unwrap();
    assert!(c.group("team").await.unwrap().members.is_empty());
    assert!(!c.can_read("globex", &doc).await.unwrap());
    assert_eq!(c.groups().await.unwrap().len(), 1);
}
