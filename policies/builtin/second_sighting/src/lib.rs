//! Admit-on-second-sighting: an entry is cached only from its `min_sightings`-th
//! request on (default 2), so one-off documents never displace reused ones.
#![no_std]
use hypic_policy_sdk::{admission_policy, param, Admit};

fn second(a: &Admit, _now_ms: u64) -> bool {
    let min = param("min_sightings").unwrap_or(2).max(1) as u32;
    a.seen_count >= min
}

admission_policy!(second);
hypic_policy_sdk::policy_params!(
    r#"{"params": [{"name": "min_sightings", "type": "int", "min": 1, "max": 1000, "default": 2, "description": "requests for an entry before it is cached (1 admits everything)"}]}"#
);
