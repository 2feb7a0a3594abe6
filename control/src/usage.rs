//! Requests and tokens per tenant since the server started, recorded by the
//! serving routes (`hypic serve`) and read by `GET /v1/admin/tenants` and
//! `GET /v1/tenants/{tenant}/usage`. Kept in the catalog across restarts by
//! [`crate::persist`]: the book remembers what it counted since the last write
//! ([`UsageBook::take_pending`]) and starts from the stored totals
//! ([`UsageBook::load`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// Most tenants counted separately; requests of further tenants are counted
/// under [`OTHER_TENANTS`] (tokens are verified, but a misconfigured issuer
/// must not grow the map without bound).
pub const MAX_TENANTS: usize = 100_000;

/// The key requests of tenants past [`MAX_TENANTS`] are counted under.
pub const OTHER_TENANTS: &str = "(other tenants)";

/// One tenant's serving counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ServingUsage {
    /// Generation requests (completions and chat completions) started.
    pub requests: u64,
    /// Prompt tokens over those requests.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache (not recomputed).
    pub cached_tokens: u64,
    /// Tokens generated (a stream's count once it ends).
    pub completion_tokens: u64,
    /// Segment lookups that hit the cache.
    pub segment_hits: u64,
    /// Segment lookups that missed.
    pub segment_misses: u64,
    /// Start of the tenant's latest request, ms since the Unix epoch
    /// (`null` before the first).
    pub last_request_at: Option<i64>,
}

impl ServingUsage {
    /// Adds `d`'s counters to these; the later `last_request_at` wins.
    pub fn add(&mut self, d: &ServingUsage) {
        self.requests += d.requests;
        self.prompt_tokens += d.prompt_tokens;
        self.cached_tokens += d.cached_tokens;
        self.completion_tokens += d.completion_tokens;
        self.segment_hits += d.segment_hits;
        self.segment_misses += d.segment_misses;
        self.last_request_at = self.last_request_at.max(d.last_request_at);
    }
}

#[derive(Debug, Default)]
struct Book {
    /// Totals: stored ones read at start plus everything counted since.
    total: HashMap<String, ServingUsage>,
    /// Counted since the last write to the catalog.
    pending: HashMap<String, ServingUsage>,
}

/// The per-tenant counters (cheap to clone: one shared map).
#[derive(Clone, Debug, Default)]
pub struct UsageBook {
    map: Arc<Mutex<Book>>,
}

/// Adds a request's completion tokens to its tenant when dropped: streams
/// count their tokens while they run, and the ticket is dropped once the
/// answer is complete.
#[derive(Debug)]
pub struct UsageTicket {
    book: UsageBook,
    tenant: String,
    completion_tokens: Arc<AtomicUsize>,
}

impl Drop for UsageTicket {
    fn drop(&mut self) {
        let n = self.completion_tokens.load(Ordering::Relaxed) as u64;
        self.book.with(&self.tenant, |u| u.completion_tokens += n);
    }
}

