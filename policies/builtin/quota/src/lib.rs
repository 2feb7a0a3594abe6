//! Per-tenant quota admission: a tenant may hold at most `quota_permille`
//! thousandths of the cache capacity (default 500, i.e. half), or at most
//! `quota_bytes` bytes when that parameter is set. Shared (public) entries are
//! not charged to a tenant and are always admitted.
#![no_std]
use hypic_policy_sdk::{admission_policy, param, Admit};

fn quota(a: &Admit, _now_ms: u64) -> bool {
    if a.flags & 1 != 0 {
        return true;
    }
    let limit = match param("quota_bytes") {
        Some(b) if b > 0 => b as u64,
        _ => {
            let pm = param("quota_permille").unwrap_or(500).clamp(0, 1000) as u128;
            (a.capacity_bytes as u128 * pm / 1000) as u64
        }
    };
    a.tenant_used_bytes.saturating_add(a.bytes) <= limit
}

admission_policy!(quota);
hypic_policy_sdk::policy_params!(
    r#"{"params": [{"name": "quota_permille", "type": "int", "min": 0, "max": 1000, "default": 500, "description": "share of the cache capacity one tenant may hold, thousandths"}, {"name": "quota_bytes", "type": "int", "min": 0, "default": 0, "description": "bytes one tenant may hold; 0 uses quota_permille instead"}]}"#
);
