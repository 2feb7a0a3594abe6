//! Linear-attention recurrences (gated delta rule) and transition families.
//!
//! Layouts follow FLA / HF transformers: time-major inputs `[T, H, D]`, recurrent
//! state K-major `[Hv, dk, dv]` in fp32.
pub mod gdr;
pub mod transition;

#[cfg(test)]
mod testutil;
