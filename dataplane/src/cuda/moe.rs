//! Feed-forward blocks on the GPU: the sparse mixture-of-experts block of Qwen3-Next /
//! Qwen3.5 ([`moe_forward`]), the dense SwiGLU MLP ([`mlp_forward`]) and SwiGLU itself
//! ([`swiglu`]). Kernels: `dataplane/kernels/moe.cu`. CPU reference: `model::moe_forward`
//! and `model::mlp_forward` (softmax router, top-k with ties to the lower expert index,
//! optional renormalisation `norm_topk_prob`, shared expert scaled by a sigmoid gate).
//!
//! MoE pipeline (all on the device, no host round trip):
//! 1. router GEMM through cuBLAS with fp32 output (`[t, E]`, plus one column for the
//!    shared-expert gate logit when there is a shared expert);
//! 2. `moe_route`: fp32 softmax + top-k per token (the Qwen rule); or, for a family
//!    with another [`RouterConfig`] (sigmoid scores, selection bias, grouped top-k,
//!    scaling: Ring-linear, Kimi-Linear), `moe_route_rule` ([`DeviceRouter`]);
//! 3. `moe_plan`: per-expert counts and offsets, the tile list of the grouped GEMMs and
//!    the permutation of the `t·k` routed rows grouped by expert (within an expert in
//!    token order; deterministic, integer work only);
//! 4. `moe_gemm_gu` (or `moe_gemv_gu`): one grouped-GEMM launch for every expert's
//!    `gate_up` projection of its gathered rows, SwiGLU fused in the epilogue
//!    (activations stored as `T`);
//! 5. `moe_gemm_down` (or `moe_gemv_down`): one launch for every expert's `down`
//!    projection (fp32 output);
//! 6. shared expert: dense SwiGLU MLP through cuBLAS;
//! 7. `moe_combine`: per token, `Σ_j w_j · y_j` in slot order plus `σ(g) · shared`
//!    (or `shared` ungated, [`MoeWeights::shared_gated`]), no atomics: bitwise
//!    reproducible run to run.
//!
//! All GEMMs accumulate in fp32. Expert GEMM kernels ([`ExpertGemm`], chosen by
//! [`expert_gemm`]): for few routed rows (decode) a GEMV-style kernel, one block per
//! routed row streaming the expert's weight rows with 16-byte loads; otherwise grouped
//! GEMMs, on tensor cores for bf16 when `hidden` and `inter` are multiples of 32
//! (`mma.sync.m16n8k16` from PTX: by default 128×128×32 tiles over 8 warps with a
//! 3-stage `cp.async` ring, [`ExpertGemm::TensorCoresLarge`]; the earlier 64×64×32 kernel
//! with register prefetch, [`ExpertGemm::TensorCores`], when forced), else a
//! shared-memory tiled fp32-FMA kernel (64×64×16 tiles, 4×4 per thread).
//! Their reference, [`ExpertGemm::PerExpert`] (forced only), runs one cuBLAS GEMM per
//! expert and projection over the same sorted rows.
use std::any::Any;
use std::collections::HashMap;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::compile::MOE;
use super::{check_len, grid_for, CudaError, CudaSlice, Elem, Gpu, Result};
use crate::router::{RouterConfig, ScoreFunction};

/// Rows per tile of the grouped GEMMs (`GBM` in moe.cu).
const GBM: usize = 64;
/// Columns per tile of the grouped GEMMs (`GBN` in moe.cu).
const GBN: usize = 64;
/// Rows per tile of the large-tile tensor-core kernels (`LBM` in moe.cu).
const LBM: usize = 128;
/// Columns per tile of the large-tile tensor-core kernels (`LBN` in moe.cu).
const LBN: usize = 128;
/// Dynamic shared memory of the large-tile kernels: `LSTAGES · (LBM + LBN) · LLD` bf16
/// (3 stages, row stride 40).
const TCL_SMEM_BYTES: u32 = (3 * (LBM + LBN) * 40 * 2) as u32;
/// Warps per block of the small-batch kernels (`GV_WARPS` in moe.cu).
const GV_WARPS: u32 = 8;
/// Gate/up column pairs per warp of `moe_gemv_gu_*` (`GV_COLS_GU` in moe.cu).
const GV_COLS_GU: usize = 2;
/// Output columns per warp of `moe_gemv_down_*` (`GV_COLS_DN` in moe.cu).
const GV_COLS_DN: usize = 4;
/// Largest expert count `moe_route` handles (32 lanes × `MOE_EPL`).
pub const MAX_EXPERTS: usize = 512;
/// Largest `top_k` `moe_route` handles (one lane per chosen expert).
pub const MAX_TOP_K: usize = 32;
/// Largest `n_group` `moe_route_rule` handles (one lane per group).
pub const MAX_GROUPS: usize = 32;

/// A routing rule other than the Qwen softmax top-k, on the device: the family's
/// [`RouterConfig`] (score function, grouped top-k with `n_group` / `topk_group` and
/// `dropped_group_score`, `renorm_single`, `routed_scaling_factor`) and its selection
/// bias `[E]` fp32 (`RouterConfig::selection_bias`: Ring-linear `gate.expert_bias`,
/// Kimi-Linear `gate.e_score_correction_bias`). Kernel `moe_route_rule` (moe.cu); the
/// same decisions as [`RouterConfig::route`] (ties to the lower index), weights to fp32
/// rounding (device `expf`).
pub struct DeviceRouter {
    /// The rule.
    pub config: RouterConfig,
    /// Selection bias `[E]`, or `None` (no bias).
    pub bias: Option<CudaSlice<f32>>,
}

