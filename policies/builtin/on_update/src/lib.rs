//! On-update invalidation: drop an entry exactly when its segment version has
//! been superseded by an update.
#![no_std]
use hypic_policy_sdk::{invalidation_policy, Check};

fn on_update(c: &Check, _now_ms: u64) -> bool {
    c.superseded()
}

invalidation_policy!(on_update);
hypic_policy_sdk::policy_params!(r#"{"params": []}"#);
