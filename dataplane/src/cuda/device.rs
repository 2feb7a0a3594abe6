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
    /// A CUDA device (0 unless an ordinal is given, [`select_on`]); an error if it
    /// is not usable.
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
            Backend::Cuda(g) => format!("cuda:{} {} ({})", g.ordinal(), g.name(), g.arch()),
        }
    }
}

/// Resolves a [`DeviceChoice`] on device ordinal 0.
pub fn select(choice: DeviceChoice) -> Result<Backend> {
    select_on(choice, 0)
}

/// Resolves a [`DeviceChoice`] on device `ordinal` (`auto` falls back to the CPU
/// when that device is not usable).
///
/// Errors: `cuda` and the device cannot be opened ([`CudaError::Unavailable`] says
/// how many devices there are when `ordinal` is past them).
pub fn select_on(choice: DeviceChoice, ordinal: usize) -> Result<Backend> {
    match choice {
        DeviceChoice::Cpu => Ok(Backend::Cpu),
        DeviceChoice::Cuda => Ok(Backend::Cuda(open(ordinal)?)),
        DeviceChoice::Auto => match open(ordinal) {
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

/// The number of CUDA devices (0 when the driver cannot be loaded).
pub fn device_count() -> usize {
    if !super::driver_present() {
        return 0;
    }
    std::panic::catch_unwind(cudarc::driver::CudaContext::device_count)
        .ok()
        .and_then(|r| r.ok())
        .map_or(0, |n| n.max(0) as usize)
}

/// `Gpu::new(ordinal)`, also turning a panic inside the dynamically loaded
/// libraries (a missing symbol in an old driver) into [`CudaError::Unavailable`].
pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
    match std::panic::catch_unwind(|| Gpu::new(ordinal)) {
        Ok(r) => r,
        Err(_) => Err(CudaError::Unavailable(
            "the CUDA libraries failed to load (panic while loading)".into(),
        )),
    }
}
