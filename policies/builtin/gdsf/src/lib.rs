//! Cost-aware eviction (GDSF-style): value = hits x recompute cost / bytes,
//! where hits counts the insertion as one use and recompute cost is the
//! segment's token count times the `cost_per_token` parameter (default 1).
//! The candidate with the lowest value is the victim; ties go to the least
//! recently used. Values are compared exactly as fractions in 128-bit integers.
#![no_std]
use hypic_policy_sdk::{eviction_policy, param, Candidates};

fn gdsf(c: &Candidates, _now_ms: u64) -> usize {
    let cpt = param("cost_per_token").unwrap_or(1).max(1) as u128;
    let mut best = 0usize;
    let mut best_num: u128 = u128::MAX;
    let mut best_den: u128 = 1;
    let mut best_lu = u64::MAX;
    for i in 0..c.len() {
        let e = c.get(i);
        let num = (e.hits as u128 + 1) * (e.recompute_tokens as u128) * cpt;
        let den = (e.bytes as u128).max(1);
        // num/den < best_num/best_den  <=>  num*best_den < best_num*den
        let lhs = num.saturating_mul(best_den);
        let rhs = best_num.saturating_mul(den);
        if i == 0 || lhs < rhs || (lhs == rhs && e.last_use_ms < best_lu) {
            best = i;
            best_num = num;
            best_den = den;
            best_lu = e.last_use_ms;
        }
    }
    best
}

eviction_policy!(gdsf);
hypic_policy_sdk::policy_params!(
    r#"{"params": [{"name": "cost_per_token", "type": "int", "min": 1, "max": 1000000, "default": 1, "description": "recompute cost of one token; scales every candidate's value alike"}]}"#
);
