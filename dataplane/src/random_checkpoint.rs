//! A random-weight checkpoint on disk: the weights of [`Model::random`] /
//! `cuda::GpuModel::random` (same config, same seed) written as sharded safetensors
//! with Hugging Face tensor names and `model.safetensors.index.json`, so that loading
//! the folder gives the random-weight model back (the same greedy output as a
//! random-weight server), at any shape, without a real checkpoint.
//!
//! Values: every weight comes from the counter-based generator of [`crate::random`]
//! at its internal index, mapped to the HF tensor that the loaders
//! ([`Model::from_checkpoint`], `GpuModel::load`) read it from, under the family's
//! tensor names (`ModelConfig::names`): the GDN in-projection in the family's
//! [`InProjLayout`](crate::config::InProjLayout) (Qwen3.5: the split `in_proj_qkv | in_proj_z | in_proj_b |
//! in_proj_a`; Qwen3-Next: the per-key-head grouped `in_proj_qkvz` / `in_proj_ba`),
//! MLP `gate_proj` /
//! `up_proj` as the two halves of the fused gate/up, routed experts as the fused 3-D
//! `experts.gate_up_proj [E, 2I, hidden]` / `experts.down_proj [E, hidden, I]`.
//!
//! Dtypes: the large tensors (projections, embedding, LM head, router, experts) in
//! [`LargeDtype`] (bf16: each value the fp32 one rounded to nearest-even, which is
//! exactly what `GpuModel::<bf16>::random` holds); the small fp32 ones (norm
//! weights, conv weights, `dt_bias`) in F32; `A_log` in F64 as `ln(A)` of the f32 `A`,
//! which the loaders turn back into exactly `−A` ([`Checkpoint::neg_a`]).
//!
//! Memory: one tensor at a time (the largest is a layer's fused experts, about 1 GiB
//! in bf16 at the Qwen3.5-35B-A3B shape); generated in parallel with rayon.
//!
//! [`Model::random`]: crate::model::Model::random
//! [`Model::from_checkpoint`]: crate::model::Model::from_checkpoint
//! [`Checkpoint::neg_a`]: crate::weights::Checkpoint::neg_a
use crate::config::{MixerKind, ModelConfig};
use crate::error::{io_err, Error, Result};
use crate::random::{self as rnd, tensor_id, tensor_key};
use rayon::prelude::*;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Element type of the large tensors of a written checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LargeDtype {
    /// bfloat16 (the HF release dtype; half the bytes).
    Bf16,
    /// fp32 (the values of `Model::random` unrounded).
    F32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dt {
    F64,
    F32,
    Bf16,
}

impl Dt {
    fn width(self) -> usize {
        match self {
            Dt::F64 => 8,
            Dt::F32 => 4,
            Dt::Bf16 => 2,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Dt::F64 => "F64",
            Dt::F32 => "F32",
            Dt::Bf16 => "BF16",
        }
    }
}

/// How the values of one HF tensor are produced.
#[derive(Clone, Debug)]
enum Gen {
    /// Symmetric uniform of tensor id `id` with bound `bound`; element `i` of the HF
    /// tensor is internal element `row_map(i / cols) · cols + i % cols + offset`.
    Sym {
        id: u64,
        bound: f64,
        offset: usize,
        rows: RowMap,
    },
    /// Every element `v`.
    Const(f32),
    /// `ln(A)` in f64 of the GDN `A` of tensor id `id`.
    ALog { id: u64 },
}

/// Row permutation of a [`Gen::Sym`] tensor.
#[derive(Clone, Debug)]
enum RowMap {
    Identity,
    /// HF row `r` is internal row `table[r]` (a GDN in-projection tensor: the
    /// family's [`InProjLayout::row_map`]).
    Table(std::sync::Arc<[usize]>),
}

impl RowMap {
    fn map(&self, r: usize) -> usize {
        match self {
            RowMap::Identity => r,
            RowMap::Table(t) => t[r],
        }
    }
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug)]
struct Spec {
    name: String,
    shape: Vec<usize>,
    dt: Dt,
    gen: Gen,
}

