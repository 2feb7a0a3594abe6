//! `hypic serve --device cuda --devices 0,1,…` (key `devices`): one segment-parallel
//! worker per GPU in the serving process (docs/segment-parallelism.md). The
//! combiner's engine runs on the first listed device; every further entry starts a
//! worker with its own model replica and public pool on that device, reached by the
//! peer transport (`dataplane::cuda::peer`: entries copied device to device with a
//! device checksum). A device may be listed more than once (`--devices 0,0`: the
//! combiner and one worker on GPU 0).
use dataplane::parallel::transport::Transport;

use super::ServeConfig;
use crate::backend::Device;
use crate::runtime::ModelSource;

/// Checks `devices` and `nccl` against `device` without opening anything.
///
/// Errors: a device list or `nccl` with `--device cpu` or `auto`, `nccl` without
/// `workers`, a list longer than [`MAX_DEVICES`].
pub fn validate(cfg: &ServeConfig) -> anyhow::Result<()> {
    if cfg.nccl {
        if cfg.device != crate::backend::DeviceArg::Cuda {
            anyhow::bail!(
                "nccl: --nccl needs --device cuda (got --device {})",
                cfg.device.as_str()
            );
        }
        if cfg.workers.is_empty() {
            anyhow::bail!("nccl: --nccl offers NCCL to the --workers, and none is given");
        }
    }
    if cfg.devices.is_empty() {
        return Ok(());
    }
    let list = list(&cfg.devices);
    if cfg.device != crate::backend::DeviceArg::Cuda {
        anyhow::bail!(
            "devices: --devices {list} needs --device cuda (got --device {}): in-process \
             workers run on GPUs only; use --workers for CPU workers",
            cfg.device.as_str()
        );
    }
    if cfg.devices.len() > MAX_DEVICES {
        anyhow::bail!(
            "devices: {} entries in --devices, at most {MAX_DEVICES}",
            cfg.devices.len()
        );
    }
    Ok(())
}

/// The NCCL link the combiner offers its TCP workers (`nccl`), on its device in
/// its element type; `None` without `nccl`.
///
/// Errors: `nccl` without a GPU combiner.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn nccl_link(
    cfg: &ServeConfig,
    device: &Device,
    config: &dataplane::config::ModelConfig,
) -> anyhow::Result<Option<std::sync::Arc<dyn dataplane::parallel::transport::NcclLink>>> {
    if !cfg.nccl {
        return Ok(None);
    }
    #[cfg(not(feature = "cuda"))]
    {
        anyhow::bail!("nccl: this binary was built without CUDA support")
    }
    #[cfg(feature = "cuda")]
    {
        use dataplane::cuda::nccl::{nccl_present, NcclReceiver};
        let Device::Cuda(gpu) = device else {
            anyhow::bail!("nccl: --nccl needs the combiner on a GPU (--device cuda)");
        };
        if !nccl_present() {
            eprintln!(
                "hypic: --nccl: libnccl could not be loaded; entries from the workers go over TCP"
            );
        }
        let link: std::sync::Arc<dyn dataplane::parallel::transport::NcclLink> = match cfg.dtype {
            crate::backend::DtypeArg::F32 => {
                std::sync::Arc::new(NcclReceiver::<f32>::new(gpu.clone(), config.clone()))
            }
            crate::backend::DtypeArg::Bf16 => {
                std::sync::Arc::new(NcclReceiver::<half::bf16>::new(gpu.clone(), config.clone()))
            }
        };
        Ok(Some(link))
    }
}

/// Most entries of `devices`.
pub const MAX_DEVICES: usize = 64;