impl UsageBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key `tenant` is counted under in `m` (see [`MAX_TENANTS`]).
    fn key<'a>(m: &HashMap<String, ServingUsage>, tenant: &'a str) -> &'a str {
        if m.contains_key(tenant) || m.len() < MAX_TENANTS {
            tenant
        } else {
            OTHER_TENANTS
        }
    }

    /// Adds `d` to `tenant`'s totals and, with `pending`, to what is to be
    /// written.
    fn add(b: &mut Book, tenant: &str, d: &ServingUsage, pending: bool) {
        let key = Self::key(&b.total, tenant).to_string();
        if pending {
            b.pending.entry(key.clone()).or_default().add(d);
        }
        b.total.entry(key).or_default().add(d);
    }

    fn with(&self, tenant: &str, f: impl FnOnce(&mut ServingUsage)) {
        let mut d = ServingUsage::default();
        f(&mut d);
        Self::add(&mut self.lock(), tenant, &d, true);
    }

    /// Adds stored totals (read from the catalog at start) to the counters;
    /// they are not written again.
    pub fn load(&self, stored: Vec<(String, ServingUsage)>) {
        let mut b = self.lock();
        for (t, u) in stored {
            Self::add(&mut b, &t, &u, false);
        }
    }

    /// What was counted since the last call, per tenant, to be added to the
    /// catalog's rows; [`UsageBook::restore_pending`] gives it back when the
    /// write fails.
    pub fn take_pending(&self) -> Vec<(String, ServingUsage)> {
        let mut v: Vec<_> = std::mem::take(&mut self.lock().pending)
            .into_iter()
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Puts increments whose write failed back, to be written next time.
    pub fn restore_pending(&self, v: Vec<(String, ServingUsage)>) {
        let mut b = self.lock();
        for (t, u) in v {
            b.pending.entry(t).or_default().add(&u);
        }
    }

    /// Records the start of one generation request of `tenant` with its prompt
    /// figures; the returned ticket adds `completion_tokens` (a counter the
    /// request increments) when dropped.
    pub fn start(
        &self,
        tenant: &str,
        prompt_tokens: usize,
        cached_tokens: usize,
        hits: usize,
        misses: usize,
        completion_tokens: Arc<AtomicUsize>,
    ) -> UsageTicket {
        let now = crate::catalog::now_ms();
        self.with(tenant, |u| {
            u.requests += 1;
            u.prompt_tokens += prompt_tokens as u64;
            u.cached_tokens += cached_tokens as u64;
            u.segment_hits += hits as u64;
            u.segment_misses += misses as u64;
            u.last_request_at = Some(now);
        });
        UsageTicket {
            book: self.clone(),
            tenant: tenant.to_string(),
            completion_tokens,
        }
    }

    /// The counters of `tenant` (zeros when it has made no request).
    pub fn of(&self, tenant: &str) -> ServingUsage {
        self.lock().total.get(tenant).cloned().unwrap_or_default()
    }

    /// Every tenant with counters, sorted by name.
    pub fn all(&self) -> Vec<(String, ServingUsage)> {
        let m = self.lock();
        let mut v: Vec<_> = m
            .total
            .iter()
            .map(|(k, u)| (k.clone(), u.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_requests_and_adds_completion_tokens_when_the_ticket_drops() {
        let b = UsageBook::default();
        let out = Arc::new(AtomicUsize::new(0));
        let t = b.start("acme", 10, 4, 1, 2, out.clone());
        out.store(7, Ordering::Relaxed);
        assert_eq!(b.of("acme").completion_tokens, 0);
        drop(t);
        let u = b.of("acme");
        assert_eq!(
            (
                u.requests,
                u.prompt_tokens,
                u.cached_tokens,
                u.completion_tokens
            ),
            (1, 10, 4, 7)
        );
        assert_eq!((u.segment_hits, u.segment_misses), (1, 2));
        assert!(u.last_request_at.is_some());
        drop(b.start("acme", 5, 0, 0, 1, Arc::new(AtomicUsize::new(3))));
        assert_eq!(b.of("acme").requests, 2);
        assert_eq!(b.of("acme").completion_tokens, 10);
        assert_eq!(b.of("nobody"), ServingUsage::default());
        assert_eq!(b.all().len(), 1);
    }

    #[test]
    fn stored_totals_add_up_and_only_new_counts_are_pending() {
        let b = UsageBook::default();
        let stored = ServingUsage {
            requests: 5,
            prompt_tokens: 50,
            completion_tokens: 9,
            last_request_at: Some(1_000),
            ..ServingUsage::default()
        };
        b.load(vec![("acme".into(), stored)]);
        assert!(
            b.take_pending().is_empty(),
            "stored totals are not written again"
        );
        drop(b.start("acme", 10, 4, 1, 0, Arc::new(AtomicUsize::new(2))));
        let u = b.of("acme");
        assert_eq!(
            (u.requests, u.prompt_tokens, u.completion_tokens),
            (6, 60, 11)
        );
        assert!(u.last_request_at.unwrap() > 1_000);
        let p = b.take_pending();
        assert_eq!(p.len(), 1);
        assert_eq!(
            (
                p[0].1.requests,
                p[0].1.prompt_tokens,
                p[0].1.completion_tokens
            ),
            (1, 10, 2)
        );
        assert!(b.take_pending().is_empty());
        // A failed write puts the increments back, and later counts join them.
        b.restore_pending(p);
        drop(b.start("acme", 1, 0, 0, 1, Arc::new(AtomicUsize::new(0))));
        let p = b.take_pending();
        assert_eq!(
            (p[0].1.requests, p[0].1.prompt_tokens, p[0].1.segment_misses),
            (2, 11, 1)
        );
        assert_eq!(b.of("acme").requests, 7);
    }
}
