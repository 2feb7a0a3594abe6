//! Shadow mode: a candidate policy answers every live hook call beside the
//! active policy of its kind; only its answers are counted, never applied.
//! [`super::PolicyRuntime`] keeps at most one shadow per kind.
//!
//! What a shadow cannot report is the hit ratio it would have had: as soon as
//! one of its answers differs from the active policy's, the cache it would have
//! had differs from the real one, and which later lookups would have hit it is
//! not observed. The dry run over the recorded traffic
//! (`POST /v1/admin/policies/{id}/dry-run`) simulates that cache instead.

use serde::{Deserialize, Serialize};

use super::{AdmitInfo, EntryInfo, PolicyKind, PolicySlot};

/// Counts of one policy's answers over the calls a shadow saw. Only the fields
/// of the shadow's kind move: admission (`admitted`, `rejected`,
/// `admitted_bytes`), eviction (`evictions`, `victim_bytes`,
/// `victim_recompute_tokens`), invalidation (`dropped`, `kept`), isolation
/// (`shared`, `private`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DecisionCounts {
    /// Hook calls answered.
    pub calls: u64,
    /// Calls that faulted (the native default answered them instead).
    pub faults: u64,
    /// Admission: entries admitted.
    pub admitted: u64,
    /// Admission: entries rejected.
    pub rejected: u64,
    /// Admission: bytes of the admitted entries.
    pub admitted_bytes: u64,
    /// Eviction: victims chosen.
    pub evictions: u64,
    /// Eviction: bytes of the victims (room freed).
    pub victim_bytes: u64,
    /// Eviction: recompute tokens of the victims (what a later miss on them costs).
    pub victim_recompute_tokens: u64,
    /// Invalidation: entries dropped.
    pub dropped: u64,
    /// Invalidation: entries kept.
    pub kept: u64,
    /// Isolation: answers allowing the shared namespace.
    pub shared: u64,
    /// Isolation: answers keeping the segment per tenant.
    pub private: u64,
}

/// One hook call's input, as both policies saw it.
pub(crate) enum Call<'a> {
    Admit(&'a AdmitInfo),
    Evict(&'a [EntryInfo]),
    Invalidate,
    Isolation,
}

impl DecisionCounts {
    /// Counts one answer. `answer`: the victim index for eviction, `1`/`0`
    /// for the boolean hooks.
    pub(crate) fn count(&mut self, call: &Call<'_>, answer: usize, faulted: bool) {
        self.calls += 1;
        self.faults += faulted as u64;
        match call {
            Call::Admit(a) => {
                if answer == 1 {
                    self.admitted += 1;
                    self.admitted_bytes += a.bytes;
                } else {
                    self.rejected += 1;
                }
            }
            Call::Evict(c) => {
                if let Some(e) = c.get(answer) {
                    self.evictions += 1;
                    self.victim_bytes += e.bytes;
                    self.victim_recompute_tokens += e.recompute_tokens;
                }
            }
            Call::Invalidate => {
                if answer == 1 {
                    self.dropped += 1;
                } else {
                    self.kept += 1;
                }
            }
            Call::Isolation => {
                if answer == 1 {
                    self.shared += 1;
                } else {
                    self.private += 1;
                }
            }
        }
    }
}

/// A running shadow: the candidate's slot and the counts of both sides.
pub(crate) struct Shadow {
    pub slot: PolicySlot,
    pub policy_id: i64,
    pub params: serde_json::Value,
    pub started_at: i64,
    pub started_by: String,
    pub candidate: DecisionCounts,
    pub active: DecisionCounts,
    pub agreed: u64,
    pub disagreed: u64,
}

impl Shadow {
    /// Counts one call: the active policy's `active` answer (and whether it
    /// faulted) and the candidate's.
    pub fn tally(
        &mut self,
        call: &Call<'_>,
        active: usize,
        active_faulted: bool,
        cand: usize,
        cand_faulted: bool,
    ) {
        self.active.count(call, active, active_faulted);
        self.candidate.count(call, cand, cand_faulted);
        let same = match call {
            // Two candidates with the same entry id are the same victim.
            Call::Evict(c) => c.get(active).map(|e| e.id) == c.get(cand).map(|e| e.id),
            _ => active == cand,
        };
        if same {
            self.agreed += 1;
        } else {
            self.disagreed += 1;
        }
    }

    /// The API's view, with the active policy of the kind now.
    pub fn view(&self, kind: PolicyKind, active_policy_id: Option<i64>) -> ShadowView {
        ShadowView {
            kind: kind.as_str().into(),
            policy_id: self.policy_id,
            params: self.params.clone(),
            started_at: self.started_at,
            started_by: self.started_by.clone(),
            active_policy_id,
            candidate: self.candidate.clone(),
            active: self.active.clone(),
            agreed: self.agreed,
            disagreed: self.disagreed,
            tripped: !self.slot.is_wasm(),
        }
    }
}

/// A shadow policy and its counts next to the active policy's over the same
/// live calls (`GET /v1/admin/policies/shadow`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ShadowView {
    /// Hook kind.
    pub kind: String,
    /// The candidate policy (catalog id).
    pub policy_id: i64,
    /// The candidate's effective parameters (defaults filled in).
    #[schema(value_type = Object)]
    pub params: serde_json::Value,
    /// When the shadow started, ms since the Unix epoch.
    pub started_at: i64,
    /// The operator who started it.
    pub started_by: String,
    /// The active policy of the kind now (`null`: the native default).
    pub active_policy_id: Option<i64>,
    /// The candidate's answers (counted, not applied).
    pub candidate: DecisionCounts,
    /// The active policy's answers to the same calls (applied).
    pub active: DecisionCounts,
    /// Calls both answered alike (eviction: the same victim).
    pub agreed: u64,
    /// Calls they answered differently.
    pub disagreed: u64,
    /// The candidate faulted too often and was disabled (its calls are then
    /// answered by the native default and still counted).
    pub tripped: bool,
}

