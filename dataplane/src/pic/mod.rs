//! Position-independent caching (PIC) for hybrid models (docs/pic-design.md §2–§5):
//! segment cache entries with cached transitions `(T_C, S_C|0)` for linear layers and
//! body KV for full-attention layers, seam windows, RoPE re-rotation, the public pool
//! of segment entries and the private pool of running-state snapshots.
pub mod engine;
pub mod pool;
pub mod spill;

pub use engine::{
    MissReason, Mode, Outcome, PicEngine, PicOutput, PicStats, Prefetch, SegmentRef, SegmentStat,
};
