//! `hypic serve --device cpu|cuda|auto --dtype f32|bf16`: flags, environment-free
//! config file keys, startup errors, and the backend that `/health`, `/metrics` and
//! the startup log report. CPU only; the GPU end-to-end check is
//! `scripts/serve_check.py` (gpu-check step `serve`).
use crate::serve_common;

use clap::Parser;
use hypic_control::backend::{DeviceArg, DtypeArg};
#[cfg(not(feature = "cuda"))]
use hypic_control::serve::spawn;
use hypic_control::serve::{ServeArgs, ServeConfig};
use serve_common::{golden_model, metric, start};
use std::process::Command;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// `hypic` with no `HYPIC_*` variable of the caller's environment.
fn hypic() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hypic"));
    for (k, _) in std::env::vars() {
        if k.starts_with("HYPIC_") {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn device_and_dtype_default_to_auto_and_f32() {
    let c = ServeConfig::default();
    assert_eq!(c.device, DeviceArg::Auto);
    assert_eq!(c.dtype, DtypeArg::F32);
}

#[test]
fn device_and_dtype_from_the_config_file_then_flags() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("hypic.toml");
    std::fs::write(&p, "device = \"cpu\"\ndtype = \"bf16\"\n").unwrap();
    let args = ServeArgs {
        config: Some(p.clone()),
        ..Default::default()
    };
    let c = ServeConfig::resolve(&args).unwrap();
    assert_eq!((c.device, c.dtype), (DeviceArg::Cpu, DtypeArg::Bf16));
    let args = ServeArgs {
        config: Some(p.clone()),
        device: Some(DeviceArg::Cuda),
        dtype: Some(DtypeArg::F32),
        ..Default::default()
    };
    let c = ServeConfig::resolve(&args).unwrap();
    assert_eq!(
        (c.device, c.dtype),
        (DeviceArg::Cuda, DtypeArg::F32),
        "flags override the file"
    );
    std::fs::write(&p, "device = \"tpu\"\n").unwrap();
    let e = format!("{:#}", ServeConfig::resolve(&args).unwrap_err());
    assert!(
        e.contains("tpu") && e.contains("cuda") && e.contains("cpu"),
        "{e}"
    );
    std::fs::write(&p, "dtype = \"f16\"\n").unwrap();
    let e = format!("{:#}", ServeConfig::resolve(&args).unwrap_err());
    assert!(e.contains("f16") && e.contains("bf16"), "{e}");
}

#[test]
fn flags_parse_and_bad_values_name_the_choices() {
    let c = Cli::try_parse_from(["hypic", "--device", "cpu", "--dtype", "bf16"]).unwrap();
    assert_eq!(c.serve.device, Some(DeviceArg::Cpu));
    assert_eq!(c.serve.dtype, Some(DtypeArg::Bf16));
    let e = Cli::try_parse_from(["hypic", "--dtype", "f64"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    let m = e.to_string();
    assert!(
        m.contains("f64") && m.contains("f32") && m.contains("bf16"),
        "{m}"
    );
    let e = Cli::try_parse_from(["hypic", "--device", "gpu0"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    let m = e.to_string();
    assert!(
        m.contains("cpu") && m.contains("cuda") && m.contains("auto"),
        "{m}"
    );
}

#[test]
fn the_binary_refuses_a_bad_dtype_before_starting() {
    let dir = tempfile::tempdir().unwrap();
    let out = hypic()
        .args([
            "serve",
            "--dtype",
            "f64",
            "--bind",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("'f64'") && err.contains("f32") && err.contains("bf16"),
        "{err}"
    );
}

/// `--device cuda` where CUDA cannot run (no `cuda` feature, or no driver): a clear
/// startup error naming the alternatives, before the model loads or the data
/// directory is touched.
#[test]
fn the_binary_refuses_device_cuda_without_cuda() {
    #[cfg(feature = "cuda")]
    if dataplane::cuda::driver_present() {
        eprintln!("a CUDA driver is present: nothing to check");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = hypic()
        .args([
            "serve",
            "--device",
            "cuda",
            "--bind",
            "127.0.0.1:0",
            "--model",
        ])
        .arg(golden_model())
        .arg("--data-dir")
        .arg(&data)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device cuda"), "{err}");
    #[cfg(not(feature = "cuda"))]
    assert!(
        err.contains("without CUDA support") && err.contains("--features cuda"),
        "{err}"
    );
    #[cfg(feature = "cuda")]
    assert!(err.contains("no usable CUDA device"), "{err}");
    assert!(err.contains("--device cpu"), "{err}");
    assert!(!data.exists(), "nothing is created before the device check");
}

#[cfg(not(feature = "cuda"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawn_with_device_cuda_fails_without_the_feature() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServeConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        model: Some(golden_model()),
        data_dir: dir.path().to_path_buf(),
        device: DeviceArg::Cuda,
        ..ServeConfig::default()
    };
    let e = format!("{:#}", spawn(cfg).await.err().expect("no CUDA here"));
    assert!(e.contains("without CUDA support"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_name_the_cpu_backend() {
    // bf16 on the CPU is ignored: the CPU backend runs f32.
    let s = start(|c| {
        c.device = DeviceArg::Cpu;
        c.dtype = DtypeArg::Bf16;
    })
    .await;
    assert_eq!(s.server.state.backend().describe, "cpu");
    let (st, h) = s.get_as(None, "/health").await;
    assert_eq!(st, 200);
    assert_eq!(h["device"], "cpu", "{h}");
    assert_eq!(h["dtype"], "f32", "{h}");
    assert_eq!(h["backend"], "cpu", "{h}");
    let m = s.metrics().await;
    assert_eq!(
        metric(
            &m,
            "hypic_backend_info",
            "backend=\"cpu\",device=\"cpu\",dtype=\"f32\""
        ),
        Some(1.0),
        "{m}"
    );
    s.server.stop().await;
}

/// `auto` serves on the GPU where CUDA is built in and GPU 0 opens, and falls back
/// to the CPU everywhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_picks_cuda_when_usable_else_the_cpu() {
    #[cfg(feature = "cuda")]
    let want = if dataplane::cuda::Gpu::new(0).is_ok() {
        "cuda"
    } else {
        "cpu"
    };
    #[cfg(not(feature = "cuda"))]
    let want = "cpu";
    let s = start(|c| c.device = DeviceArg::Auto).await;
    let (_, h) = s.get_as(None, "/health").await;
    assert_eq!(h["device"], want, "{h}");
    s.server.stop().await;
}

/// The bundled model (it has the held-out QA set `hypic eval` reads).
fn tiny_model() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny")
}

/// `hypic generate`, `hypic eval` and the in-process `hypic bench` build their engine
/// as `serve` does: `--device cuda` in a build without CUDA is the same clear error,
/// before the weights are read and before any output is written.
#[cfg(not(feature = "cuda"))]
#[test]
fn offline_commands_refuse_device_cuda_without_cuda() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let model = tiny_model().display().to_string();
    let outs = out.display().to_string();
    let runs: [&[&str]; 3] = [
        &["generate", "--prompt", "hello", "--model", &model],
        &["eval", "--limit", "1", "--model", &model, "--out", &outs],
        &[
            "bench",
            "--requests",
            "1",
            "--model",
            &model,
            "--out",
            &outs,
        ],
    ];
    for args in runs {
        let r = hypic()
            .args(args)
            .args(["--device", "cuda"])
            .output()
            .unwrap();
        assert_eq!(r.status.code(), Some(1), "{args:?}: {r:?}");
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            err.contains("--device cuda")
                && err.contains("without CUDA support")
                && err.contains("--features cuda")
                && err.contains("--device cpu"),
            "{args:?}: {err}"
        );
        assert!(r.stdout.is_empty(), "{args:?}");
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
}

/// `--device auto` (the default) falls back to the CPU with one line saying why, and
/// the command then runs on the CPU engine and scheduler.
#[cfg(not(feature = "cuda"))]
#[test]
fn offline_commands_fall_back_to_the_cpu_on_auto() {
    let dir = tempfile::tempdir().unwrap();
    let r = hypic()
        .args([
            "generate",
            "--prompt",
            "The capital of",
            "--max-tokens",
            "3",
        ])
        .args(["--device", "auto", "--dtype", "bf16", "--model"])
        .arg(tiny_model())
        .output()
        .unwrap();
    assert!(r.status.success(), "{r:?}");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("built without CUDA support; using the CPU backend"),
        "{err}"
    );
    assert!(err.contains("applies to the GPU backend only"), "{err}");
    assert!(err.contains("backend: cpu"), "{err}");
    assert!(err.contains("prompt ") && err.contains("TTFT"), "{err}");
    let out = dir.path().join("eval");
    let r = hypic()
        .args(["eval", "--limit", "1", "--modes", "full,hypic8", "--quiet"])
        .args(["--max-new-tokens", "4", "--model"])
        .arg(tiny_model())
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(r.status.success(), "{r:?}");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("using the CPU backend") && err.contains("backend: cpu"),
        "{err}"
    );
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(rep.as_array().unwrap().len(), 2, "{rep}");
    assert_eq!(rep[0]["label"], "full_recompute");
    assert_eq!(rep[1]["label"], "hypic_w8");
    assert!(
        rep[1]["mean_tokens_reused"].as_f64().unwrap() > 0.0,
        "the hot cache is hit through the scheduler: {rep}"
    );
}

/// `--max-tokens 0` and an eval reply budget of 0 are refused with a message naming
/// the flag.
#[test]
fn offline_commands_name_a_zero_token_budget() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o").display().to_string();
    for (args, flag) in [
        (
            vec![
                "generate",
                "--prompt",
                "hi",
                "--max-tokens",
                "0",
                "--device",
                "cpu",
            ],
            "--max-tokens",
        ),
        (
            vec![
                "eval",
                "--limit",
                "1",
                "--max-new-tokens",
                "0",
                "--device",
                "cpu",
                "--out",
                &out,
            ],
            "--max-new-tokens",
        ),
    ] {
        let r = hypic()
            .args(&args)
            .arg("--model")
            .arg(tiny_model())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(flag) && err.contains("at least 1"), "{err}");
    }
}
