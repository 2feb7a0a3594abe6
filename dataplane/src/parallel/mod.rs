//! Segment parallelism (docs/segment-parallelism.md; the paper's Sec. 4.4): a
//! request's cold segments are prefilled on several workers at once (scatter) and
//! composed on the process that received the request (combine).
//!
//! * [`wire`]: the checksummed binary form of one shipped cache entry;
//! * [`assign`]: longest-processing-time-first assignment with holder affinity,
//!   round robin, makespan;
//! * [`transport`]: the [`transport::Transport`] trait, an in-process transport and
//!   a blocking TCP transport (whose entry payloads may move by NIXL);
//! * [`nixl`]: NIXL (RDMA) READs of the entry payloads, negotiated per task, with
//!   a library probe so that a missing NIXL falls back to TCP;
//! * [`worker`]: a worker (a model replica and its public pool) that builds the
//!   entries of the segments it is given and ships each as soon as it is built;
//! * [`scatter`]: the combiner's side: assignment over live workers, deadlines,
//!   recomputation of lost or corrupt segments, health checks, statistics.
//!
//! The PIC engine sees a scatter only through [`EntrySource`]: while it assembles a
//! request in order, it asks the source for each cold segment's entries and composes
//! them as soon as they and their predecessors are in.
use std::time::Duration;

pub mod assign;
pub mod nixl;
pub mod scatter;
pub mod transport;
pub mod wire;
pub mod worker;

/// What an [`EntrySource`] has for one segment of the request.
#[derive(Debug)]
pub enum Supply {
    /// Not scattered, or given up on (dead worker, missed deadline, corrupt entry,
    /// no live worker left): the engine builds the entry itself.
    Local,
    /// Still being built or shipped.
    Pending,
    /// Arrived and verified (header and checksum, [`wire::decode`] checks again
    /// when parsing): one wire frame per body start, ascending by body start.
    Ready(Vec<Vec<u8>>),
}

/// The entries of a request's scattered cold segments, as the PIC engine consumes
/// them ([`crate::pic::Pic::begin_with_source`]). Implemented by
/// [`scatter::ScatterRun`]; every method is cheap and never panics.
pub trait EntrySource: Send + Sync {
    /// The entries of segment `index` of the request, waiting at most `wait` for a
    /// pending one. `Ready` hands the frames over (a second call gives `Local`).
    fn take(&self, index: usize, wait: Duration) -> Supply;
    /// The engine could not use the frames of `index` that it took (they did not
    /// parse or did not fit the model: `why`) and builds the entry itself.
    fn rejected(&self, index: usize, why: &str);
    /// The model fingerprint the source's frames were verified against (the
    /// engine checks it equals its own before decoding).
    fn model(&self) -> wire::ModelFingerprint;
}
