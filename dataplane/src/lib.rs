//! HYPIC data plane: model families ([`models`]), token mixers ([`mixers`]), model
//! loading, the CPU reference backend, hybrid-attention layers (Gated DeltaNet,
//! gated full attention, MoE), the PIC engine, the per-layer state API and
//! sampling.
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod error;
pub mod eval;
pub mod linear;
pub mod mixers;
pub mod model;
pub mod models;
pub mod ops;
pub mod parallel;
pub mod pic;
pub mod random;
pub mod random_checkpoint;
pub mod router;
pub mod state;
pub mod weights;

pub use error::{Error, Result};
pub mod sampling;
pub mod scheduler;
pub mod tokenizer;