impl Spec {
    fn elems(&self) -> usize {
        self.shape.iter().product()
    }
    fn bytes(&self) -> usize {
        self.elems() * self.dt.width()
    }
}

/// Every tensor of the random checkpoint of `c` in model order.
fn specs(c: &ModelConfig, large: LargeDtype) -> Vec<Spec> {
    let big = match large {
        LargeDtype::Bf16 => Dt::Bf16,
        LargeDtype::F32 => Dt::F32,
    };
    let lb = rnd::linear_bound();
    let n = &c.names;
    let h = c.hidden_size;
    let mut v = Vec::new();
    let mut sym = |name: String, shape: Vec<usize>, id: u64, offset: usize, rows: RowMap| {
        v.push(Spec {
            name,
            shape,
            dt: big,
            gen: Gen::Sym {
                id,
                bound: lb,
                offset,
                rows,
            },
        })
    };
    let g = |s| tensor_id(None, s);
    sym(
        n.embed_tokens(),
        vec![c.vocab_size, h],
        g(rnd::SLOT_EMBED),
        0,
        RowMap::Identity,
    );
    if !c.tie_word_embeddings {
        sym(
            n.lm_head.into(),
            vec![c.vocab_size, h],
            g(rnd::SLOT_LM_HEAD),
            0,
            RowMap::Identity,
        );
    }
    // RMSNorm weights: the model's zero-centred 0 is a checkpoint 1 for plain norms.
    let norm_one = match c.norm {
        crate::config::NormStyle::ZeroCentred => 0.0,
        crate::config::NormStyle::Plain => 1.0,
    };
    let mut small: Vec<Spec> = vec![Spec {
        name: n.norm(),
        shape: vec![h],
        dt: Dt::F32,
        gen: Gen::Const(norm_one),
    }];
    let (hv, dv, vd) = (c.linear_v_heads, c.linear_v_dim, c.value_dim());
    for l in 0..c.num_layers {
        let id = |s| tensor_id(Some(l), s);
        let konst = |name: String, n: usize, x: f32| Spec {
            name,
            shape: vec![n],
            dt: Dt::F32,
            gen: Gen::Const(x),
        };
        match c.mixers[l] {
            MixerKind::GatedDeltaNet => {
                let q = n.mixer(l, MixerKind::GatedDeltaNet);
                let w_in = id(rnd::SLOT_GDN_IN);
                let layout = c.gdn_in_proj;
                for (ti, t) in layout.tensors(c).iter().enumerate() {
                    sym(
                        format!("{q}{}", t.name),
                        vec![t.rows, h],
                        w_in,
                        0,
                        RowMap::Table(layout.row_map(c, ti).into()),
                    );
                }
                sym(
                    format!("{q}out_proj.weight"),
                    vec![h, vd],
                    id(rnd::SLOT_GDN_OUT),
                    0,
                    RowMap::Identity,
                );
                small.push(Spec {
                    name: format!("{q}conv1d.weight"),
                    shape: vec![c.conv_dim(), 1, c.conv_kernel],
                    dt: Dt::F32,
                    gen: Gen::Sym {
                        id: id(rnd::SLOT_GDN_CONV),
                        bound: rnd::conv_bound(c.conv_kernel),
                        offset: 0,
                        rows: RowMap::Identity,
                    },
                });
                small.push(Spec {
                    name: format!("{q}A_log"),
                    shape: vec![hv],
                    dt: Dt::F64,
                    gen: Gen::ALog {
                        id: id(rnd::SLOT_GDN_A),
                    },
                });
                small.push(konst(format!("{q}dt_bias"), hv, 1.0));
                small.push(konst(format!("{q}norm.weight"), dv, 1.0));
            }
            MixerKind::Attention => {
                let q = n.mixer(l, MixerKind::Attention);
                let hd = c.head_dim;
                let qw = c.num_heads * hd * if c.attn_output_gate { 2 } else { 1 };
                let kv = c.num_kv_heads * hd;
                let fused = c.attn_proj == crate::config::AttnProjLayout::FusedQkv;
                if fused {
                    sym(
                        format!("{q}query_key_value.weight"),
                        vec![qw + 2 * kv, h],
                        id(rnd::SLOT_ATTN_QKV),
                        0,
                        RowMap::Identity,
                    );
                } else {
                    for (name, r, s) in [
                        ("q_proj", qw, rnd::SLOT_ATTN_Q),
                        ("k_proj", kv, rnd::SLOT_ATTN_K),
                        ("v_proj", kv, rnd::SLOT_ATTN_V),
                    ] {
                        sym(
                            format!("{q}{name}.weight"),
                            vec![r, h],
                            id(s),
                            0,
                            RowMap::Identity,
                        );
                    }
                }
                let (o, qn, kn) = if fused {
                    ("dense", "query_layernorm", "key_layernorm")
                } else {
                    ("o_proj", "q_norm", "k_norm")
                };
                sym(
                    format!("{q}{o}.weight"),
                    vec![h, c.num_heads * hd],
                    id(rnd::SLOT_ATTN_O),
                    0,
                    RowMap::Identity,
                );
                small.push(konst(format!("{q}{qn}.weight"), hd, norm_one));
                small.push(konst(format!("{q}{kn}.weight"), hd, norm_one));
            }
            MixerKind::Lightning => {
                let q = n.mixer(l, MixerKind::Lightning);
                let (d, wd) = (c.linear_k_dim, c.linear_v_heads * c.linear_v_dim);
                for (name, shape, s) in [
                    ("query_key_value", vec![3 * wd, h], rnd::SLOT_LIGHTNING_QKV),
                    ("g_proj", vec![wd, h], rnd::SLOT_LIGHTNING_G),
                    ("dense", vec![h, wd], rnd::SLOT_LIGHTNING_DENSE),
                ] {
                    sym(
                        format!("{q}{name}.weight"),
                        shape,
                        id(s),
                        0,
                        RowMap::Identity,
                    );
                }
                small.push(konst(format!("{q}query_layernorm.weight"), d, norm_one));
                small.push(konst(format!("{q}key_layernorm.weight"), d, norm_one));
                small.push(konst(format!("{q}g_norm.weight"), wd, 1.0));
            }
            MixerKind::Kda => {
                let q = n.mixer(l, MixerKind::Kda);
                let (d, nh) = (c.linear_k_dim, c.linear_v_heads);
                let wd = nh * c.linear_v_dim;
                // The merged in-projection's row blocks, in order (model::KdaWeights).
                let mut off = 0;
                for (name, rows) in [
                    ("q_proj", wd),
                    ("k_proj", wd),
                    ("v_proj", wd),
                    ("f_a_proj", d),
                    ("g_a_proj", d),
                    ("b_proj", nh),
                ] {
                    sym(
                        format!("{q}{name}.weight"),
                        vec![rows, h],
                        id(rnd::SLOT_KDA_IN),
                        off,
                        RowMap::Identity,
                    );
                    off += rows * h;
                }
                for (name, shape, s) in [
                    ("f_b_proj", vec![wd, d], rnd::SLOT_KDA_FB),
                    ("g_b_proj", vec![wd, d], rnd::SLOT_KDA_GB),
                    ("o_proj", vec![h, wd], rnd::SLOT_KDA_O),
                ] {
                    sym(
                        format!("{q}{name}.weight"),
                        shape,
                        id(s),
                        0,
                        RowMap::Identity,
                    );
                }
                for (j, name) in ["q_conv1d", "k_conv1d", "v_conv1d"].iter().enumerate() {
                    small.push(Spec {
                        name: format!("{q}{name}.weight"),
                        shape: vec![wd, 1, c.conv_kernel],
                        dt: Dt::F32,
                        gen: Gen::Sym {
                            id: id(rnd::SLOT_KDA_CONV),
                            bound: rnd::conv_bound(c.conv_kernel),
                            offset: j * wd * c.conv_kernel,
                            rows: RowMap::Identity,
                        },
                    });
                }
                small.push(Spec {
                    name: format!("{q}A_log"),
                    shape: vec![1, 1, nh, 1],
                    dt: Dt::F64,
                    gen: Gen::ALog {
                        id: id(rnd::SLOT_KDA_A),
                    },
                });
                small.push(konst(format!("{q}dt_bias"), wd, 1.0));
                small.push(konst(format!("{q}o_norm.weight"), d, 1.0));
            }
            MixerKind::Mla => {
                let q = n.mixer(l, MixerKind::Mla);
                let m = &c.mla;
                let nh = c.num_heads;
                for (name, shape, s) in [
                    ("q_proj", vec![nh * m.qk_head_dim(), h], rnd::SLOT_MLA_Q),
                    ("kv_a_proj_with_mqa", vec![m.row(), h], rnd::SLOT_MLA_KV_A),
                    (
                        "kv_b_proj",
                        vec![nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
                        rnd::SLOT_MLA_KV_B,
                    ),
                    ("o_proj", vec![h, nh * m.v_head_dim], rnd::SLOT_MLA_O),
                ] {
                    sym(
                        format!("{q}{name}.weight"),
                        shape,
                        id(s),
                        0,
                        RowMap::Identity,
                    );
                }
                small.push(konst(
                    format!("{q}kv_a_layernorm.weight"),
                    m.kv_lora_rank,
                    1.0,
                ));
            }
        }
        let m = n.mlp(l);
        let mlp = |sym: &mut dyn FnMut(String, Vec<usize>, u64, usize, RowMap),
                   q: String,
                   inter: usize,
                   gu: u64,
                   dn: u64| {
            sym(
                format!("{q}gate_proj.weight"),
                vec![inter, h],
                id(gu),
                0,
                RowMap::Identity,
            );
            sym(
                format!("{q}up_proj.weight"),
                vec![inter, h],
                id(gu),
                inter * h,
                RowMap::Identity,
            );
            sym(
                format!("{q}down_proj.weight"),
                vec![h, inter],
                id(dn),
                0,
                RowMap::Identity,
            );
        };
        if c.layer_is_moe[l] {
            let (e, i, si) = (
                c.num_experts,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
            );
            for (name, shape, s) in [
                ("gate.weight", vec![e, h], rnd::SLOT_MOE_ROUTER),
                (
                    "experts.gate_up_proj",
                    vec![e, 2 * i, h],
                    rnd::SLOT_MOE_GATE_UP,
                ),
                ("experts.down_proj", vec![e, h, i], rnd::SLOT_MOE_DOWN),
            ] {
                sym(format!("{m}{name}"), shape, id(s), 0, RowMap::Identity);
            }
            if let Some(b) = c.router.selection_bias {
                small.push(konst(format!("{m}{b}"), e, 0.0));
            }
            if si > 0 {
                if let Some(gate) = n.shared_expert_gate {
                    sym(
                        format!("{m}{gate}"),
                        vec![1, h],
                        id(rnd::SLOT_SHARED_GATE),
                        0,
                        RowMap::Identity,
                    );
                }
                mlp(
                    &mut sym,
                    format!("{m}{}", n.shared_expert),
                    si,
                    rnd::SLOT_SHARED_GATE_UP,
                    rnd::SLOT_SHARED_DOWN,
                );
            }
        } else {
            mlp(
                &mut sym,
                m,
                c.intermediate_size,
                rnd::SLOT_MLP_GATE_UP,
                rnd::SLOT_MLP_DOWN,
            );
        }
        small.push(konst(n.input_layernorm(l), h, norm_one));
        small.push(konst(n.post_layernorm(l), h, norm_one));
    }
    v.extend(small);
    v
}

/// Fills `out` (little-endian elements of `s.dt`) with the values of tensor `s`.
fn generate(s: &Spec, seed: u64, out: &mut [u8]) {
    let w = s.dt.width();
    let cols = s.shape.last().copied().unwrap_or(1).max(1);
    let put = |o: &mut [u8], x: f32| match s.dt {
        Dt::F32 => o.copy_from_slice(&x.to_le_bytes()),
        Dt::Bf16 => o.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes()),
        Dt::F64 => o.copy_from_slice(&(x as f64).to_le_bytes()),
    };
    match &s.gen {
        Gen::Const(x) => out.par_chunks_mut(w).for_each(|o| put(o, *x)),
        Gen::ALog { id } => {
            let key = tensor_key(seed, *id);
            for (i, o) in out.chunks_mut(w).enumerate() {
                let a = -rnd::neg_a_value(key, i as u64);
                o.copy_from_slice(&(a as f64).ln().to_le_bytes());
            }
        }
        Gen::Sym {
            id,
            bound,
            offset,
            rows,
        } => {
            let key = tensor_key(seed, *id);
            let scale = rnd::sym_scale(*bound);
            out.par_chunks_mut(w * cols)
                .enumerate()
                .for_each(|(r, row)| {
                    let base = (rows.map(r) * cols + offset) as u64;
                    for (j, o) in row.chunks_mut(w).enumerate() {
                        put(o, rnd::sym_value(key, base + j as u64, scale));
                    }
                });
        }
    }
}

