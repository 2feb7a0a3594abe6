//! The `hypic` command: generation, serving and operator tools.
mod eval_cmd;
mod generate;
mod random_ckpt_cmd;

use clap::{Parser, Subcommand};

/// HYPIC: serving hybrid-attention LLMs with position-independent caching.
#[derive(Parser)]
#[command(name = "hypic", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log format of the servers (`serve`, `control`) on stderr: text or json.
    /// The filter comes from HYPIC_LOG, else RUST_LOG, else `info`.
    #[arg(
        long,
        global = true,
        value_enum,
        env = "HYPIC_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: hypic_control::serve::reqlog::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streamed to stdout, then print TTFT and decode speed.
    Generate(generate::GenerateArgs),
    /// Mint a bearer token for local use (HS256 secret from the data directory).
    Token(hypic_control::TokenArgs),
    /// Serve the control-plane API alone (catalog, segments, grants, policies).
    Control(hypic_control::ControlServeArgs),
    /// Evaluate held-out multi-document QA through every reuse mode (quality and TTFT).
    Eval(eval_cmd::EvalArgs),
    /// Serve the OpenAI-compatible, segment-aware HTTP API (completions, chat, segments, metrics).
    Serve(Box<hypic_control::serve::ServeArgs>),
    /// Run the RAG workload benchmark (in-process or against a server) for each reuse mode.
    Bench(hypic_control::bench::BenchArgs),
    /// Serve as a segment-parallel worker: prefill the cold segments `serve --workers` sends.
    Worker(hypic_control::worker::WorkerArgs),
    /// Write a random-weight checkpoint (sharded safetensors, HF names) of any shape.
    RandomCheckpoint(random_ckpt_cmd::RandomCheckpointArgs),
}

fn main() {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Serve(_) | Command::Control(_) | Command::Worker(_)
    ) {
        hypic_control::serve::reqlog::init_logging(cli.log_format);
    }
    let res = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Eval(a) => eval_cmd::run(a),
        Command::Token(a) => hypic_control::auth::token_from_args(&a).map(|t| println!("{t}")),
        Command::Control(a) => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(hypic_control::run_control_command(a))),
        Command::Serve(a) => hypic_control::serve::run_serve_command(*a),
        Command::Bench(a) => hypic_control::bench::run_bench_command(a),
        Command::RandomCheckpoint(a) => random_ckpt_cmd::run(a),
        Command::Worker(a) => hypic_control::worker::run_worker_command(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