#[cfg(test)]
mod tests {
    use super::super::{
        builtin, policy_engine, AdmitInfo, EntryInfo, PolicyKind, PolicyLimits, PolicyRuntime,
        WasmPolicy,
    };
    use serde_json::json;

    fn rt() -> PolicyRuntime {
        PolicyRuntime::new(policy_engine(), PolicyLimits::default(), None)
    }

    fn load(name: &str, kind: PolicyKind) -> WasmPolicy {
        WasmPolicy::load(
            &policy_engine(),
            kind,
            builtin::module(name).unwrap(),
            &json!({}),
            PolicyLimits::default(),
        )
        .unwrap()
    }

    #[test]
    fn shadow_answers_are_counted_not_applied() {
        let rt = rt();
        rt.start_shadow(
            load("second_sighting", PolicyKind::Admission),
            7,
            json!({}),
            "op",
        );
        let a = |seen| AdmitInfo {
            bytes: 100,
            seen_count: seen,
            ..AdmitInfo::default()
        };
        // Native admits everything, whatever the shadow says.
        assert!(rt.admit(&a(1), 0));
        assert!(rt.admit(&a(1), 0));
        assert!(rt.admit(&a(2), 0));
        let v = rt.shadow(PolicyKind::Admission).unwrap();
        assert_eq!(
            (v.active.calls, v.active.admitted, v.active.rejected),
            (3, 3, 0)
        );
        assert_eq!(
            (
                v.candidate.calls,
                v.candidate.admitted,
                v.candidate.rejected
            ),
            (3, 1, 2)
        );
        assert_eq!((v.agreed, v.disagreed), (1, 2));
        assert_eq!(
            (v.active.admitted_bytes, v.candidate.admitted_bytes),
            (300, 100)
        );
        assert_eq!(v.policy_id, 7);
        // Other kinds have no shadow; the one here stops with its counts.
        assert!(rt.shadow(PolicyKind::Eviction).is_none());
        let fin = rt.stop_shadow(PolicyKind::Admission).unwrap();
        assert_eq!(fin.candidate.calls, 3);
        assert!(rt.admit(&a(1), 0));
        assert!(rt.shadow(PolicyKind::Admission).is_none());
        assert!(rt.stop_shadow(PolicyKind::Admission).is_none());
    }

    #[test]
    fn eviction_shadow_compares_victims() {
        let rt = rt();
        rt.start_shadow(load("gdsf", PolicyKind::Eviction), 1, json!({}), "op");
        // LRU picks the least recently used (id 1); GDSF the lowest
        // (hits + 1) x tokens / bytes (id 2: 10/1000 against 1000/100).
        let c = [
            EntryInfo {
                id: 1,
                bytes: 100,
                recompute_tokens: 1000,
                last_use_ms: 1,
                ..EntryInfo::default()
            },
            EntryInfo {
                id: 2,
                bytes: 1000,
                recompute_tokens: 10,
                last_use_ms: 5,
                ..EntryInfo::default()
            },
        ];
        assert_eq!(rt.evict(&c, 10), 0, "the active LRU decides");
        let v = rt.shadow(PolicyKind::Eviction).unwrap();
        assert_eq!((v.active.evictions, v.active.victim_bytes), (1, 100));
        assert_eq!((v.candidate.evictions, v.candidate.victim_bytes), (1, 1000));
        assert_eq!(v.candidate.victim_recompute_tokens, 10);
        assert_eq!((v.agreed, v.disagreed), (0, 1));
    }
}
