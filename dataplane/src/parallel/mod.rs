//! Segment parallelism (docs/segment-parallelism.md; the paper's Sec. 4.4): a
//! request's cold segments are prefilled on several workers at once (scatter) and
//! composed on the process that received the request (combine).
//!
//! * [`wire`]: the checksummed binary form of one shipped cache entry;
//! * [`checksum`]: the checksum of an entry shipped device to device (CPU
//!   reference of the device kernel);
//! * [`nccl`]: negotiation and headers of NCCL transfers between processes;
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
use std::any::Any;
use std::time::Duration;

pub mod assign;
pub mod checksum;
pub mod nccl;
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
    /// when parsing; a device entry's checksum recomputed on the receiving device):
    /// one entry per body start, ascending by body start.
    Ready(Vec<Shipped>),
}

/// One shipped entry of a segment, in the form its transport delivers it.
#[derive(Debug)]
pub enum Shipped {
    /// A wire frame ([`wire`]: header, XXH3-128 of the payload, the entry's spill
    /// form), from a TCP or in-process worker.
    Frame(Vec<u8>),
    /// An entry already in the combiner's device memory (a peer copy from a worker
    /// on a GPU of this process), never encoded to host bytes on the way.
    Device(Box<dyn DeviceEntry>),
}

impl Shipped {
    /// The wire frame, when this is one.
    pub fn frame(&self) -> Option<&[u8]> {
        match self {
            Shipped::Frame(f) => Some(f),
            Shipped::Device(_) => None,
        }
    }

    /// Bytes shipped: the wire frame's length, or a device entry's payload bytes.
    pub fn len(&self) -> usize {
        match self {
            Shipped::Frame(f) => f.len(),
            Shipped::Device(d) => d.bytes(),
        }
    }

    /// Whether nothing was shipped (an empty frame).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An entry delivered into the combiner's device memory by a device transport
/// (`cuda::peer`), with the checksum its sender computed on the sender's device.
/// The combiner's scatter checks [`DeviceEntry::verify`] on arrival, exactly where it
/// checks a wire frame's checksum; the engine then takes the backend entry out of
/// [`DeviceEntry::into_any`].
pub trait DeviceEntry: Send + Sync + std::fmt::Debug {
    /// The model fingerprint of the worker that built it.
    fn model(&self) -> wire::ModelFingerprint;
    /// Segment length in tokens.
    fn tokens(&self) -> usize;
    /// First body token (0: the whole segment; the seam width: the body after it).
    fn body_start(&self) -> usize;
    /// Payload bytes moved.
    fn bytes(&self) -> usize;
    /// Recomputes the payload's checksum on the receiving device and compares it
    /// with the sender's.
    ///
    /// Errors: a mismatch (the entry is corrupt and must not be composed) or a
    /// device failure, each with a message saying which.
    fn verify(&self) -> Result<(), String>;
    /// Fault injection for tests: flips one bit of the payload on the device (after
    /// the copy, before [`DeviceEntry::verify`]); false when it could not.
    #[doc(hidden)]
    fn damage(&mut self) -> bool;
    /// The backend entry (`Box<B::Entry>` of the combiner's backend type).
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    /// The object itself, for a transport that needs its concrete type back (an
    /// NCCL sender reading the buffers it packed).
    fn as_any(&self) -> &dyn Any;
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

/// The golden `qwen3_5` fixture on the CPU engine, for this module's tests: from
/// the source tree this was built in or, for a test binary carried to another
/// machine, from the current folder (the repository root).
#[cfg(test)]
pub(crate) fn golden_engine() -> std::sync::Arc<crate::pic::PicEngine> {
    let rel = "tests/fixtures/golden/qwen3_5";
    let mut dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    if !dir.is_dir() {
        dir = std::path::Path::new("dataplane").join(rel);
    }
    let model = crate::model::Model::load(&dir, &mut |_, _| {}).expect("the golden fixture");
    std::sync::Arc::new(crate::pic::PicEngine::new(
        std::sync::Arc::new(model),
        "w",
        1 << 26,
        0,
    ))
}
