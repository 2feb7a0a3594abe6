//! LRU eviction: the candidate with the oldest last use is the victim
//! (ties: the oldest insertion, then the lowest index).
#![no_std]
use hypic_policy_sdk::{eviction_policy, Candidates};

fn lru(c: &Candidates, _now_ms: u64) -> usize {
    let mut best = 0usize;
    let mut key = (u64::MAX, u64::MAX);
    for i in 0..c.len() {
        let e = c.get(i);
        let k = (e.last_use_ms, e.inserted_ms);
        if k < key {
            key = k;
            best = i;
        }
    }
    best
}

eviction_policy!(lru);
hypic_policy_sdk::policy_params!(r#"{"params": []}"#);
