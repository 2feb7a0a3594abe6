//! A random Qwen3.5-text model at the real head dims (dk = dv = 128, head_dim 256),
//! written as an HF folder (config.json + model.safetensors) so that the GPU tests
//! exercise the tuned kernels through the normal loading path. Shared by
//! `cuda_model.rs`, `cuda_pic.rs`, `cuda_graph.rs` and `cuda_decode.rs` (`#[path]`
//! module; each uses part of it).
#![allow(dead_code)]
use std::path::Path;

use dataplane::model::Model;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The layers of [`write_synthetic`]: 3 GDN + 1 attention.
pub const SYNTHETIC_LAYERS: [&str; 4] = [
    "linear_attention",
    "linear_attention",
    "full_attention",
    "linear_attention",
];

/// Writes a random Qwen3.5-text model (bare `qwen3_5_text`, tied embeddings) with
/// dk = dv = 128, head_dim = 256, 4 layers (3 GDN + 1 attention) into `dir`.
pub fn write_synthetic(dir: &Path) -> std::result::Result<(), String> {
    write_synthetic_with(dir, &SYNTHETIC_LAYERS)
}

/// [`write_synthetic`] with the given `layer_types` (`linear_attention` /
/// `full_attention`).
pub fn write_synthetic_with(dir: &Path, layer_types: &[&str]) -> std::result::Result<(), String> {
    let (h, vocab, inter) = (256usize, 320usize, 256usize);
    let (nh, nkv, hd) = (4usize, 2usize, 256usize);
    let (hk, hv, dk, dv, kconv) = (2usize, 4usize, 128usize, 128usize, 4usize);
    let cfg = serde_json::json!({
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "attn_output_gate": true,
        "head_dim": hd,
        "hidden_size": h,
        "intermediate_size": inter,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": kconv,
        "linear_key_head_dim": dk,
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "linear_value_head_dim": dv,
        "max_position_embeddings": 4096,
        "num_attention_heads": nh,
        "num_hidden_layers": layer_types.len(),
        "num_key_value_heads": nkv,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
        "tie_word_embeddings": true,
        "vocab_size": vocab,
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("config.json"), cfg.to_string()).map_err(|e| e.to_string())?;
    let mut r = StdRng::seed_from_u64(42);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![];
    let mut mat = |r: &mut StdRng, name: String, shape: Vec<usize>, lo: f32, hi: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| r.random_range(lo..hi)).collect();
        tensors.push((name, shape, v));
    };
    let lin = |fan_in: usize| (3.0f32 / fan_in as f32).sqrt();
    mat(
        &mut r,
        "model.embed_tokens.weight".into(),
        vec![vocab, h],
        -1.0,
        1.0,
    );
    mat(&mut r, "model.norm.weight".into(), vec![h], -0.1, 0.1);
    let (kd, vd) = (hk * dk, hv * dv);
    for (i, lt) in layer_types.iter().enumerate() {
        let p = format!("model.layers.{i}.");
        mat(
            &mut r,
            format!("{p}input_layernorm.weight"),
            vec![h],
            -0.1,
            0.1,
        );
        mat(
            &mut r,
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            -0.1,
            0.1,
        );
        if *lt == "linear_attention" {
            let a = format!("{p}linear_attn.");
            let s = lin(h);
            mat(
                &mut r,
                format!("{a}in_proj_qkv.weight"),
                vec![2 * kd + vd, h],
                -s,
                s,
            );
            mat(&mut r, format!("{a}in_proj_z.weight"), vec![vd, h], -s, s);
            mat(&mut r, format!("{a}in_proj_b.weight"), vec![hv, h], -s, s);
            mat(&mut r, format!("{a}in_proj_a.weight"), vec![hv, h], -s, s);
            mat(&mut r, format!("{a}A_log"), vec![hv], -2.0, 0.5);
            mat(&mut r, format!("{a}dt_bias"), vec![hv], -1.0, 1.0);
            mat(
                &mut r,
                format!("{a}conv1d.weight"),
                vec![2 * kd + vd, 1, kconv],
                -0.5,
                0.5,
            );
            mat(&mut r, format!("{a}norm.weight"), vec![dv], 0.9, 1.1);
            let s = lin(vd);
            mat(&mut r, format!("{a}out_proj.weight"), vec![h, vd], -s, s);
        } else {
            let a = format!("{p}self_attn.");
            let s = lin(h);
            mat(
                &mut r,
                format!("{a}q_proj.weight"),
                vec![2 * nh * hd, h],
                -s,
                s,
            );
            mat(
                &mut r,
                format!("{a}k_proj.weight"),
                vec![nkv * hd, h],
                -s,
                s,
            );
            mat(
                &mut r,
                format!("{a}v_proj.weight"),
                vec![nkv * hd, h],
                -s,
                s,
            );
            let s = lin(nh * hd);
            mat(&mut r, format!("{a}o_proj.weight"), vec![h, nh * hd], -s, s);
            mat(&mut r, format!("{a}q_norm.weight"), vec![hd], -0.1, 0.1);
            mat(&mut r, format!("{a}k_norm.weight"), vec![hd], -0.1, 0.1);
        }
        let m = format!("{p}mlp.");
        let s = lin(h);
        mat(
            &mut r,
            format!("{m}gate_proj.weight"),
            vec![inter, h],
            -s,
            s,
        );
        mat(&mut r, format!("{m}up_proj.weight"), vec![inter, h], -s, s);
        let s = lin(inter);
        mat(
            &mut r,
            format!("{m}down_proj.weight"),
            vec![h, inter],
            -s,
            s,
        );
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| format!("{n}: {e:?}"))
        })
        .collect::<std::result::Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(|e| format!("serialize: {e:?}"))
}

/// Writes the synthetic model into a fresh temporary folder (one per call: tests run
/// in parallel), loads it on the CPU and removes the folder.
pub fn synthetic_model() -> std::result::Result<Model, String> {
    synthetic_model_with(&SYNTHETIC_LAYERS)
}

/// [`synthetic_model`] with the given `layer_types`.
pub fn synthetic_model_with(layer_types: &[&str]) -> std::result::Result<Model, String> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("hypic-synth-{}-{n}", std::process::id()));
    write_synthetic_with(&dir, layer_types)?;
    let m = Model::load(&dir, &mut |_, _| {}).map_err(|e| format!("load synthetic: {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    m
}