/// What [`write`] produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Shard files, in order.
    pub files: Vec<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub bytes: u64,
    /// Bytes of the largest shard file.
    pub largest_shard: u64,
}

/// Total tensor bytes [`write`] would produce for `c` (for a progress bar).
pub fn total_bytes(c: &ModelConfig, large: LargeDtype) -> u64 {
    specs(c, large).iter().map(|s| s.bytes() as u64).sum()
}

/// Writes the random checkpoint of `c` with `seed` into `dir` (created if needed):
/// shards `model-0000i-of-0000n.safetensors` of at most `shard_bytes` tensor bytes
/// each (a larger tensor gets a shard of its own), `model.safetensors.index.json`,
/// and `config_json` as `config.json` (pass the config the model was parsed from, with
/// the layer count already sliced if wanted). `progress(bytes_done, bytes_total)`
/// after each tensor. Peak memory: one tensor.
///
/// Errors: [`Error::Io`] for a file that cannot be created or written.
pub fn write(
    c: &ModelConfig,
    config_json: &serde_json::Value,
    dir: &Path,
    seed: u64,
    large: LargeDtype,
    shard_bytes: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Written> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let all = specs(c, large);
    let total: u64 = all.iter().map(|s| s.bytes() as u64).sum();
    // Greedy shards in model order.
    let mut shards: Vec<Vec<Spec>> = vec![vec![]];
    let mut fill = 0u64;
    for s in all {
        let b = s.bytes() as u64;
        if fill > 0 && fill + b > shard_bytes {
            shards.push(vec![]);
            fill = 0;
        }
        fill += b;
        shards.last_mut().expect("one shard").push(s);
    }
    let n = shards.len();
    let mut out = Written::default();
    let mut weight_map = serde_json::Map::new();
    let mut done = 0u64;
    progress(0, total);
    for (k, mut shard) in shards.into_iter().enumerate() {
        // Widest dtype first: the data section starts 8-aligned, so every tensor is
        // aligned to its element type.
        shard.sort_by_key(|s| std::cmp::Reverse(s.dt.width()));
        let fname = format!("model-{:05}-of-{:05}.safetensors", k + 1, n);
        let path = dir.join(&fname);
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({"format": "pt", "generator": "hypic random-checkpoint"}),
        );
        let mut at = 0usize;
        for s in &shard {
            header.insert(
                s.name.clone(),
                serde_json::json!({"dtype": s.dt.name(), "shape": s.shape, "data_offsets": [at, at + s.bytes()]}),
            );
            at += s.bytes();
            weight_map.insert(s.name.clone(), fname.clone().into());
        }
        let mut head = serde_json::to_vec(&serde_json::Value::Object(header)).expect("json");
        while !head.len().is_multiple_of(8) {
            head.push(b' ');
        }
        let file = std::fs::File::create(&path).map_err(io_err(&path))?;
        let mut f = std::io::BufWriter::with_capacity(1 << 22, file);
        let w = |f: &mut std::io::BufWriter<std::fs::File>, b: &[u8]| {
            f.write_all(b).map_err(io_err(&path))
        };
        w(&mut f, &(head.len() as u64).to_le_bytes())?;
        w(&mut f, &head)?;
        for s in &shard {
            let mut buf = vec![0u8; s.bytes()];
            generate(s, seed, &mut buf);
            w(&mut f, &buf)?;
            done += buf.len() as u64;
            out.tensors += 1;
            progress(done, total);
        }
        f.flush().map_err(io_err(&path))?;
        let size = 8 + head.len() as u64 + at as u64;
        out.largest_shard = out.largest_shard.max(size);
        out.files.push(path);
    }
    out.bytes = total;
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let ipath = dir.join("model.safetensors.index.json");
    let mut text = serde_json::to_vec_pretty(&index).expect("json");
    text.push(b'\n');
    std::fs::write(&ipath, text).map_err(io_err(&ipath))?;
    let cpath = dir.join("config.json");
    std::fs::write(
        &cpath,
        serde_json::to_vec_pretty(config_json).expect("json"),
    )
    .map_err(io_err(&cpath))?;
    Ok(out)
}

