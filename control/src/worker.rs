//! `hypic worker`: a segment-parallel worker (docs/segment-parallelism.md). It loads
//! the model on the CPU or the GPU (`--device`, `--dtype`, as `hypic serve`), keeps
//! a public pool of the entries it built, and serves scatter tasks of `hypic serve
//! --workers` over TCP ([`dataplane::parallel::worker::serve_tcp`]). A combiner takes
//! entries only from workers of its own model fingerprint, which includes the
//! backend and element type: CPU workers serve a CPU server, `--device cuda
//! --dtype bf16` workers a server of the same device and dtype.
//!
//! `--transport nixl` (a build with the cargo feature `nixl`) registers the built
//! entries for the combiner's NIXL READ when the combiner offers one (`hypic serve
//! --worker-transport nixl`); the task and control frames stay on TCP
//! ([`dataplane::parallel::nixl`]).
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use dataplane::parallel::nixl::{self, Unavailable};
use dataplane::parallel::worker::{serve_tcp_with, Worker};
use dataplane::pic::{Pic, PicBackend, PicEngine};

use crate::backend::{select_device_on, Device, DeviceArg, DtypeArg};
use crate::runtime::open_model;

/// Arguments of `hypic worker`.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Listen address (`127.0.0.1:0` picks a free port; the ready line names it).
    #[arg(long, env = "HYPIC_WORKER_LISTEN")]
    pub listen: SocketAddr,
    /// Hugging Face model folder: the checkpoint the combiner serves
    /// (default: models/hypic-tiny).
    #[arg(long, env = "HYPIC_MODEL")]
    pub model: Option<PathBuf>,
    /// Backend: cpu, cuda (GPU `--gpu`; an error when unusable or not built in) or auto
    /// [default: cpu]. It must match the server's: entries of another backend or
    /// dtype are refused by the combiner's fingerprint check.
    #[arg(long, value_enum, env = "HYPIC_DEVICE", default_value = "cpu")]
    pub device: DeviceArg,
    /// Weight and activation type on the GPU backend: f32 or bf16 [default: f32].
    #[arg(long, value_enum, env = "HYPIC_DTYPE", default_value = "f32")]
    pub dtype: DtypeArg,
    /// CUDA device ordinal of `--device cuda` (an error when it does not exist).
    #[arg(long, env = "HYPIC_WORKER_GPU", default_value_t = 0)]
    pub gpu: usize,
    /// Accept a combiner's NCCL offer (`hypic serve --nccl`): entry payloads move
    /// GPU to GPU by ncclSend/ncclRecv, headers over TCP (`--device cuda` only;
    /// libnccl is loaded at run time, and a task falls back to TCP when it cannot).
    #[arg(long, env = "HYPIC_WORKER_NCCL")]
    pub nccl: bool,
    /// Public pool (the entries this worker built) capacity, MiB.
    #[arg(long, default_value_t = 1024)]
    pub public_pool_mib: usize,
    /// Scatter connections served at once.
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
    /// How entry payloads reach the combiner: tcp (on the task's connection) or
    /// nixl (registered for the combiner's NIXL READ when it offers one; needs a
    /// build with the `nixl` feature, an error otherwise, and libnixl_capi.so at run
    /// time, TCP with a warning otherwise) [default: tcp].
    #[arg(
        long,
        value_enum,
        env = "HYPIC_WORKER_TRANSPORT",
        default_value = "tcp"
    )]
    pub transport: TransportArg,
}

/// Entry payload transport between workers and the combiner.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportArg {
    /// Streamed on the task's TCP connection.
    Tcp,
    /// NIXL READ (RDMA where the fabric has it), control on TCP.
    Nixl,
}

/// A NIXL agent for `role`, or `None` (TCP payloads) when NIXL cannot run here;
/// that is logged once, with the reason, on stderr and in the log.
///
/// Errors: the binary was built without the `nixl` feature.
pub fn nixl_or_tcp<T>(
    role: &str,
    make: impl FnOnce(&str) -> Result<T, Unavailable>,
) -> anyhow::Result<Option<T>> {
    let name = nixl::agent_name(role);
    match make(&name) {
        Ok(t) => {
            tracing::info!(agent = %name, "NIXL agent {name} ready (UCX backend)");
            Ok(Some(t))
        }
        Err(Unavailable::NotBuilt) => Err(anyhow::anyhow!("{}", Unavailable::NotBuilt)),
        Err(e) => {
            eprintln!("hypic: NIXL unavailable, entries go over TCP: {e}");
            tracing::warn!("NIXL unavailable, entries go over TCP: {e}");
            Ok(None)
        }
    }
}

