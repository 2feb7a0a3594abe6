//! Transition families for position-independent caching ([`transition`]) and, under
//! its former path [`gdr`], the gated delta rule of the Gated DeltaNet mixer.
//!
//! Layouts follow FLA / HF transformers: time-major inputs `[T, H, D]`, recurrent
//! state K-major `[Hv, dk, dv]` in fp32.
pub use crate::mixers::gated_deltanet as gdr;
pub mod transition;

#[cfg(test)]
pub(crate) mod testutil;
