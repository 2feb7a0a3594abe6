//! The recorded recent traffic a policy dry run can replay
//! (`GET /v1/admin/traffic`, operator only): a bounded ring of the last
//! [`CAPACITY`] prompts' cacheable segments, in the JSONL trace format of
//! [`crate::sim::TraceRecord`].
//!
//! Tenants are pseudonymised ([`crate::auth::IsolationKeyer::pseudonym`]); a
//! catalog segment appears under the id the request named it by, an inline one
//! as `h:` and the first 16 hex digits of its content hash. Segments the engine
//! computes in place (the query, segments no longer than the seam window) are
//! left out: no policy decides about them. Bytes are the segment's cache entry as
//! the public pool holds it (the entry's recurrent-state pairs, conv tail and body
//! KV) when it is resident as the prompt used it; otherwise an estimate, the
//! segment's tokens times the KV bytes one token costs in the full-attention
//! layers (the recurrent state left out).
use super::routes::Resolved;
use crate::sim::TraceRecord;
use dataplane::pic::{Outcome, PicStats};
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Mutex;

/// Prompts kept.
pub const CAPACITY: usize = 10_000;

/// The ring of recorded prompts, oldest first.
#[derive(Default)]
pub struct Traffic {
    ring: Mutex<VecDeque<TraceRecord>>,
}

/// Answer of `GET /v1/admin/traffic` (`RecordedTraffic` in the OpenAPI document).
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = RecordedTraffic)]
pub struct TrafficView {
    /// Prompts in `trace`.
    pub requests: usize,
    /// Prompts kept at most.
    pub capacity: usize,
    /// JSONL, one prompt per line, oldest first (the body of a dry run's `trace`).
    pub trace: String,
    /// The server's public pool capacity, bytes: the dry run's `capacity_bytes`
    /// that replays this trace through a cache the size of the server's own.
    pub public_pool_bytes: u64,
}

impl Traffic {
    /// Records one started prompt of `tenant_pseudonym`: its segments `segs` as
    /// resolved and their outcomes in `stats`. `entry_bytes(segment, body start)`
    /// gives the bytes of a resident entry (`None`: not resident), else
    /// `bytes_per_token` sizes the segment. A prompt without a cacheable segment is
    /// not recorded.
    pub fn record(
        &self,
        tenant_pseudonym: &str,
        segs: &[Resolved],
        stats: &PicStats,
        entry_bytes: &dyn Fn(&Resolved, usize) -> Option<usize>,
        bytes_per_token: usize,
        ts_ms: u64,
    ) {
        let mut rec = TraceRecord {
            tenant: tenant_pseudonym.to_string(),
            segments: vec![],
            tokens: vec![],
            bytes: vec![],
            ts_ms: Some(ts_ms),
            versions: Some(vec![]),
            public: vec![],
        };
        for st in stats
            .segments
            .iter()
            .filter(|x| x.outcome != Outcome::Computed)
        {
            let r = segs.get(st.index);
            let id = match r.and_then(|r| r.id.clone()) {
                Some(id) => id,
                None => format!("h:{}", st.content_hash.get(..16).unwrap_or("")),
            };
            if r.is_some_and(|r| r.shared) {
                rec.public.push(id.clone());
            }
            rec.segments.push(id);
            rec.tokens.push(st.tokens as u64);
            let bytes = r
                .and_then(|r| entry_bytes(r, st.seam))
                .unwrap_or(st.tokens * bytes_per_token);
            rec.bytes.push(bytes as u64);
            if let Some(v) = rec.versions.as_mut() {
                v.push(r.and_then(|r| r.version).unwrap_or(1));
            }
        }
        if rec.segments.is_empty() {
            return;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.push_back(rec);
        while ring.len() > CAPACITY {
            ring.pop_front();
        }
    }

    /// The recorded prompts as a trace, beside the public pool's capacity
    /// `public_pool_bytes`.
    pub fn view(&self, public_pool_bytes: u64) -> TrafficView {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let mut trace = String::new();
        for r in ring.iter() {
            if let Ok(line) = serde_json::to_string(r) {
                trace.push_str(&line);
                trace.push('\n');
            }
        }
        TrafficView {
            requests: ring.len(),
            capacity: CAPACITY,
            trace,
            public_pool_bytes,
        }
    }
}
