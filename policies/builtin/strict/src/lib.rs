//! Strict isolation: every segment, public or not, is cached per tenant.
#![no_std]
use hypic_policy_sdk::{isolation_policy, Isolation};

fn strict(_s: &Isolation) -> bool {
    false
}

isolation_policy!(strict);
hypic_policy_sdk::policy_params!(r#"{"params": []}"#);
