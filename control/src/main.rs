//! The `hypic` command: generation, serving and operator tools.
mod generate;

use clap::{Parser, Subcommand};

/// HYPIC: serving hybrid-attention LLMs with position-independent caching.
#[derive(Parser)]
#[command(name = "hypic", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streamed to stdout, then print TTFT and decode speed.
    Generate(generate::GenerateArgs),
}

fn main() {
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Generate(a) => generate::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