/// Whether libnccl loads (false without the `cuda` feature).
fn nccl_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        dataplane::cuda::nccl::nccl_present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Runs `hypic worker` until the process is stopped. Prints
/// `hypic: worker ready on ADDR (model FINGERPRINT, N tokens/s)` on stdout once it
/// accepts tasks.
///
/// Errors: the model does not load, the address cannot be bound.
pub fn run_worker_command(a: WorkerArgs) -> anyhow::Result<()> {
    if a.gpu != 0 && a.device == DeviceArg::Cpu {
        anyhow::bail!("--gpu {} needs --device cuda (got --device cpu)", a.gpu);
    }
    if a.nccl && a.device != DeviceArg::Cuda {
        anyhow::bail!(
            "--nccl needs --device cuda (got --device {})",
            a.device.as_str()
        );
    }
    let dev = select_device_on(a.device, a.dtype, a.gpu)?;
    let dir = match a.model.clone() {
        Some(d) => d,
        None => crate::runtime::default_model_dir()
            .context("no --model given and models/hypic-tiny not found")?,
    };
    let (model, _tok) = open_model(&dir, !matches!(dev, Device::Cpu), None)?;
    let public = a.public_pool_mib << 20;
    match dev {
        Device::Cpu => {
            let engine = PicEngine::new(Arc::new(model.into_host()?), "worker", public, 0);
            serve(&a, Arc::new(engine), None)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            use dataplane::cuda::nccl::NcclSender;
            use dataplane::cuda::pic::GpuPicEngine;
            use dataplane::parallel::transport::NcclJoin;
            match a.dtype {
                DtypeArg::F32 => {
                    let m = crate::runtime::gpu_model!(f32, gpu.clone(), model);
                    let e = Arc::new(GpuPicEngine::new(Arc::new(m), "worker", public, 0));
                    let nccl = a.nccl.then(|| {
                        Arc::new(NcclSender::<f32>::new(gpu.clone(), e.model_fingerprint()))
                            as Arc<dyn NcclJoin<_>>
                    });
                    serve(&a, e, nccl)
                }
                DtypeArg::Bf16 => {
                    let m = crate::runtime::gpu_model!(half::bf16, gpu.clone(), model);
                    let e = Arc::new(GpuPicEngine::new(Arc::new(m), "worker", public, 0));
                    let nccl = a.nccl.then(|| {
                        Arc::new(NcclSender::<half::bf16>::new(
                            gpu.clone(),
                            e.model_fingerprint(),
                        )) as Arc<dyn NcclJoin<_>>
                    });
                    serve(&a, e, nccl)
                }
            }
        }
    }
}

/// Binds the listener, prints the ready line and serves `engine` until the process
/// ends (taking NCCL offers through `nccl` when given, NIXL offers with
/// `--transport nixl`).
fn serve<B: PicBackend + 'static>(
    a: &WorkerArgs,
    engine: Arc<Pic<B>>,
    nccl: Option<Arc<dyn dataplane::parallel::transport::NcclJoin<B>>>,
) -> anyhow::Result<()> {
    let exposer = match a.transport {
        TransportArg::Tcp => None,
        TransportArg::Nixl => nixl_or_tcp("worker", nixl::exposer)?,
    };
    let worker = Arc::new(Worker::new(engine));
    let listener = TcpListener::bind(a.listen).with_context(|| format!("binding {}", a.listen))?;
    let addr = listener.local_addr()?;
    let info = worker.info();
    println!(
        "hypic: worker ready on {addr} (model {}, {:.0} tokens/s{})",
        info.model,
        info.tokens_per_s,
        if exposer.is_some() { ", NIXL" } else { "" }
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    if nccl.is_some() {
        let present = nccl_present();
        println!(
            "hypic: worker {addr} accepts NCCL offers{}",
            if present {
                ""
            } else {
                " (libnccl not found: every task will fall back to TCP)"
            }
        );
    }
    serve_tcp_with(listener, worker, a.max_connections.max(1), nccl, exposer);
    Ok(())
}
