//! `--device cuda|cpu|auto` selection.
//!
//! `cpu` never touches CUDA; `cuda` fails when no usable device is found; `auto`
//! tries CUDA and falls back to the CPU backend with one line on stderr saying why.
use std::str::FromStr;
use std::sync::Arc;

use super::{CudaError, Gpu, Result};

/// The user's choice (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The CPU reference backend.
    Cpu,
    /// CUDA device 0; an error if none is usable.
    Cuda,
    /// CUDA when usable, else the CPU backend (logged).
    #[default]
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda),
            "auto" => Ok(DeviceChoice::Auto),
            o => Err(format!("unknown device `{o}` (expected cuda, cpu or auto)")),
        }
    }
}

/// The backend that was selected.
#[derive(Clone, Debug)]
pub enum Backend {
    /// The CPU reference backend.
    Cpu,
    /// A CUDA device.
    Cuda(Arc<Gpu>),
}

impl Backend {
    /// Short description for logs ("cpu" or "cuda:0 NVIDIA H200 (sm_90a)").
    pub fn describe(&self) -> String {
        match self {
            Backend::Cpu => "cpu".into(),
            Backend::Cuda(g) => format!("cuda:0 {} ({})", g.name(), g.arch()),
        }
    }
}

/// Resolves a [`DeviceChoice`] on device ordinal 0.
pub fn select(choice: DeviceChoice) -> Result<Backend> {
    match choice {
        DeviceChoice::Cpu => Ok(Backend::Cpu),
        DeviceChoice::Cuda => Ok(Backend::Cuda(Gpu::new(0)?)),
        DeviceChoice::Auto => match try_gpu() {
            Ok(g) => Ok(Backend::Cuda(g)),
            Err(e) => {
                eprintln!(
                    "hypic: --device auto: no usable CUDA device ({e}); using the CPU backend"
                );
                Ok(Backend::Cpu)
            }
        },
    }
}

/// `Gpu::new(0)`, also turning a panic inside the dynamically loaded libraries (a
/// missing symbol in an old driver) into [`CudaError::Unavailable`].
fn try_gpu() -> Result<Arc<Gpu>> {
    match std::panic::catch_unwind(|| Gpu::new(0)) {
        Ok(r) => r,
        Err(_) => Err(CudaError::Unavailable(
            "the CUDA libraries failed to load (panic while loading)".into(),
        )),
    }
}