impl DeviceRouter {
    /// Uploads `bias` (`[E]`, when given) for the rule `config` over `num_experts`
    /// experts and `top_k` choices.
    ///
    /// Errors: [`CudaError::Shape`] when the grouping does not fit
    /// ([`RouterConfig::check`], at most [`MAX_GROUPS`] groups) or the bias is not `[E]`.
    pub fn upload(
        gpu: &Gpu,
        config: &RouterConfig,
        bias: Option<&[f32]>,
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self> {
        config
            .check(num_experts, top_k)
            .map_err(|(k, m)| shape_err(format!("router `{k}`: {m}")))?;
        if config.n_group > MAX_GROUPS {
            return Err(shape_err(format!(
                "router with {} expert groups (supported: 1..={MAX_GROUPS})",
                config.n_group
            )));
        }
        let bias = match bias {
            Some(b) => {
                check_host("router bias", b, num_experts)?;
                Some(gpu.upload(b)?)
            }
            None => None,
        };
        Ok(DeviceRouter {
            config: config.clone(),
            bias,
        })
    }

    /// Whether `config` needs a [`DeviceRouter`] (anything but the default softmax
    /// rule, which `moe_route` runs).
    pub fn needed(config: &RouterConfig) -> bool {
        *config != RouterConfig::default()
    }
}

/// Host weights of a shared expert for [`MoeWeights::upload_with_router`].
#[derive(Clone, Copy, Debug)]
pub struct SharedExpertHost<'a> {
    /// `[2·Is, hidden]`, gate rows then up rows.
    pub gate_up: &'a [f32],
    /// `[hidden, Is]`.
    pub down: &'a [f32],
    /// Sigmoid gate `[1, hidden]` (Qwen), or `None`: the output is added ungated
    /// (Ring-linear, Kimi-Linear).
    pub gate: Option<&'a [f32]>,
}

/// MoE weights on the device, in the element type `T` of the activations.
///
/// Layouts (row-major, HF `nn.Linear` orientation, `H` = hidden, `I` = expert
/// intermediate, `Is` = shared intermediate):
/// * `router`: `[E, H]`, or `[E + 1, H]` with the shared-expert gate (`[1, H]`) as row `E`
///   when there is a shared expert (one GEMM yields both);
/// * `gate_up`: `[E, 2I, H]` (per expert gate rows then up rows, as the fused HF
///   `experts.gate_up_proj`);
/// * `down`: `[E, H, I]`;
/// * `shared`: `(gate_up [2Is, H], down [H, Is])`.
pub struct MoeWeights<T> {
    /// Hidden size `H`.
    pub hidden: usize,
    /// Expert intermediate size `I`.
    pub inter: usize,
    /// Shared-expert intermediate size `Is` (0 without a shared expert).
    pub shared_inter: usize,
    /// Number of routed experts `E`.
    pub num_experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Whether the top-k probabilities are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Router (+ shared gate row), `[E (+1), H]`.
    pub router: CudaSlice<T>,
    /// Stacked expert gate/up projections, `[E, 2I, H]`.
    pub gate_up: CudaSlice<T>,
    /// Stacked expert down projections, `[E, H, I]`.
    pub down: CudaSlice<T>,
    /// Shared expert `(gate_up [2Is, H], down [H, Is])`.
    pub shared: Option<(CudaSlice<T>, CudaSlice<T>)>,
    /// Whether the shared expert's output is scaled by `σ(x·gateᵀ)` (its gate logit is
    /// row `E` of `router`); false: added as is (no gate row).
    pub shared_gated: bool,
    /// The routing rule when it is not the Qwen softmax top-k (`None`: `moe_route`).
    pub rule: Option<DeviceRouter>,
}

fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(msg)
}

fn check_host(name: &str, x: &[f32], need: usize) -> Result<()> {
    if x.len() != need {
        return Err(shape_err(format!(
            "`{name}` holds {} values, expected {need}",
            x.len()
        )));
    }
    Ok(())
}

impl<T: Elem> MoeWeights<T> {
    /// Uploads fp32 host weights (converted to `T`, round to nearest).
    ///
    /// * `router`: `[E, hidden]` (E = `experts_gate_up.len()`);
    /// * `experts_gate_up[e]`: `[2·inter, hidden]`, gate rows then up rows;
    /// * `experts_down[e]`: `[hidden, inter]`;
    /// * `shared`: `(gate_up [2·shared_inter, hidden], down [hidden, shared_inter],
    ///   gate [1, hidden])`.
    ///
    /// Errors: [`CudaError::Shape`] for inconsistent lengths, `E` of 0 or over
    /// [`MAX_EXPERTS`], `top_k` of 0 or over `min(E, MAX_TOP_K)`.
    #[allow(clippy::too_many_arguments)]
    pub fn upload(
        gpu: &Gpu,
        router: &[f32],
        experts_gate_up: &[&[f32]],
        experts_down: &[&[f32]],
        shared: Option<(&[f32], &[f32], &[f32])>,
        hidden: usize,
        inter: usize,
        shared_inter: usize,
        top_k: usize,
        norm_topk_prob: bool,
    ) -> Result<Self> {
        Self::upload_with_router(
            gpu,
            router,
            &RouterConfig::default(),
            None,
            experts_gate_up,
            experts_down,
            shared.map(|(gate_up, down, gate)| SharedExpertHost {
                gate_up,
                down,
                gate: Some(gate),
            }),
            hidden,
            inter,
            shared_inter,
            top_k,
            norm_topk_prob,
        )
    }

