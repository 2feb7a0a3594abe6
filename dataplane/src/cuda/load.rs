//! [`GpuModel::load`]: a checkpoint streamed from its memory-mapped safetensors shards
//! to the device one tensor at a time, in the stored dtype.
//!
//! Per tensor: the bytes are read in place from the mapping ([`Checkpoint::raw`]) and
//! copied to the device; when the stored dtype is the model's (`bf16` checkpoint into a
//! `bf16` model, `f32` into `f32`) they land in the weight buffer directly, otherwise in
//! a device staging buffer of the stored dtype that a kernel of `kernels/init.cu`
//! converts into the weight buffer (`convert_<src>_<dst>`: exact widening, bf16
//! narrowing rounded to nearest-even as the host `half::bf16::from_f32`). Then the
//! tensor's pages are released from the mapping ([`Checkpoint::release`]). The host
//! never holds more than one tensor's pages (plus one tensor copy when a tensor's
//! bytes are not aligned to its element type, or for `F64` tensors), so the peak
//! resident memory is about one tensor, not the model.
//!
//! The small fp32 tensors (norm weights, conv weights, `A_log`, `dt_bias`) go through
//! [`Checkpoint::get`] as on the CPU. Layouts are those of [`GpuModel::upload`]: the
//! GDN in-projection assembled from the Qwen3.5 split tensors (or regrouped on the
//! device from Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba`), `q|k|v` fused, MLP
//! `gate|up` fused, MoE experts as the fused `[E, 2I, hidden]` / `[E, hidden, I]` and
//! the router with the shared-expert gate as row `E` (FFN path [`FfnPath::Fused`]).
//! Tensor names and shapes are checked exactly as [`Model::from_checkpoint`] does,
//! so a checkpoint that loads on one backend loads on the other with the same values
//! (in fp32 bit for bit; in bf16 each large weight is the stored value rounded once).
//!
//! [`Model::from_checkpoint`]: crate::model::Model::from_checkpoint
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::{CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use safetensors::Dtype;

use super::compile::INIT;
use super::kimi::{kda_in_width, kda_width, mla_in_width, KdaW, MlaW};
use super::lightning::LightningW;
use super::model::{check_config, AttnW, FfnPath, FfnW, GdnW, GpuModel, LayerW, MixerW, MlpW};
use super::random::check_moe_config;
use super::{gdr, grid_for, moe, ops, CudaError, CudaSlice, Elem, Gpu, Result};
use crate::config::{AttnProjLayout, InProjLayout, MixerKind, ModelConfig};
use crate::weights::Checkpoint;

/// What a [`GpuModel::load`] read and how long it took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadStats {
    /// Tensors copied to the device.
    pub tensors: usize,
    /// Bytes of those tensors as stored in the checkpoint.
    pub bytes: usize,
    /// Wall time of the load, seconds (until the device finished every copy).
    pub seconds: f64,
}

impl LoadStats {
    /// Bytes read per second, in GB/s (10⁹ bytes).
    pub fn gb_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

fn werr(e: crate::Error) -> CudaError {
    CudaError::Shape(format!("checkpoint: {e}"))
}

fn launch_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_for(n, 256).min(65_535 * 4), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Uninitialised device buffer of `n` elements (at least one); the loader writes
/// every element of `0..n` before the model is returned.
fn alloc<T: Elem>(gpu: &Gpu, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: callers fill `0..n` completely (the tensor puts cover the buffer).
    Ok(unsafe { gpu.stream().alloc::<T>(n.max(1)) }?)
}

/// `bytes` as a slice of `U` (little-endian host): borrowed when aligned, else copied.
fn as_elems<U: Copy + Default>(bytes: &[u8], n: usize) -> std::borrow::Cow<'_, [U]> {
    let w = std::mem::size_of::<U>();
    debug_assert_eq!(bytes.len(), n * w);
    if (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<U>()) {
        // SAFETY: aligned, `n · size_of::<U>()` bytes in bounds, and `U` is one of
        // u16 / f32 / bf16 (every bit pattern valid) on a little-endian host.
        std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), n) })
    } else {
        let mut v = vec![U::default(); n];
        // SAFETY: `v` holds exactly `bytes.len()` bytes; the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes.len())
        };
        std::borrow::Cow::Owned(v)
    }
}

struct Loader<'a> {
    gpu: &'a Gpu,
    ckpt: &'a Checkpoint,
    stats: LoadStats,
}

