//! Position-independent caching (PIC) for hybrid models (docs/pic-design.md §2–§5):
//! segment cache entries with cached transitions `(T_C, S_C|0)` for linear layers and
//! body KV for full-attention layers, seam windows, RoPE re-rotation, the public pool
//! of segment entries and the private pool of running-state snapshots.
//!
//! The request logic ([`engine::Pic`]) is written once over [`backend::PicBackend`];
//! [`cpu::CpuBackend`] is the CPU reference ([`PicEngine`]), `cuda::pic::GpuBackend`
//! (feature `cuda`) the device backend.
pub mod backend;
pub mod cpu;
pub mod engine;
pub mod pool;
pub mod spill;

pub use backend::{CacheEntry, PicBackend};
pub use cpu::CpuBackend;
pub use engine::{
    EntryReport, MissReason, Mode, Outcome, Pic, PicEngine, PicJob, PicOutput, PicStats, Prefetch,
    PrefetchJob, SegmentRef, SegmentStat,
};