    /// [`MoeWeights::upload`] with any routing rule (`rule`, its selection bias
    /// `bias [E]`; see [`DeviceRouter`]) and a gated or ungated shared expert.
    ///
    /// Errors: as [`MoeWeights::upload`], and [`DeviceRouter::upload`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn upload_with_router(
        gpu: &Gpu,
        router: &[f32],
        rule: &RouterConfig,
        bias: Option<&[f32]>,
        experts_gate_up: &[&[f32]],
        experts_down: &[&[f32]],
        shared: Option<SharedExpertHost<'_>>,
        hidden: usize,
        inter: usize,
        shared_inter: usize,
        top_k: usize,
        norm_topk_prob: bool,
    ) -> Result<Self> {
        let e = experts_gate_up.len();
        if e == 0 || e > MAX_EXPERTS {
            return Err(shape_err(format!(
                "MoE with {e} experts (supported: 1..={MAX_EXPERTS})"
            )));
        }
        if experts_down.len() != e {
            return Err(shape_err(format!(
                "{e} gate_up matrices but {} down matrices",
                experts_down.len()
            )));
        }
        if top_k == 0 || top_k > e.min(MAX_TOP_K) {
            return Err(shape_err(format!(
                "top_k {top_k} with {e} experts (supported: 1..={})",
                e.min(MAX_TOP_K)
            )));
        }
        if hidden == 0 || inter == 0 {
            return Err(shape_err(format!(
                "MoE hidden {hidden}, inter {inter}: both must be positive"
            )));
        }
        check_host("router", router, e * hidden)?;
        let mut r: Vec<T> = router.iter().map(|&a| T::from_f32(a)).collect();
        let mut gu: Vec<T> = Vec::with_capacity(e * 2 * inter * hidden);
        let mut dn: Vec<T> = Vec::with_capacity(e * hidden * inter);
        for (j, (g, d)) in experts_gate_up.iter().zip(experts_down).enumerate() {
            check_host(&format!("experts_gate_up[{j}]"), g, 2 * inter * hidden)?;
            check_host(&format!("experts_down[{j}]"), d, hidden * inter)?;
            gu.extend(g.iter().map(|&a| T::from_f32(a)));
            dn.extend(d.iter().map(|&a| T::from_f32(a)));
        }
        let shared_gated = shared.is_some_and(|s| s.gate.is_some());
        let shared = match shared {
            None => None,
            Some(sh) => {
                if shared_inter == 0 {
                    return Err(shape_err("shared expert given with shared_inter 0".into()));
                }
                check_host("shared gate_up", sh.gate_up, 2 * shared_inter * hidden)?;
                check_host("shared down", sh.down, hidden * shared_inter)?;
                if let Some(sg) = sh.gate {
                    check_host("shared gate", sg, hidden)?;
                    r.extend(sg.iter().map(|&a| T::from_f32(a)));
                }
                let a: Vec<T> = sh.gate_up.iter().map(|&a| T::from_f32(a)).collect();
                let b: Vec<T> = sh.down.iter().map(|&a| T::from_f32(a)).collect();
                Some((gpu.upload(&a)?, gpu.upload(&b)?))
            }
        };
        let rule = if DeviceRouter::needed(rule) {
            Some(DeviceRouter::upload(gpu, rule, bias, e, top_k)?)
        } else {
            None
        };
        Ok(MoeWeights {
            hidden,
            inter,
            shared_inter: if shared.is_some() { shared_inter } else { 0 },
            num_experts: e,
            top_k,
            norm_topk_prob,
            router: gpu.upload(&r)?,
            gate_up: gpu.upload(&gu)?,
            down: gpu.upload(&dn)?,
            shared,
            shared_gated,
            rule,
        })
    }

    /// Columns of the router GEMM output (`E`, or `E + 1` with a gated shared expert).
    fn router_rows(&self) -> usize {
        self.num_experts + usize::from(self.shared.is_some() && self.shared_gated)
    }
}

/// Device scratch of [`moe_forward`], grown on demand (to the next power of two) and
/// reused across calls; one per stream/thread. For `n = t · top_k` routed rows it holds
/// about `n · (4·hidden + size_of::<T>()·inter + 16) + t · 4·(E + 1)` bytes (the fp32
/// expert outputs dominate: 256 MiB at t = 4096, top-8, hidden 2048) plus, with a shared
/// expert, `t · size_of::<T>() · (3·Is + hidden)`.
#[derive(Default)]
pub struct MoeWorkspace {
    bufs: HashMap<(&'static str, std::any::TypeId), Box<dyn Any + Send + Sync>>,
    bytes: usize,
    forced: Option<ExpertGemm>,
}

impl std::fmt::Debug for MoeWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeWorkspace")
            .field("buffers", &self.bufs.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl MoeWorkspace {
    /// An empty workspace (allocated on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes currently allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Forces an expert-GEMM kernel (`None`: automatic, the default). A forced kernel
    /// the shapes do not allow is ignored (see [`expert_gemm`]). For tests and benches.
    pub fn force_expert_gemm(&mut self, path: Option<ExpertGemm>) {
        self.forced = path;
    }

    /// The forced expert-GEMM kernel ([`Self::force_expert_gemm`]).
    pub fn forced_expert_gemm(&self) -> Option<ExpertGemm> {
        self.forced
    }

    /// Takes buffer `name` of at least `n` elements out of the workspace (allocating a
    /// new, uninitialised one when missing or too short). Give it back with [`Self::put`].
    fn take<U: DeviceRepr + Send + Sync + 'static>(
        &mut self,
        gpu: &Gpu,
        name: &'static str,
        n: usize,
    ) -> Result<CudaSlice<U>> {
        let key = (name, std::any::TypeId::of::<U>());
        if let Some(b) = self.bufs.remove(&key) {
            if let Ok(b) = b.downcast::<CudaSlice<U>>() {
                if b.len() >= n.max(1) {
                    return Ok(*b);
                }
                self.bytes -= b.len() * std::mem::size_of::<U>();
            }
        }
        // Grow with slack so that slowly rising t does not reallocate every call.
        let len = n.max(1).next_power_of_two();
        // SAFETY: every element a kernel reads is written earlier in the same call.
        let b = unsafe { gpu.stream().alloc::<U>(len) }?;
        self.bytes += len * std::mem::size_of::<U>();
        Ok(b)
    }

    fn put<U: DeviceRepr + Send + Sync + 'static>(&mut self, name: &'static str, b: CudaSlice<U>) {
        self.bufs
            .insert((name, std::any::TypeId::of::<U>()), Box::new(b));
    }
}