impl Loader<'_> {
    /// Copies tensor `name` (shape `shape`) into `dst[off .. off + n]`, converting on
    /// the device when its stored dtype is not `T`.
    fn put<T: Elem>(
        &mut self,
        name: &str,
        shape: &[usize],
        dst: &mut CudaSlice<T>,
        off: usize,
    ) -> Result<()> {
        let n: usize = shape.iter().product();
        if off + n > dst.len() {
            return Err(CudaError::Shape(format!(
                "tensor `{name}`: {off} + {n} elements exceed the weight buffer of {}",
                dst.len()
            )));
        }
        let raw = self.ckpt.raw(name, shape).map_err(werr)?;
        self.stats.tensors += 1;
        self.stats.bytes += raw.bytes.len();
        if n > 0 {
            let mut view = dst.slice_mut(off..off + n);
            self.copy_raw(name, raw.dtype, raw.bytes, n, &mut view)?;
        }
        self.ckpt.release(name);
        Ok(())
    }

    fn copy_raw<T: Elem>(
        &self,
        name: &str,
        dtype: Dtype,
        bytes: &[u8],
        n: usize,
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let s = self.gpu.stream();
        let t = std::any::TypeId::of::<T>();
        let is_f32 = t == std::any::TypeId::of::<f32>();
        let same = (dtype == Dtype::F32 && is_f32)
            || (dtype == Dtype::BF16 && t == std::any::TypeId::of::<half::bf16>());
        if same {
            s.memcpy_htod(&*as_elems::<T>(bytes, n), dst)?;
            return Ok(());
        }
        match dtype {
            Dtype::BF16 | Dtype::F16 => {
                let src = self.stage::<u16>(&as_elems::<u16>(bytes, n))?;
                let kind = if dtype == Dtype::BF16 { "bf16" } else { "f16" };
                self.convert(&format!("convert_{kind}_{}", T::SUFFIX), &src, dst, n)
            }
            Dtype::F32 => {
                let src = self.stage::<f32>(&as_elems::<f32>(bytes, n))?;
                self.convert(&format!("convert_f32_{}", T::SUFFIX), &src, dst, n)
            }
            Dtype::F64 => {
                let v: Vec<f32> = bytes
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8-byte chunk")) as f32)
                    .collect();
                if is_f32 {
                    // SAFETY: T is f32 here (checked by TypeId).
                    let v: &[T] = unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), n) };
                    s.memcpy_htod(v, dst)?;
                    return Ok(());
                }
                let src = self.stage::<f32>(&v)?;
                self.convert(&format!("convert_f32_{}", T::SUFFIX), &src, dst, n)
            }
            d => Err(CudaError::Shape(format!(
                "tensor `{name}`: dtype {d:?} is not supported (F32, F64, BF16, F16)"
            ))),
        }
    }

    /// A device staging copy of `v` (freed stream-ordered when dropped, after the
    /// conversion kernel that reads it).
    fn stage<U: DeviceRepr>(&self, v: &[U]) -> Result<CudaSlice<U>> {
        self.gpu.upload(v)
    }

    fn convert<S, T: Elem>(
        &self,
        kernel: &str,
        src: &CudaSlice<S>,
        dst: &mut CudaViewMut<'_, T>,
        n: usize,
    ) -> Result<()> {
        let f = self.gpu.function(&INIT, kernel, 0)?;
        let ni = n as i64;
        let mut b = self.gpu.stream().launch_builder(&f);
        b.arg(src).arg(dst).arg(&ni);
        // SAFETY: matches `convert_*` in init.cu (src: n stored elements, dst: n
        // elements of T).
        unsafe { b.launch(launch_cfg(n)) }?;
        Ok(())
    }

    /// A new buffer holding tensor `name` in `T`.
    fn tensor<T: Elem>(&mut self, name: &str, shape: &[usize]) -> Result<CudaSlice<T>> {
        let mut x = alloc::<T>(self.gpu, shape.iter().product())?;
        self.put(name, shape, &mut x, 0)?;
        Ok(x)
    }

    /// A small fp32 tensor through the host (as the CPU loader reads it).
    fn small(&mut self, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>> {
        let v = self.ckpt.get(name, shape).map_err(werr)?;
        self.stats.tensors += 1;
        self.stats.bytes += self
            .ckpt
            .raw(name, shape)
            .map(|r| r.bytes.len())
            .unwrap_or(0);
        self.upload_f32(&v)
    }

    /// An RMSNorm weight through the host, brought to the model's zero-centred form
    /// (`ModelConfig::norm_weight`: `w − 1` for a family with plain norms).
    fn norm(&mut self, c: &ModelConfig, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>> {
        let v = c.norm_weight(self.ckpt.get(name, shape).map_err(werr)?);
        self.stats.tensors += 1;
        self.stats.bytes += self
            .ckpt
            .raw(name, shape)
            .map(|r| r.bytes.len())
            .unwrap_or(0);
        self.upload_f32(&v)
    }

    fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        if v.is_empty() {
            return self.gpu.zeros(1);
        }
        self.gpu.upload(v)
    }

    /// MLP `gate_proj` + `up_proj` into one `[2I, hidden]` buffer and `down_proj`.
    fn mlp<T: Elem>(&mut self, p: &str, h: usize, inter: usize) -> Result<MlpW<T>> {
        self.mlp_named(
            p,
            h,
            inter,
            ["gate_proj.weight", "up_proj.weight", "down_proj.weight"],
        )
    }

    /// [`Loader::mlp`] with the family's names of the gate, up and down projections.
    fn mlp_named<T: Elem>(
        &mut self,
        p: &str,
        h: usize,
        inter: usize,
        [gate, up, down]: [&str; 3],
    ) -> Result<MlpW<T>> {
        let mut gate_up = alloc::<T>(self.gpu, 2 * inter * h)?;
        self.put(&format!("{p}{gate}"), &[inter, h], &mut gate_up, 0)?;
        self.put(&format!("{p}{up}"), &[inter, h], &mut gate_up, inter * h)?;
        Ok(MlpW {
            gate_up,
            down: self.tensor(&format!("{p}{down}"), &[h, inter])?,
            inter,
        })
    }

    /// A Lightning layer (`layer` `l`, mixer prefix `p`): `query_key_value` and
    /// `g_proj` into one `[4W, hidden]` buffer, q/k norms zero-centred, `g_norm` as
    /// stored, `dense`, the layer's log decays.
    fn lightning<T: Elem>(&mut self, c: &ModelConfig, p: &str, l: usize) -> Result<LightningW<T>> {
        let (h, d) = (c.hidden_size, c.linear_k_dim);
        let wd = c.linear_v_heads * d;
        let mut w_in = alloc::<T>(self.gpu, 4 * wd * h)?;
        self.put(
            &format!("{p}query_key_value.weight"),
            &[3 * wd, h],
            &mut w_in,
            0,
        )?;
        self.put(
            &format!("{p}g_proj.weight"),
            &[wd, h],
            &mut w_in,
            3 * wd * h,
        )?;
        let log_decay = crate::mixers::lightning::layer::layer_log_decay(c, l);
        Ok(LightningW {
            w_in,
            q_norm: self.norm(c, &format!("{p}query_layernorm.weight"), &[d])?,
            k_norm: self.norm(c, &format!("{p}key_layernorm.weight"), &[d])?,
            g_norm: self.small(&format!("{p}g_norm.weight"), &[wd])?,
            dense: self.tensor(&format!("{p}dense.weight"), &[h, wd])?,
            log_decay: self.upload_f32(&log_decay)?,
            log_decay_host: log_decay,
        })
    }

    fn gdn<T: Elem>(&mut self, c: &ModelConfig, p: &str) -> Result<GdnW<T>> {
        let h = c.hidden_size;
        let (hv, dv, vd) = (c.linear_v_heads, c.linear_v_dim, c.value_dim());
        let rows = InProjLayout::merged_rows(c);
        let mut w_in = alloc::<T>(self.gpu, rows * h)?;
        let layout = c.gdn_in_proj.resolve(|n| self.ckpt.contains(n), p);
        let tensors = layout.tensors(c);
        if layout.is_concatenation(c) {
            // Each tensor is the next block of rows: placed directly.
            let mut at = 0;
            for t in &tensors {
                self.put(&format!("{p}{}", t.name), &[t.rows, h], &mut w_in, at * h)?;
                at += t.rows;
            }
        } else {
            // Row blocks of several tensors (Qwen3-Next's per-key-head groups):
            // uploaded whole, then regrouped on the device in merged-row order (as
            // the CPU loader, `mixers::gated_deltanet::layer::load`).
            let src = tensors
                .iter()
                .map(|t| self.tensor::<T>(&format!("{p}{}", t.name), &[t.rows, h]))
                .collect::<Result<Vec<_>>>()?;
            let s = self.gpu.stream();
            let mut at = 0usize;
            for blk in layout.blocks(c) {
                let (a, n) = (blk.src_row * h, blk.rows * h);
                s.memcpy_dtod(
                    &src[blk.tensor].slice(a..a + n),
                    &mut w_in.slice_mut(at..at + n),
                )?;
                at += n;
            }
            debug_assert_eq!(at, rows * h);
        }
        let neg_a = self.ckpt.neg_a(&format!("{p}A_log"), hv).map_err(werr)?;
        self.stats.tensors += 1;
        self.stats.bytes += self
            .ckpt
            .raw(&format!("{p}A_log"), &[hv])
            .map(|r| r.bytes.len())
            .unwrap_or(0);
        Ok(GdnW {
            w_in,
            conv: self.small(
                &format!("{p}conv1d.weight"),
                &[c.conv_dim(), 1, c.conv_kernel],
            )?,
            neg_a: self.upload_f32(&neg_a)?,
            dt_bias: self.small(&format!("{p}dt_bias"), &[hv])?,
            norm: self.small(&format!("{p}norm.weight"), &[dv])?,
            out: self.tensor(&format!("{p}out_proj.weight"), &[h, vd])?,
        })
    }

    /// A KDA layer (the release layout, as `mixers::kda::layer::load` reads it): the
    /// six input projections placed as the rows of one merged in-projection.
    fn kda<T: Elem>(&mut self, c: &ModelConfig, p: &str) -> Result<KdaW<T>> {
        let (h, nh, d) = (c.hidden_size, c.linear_v_heads, c.linear_k_dim);
        let wd = kda_width(c);
        let mut w_in = alloc::<T>(self.gpu, kda_in_width(c) * h)?;
        let mut at = 0;
        for (name, rows) in [
            ("q_proj", wd),
            ("k_proj", wd),
            ("v_proj", wd),
            ("f_a_proj", d),
            ("g_a_proj", d),
            ("b_proj", nh),
        ] {
            self.put(&format!("{p}{name}.weight"), &[rows, h], &mut w_in, at * h)?;
            at += rows;
        }
        let mut conv = Vec::with_capacity(3 * wd * c.conv_kernel);
        for name in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            let shape = [wd, 1, c.conv_kernel];
            conv.extend(
                self.ckpt
                    .get(&format!("{p}{name}.weight"), &shape)
                    .map_err(werr)?,
            );
            self.stats.tensors += 1;
            self.stats.bytes += 4 * wd * c.conv_kernel;
        }
        let neg_a = self
            .ckpt
            .neg_a_shaped(&format!("{p}A_log"), &[1, 1, nh, 1])
            .map_err(werr)?;
        self.stats.tensors += 1;
        Ok(KdaW {
            w_in,
            f_b: self.tensor(&format!("{p}f_b_proj.weight"), &[wd, d])?,
            g_b: self.tensor(&format!("{p}g_b_proj.weight"), &[wd, d])?,
            conv: self.upload_f32(&conv)?,
            neg_a: self.upload_f32(&neg_a)?,
            dt_bias: self.small(&format!("{p}dt_bias"), &[wd])?,
            o_norm: self.small(&format!("{p}o_norm.weight"), &[d])?,
            o_proj: self.tensor(&format!("{p}o_proj.weight"), &[h, wd])?,
        })
    }

    /// An MLA layer (as `mixers::mla::load` reads it): `q_proj` and
    /// `kv_a_proj_with_mqa` as the rows of one in-projection, `kv_b_proj` split per
    /// head into the key and value expansions on the device.
    fn mla<T: Elem>(&mut self, c: &ModelConfig, p: &str) -> Result<MlaW<T>> {
        let m = c.mla;
        let (h, nh, r) = (c.hidden_size, c.num_heads, m.kv_lora_rank);
        let (nope, vd) = (m.qk_nope_head_dim, m.v_head_dim);
        if self.ckpt.contains(&format!("{p}q_a_proj.weight")) {
            return Err(CudaError::Shape(format!(
                "{p}q_a_proj.weight: a low-rank MLA query is not supported"
            )));
        }
        let qw = nh * m.qk_head_dim();
        let mut w_in = alloc::<T>(self.gpu, mla_in_width(c) * h)?;
        self.put(&format!("{p}q_proj.weight"), &[qw, h], &mut w_in, 0)?;
        self.put(
            &format!("{p}kv_a_proj_with_mqa.weight"),
            &[m.row(), h],
            &mut w_in,
            qw * h,
        )?;
        let kv_b = self.tensor::<T>(&format!("{p}kv_b_proj.weight"), &[nh * (nope + vd), r])?;
        let mut w_uk = alloc::<T>(self.gpu, nh * nope * r)?;
        let mut w_uv = alloc::<T>(self.gpu, nh * vd * r)?;
        let s = self.gpu.stream();
        for hd in 0..nh {
            let a = hd * (nope + vd) * r;
            s.memcpy_dtod(
                &kv_b.slice(a..a + nope * r),
                &mut w_uk.slice_mut(hd * nope * r..(hd + 1) * nope * r),
            )?;
            s.memcpy_dtod(
                &kv_b.slice(a + nope * r..a + (nope + vd) * r),
                &mut w_uv.slice_mut(hd * vd * r..(hd + 1) * vd * r),
            )?;
        }
        Ok(MlaW {
            w_in,
            kv_norm: self.small(&format!("{p}kv_a_layernorm.weight"), &[r])?,
            w_uk,
            w_uv,
            o: self.tensor(&format!("{p}o_proj.weight"), &[h, nh * vd])?,
        })
    }

    fn attn<T: Elem>(&mut self, c: &ModelConfig, p: &str) -> Result<AttnW<T>> {
        let (h, nh, nkv, hd) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
        let qw = nh * hd * if c.attn_output_gate { 2 } else { 1 };
        let kvw = nkv * hd;
        if c.attn_proj == AttnProjLayout::FusedQkv {
            // One `query_key_value` with rows q | k | v: the fused layout as stored.
            return Ok(AttnW {
                qkv: self.tensor(&format!("{p}query_key_value.weight"), &[qw + 2 * kvw, h])?,
                o: self.tensor(&format!("{p}dense.weight"), &[h, nh * hd])?,
                q_norm: self.norm(c, &format!("{p}query_layernorm.weight"), &[hd])?,
                k_norm: self.norm(c, &format!("{p}key_layernorm.weight"), &[hd])?,
            });
        }
        let mut qkv = alloc::<T>(self.gpu, (qw + 2 * kvw) * h)?;
        self.put(&format!("{p}q_proj.weight"), &[qw, h], &mut qkv, 0)?;
        self.put(&format!("{p}k_proj.weight"), &[kvw, h], &mut qkv, qw * h)?;
        self.put(
            &format!("{p}v_proj.weight"),
            &[kvw, h],
            &mut qkv,
            (qw + kvw) * h,
        )?;
        Ok(AttnW {
            qkv,
            o: self.tensor(&format!("{p}o_proj.weight"), &[h, nh * hd])?,
            q_norm: self.norm(c, &format!("{p}q_norm.weight"), &[hd])?,
            k_norm: self.norm(c, &format!("{p}k_norm.weight"), &[hd])?,
        })
    }

    fn moe<T: Elem>(&mut self, c: &ModelConfig, p: &str) -> Result<moe::MoeWeights<T>> {
        let (h, e, i, si) = (
            c.hidden_size,
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        // Router rows [E, H], plus the shared-expert gate as row E when it is gated.
        let gate = c.names.shared_expert_gate;
        let mut router = alloc::<T>(self.gpu, (e + usize::from(si > 0 && gate.is_some())) * h)?;
        self.put(&format!("{p}gate.weight"), &[e, h], &mut router, 0)?;
        let fused = format!("{p}experts.gate_up_proj");
        let (gate_up, down) = if self.ckpt.contains(&fused) {
            (
                self.tensor::<T>(&fused, &[e, 2 * i, h])?,
                self.tensor::<T>(&format!("{p}experts.down_proj"), &[e, h, i])?,
            )
        } else {
            let mut gu = alloc::<T>(self.gpu, e * 2 * i * h)?;
            let mut dn = alloc::<T>(self.gpu, e * h * i)?;
            let [gn, un, dname] = c.names.expert_proj;
            for j in 0..e {
                let q = format!("{p}experts.{j}.");
                let o = j * 2 * i * h;
                self.put(&format!("{q}{gn}"), &[i, h], &mut gu, o)?;
                self.put(&format!("{q}{un}"), &[i, h], &mut gu, o + i * h)?;
                self.put(&format!("{q}{dname}"), &[h, i], &mut dn, j * h * i)?;
            }
            (gu, dn)
        };
        let shared = if si > 0 {
            if let Some(g) = gate {
                self.put(&format!("{p}{g}"), &[1, h], &mut router, e * h)?;
            }
            let m = self.mlp::<T>(&format!("{p}{}", c.names.shared_expert), h, si)?;
            Some((m.gate_up, m.down))
        } else {
            None
        };
        let rule = if moe::DeviceRouter::needed(&c.router) {
            let bias = match c.router.selection_bias {
                Some(b) => {
                    let name = format!("{p}{b}");
                    let v = self.ckpt.get(&name, &[e]).map_err(werr)?;
                    self.stats.tensors += 1;
                    Some(v)
                }
                None => None,
            };
            Some(moe::DeviceRouter::upload(
                self.gpu,
                &c.router,
                bias.as_deref(),
                e,
                c.experts_per_tok,
            )?)
        } else {
            None
        };
        Ok(moe::MoeWeights {
            hidden: h,
            inter: i,
            shared_inter: si,
            num_experts: e,
            top_k: c.experts_per_tok,
            norm_topk_prob: c.norm_topk_prob,
            router,
            gate_up,
            down,
            shared,
            shared_gated: gate.is_some(),
            rule,
        })
    }
}

