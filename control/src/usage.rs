//! Requests and tokens per tenant since the server started, recorded by the
//! serving routes (`hypic serve`) and read by `GET /v1/admin/tenants` and
//! `GET /v1/tenants/{tenant}/usage`. In memory only: a restart starts over.

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

/// The per-tenant counters (cheap to clone: one shared map).
#[derive(Clone, Debug, Default)]
pub struct UsageBook {
    map: Arc<Mutex<HashMap<String, ServingUsage>>>,
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
    fn with(&self, tenant: &str, f: impl FnOnce(&mut ServingUsage)) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let key = if m.contains_key(tenant) || m.len() < MAX_TENANTS {
            tenant
        } else {
            OTHER_TENANTS
        };
        f(m.entry(key.to_string()).or_default());
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
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(tenant)
            .cloned()
            .unwrap_or_default()
    }

    /// Every tenant with counters, sorted by name.
    pub fn all(&self) -> Vec<(String, ServingUsage)> {
        let m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = m.iter().map(|(k, u)| (k.clone(), u.clone())).collect();
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
}