fn cuda_type<U: Elem>() -> cudaDataType {
    if U::SUFFIX == "bf16" {
        cudaDataType::CUDA_R_16BF
    } else {
        cudaDataType::CUDA_R_32F
    }
}

/// `y = x · wᵀ` (row-major `x: [t, inp]`, `w: [out, inp]`, `y: [t, out]`) through
/// `cublasGemmEx` with fp32 compute; input type `T`, output type `O` (so a bf16 router
/// can produce fp32 logits). Works for every [`Elem`] without a `Gemm<T>` bound.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_rm<T: Elem, O: Elem>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    t: usize,
    inp: usize,
    w: &CudaSlice<T>,
    out: usize,
    y: &mut CudaSlice<O>,
) -> Result<()> {
    check_len("x", x, t * inp)?;
    check_len("w", w, out * inp)?;
    check_len("y", y, t * out)?;
    if t == 0 || out == 0 {
        return Ok(());
    }
    // Few rows (decode, seam windows): the GEMV kernel (a cuBLAS call for one row ran a
    // general GEMM plus a split-K reduction, ~18 µs of device time per MoE layer).
    if T::SUFFIX == "bf16"
        && matches!(O::SUFFIX, "bf16" | "f32")
        && t <= super::blas::GEMV_MAX_ROWS
        && inp.is_multiple_of(8)
        && out <= i32::MAX as usize
        && inp <= i32::MAX as usize
    {
        return super::blas::gemv(gpu, x, t, inp, w, out, y);
    }
    let alpha = 1f32;
    let beta = 0f32;
    let stream = gpu.stream();
    let (wp, _rw) = w.device_ptr(stream);
    let (xp, _rx) = x.device_ptr(stream);
    let (yp, _ry) = y.device_ptr_mut(stream);
    // SAFETY: lengths checked above; column-major yᵀ = w · xᵀ with w read transposed;
    // the handle is bound to `stream`, on which all buffers are used.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *gpu.blas().handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            out as i32,
            t as i32,
            inp as i32,
            (&alpha) as *const f32 as *const _,
            wp as *const _,
            cuda_type::<T>(),
            inp as i32,
            xp as *const _,
            cuda_type::<T>(),
            inp as i32,
            (&beta) as *const f32 as *const _,
            yp as *mut _,
            cuda_type::<O>(),
            out as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// [`gemm_rm`]'s cuBLAS call on views (`x: [t, inp]`, `w: [out, inp]`, `y: [t, out]`,
/// row-major), always cuBLAS (no GEMV shortcut): the per-expert reference path.
fn gemm_views<T: Elem, O: Elem>(
    gpu: &Gpu,
    x: &cudarc::driver::CudaView<'_, T>,
    t: usize,
    inp: usize,
    w: &cudarc::driver::CudaView<'_, T>,
    out: usize,
    y: &mut cudarc::driver::CudaViewMut<'_, O>,
) -> Result<()> {
    if x.len() < t * inp || w.len() < out * inp || y.len() < t * out {
        return Err(shape_err(format!(
            "per-expert GEMM: x {} < {t}×{inp}, w {} < {out}×{inp} or y {} < {t}×{out}",
            x.len(),
            w.len(),
            y.len()
        )));
    }
    if t == 0 || out == 0 {
        return Ok(());
    }
    if t > i32::MAX as usize || out > i32::MAX as usize || inp > i32::MAX as usize {
        return Err(shape_err(format!(
            "per-expert GEMM {t}×{inp}×{out} too large"
        )));
    }
    let alpha = 1f32;
    let beta = 0f32;
    let stream = gpu.stream();
    let (wp, _rw) = w.device_ptr(stream);
    let (xp, _rx) = x.device_ptr(stream);
    let (yp, _ry) = y.device_ptr_mut(stream);
    // SAFETY: lengths checked above; column-major yᵀ = w · xᵀ with w read transposed;
    // the handle is bound to `stream`, on which all buffers are used.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *gpu.blas().handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            out as i32,
            t as i32,
            inp as i32,
            (&alpha) as *const f32 as *const _,
            wp as *const _,
            cuda_type::<T>(),
            inp as i32,
            xp as *const _,
            cuda_type::<T>(),
            inp as i32,
            (&beta) as *const f32 as *const _,
            yp as *mut _,
            cuda_type::<O>(),
            out as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// SwiGLU: `out[r, j] = silu(gate_up[r, j]) · gate_up[r, I + j]` for `r < t`, `j < I`
/// (`gate_up: [t, 2I]` gate columns then up columns, `out: [t, I]`; fp32 math).
pub fn swiglu<T: Elem>(
    gpu: &Gpu,
    gate_up: &CudaSlice<T>,
    t: usize,
    inter: usize,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    check_len("gate_up [t,2I]", gate_up, t * 2 * inter)?;
    check_len("out [t,I]", out, t * inter)?;
    let n = t * inter;
    if n == 0 {
        return Ok(());
    }
    if inter > i32::MAX as usize {
        return Err(shape_err(format!("swiglu inter {inter} too large")));
    }
    let f = gpu.function(&MOE, &format!("swiglu_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, i) = (t as i64, inter as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(gate_up).arg(out).arg(&rows).arg(&i);
    // SAFETY: matches `swiglu_*` in moe.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Dense SwiGLU MLP: `out = (silu(x·gᵀ) ⊙ (x·uᵀ)) · downᵀ`.
///
/// `gate_up: [2I, hidden]` (gate rows then up rows), `down: [hidden, I]`,
/// `x: [t, hidden]`, `out: [t, hidden]` (overwritten). Two cuBLAS GEMMs (fp32 compute)
/// and the [`swiglu`] kernel; temporaries `[t, 2I]` and `[t, I]` are allocated per call.
#[allow(clippy::too_many_arguments)]
pub fn mlp_forward<T: Elem>(
    gpu: &Gpu,
    gate_up: &CudaSlice<T>,
    down: &CudaSlice<T>,
    x: &CudaSlice<T>,
    t: usize,
    hidden: usize,
    inter: usize,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    check_len("gate_up [2I,hidden]", gate_up, 2 * inter * hidden)?;
    check_len("down [hidden,I]", down, hidden * inter)?;
    check_len("x [t,hidden]", x, t * hidden)?;
    check_len("out [t,hidden]", out, t * hidden)?;
    if t == 0 || hidden == 0 {
        return Ok(());
    }
    // Scratch (fully written by the GEMM / swiglu before being read): no driver call
    // per layer, and a CUDA graph of the decode step keeps them (cuda/graph.rs).
    let mut gu = gpu.scratch::<T>(t * 2 * inter)?;
    let mut act = gpu.scratch::<T>(t * inter)?;
    mlp_impl(
        gpu, gate_up, down, x, t, hidden, inter, &mut gu, &mut act, out,
    )
}

#[allow(clippy::too_many_arguments)]
fn mlp_impl<T: Elem>(
    gpu: &Gpu,
    gate_up: &CudaSlice<T>,
    down: &CudaSlice<T>,
    x: &CudaSlice<T>,
    t: usize,
    hidden: usize,
    inter: usize,
    gu: &mut CudaSlice<T>,
    act: &mut CudaSlice<T>,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    if inter == 0 {
        // Zero-width MLP: the output is zero.
        gpu.stream().memset_zeros(out)?;
        return Ok(());
    }
    gemm_rm::<T, T>(gpu, x, t, hidden, gate_up, 2 * inter, gu)?;
    swiglu(gpu, gu, t, inter, act)?;
    gemm_rm::<T, T>(gpu, act, t, inter, down, hidden, out)
}

/// Kernel family of the expert GEMMs of [`moe_forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertGemm {
    /// One block per routed row, weight rows streamed with 16-byte loads (small batches,
    /// decode). Needs `hidden` and `inter` multiples of 8.
    Gemv,
    /// Grouped GEMM, shared-memory tiles, fp32 FMA (any shape, f32 or bf16).
    Simt,
    /// Grouped GEMM on tensor cores (`mma.sync` bf16, fp32 accumulation), 64×64×32 tiles,
    /// 128 threads. Needs bf16 and `hidden`, `inter` multiples of 32.
    TensorCores,
    /// Grouped GEMM on tensor cores with 128×128×32 tiles, 256 threads and a 3-stage
    /// `cp.async` ring in 60 KiB of dynamic shared memory (the prefill default). Needs
    /// the same shapes as [`ExpertGemm::TensorCores`].
    TensorCoresLarge,
    /// The reference of the grouped kernels: one cuBLAS GEMM per expert and projection
    /// over that expert's rows of the same expert-sorted order (`gate_up` output rounded
    /// to `T` before SwiGLU, as the dense MLP; one host sync for the counts). Any shape;
    /// only when forced ([`MoeWorkspace::force_expert_gemm`]), for tests and benches.
    PerExpert,
}

/// Routed rows (`t · top_k`) up to which [`ExpertGemm::Gemv`] is chosen automatically.
pub const GEMV_MAX_ROWS: usize = 128;

/// The expert-GEMM kernel [`moe_forward`] uses for `t` tokens: the workspace's forced
/// choice when the shapes allow it, else `Gemv` for `t · top_k ≤` [`GEMV_MAX_ROWS`], else
/// `TensorCoresLarge`, else `Simt` (the first the shapes allow).
pub fn expert_gemm<T: Elem>(w: &MoeWeights<T>, ws: &MoeWorkspace, t: usize) -> ExpertGemm {
    // (≤ 48 KiB of staged input row: no shared-memory opt-in needed.)
    let gemv_ok = w.hidden.is_multiple_of(8)
        && w.inter.is_multiple_of(8)
        && w.hidden <= 12288
        && w.inter <= 12288;
    let tc_ok = T::SUFFIX == "bf16" && w.hidden.is_multiple_of(32) && w.inter.is_multiple_of(32);
    match ws.forced {
        Some(ExpertGemm::Gemv) if gemv_ok => return ExpertGemm::Gemv,
        Some(ExpertGemm::TensorCores) if tc_ok => return ExpertGemm::TensorCores,
        Some(ExpertGemm::TensorCoresLarge) if tc_ok => return ExpertGemm::TensorCoresLarge,
        Some(ExpertGemm::Simt) => return ExpertGemm::Simt,
        Some(ExpertGemm::PerExpert) => return ExpertGemm::PerExpert,
        _ => {}
    }
    if gemv_ok && t * w.top_k <= GEMV_MAX_ROWS {
        ExpertGemm::Gemv
    } else if tc_ok {
        ExpertGemm::TensorCoresLarge
    } else {
        ExpertGemm::Simt
    }
}

/// Sparse MoE block (Qwen3-Next / Qwen3.5 `SparseMoeBlock`) over `t` tokens.
///
/// `x: [t, hidden]`, `out: [t, hidden]` (overwritten). Per token: `p = softmax(x·routerᵀ)`
/// (fp32), the `top_k` largest `p` (ties to the lower expert index), weights `p_j`
/// (or `p_j / Σ p_top` with `norm_topk_prob`), `out = Σ_j w_j · MLP_j(x)` plus, with a
/// shared expert, `σ(x·gateᵀ) · MLP_shared(x)`. Routing and the combine are fp32; expert
/// GEMMs accumulate in fp32, SwiGLU activations are rounded to `T` between the two
/// expert GEMMs, expert outputs stay fp32 until the combine. Deterministic.
///
/// Errors: [`CudaError::Shape`] when a buffer is shorter than its shape or `t·top_k`
/// overflows `i32`.
pub fn moe_forward<T: Elem>(
    gpu: &Gpu,
    w: &MoeWeights<T>,
    x: &CudaSlice<T>,
    t: usize,
    ws: &mut MoeWorkspace,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let (h, e, k, inter) = (w.hidden, w.num_experts, w.top_k, w.inter);
    check_len("x [t,hidden]", x, t * h)?;
    check_len("out [t,hidden]", out, t * h)?;
    if t == 0 {
        return Ok(());
    }
    let n = t * k;
    if n > (i32::MAX as usize) / 2
        || t * h > i32::MAX as usize
        || n * h.max(inter) > isize::MAX as usize / 4
    {
        return Err(shape_err(format!(
            "MoE with t = {t}, top_k = {k} is too large"
        )));
    }
    let ld = w.router_rows();
    let path = expert_gemm(w, ws, t);
    // Rows per tile of the plan's tile list (the grouped kernel's tile height).
    let bm = if path == ExpertGemm::TensorCoresLarge {
        LBM
    } else {
        GBM
    };
    let max_tiles = n.div_ceil(bm) + e.min(n);

    let mut logits = ws.take::<f32>(gpu, "logits", t * ld)?;
    let mut topk_idx = ws.take::<i32>(gpu, "topk_idx", n)?;
    let mut topk_w = ws.take::<f32>(gpu, "topk_w", n)?;
    let mut counts = ws.take::<i32>(gpu, "counts", e)?;
    let mut offsets = ws.take::<i32>(gpu, "offsets", e)?;
    let mut tile_e = ws.take::<i32>(gpu, "tile_e", max_tiles)?;
    let mut tile_r0 = ws.take::<i32>(gpu, "tile_r0", max_tiles)?;
    let mut num_tiles = ws.take::<i32>(gpu, "num_tiles", 1)?;
    let mut perm_tok = ws.take::<i32>(gpu, "perm_tok", n)?;
    let mut slot_pos = ws.take::<i32>(gpu, "slot_pos", n)?;
    let mut act = ws.take::<T>(gpu, "act", n * inter)?;
    let mut y = ws.take::<f32>(gpu, "y", n * h)?;

    // 1. Router logits (fp32 output), shared gate logit in column E.
    gemm_rm::<T, f32>(gpu, x, t, h, &w.router, ld, &mut logits)?;

    // 2. Routing.
    let (ld_i, t_i, e_i, k_i) = (ld as i32, t as i32, e as i32, k as i32);
    route(gpu, w, &logits, t, &mut topk_idx, &mut topk_w)?;

    // 3. Plan: counts, offsets, tiles, permutation.
    let f = gpu.function(&MOE, "moe_plan", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (e as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (e * 4) as u32,
    };
    let (n_i, bm_i) = (n as i32, bm as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&topk_idx)
        .arg(&n_i)
        .arg(&k_i)
        .arg(&e_i)
        .arg(&bm_i)
        .arg(&mut counts)
        .arg(&mut offsets)
        .arg(&mut tile_e)
        .arg(&mut tile_r0)
        .arg(&mut num_tiles)
        .arg(&mut perm_tok)
        .arg(&mut slot_pos);
    // SAFETY: matches `moe_plan`; tile buffers hold the bound ceil(n/bm) + min(E, n).
    unsafe { b.launch(cfg) }?;

    let (h_i, i_i) = (h as i32, inter as i32);
    match path {
        ExpertGemm::Gemv => {
            // 4/5 (small batch): one block per routed row, weights streamed once per row.
            let cfg = |cols: usize, per_block: usize, k_len: usize| LaunchConfig {
                grid_dim: (n as u32, cols.div_ceil(per_block) as u32, 1),
                block_dim: (GV_WARPS * 32, 1, 1),
                shared_mem_bytes: (k_len * 4) as u32,
            };
            let f = gpu.function(&MOE, &format!("moe_gemv_gu_{}", T::SUFFIX), (h * 4) as u32)?;
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(x)
                .arg(&topk_idx)
                .arg(&slot_pos)
                .arg(&k_i)
                .arg(&w.gate_up)
                .arg(&mut act)
                .arg(&h_i)
                .arg(&i_i);
            // SAFETY: matches `moe_gemv_gu_*`; x [t,H], topk_idx/slot_pos [n], gate_up
            // [E,2I,H], act [n,I]; H, I multiples of 8 (vector loads); H floats of smem.
            unsafe { b.launch(cfg(inter, GV_WARPS as usize * GV_COLS_GU, h)) }?;
            let f = gpu.function(
                &MOE,
                &format!("moe_gemv_down_{}", T::SUFFIX),
                (inter * 4) as u32,
            )?;
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(&act)
                .arg(&topk_idx)
                .arg(&slot_pos)
                .arg(&k_i)
                .arg(&w.down)
                .arg(&mut y)
                .arg(&i_i)
                .arg(&h_i);
            // SAFETY: matches `moe_gemv_down_*`; act [n,I], down [E,H,I], y [n,H].
            unsafe { b.launch(cfg(h, GV_WARPS as usize * GV_COLS_DN, inter)) }?;
        }
        ExpertGemm::PerExpert => {
            // 4/5 (reference): per expert, cuBLAS over its rows of the sorted order.
            let cnt = gpu.download(&counts)?;
            let off = gpu.download(&offsets)?;
            let mut xe = ws.take::<T>(gpu, "xe", n * h)?;
            let mut gu = ws.take::<T>(gpu, "gu", n * 2 * inter)?;
            {
                let f = gpu.function(
                    &super::compile::MODEL,
                    &format!("gather_rows_{}", T::SUFFIX),
                    0,
                )?;
                let cfg = LaunchConfig {
                    grid_dim: (grid_for(n * h, 256), 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = gpu.stream().launch_builder(&f);
                b.arg(x).arg(&perm_tok).arg(&mut xe).arg(&n_i).arg(&h_i);
                // SAFETY: matches `gather_rows_*` in model.cu; perm_tok [n] holds token
                // indices < t, x [t,H], xe [n,H].
                unsafe { b.launch(cfg) }?;
            }
            for ex in 0..e {
                let (c, o) = (cnt[ex] as usize, off[ex] as usize);
                if c == 0 {
                    continue;
                }
                if o + c > n {
                    return Err(shape_err(format!(
                        "expert {ex}: rows {o}..{} outside the {n} routed rows",
                        o + c
                    )));
                }
                gemm_views::<T, T>(
                    gpu,
                    &xe.slice(o * h..(o + c) * h),
                    c,
                    h,
                    &w.gate_up
                        .slice(ex * 2 * inter * h..(ex + 1) * 2 * inter * h),
                    2 * inter,
                    &mut gu.slice_mut(o * 2 * inter..(o + c) * 2 * inter),
                )?;
            }
            swiglu(gpu, &gu, n, inter, &mut act)?;
            for ex in 0..e {
                let (c, o) = (cnt[ex] as usize, off[ex] as usize);
                if c == 0 {
                    continue;
                }
                gemm_views::<T, f32>(
                    gpu,
                    &act.slice(o * inter..(o + c) * inter),
                    c,
                    inter,
                    &w.down.slice(ex * h * inter..(ex + 1) * h * inter),
                    h,
                    &mut y.slice_mut(o * h..(o + c) * h),
                )?;
            }
            ws.put("xe", xe);
            ws.put("gu", gu);
        }
        path => {
            // 4. Grouped gate_up GEMM + SwiGLU → act [n, I]. Tiles of bm rows × bn
            // columns (bn/2 gate + bn/2 up here): 64 × 64 for the SIMT kernel (256
            // threads) and the small tensor-core one (128 threads), 128 × 128 for the
            // large one (256 threads, dynamic shared memory).
            let (kname, threads, bn, smem) = match path {
                ExpertGemm::TensorCores => ("tc_bf16", 128, GBN, 0),
                ExpertGemm::TensorCoresLarge => ("tcl_bf16", 256, LBN, TCL_SMEM_BYTES),
                _ => (T::SUFFIX, 256, GBN, 0),
            };
            let f = gpu.function(&MOE, &format!("moe_gemm_gu_{kname}"), smem)?;
            let cfg = LaunchConfig {
                grid_dim: (max_tiles as u32, inter.div_ceil(bn / 2) as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem,
            };
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(x)
                .arg(&perm_tok)
                .arg(&w.gate_up)
                .arg(&mut act)
                .arg(&counts)
                .arg(&offsets)
                .arg(&tile_e)
                .arg(&tile_r0)
                .arg(&num_tiles)
                .arg(&h_i)
                .arg(&i_i);
            // SAFETY: matches `moe_gemm_gu_*`; x [t,H], gate_up [E,2I,H], act [n,I]; the
            // tensor-core kernel only for bf16 with H, I multiples of 32 (16-byte loads).
            unsafe { b.launch(cfg) }?;

            // 5. Grouped down GEMM → y [n, H] fp32.
            let f = gpu.function(&MOE, &format!("moe_gemm_down_{kname}"), smem)?;
            let cfg = LaunchConfig {
                grid_dim: (max_tiles as u32, h.div_ceil(bn) as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem,
            };
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(&act)
                .arg(&w.down)
                .arg(&mut y)
                .arg(&counts)
                .arg(&offsets)
                .arg(&tile_e)
                .arg(&tile_r0)
                .arg(&num_tiles)
                .arg(&i_i)
                .arg(&h_i);
            // SAFETY: matches `moe_gemm_down_*`; act [n,I], down [E,H,I], y [n,H].
            unsafe { b.launch(cfg) }?;
        }
    }

    // 6. Shared expert (dense) → sh_out [t, H].
    let mut shared_bufs = None;
    if let Some((sgu, sdn)) = &w.shared {
        let is = w.shared_inter;
        let mut s_gu = ws.take::<T>(gpu, "s_gu", t * 2 * is)?;
        let mut s_act = ws.take::<T>(gpu, "s_act", t * is)?;
        let mut s_out = ws.take::<T>(gpu, "s_out", t * h)?;
        mlp_impl(
            gpu, sgu, sdn, x, t, h, is, &mut s_gu, &mut s_act, &mut s_out,
        )?;
        shared_bufs = Some((s_gu, s_act, s_out));
    }

    // 7. Combine in token order.
    let f = gpu.function(&MOE, &format!("moe_combine_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(t * h, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let null: u64 = 0;
    let gate_col = if w.shared_gated { e as i32 } else { -1 };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&y).arg(&slot_pos).arg(&topk_w).arg(&k_i);
    match &shared_bufs {
        Some((_, _, s_out)) => b.arg(s_out),
        None => b.arg(&null),
    };
    b.arg(&logits)
        .arg(&ld_i)
        .arg(&gate_col)
        .arg(out)
        .arg(&t_i)
        .arg(&h_i);
    // SAFETY: matches `moe_combine_*`; y [n,H], slot_pos/topk_w [t,k], shared [t,H],
    // logits [t,ld] with the gate logit in column E when shared is non-null, out [t,H].
    unsafe { b.launch(cfg) }?;

    ws.put("logits", logits);
    ws.put("topk_idx", topk_idx);
    ws.put("topk_w", topk_w);
    ws.put("counts", counts);
    ws.put("offsets", offsets);
    ws.put("tile_e", tile_e);
    ws.put("tile_r0", tile_r0);
    ws.put("num_tiles", num_tiles);
    ws.put("perm_tok", perm_tok);
    ws.put("slot_pos", slot_pos);
    ws.put("act", act);
    ws.put("y", y);
    if let Some((a, b, c)) = shared_bufs {
        ws.put("s_gu", a);
        ws.put("s_act", b);
        ws.put("s_out", c);
    }
    Ok(())
}

/// Routes `t` tokens from their router logits (`logits: [t, ld]` fp32, the first `E`
/// columns the experts'; `ld` = E, or E + 1 with a gated shared expert) by `w`'s rule:
/// `topk_idx [t, k]` (chosen experts in selection order) and `topk_w [t, k]` (their
/// weights, scaling included). `moe_route` for the softmax rule, `moe_route_rule`
/// otherwise.
///
/// Errors: [`CudaError::Shape`] for buffers shorter than their shapes.
pub fn route<T: Elem>(
    gpu: &Gpu,
    w: &MoeWeights<T>,
    logits: &CudaSlice<f32>,
    t: usize,
    topk_idx: &mut CudaSlice<i32>,
    topk_w: &mut CudaSlice<f32>,
) -> Result<()> {
    let (e, k, ld) = (w.num_experts, w.top_k, w.router_rows());
    check_len("logits [t,ld]", logits, t * ld)?;
    check_len("topk_idx [t,k]", topk_idx, t * k)?;
    check_len("topk_w [t,k]", topk_w, t * k)?;
    if t == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: ((t * 32).div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ld_i, t_i, e_i, k_i, norm_i) = (
        ld as i32,
        t as i32,
        e as i32,
        k as i32,
        i32::from(w.norm_topk_prob),
    );
    let Some(rule) = &w.rule else {
        let f = gpu.function(&MOE, "moe_route", 0)?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(logits)
            .arg(&ld_i)
            .arg(&t_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&norm_i)
            .arg(topk_idx)
            .arg(topk_w);
        // SAFETY: matches `moe_route`; buffers checked above; E ≤ 512, k ≤ 32 (checked
        // at upload).
        unsafe { b.launch(cfg) }?;
        return Ok(());
    };
    let c = &rule.config;
    let f = gpu.function(&MOE, "moe_route_rule", 0)?;
    let null: u64 = 0;
    let (sig, ng, tg, rs) = (
        i32::from(c.score == ScoreFunction::Sigmoid),
        c.n_group as i32,
        c.topk_group as i32,
        i32::from(c.renorm_single),
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(logits)
        .arg(&ld_i)
        .arg(&t_i)
        .arg(&e_i)
        .arg(&k_i)
        .arg(&norm_i)
        .arg(&sig);
    match &rule.bias {
        Some(bias) => b.arg(bias),
        None => b.arg(&null),
    };
    b.arg(&ng)
        .arg(&tg)
        .arg(&c.dropped_group_score)
        .arg(&rs)
        .arg(&c.routed_scaling_factor)
        .arg(topk_idx)
        .arg(topk_w);
    // SAFETY: matches `moe_route_rule`; buffers checked above; bias [E] (checked at
    // upload); E ≤ 512, k ≤ 32, n_group ≤ 32 dividing E (DeviceRouter::upload).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Routing decisions of the last [`moe_forward`] call that used `ws` (for tests and
/// diagnostics; waits for the stream): `(topk_idx [t, k], topk_w [t, k], counts [E])`.
pub fn last_routing(
    gpu: &Gpu,
    ws: &MoeWorkspace,
    t: usize,
    top_k: usize,
    num_experts: usize,
) -> Result<(Vec<i32>, Vec<f32>, Vec<i32>)> {
    let get_i = |name: &'static str, n: usize| -> Result<Vec<i32>> {
        let b = ws
            .bufs
            .get(&(name, std::any::TypeId::of::<i32>()))
            .and_then(|b| b.downcast_ref::<CudaSlice<i32>>())
            .ok_or_else(|| shape_err(format!("workspace has no `{name}` (no moe_forward yet)")))?;
        check_len(name, b, n)?;
        Ok(gpu.download(b)?[..n].to_vec())
    };
    let idx = get_i("topk_idx", t * top_k)?;
    let counts = get_i("counts", num_experts)?;
    let wb = ws
        .bufs
        .get(&("topk_w", std::any::TypeId::of::<f32>()))
        .and_then(|b| b.downcast_ref::<CudaSlice<f32>>())
        .ok_or_else(|| shape_err("workspace has no `topk_w`".into()))?;
    check_len("topk_w", wb, t * top_k)?;
    let wv = gpu.download(wb)?[..t * top_k].to_vec();
    Ok((idx, wv, counts))
}
