//! `--device cpu|cuda|auto` and `--dtype f32|bf16`, shared by `hypic generate` and
//! `hypic serve`: which backend runs the model.
//!
//! * `cpu`: the CPU reference backend (always fp32; `--dtype bf16` is ignored with a
//!   line on stderr).
//! * `cuda`: CUDA device 0 (or the first of `hypic serve --devices`); an error when the binary was built without the `cuda`
//!   feature or when no driver or device is usable (the message names the
//!   alternatives).
//! * `auto` (default): CUDA when usable, else the CPU backend with one line on stderr
//!   saying why.
use anyhow::Result;
use serde::{Deserialize, Serialize};

/// `--device` choices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceArg {
    /// The CPU reference backend.
    Cpu,
    /// CUDA device 0.
    Cuda,
    /// CUDA when usable, else the CPU.
    #[default]
    Auto,
}

impl DeviceArg {
    /// The flag value (`cpu`, `cuda`, `auto`).
    pub fn as_str(&self) -> &'static str {
        match self {
            DeviceArg::Cpu => "cpu",
            DeviceArg::Cuda => "cuda",
            DeviceArg::Auto => "auto",
        }
    }
}

/// `--dtype` choices of the GPU backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeArg {
    /// fp32 weights and activations.
    #[default]
    F32,
    /// bf16 weights and activations.
    Bf16,
}

impl DtypeArg {
    /// The flag value (`f32`, `bf16`).
    pub fn as_str(&self) -> &'static str {
        match self {
            DtypeArg::F32 => "f32",
            DtypeArg::Bf16 => "bf16",
        }
    }
}

/// The device picked by [`select_device`], before any weights are loaded.
#[derive(Clone, Debug)]
pub enum Device {
    /// The CPU reference backend.
    Cpu,
    /// A usable CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<dataplane::cuda::Gpu>),
}

impl Device {
    /// One-line description for the log: `cpu`, or `cuda:0 NVIDIA H200 (sm_90a) f32`.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn describe(&self, dtype: DtypeArg) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => format!(
                "{} {}",
                dataplane::cuda::device::Backend::Cuda(g.clone()).describe(),
                dtype.as_str()
            ),
        }
    }
}

const BF16_ON_CPU: &str =
    "hypic: --dtype bf16 applies to the GPU backend only; the CPU backend runs in f32";

/// Resolves `--device` / `--dtype`: opens the CUDA device for `cuda` and `auto`
/// (falling back to the CPU for `auto` with one line on stderr saying why), never
/// touches CUDA for `cpu`. A `bf16` request that ends on the CPU says so on stderr.
///
/// Errors: `cuda` in a binary built without the `cuda` feature, or with no usable
/// driver or device; the message names the alternatives.
pub fn select_device(device: DeviceArg, dtype: DtypeArg) -> Result<Device> {
    select_device_on(device, dtype, 0)
}

/// [`select_device`] on CUDA device `ordinal` (`hypic serve --devices`: the
/// combiner's engine runs on the first listed device).
///
/// Errors: as [`select_device`]; for `cuda`, also an ordinal past the devices
/// present (the message says how many there are).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn select_device_on(device: DeviceArg, dtype: DtypeArg, ordinal: usize) -> Result<Device> {
    let on_cpu = || {
        if dtype == DtypeArg::Bf16 {
            eprintln!("{BF16_ON_CPU}");
        }
        Device::Cpu
    };
    #[cfg(not(feature = "cuda"))]
    {
        match device {
            DeviceArg::Cpu => Ok(on_cpu()),
            DeviceArg::Cuda => anyhow::bail!(
                "--device cuda: this binary was built without CUDA support; rebuild with \
                 `cargo build --release --features cuda` or use --device cpu (or --device auto)"
            ),
            DeviceArg::Auto => {
                eprintln!(
                    "hypic: --device auto: built without CUDA support; using the CPU backend"
                );
                Ok(on_cpu())
            }
        }
    }
    #[cfg(feature = "cuda")]
    {
        use anyhow::Context;
        use dataplane::cuda::device::{select_on, Backend, DeviceChoice};
        let choice = match device {
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Cuda => DeviceChoice::Cuda,
            DeviceArg::Auto => DeviceChoice::Auto,
        };
        match select_on(choice, ordinal).with_context(|| {
            format!(
                "--device cuda: no usable CUDA device (device {ordinal}); use --device cpu, \
                 or --device auto to fall back"
            )
        })? {
            Backend::Cpu => Ok(on_cpu()),
            Backend::Cuda(g) => Ok(Device::Cuda(g)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_serde_and_clap() {
        use clap::ValueEnum;
        for d in DeviceArg::value_variants() {
            let j = serde_json::to_string(d).unwrap();
            assert_eq!(j, format!("\"{}\"", d.as_str()));
            assert_eq!(DeviceArg::from_str(d.as_str(), false).unwrap(), *d);
        }
        for d in DtypeArg::value_variants() {
            let j = serde_json::to_string(d).unwrap();
            assert_eq!(j, format!("\"{}\"", d.as_str()));
            assert_eq!(DtypeArg::from_str(d.as_str(), false).unwrap(), *d);
        }
    }

    #[test]
    fn cpu_never_touches_cuda() {
        let d = select_device(DeviceArg::Cpu, DtypeArg::Bf16).unwrap();
        assert!(matches!(d, Device::Cpu));
        assert_eq!(d.describe(DtypeArg::Bf16), "cpu");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_names_the_alternatives() {
        let e = select_device(DeviceArg::Cuda, DtypeArg::F32)
            .expect_err("no CUDA in this build")
            .to_string();
        assert!(e.contains("without CUDA support"), "{e}");
        assert!(
            e.contains("--features cuda") && e.contains("--device cpu"),
            "{e}"
        );
        assert!(matches!(
            select_device(DeviceArg::Auto, DtypeArg::F32).unwrap(),
            Device::Cpu
        ));
    }
}