/// `0,1,1`.
fn list(d: &[usize]) -> String {
    d.iter()
        .map(|o| o.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The combiner's device ordinal: the first of `devices`, else 0.
pub fn combiner_ordinal(cfg: &ServeConfig) -> usize {
    cfg.devices.first().copied().unwrap_or(0)
}

/// The in-process workers of `cfg.devices[1..]` over `model`, each a transport to
/// the combiner on `device` (loaded now; the log names each worker and its copy
/// path). Empty without `devices`.
///
/// Errors: a device that does not exist or cannot be opened (named), a model that
/// does not load on it, a host-loaded model (replicas load from the checkpoint
/// folder or random weights), a combiner on another device than the first listed.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn start_workers(
    cfg: &ServeConfig,
    device: &Device,
    model: &ModelSource,
) -> anyhow::Result<Vec<Box<dyn Transport>>> {
    if cfg.devices.is_empty() {
        return Ok(vec![]);
    }
    validate(cfg)?;
    #[cfg(not(feature = "cuda"))]
    {
        anyhow::bail!(
            "devices: this binary was built without CUDA support; rebuild with \
             `cargo build --release --features cuda`"
        )
    }
    #[cfg(feature = "cuda")]
    {
        let Device::Cuda(combiner) = device else {
            anyhow::bail!("devices: --devices needs the combiner on a GPU (--device cuda)");
        };
        if combiner.ordinal() != cfg.devices[0] {
            anyhow::bail!(
                "devices: the combiner runs on GPU {}, --devices lists {} first",
                combiner.ordinal(),
                cfg.devices[0]
            );
        }
        let mut out: Vec<Box<dyn Transport>> = Vec::new();
        for (k, &ord) in cfg.devices.iter().enumerate().skip(1) {
            out.push(cuda::start_one(cfg, combiner, model, k, ord)?);
        }
        Ok(out)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use anyhow::Context;
    use dataplane::cuda::device::{device_count, open};
    use dataplane::cuda::peer::peer_transport;
    use dataplane::cuda::pic::GpuPicEngine;
    use dataplane::cuda::Gpu;
    use dataplane::parallel::transport::Transport;
    use dataplane::parallel::worker::Worker;

    use crate::backend::DtypeArg;
    use crate::runtime::ModelSource;
    use crate::serve::ServeConfig;

    /// Worker `k` of `devices` on GPU `ord`.
    pub(super) fn start_one(
        cfg: &ServeConfig,
        combiner: &Arc<Gpu>,
        model: &ModelSource,
        k: usize,
        ord: usize,
    ) -> anyhow::Result<Box<dyn Transport>> {
        let n = device_count();
        if ord >= n {
            anyhow::bail!("devices: GPU {ord} in --devices does not exist ({n} present)");
        }
        let gpu = open(ord).with_context(|| format!("devices: opening GPU {ord}"))?;
        let source = match model {
            ModelSource::Checkpoint { dir, config } => ModelSource::Checkpoint {
                dir: dir.clone(),
                config: config.clone(),
            },
            ModelSource::Random { config, seed } => ModelSource::Random {
                config: config.clone(),
                seed: *seed,
            },
            ModelSource::Host(_) => anyhow::bail!(
                "devices: in-process GPU workers load their replica from the model folder \
                 or random weights, not from a model loaded on the host"
            ),
        };
        let name = format!("cuda:{ord}/{k}");
        let public = cfg.public_pool_mib << 20;
        let (transport, path): (Box<dyn Transport>, _) = match cfg.dtype {
            DtypeArg::F32 => {
                let m = crate::runtime::gpu_model!(f32, gpu, source);
                let e = Arc::new(GpuPicEngine::new(Arc::new(m), "worker", public, 0));
                let (t, p) = peer_transport(Arc::new(Worker::new(e)), &name, combiner.clone())
                    .with_context(|| format!("devices: peer access GPU {ord} → combiner"))?;
                (Box::new(t) as Box<dyn Transport>, p)
            }
            DtypeArg::Bf16 => {
                let m = crate::runtime::gpu_model!(half::bf16, gpu, source);
                let e = Arc::new(GpuPicEngine::new(Arc::new(m), "worker", public, 0));
                let (t, p) = peer_transport(Arc::new(Worker::new(e)), &name, combiner.clone())
                    .with_context(|| format!("devices: peer access GPU {ord} → combiner"))?;
                (Box::new(t) as Box<dyn Transport>, p)
            }
        };
        tracing::info!(
            worker = %name,
            path = path.describe(),
            "in-process worker {name} on GPU {ord} ready (entries to the combiner's GPU {}: {})",
            combiner.ordinal(),
            path.describe()
        );
        eprintln!(
            "hypic: in-process worker {name} ready (peer transport to GPU {}, {})",
            combiner.ordinal(),
            path.describe()
        );
        Ok(transport)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DeviceArg;

    fn cfg(device: DeviceArg, devices: &[usize]) -> ServeConfig {
        ServeConfig {
            device,
            devices: devices.to_vec(),
            ..ServeConfig::default()
        }
    }

    /// `--devices` needs `--device cuda`: with `cpu` or `auto` it is an error naming
    /// the list and the device; an empty list is always fine; too long a list is
    /// refused.
    #[test]
    fn serve_parallel_devices_are_checked() {
        assert!(validate(&cfg(DeviceArg::Cpu, &[])).is_ok());
        assert!(validate(&cfg(DeviceArg::Cuda, &[0, 0])).is_ok());
        let e = validate(&cfg(DeviceArg::Cpu, &[0, 1]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--devices 0,1") && e.contains("--device cuda"),
            "{e}"
        );
        assert!(e.contains("--device cpu"), "{e}");
        let e = validate(&cfg(DeviceArg::Auto, &[0]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--device auto"), "{e}");
        let long = vec![0; MAX_DEVICES + 1];
        let e = validate(&cfg(DeviceArg::Cuda, &long))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most"), "{e}");
        assert_eq!(combiner_ordinal(&cfg(DeviceArg::Cuda, &[3, 1])), 3);
        assert_eq!(combiner_ordinal(&cfg(DeviceArg::Cuda, &[])), 0);
    }

    /// Without devices nothing is started; with `--device cpu` the list is refused
    /// before any model is touched.
    #[test]
    fn serve_parallel_devices_start_nothing_without_a_list() {
        let src = ModelSource::Random {
            config: dataplane::config::ModelConfig::from_dir(
                &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../dataplane/tests/fixtures/golden/qwen3_5"),
            )
            .unwrap(),
            seed: 1,
        };
        let none = start_workers(&cfg(DeviceArg::Cpu, &[]), &Device::Cpu, &src).unwrap();
        assert!(none.is_empty());
        let e = start_workers(&cfg(DeviceArg::Cpu, &[0, 0]), &Device::Cpu, &src)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("needs --device cuda"), "{e}");
    }

    /// `--devices 0,0` parses as a list (clap's `,` delimiter) and reaches the
    /// configuration; the TOML key does too.
    #[test]
    fn serve_parallel_devices_flag_and_key() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: crate::serve::ServeArgs,
        }
        let c = Cli::try_parse_from(["hypic", "--device", "cuda", "--devices", "0,0"]).unwrap();
        assert_eq!(c.serve.devices, Some(vec![0, 0]));
        let bad = Cli::try_parse_from(["hypic", "--devices", "0,x"]);
        assert!(bad.is_err());
        let t: ServeConfig = toml::from_str("device = \"cuda\"\ndevices = [1, 2]\n").unwrap();
        assert_eq!(t.devices, vec![1, 2]);
    }
}