/// `config_json` with the decoder cut to its first `layers` layers
/// (`num_hidden_layers` and `layer_types`, at the top level or under `text_config`).
///
/// Errors: [`Error::Json`] when `layers` is 0 or more than the config has, or the
/// config is not an object.
pub fn slice_layers(config_json: &serde_json::Value, layers: usize) -> Result<serde_json::Value> {
    let mut v = config_json.clone();
    let obj = if v.get("text_config").is_some() {
        v.get_mut("text_config")
    } else {
        Some(&mut v)
    };
    let obj = obj
        .and_then(|o| o.as_object_mut())
        .ok_or_else(|| Error::Json {
            path: PathBuf::from("config.json"),
            msg: "not an object".into(),
        })?;
    let have = obj
        .get("num_hidden_layers")
        .and_then(|x| x.as_u64())
        .unwrap_or(0) as usize;
    if layers == 0 || layers > have {
        return Err(Error::Json {
            path: PathBuf::from("config.json"),
            msg: format!("cannot slice {have} layers to {layers} (need 1..={have})"),
        });
    }
    obj.insert("num_hidden_layers".into(), layers.into());
    for key in ["layer_types", "mlp_layer_types"] {
        if let Some(serde_json::Value::Array(a)) = obj.get_mut(key) {
            a.truncate(layers);
        }
    }
    // Kimi-Linear's 1-indexed layer lists keep the layers that remain.
    if let Some(lac) = obj
        .get_mut("linear_attn_config")
        .and_then(|x| x.as_object_mut())
    {
        for key in ["kda_layers", "full_attn_layers"] {
            if let Some(serde_json::Value::Array(a)) = lac.get_mut(key) {
                a.retain(|x| x.as_u64().is_some_and(|l| l as usize <= layers));
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::InProjLayout;
    use crate::model::{Ffn, Logits, Mixer, Model};

    fn golden_json(name: &str) -> serde_json::Value {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden")
            .join(name)
            .join("config.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "hypic-random-ckpt-{tag}-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn bf(v: &mut [f32]) {
        for x in v {
            *x = half::bf16::from_f32(*x).to_f32();
        }
    }

    /// `Model::random` with every large weight rounded to bf16 (what a bf16
    /// checkpoint holds); the small fp32 tensors stay.
    fn round_large(m: &mut Model) {
        bf(&mut m.embed);
        if let Some(w) = m.lm_head.as_mut() {
            bf(w);
        }
        for l in &mut m.layers {
            match &mut l.mixer {
                Mixer::GatedDeltaNet(g) => {
                    bf(&mut g.w_in);
                    bf(&mut g.out);
                }
                Mixer::Lightning(w) => {
                    bf(&mut w.qkv);
                    bf(&mut w.g_proj);
                    bf(&mut w.dense);
                }
                Mixer::Attention(a) => {
                    for w in [&mut a.q, &mut a.k, &mut a.v, &mut a.o] {
                        bf(w);
                    }
                }
                Mixer::Kda(w) => {
                    for x in [&mut w.w_in, &mut w.f_b, &mut w.g_b, &mut w.o_proj] {
                        bf(x);
                    }
                }
                Mixer::Mla(w) => {
                    for x in [&mut w.q, &mut w.kv_a, &mut w.o] {
                        bf(x);
                    }
                    bf(&mut w.w_uk);
                    bf(&mut w.w_uv);
                }
            }
            match &mut l.ffn {
                Ffn::Dense(d) => {
                    bf(&mut d.gate_up);
                    bf(&mut d.down);
                }
                Ffn::Moe(mo) => {
                    bf(&mut mo.router);
                    for e in &mut mo.experts {
                        bf(&mut e.gate_up);
                        bf(&mut e.down);
                    }
                    if let Some((s, g)) = mo.shared.as_mut() {
                        bf(&mut s.gate_up);
                        bf(&mut s.down);
                        bf(g);
                    }
                    if let Some(s) = mo.shared_plain.as_mut() {
                        bf(&mut s.gate_up);
                        bf(&mut s.down);
                    }
                }
            }
        }
    }

    fn logits(m: &Model) -> Vec<f32> {
        let mut st = m.new_state();
        let toks: Vec<u32> = (0..24u32)
            .map(|i| (i * 37 + 5) % m.config.vocab_size as u32)
            .collect();
        m.prefill(&toks, &mut st, Logits::All).unwrap().logits
    }

    #[test]
    fn written_checkpoint_loads_as_the_random_model() {
        for name in [
            "qwen3_5",
            "qwen3_5_moe",
            "qwen3_next",
            "bailing_moe_linear",
            "kimi_linear",
        ] {
            let json = golden_json(name);
            let c = ModelConfig::from_json(&json).unwrap();
            for large in [LargeDtype::F32, LargeDtype::Bf16] {
                let dir = tmp(name);
                // Small shards: several files, tensors of mixed dtypes per file.
                let w = write(&c, &json, &dir, 11, large, 64 << 10, &mut |_, _| {}).unwrap();
                assert!(w.files.len() > 1, "{name}: {} shard(s)", w.files.len());
                assert_eq!(w.bytes, total_bytes(&c, large));
                let loaded = Model::load(&dir, &mut |_, _| {}).unwrap();
                // An f32 checkpoint is used in place; a bf16 one is converted.
                assert_eq!(
                    loaded.embed.is_mapped(),
                    large == LargeDtype::F32,
                    "{name} {large:?}"
                );
                let mut want = Model::random(c.clone(), 11);
                if large == LargeDtype::Bf16 {
                    round_large(&mut want);
                }
                // The weights themselves, then the forward.
                assert_eq!(loaded.embed, want.embed, "{name} {large:?}");
                for (a, b) in loaded.layers.iter().zip(&want.layers) {
                    match (&a.mixer, &b.mixer) {
                        (Mixer::GatedDeltaNet(x), Mixer::GatedDeltaNet(y)) => {
                            assert_eq!(x.w_in, y.w_in, "{name} {large:?} w_in");
                            assert_eq!(x.neg_a, y.neg_a, "{name} {large:?} neg_a");
                            assert_eq!(x.conv, y.conv, "{name} {large:?} conv");
                        }
                        (Mixer::Attention(x), Mixer::Attention(y)) => {
                            assert_eq!(x.q, y.q, "{name} {large:?} q");
                        }
                        (Mixer::Lightning(x), Mixer::Lightning(y)) => {
                            assert_eq!(x.qkv, y.qkv, "{name} {large:?} qkv");
                            assert_eq!(x.q_norm, y.q_norm, "{name} {large:?} q_norm");
                            assert_eq!(x.log_decay, y.log_decay, "{name} {large:?} decay");
                        }
                        (Mixer::Kda(x), Mixer::Kda(y)) => {
                            assert_eq!(x.w_in, y.w_in, "{name} {large:?} w_in");
                            assert_eq!(x.neg_a, y.neg_a, "{name} {large:?} neg_a");
                            assert_eq!(x.conv, y.conv, "{name} {large:?} conv");
                            assert_eq!(x.f_b, y.f_b, "{name} {large:?} f_b");
                        }
                        (Mixer::Mla(x), Mixer::Mla(y)) => {
                            assert_eq!(x.w_uk, y.w_uk, "{name} {large:?} w_uk");
                            assert_eq!(x.w_uv, y.w_uv, "{name} {large:?} w_uv");
                            assert_eq!(x.kv_a, y.kv_a, "{name} {large:?} kv_a");
                        }
                        _ => panic!("{name}: layer kinds differ"),
                    }
                }
                assert_eq!(logits(&loaded), logits(&want), "{name} {large:?} logits");
                // Against the unrounded model, a bf16 checkpoint's logits differ.
                if large == LargeDtype::Bf16 {
                    assert_ne!(
                        logits(&loaded),
                        logits(&Model::random(c.clone(), 11)),
                        "{name}"
                    );
                }
                std::fs::remove_dir_all(&dir).unwrap();
            }
        }
    }

    #[test]
    fn slice_layers_keeps_kimi_layer_lists_consistent() {
        let mut json = golden_json("kimi_linear");
        json.as_object_mut().unwrap().remove("layer_types");
        let s = slice_layers(&json, 2).unwrap();
        let c = ModelConfig::from_json(&s).unwrap();
        assert_eq!(c.mixers, vec![MixerKind::Kda, MixerKind::Kda]);
        assert_eq!(c.layer_is_moe, vec![false, true]);
    }

    #[test]
    fn slice_layers_cuts_types_and_count() {
        let json = golden_json("qwen3_5_moe");
        let s = slice_layers(&json, 2).unwrap();
        let c = ModelConfig::from_json(&s).unwrap();
        assert_eq!(c.num_layers, 2);
        assert_eq!(c.mixers.len(), 2);
        assert!(slice_layers(&json, 0).is_err());
        assert!(slice_layers(&json, 99).is_err());
    }

    /// Each GDN in-projection tensor written for a family maps its rows onto
    /// distinct internal rows, all of them together covering the merged matrix once.
    #[test]
    fn in_proj_tensors_cover_the_merged_rows() {
        for name in ["qwen3_5", "qwen3_next"] {
            let c = ModelConfig::from_json(&golden_json(name)).unwrap();
            let mut rows = vec![];
            for s in specs(&c, LargeDtype::F32).iter().filter(|s| {
                s.name
                    .starts_with(&c.names.mixer(0, MixerKind::GatedDeltaNet))
            }) {
                if let Gen::Sym {
                    rows: map @ RowMap::Table(_),
                    ..
                } = &s.gen
                {
                    rows.extend((0..s.shape[0]).map(|r| map.map(r)));
                }
            }
            rows.sort_unstable();
            assert_eq!(
                rows,
                (0..InProjLayout::merged_rows(&c)).collect::<Vec<_>>(),
                "{name}"
            );
        }
    }
}
