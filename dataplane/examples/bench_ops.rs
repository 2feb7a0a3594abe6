//! Throughput of `dataplane::ops::linear` on the matrix shapes of the ~0.5B benchmark
//! model (tools/bench_hf_cpu.py --preset 0.5b): prefill-sized products (T=512, and
//! T=128 for one expert's share of a 512-token prompt) and one-token decode products.
//!
//! ```text
//! cargo run --release -p hypic-dataplane --example bench_ops
//! /work/pyenv/hf/bin/python tools/bench_hf_cpu.py --ops     # the same shapes through torch
//! ```
//!
//! Prints wall GFLOP/s and GFLOP per CPU-second (all threads, from
//! `/proc/self/task/*/schedstat`), which is the fairer number on a shared machine.
use dataplane::ops::linear;
use std::time::Instant;

/// CPU seconds of this process so far (all threads).
fn cpu_s() -> f64 {
    let Ok(rd) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let ns: u64 = rd
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 * 1e-9
}

/// (name, tokens, in, out, calls): keep in sync with OPS_SHAPES in tools/bench_hf_cpu.py.
const SHAPES: &[(&str, usize, usize, usize, usize)] = &[
    ("gdn_in_proj T512", 512, 1024, 3104, 5),
    ("attn_q_proj T512", 512, 1024, 2048, 5),
    ("out_proj T512", 512, 1024, 1024, 10),
    ("expert_gate_up T128", 128, 1024, 256, 40),
    ("expert_down T128", 128, 128, 1024, 40),
    ("shared_down T512", 512, 512, 1024, 10),
    ("gdn_in_proj T1", 1, 1024, 3104, 200),
    ("lm_head T1", 1, 1024, 32768, 40),
    ("expert_gate_up T1", 1, 1024, 256, 2000),
    ("expert_down T1", 1, 128, 1024, 2000),
];

fn main() {
    println!(
        "{:20} {:>10} {:>12} {:>14} {:>6}",
        "shape", "ms/call", "GFLOP/s", "GFLOP/CPU-s", "util"
    );
    for &(name, t, inp, out, calls) in SHAPES {
        let x: Vec<f32> = (0..t * inp)
            .map(|i| ((i * 7919 % 1000) as f32) * 1e-3 - 0.5)
            .collect();
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 104_729 % 1000) as f32) * 1e-3 - 0.5)
            .collect();
        std::hint::black_box(linear(&x, t, inp, &w, out));
        let (c0, t0) = (cpu_s(), Instant::now());
        for _ in 0..calls {
            std::hint::black_box(linear(&x, t, inp, &w, out));
        }
        let wall = t0.elapsed().as_secs_f64();
        let cpu = cpu_s() - c0;
        let flop = 2.0 * (t * inp * out * calls) as f64;
        println!(
            "{name:20} {:10.3} {:12.1} {:14.1} {:6.2}",
            wall * 1e3 / calls as f64,
            flop / wall * 1e-9,
            flop / cpu * 1e-9,
            cpu / wall
        );
    }
}