impl<T: Elem> GpuModel<T>
where
    CudaBlas: Gemm<T>,
{
    /// Loads the checkpoint `ckpt` of shape `config` straight to `gpu`, one tensor at a
    /// time in its stored dtype (see the module docs), reporting progress per layer
    /// through `progress(done, total)` as [`crate::model::Model::load`]. FFN path
    /// [`FfnPath::Fused`].
    ///
    /// Errors: [`CudaError::Shape`] for a configuration the kernels do not support (as
    /// [`GpuModel::random`]), and for a missing tensor, a wrong shape or an unsupported
    /// dtype (the message names the tensor); driver errors (e.g. out of device memory).
    pub fn load(
        gpu: Arc<Gpu>,
        config: ModelConfig,
        ckpt: &Checkpoint,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Self, LoadStats)> {
        let t0 = Instant::now();
        let c = config;
        check_config(&c)?;
        check_moe_config(&c)?;
        let g = &*gpu;
        let mut ld = Loader {
            gpu: g,
            ckpt,
            stats: LoadStats::default(),
        };
        let n = c.names.clone();
        let h = c.hidden_size;
        let total = c.num_layers + 2;
        progress(0, total);
        let embed = ld.tensor::<T>(&n.embed_tokens(), &[c.vocab_size, h])?;
        let final_norm = ld.norm(&c, &n.norm(), &[h])?;
        let lm_head = if c.tie_word_embeddings && !ckpt.contains(n.lm_head) {
            None
        } else {
            Some(ld.tensor::<T>(n.lm_head, &[c.vocab_size, h])?)
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let kind = c.mixers[l];
            let mp = n.mixer(l, kind);
            let mixer = match kind {
                MixerKind::GatedDeltaNet => MixerW::GatedDeltaNet(ld.gdn(&c, &mp)?),
                MixerKind::Attention => MixerW::Attention(ld.attn(&c, &mp)?),
                MixerKind::Lightning => MixerW::Lightning(ld.lightning(&c, &mp, l)?),
                MixerKind::Kda => MixerW::Kda(ld.kda(&c, &mp)?),
                MixerKind::Mla => MixerW::Mla(ld.mla(&c, &mp)?),
            };
            let ffn = if c.layer_is_moe[l] {
                FfnW::MoeFused(ld.moe(&c, &n.mlp(l))?)
            } else {
                FfnW::Dense(ld.mlp(&n.mlp(l), h, c.intermediate_size)?)
            };
            layers.push(LayerW {
                input_norm: ld.norm(&c, &n.input_layernorm(l), &[h])?,
                post_norm: ld.norm(&c, &n.post_layernorm(l), &[h])?,
                mixer,
                ffn,
            });
            progress(l + 2, total);
        }
        let inv_freq = if c.rotary_dim >= 2 {
            Some(g.upload(&ops::rope_inv_freq(c.rotary_dim, c.rope_theta))?)
        } else {
            None
        };
        gpu.sync()?;
        progress(total, total);
        let mut stats = ld.stats;
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok((
            GpuModel {
                gpu,
                config: c,
                embed,
                final_norm,
                lm_head,
                layers,
                inv_freq,
                gdr_ws: Mutex::new(gdr::Workspace::new()),
                moe_ws: Mutex::new(moe::MoeWorkspace::new()),
                graphs: super::graph::DecodeGraphs::default(),
                ffn_path: FfnPath::Fused,
            },
            stats,
        ))
    }
}
