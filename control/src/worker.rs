//! `hypic worker`: a segment-parallel worker (docs/segment-parallelism.md). It loads
//! the model on the CPU, keeps a public pool of the entries it built, and serves
//! scatter tasks of `hypic serve --workers` over TCP
//! ([`dataplane::parallel::worker::serve_tcp`]).
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use dataplane::parallel::worker::{serve_tcp, Worker};
use dataplane::pic::PicEngine;

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
    /// Public pool (the entries this worker built) capacity, MiB.
    #[arg(long, default_value_t = 1024)]
    pub public_pool_mib: usize,
    /// Scatter connections served at once.
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
}

/// Runs `hypic worker` until the process is stopped. Prints
/// `hypic: worker ready on ADDR (model FINGERPRINT, N tokens/s)` on stdout once it
/// accepts tasks.
///
/// Errors: the model does not load, the address cannot be bound.
pub fn run_worker_command(a: WorkerArgs) -> anyhow::Result<()> {
    let dir = match a.model {
        Some(d) => d,
        None => crate::runtime::default_model_dir()
            .context("no --model given and models/hypic-tiny not found")?,
    };
    let (model, _tok) = crate::runtime::load_model(&dir)?;
    let engine = Arc::new(PicEngine::new(
        Arc::new(model),
        "worker",
        a.public_pool_mib << 20,
        0,
    ));
    let worker = Arc::new(Worker::new(engine));
    let listener = TcpListener::bind(a.listen).with_context(|| format!("binding {}", a.listen))?;
    let addr = listener.local_addr()?;
    let info = worker.info();
    println!(
        "hypic: worker ready on {addr} (model {}, {:.0} tokens/s)",
        info.model, info.tokens_per_s
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    serve_tcp(listener, worker, a.max_connections.max(1));
    Ok(())
}
