//! TTL invalidation: drop entries older than `ttl_ms` (default 3 600 000, one
//! hour) since insertion, and entries whose segment version was superseded.
#![no_std]
use hypic_policy_sdk::{invalidation_policy, param, Check};

fn ttl(c: &Check, now_ms: u64) -> bool {
    let ttl = param("ttl_ms").unwrap_or(3_600_000).max(0) as u64;
    c.superseded() || now_ms.saturating_sub(c.inserted_ms) > ttl
}

invalidation_policy!(ttl);
hypic_policy_sdk::policy_params!(
    r#"{"params": [{"name": "ttl_ms", "type": "int", "min": 0, "default": 3600000, "description": "entries older than this since insertion are dropped, ms"}]}"#
);
