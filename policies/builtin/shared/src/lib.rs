//! Shared isolation: explicitly public segments use one shared namespace;
//! everything else stays per tenant (the host enforces this too).
#![no_std]
use hypic_policy_sdk::{isolation_policy, Isolation};

fn shared(s: &Isolation) -> bool {
    s.public()
}

isolation_policy!(shared);
hypic_policy_sdk::policy_params!(r#"{"params": []}"#);
