//! Native GPU data plane (cargo feature `cuda`, off by default).
//!
//! Build: `cargo build --release --features cuda`. Nothing here needs a CUDA toolkit
//! at build time: cudarc 0.19 loads the driver (`libcuda`), NVRTC and cuBLAS at run
//! time (`dynamic-loading`), so the feature also builds on CPU-only machines.
//!
//! * [`Gpu`]: one device context with its stream, a cuBLAS handle and the kernel
//!   modules, compiled by NVRTC from `dataplane/kernels/*.cu` for the device's
//!   architecture (`sm_90a` on H200) and cached on disk ([`compile`]).
//! * [`device`]: the `--device cuda|cpu|auto` choice; `auto` falls back to the CPU
//!   backend with a log line on stderr when no driver or device is usable.
//! * Kernels, each tested against its CPU reference (`dataplane/tests/cuda_*.rs`):
//!   [`ops`] (RMSNorm variants, partial RoPE and K re-rotation, causal conv1d prefill
//!   and one-token update), [`gdr`] (gated delta rule one-token recurrent decode and
//!   chunked prefill from an initial state, optionally with the segment transition
//!   `T_C`; bf16 prefill on tensor cores), [`transition`] (dense pair compose/apply through cuBLAS strided batched
//!   GEMM), [`attn`] (causal GQA attention prefill over KV at arbitrary positions: a tiled
//!   SIMT kernel, a cuBLAS GEMM path `attn::prefill_fast` for long spans, and for bf16 a
//!   FlashAttention-2 tensor-core kernel `attn::prefill_flash`),
//!   [`lightning`] (Lightning attention of Ring-linear: input preparation, the
//!   per-token recurrence, one- and two-pass chunked prefill, group norm and gate,
//!   PIC state rotation and scalar pairs), [`transition`] also scalar pairs,
//!   [`moe`] (sparse MoE block with device routing — softmax top-k, or the sigmoid
//!   rule with selection bias and grouped top-k of [`moe::DeviceRouter`] —, grouped
//!   expert GEMMs, dense SwiGLU MLP),
//!   [`sample`] (greedy argmax and seeded temperature / top-k / top-p sampling),
//!   [`pic`] (the PIC engine on the device: cache build, compose, seams, device pools
//!   with a host spill tier), [`peer`] (entries shipped between GPUs of one process
//!   by device copies, with a device checksum), [`nccl`] (entries shipped between
//!   processes by NCCL send/recv).
//! * [`model`]: the whole-model forward ([`model::GpuModel`] prefill/decode from a
//!   [`model::GpuState`]), equivalent to the CPU `model::Model`.
//!
//! Device buffers are cudarc `CudaSlice<T>` in the same row-major layouts as the CPU
//! backend (documented per function); element type `T` is `f32` or `half::bf16`
//! ([`Elem`]); recurrent states and transitions are always fp32.
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
pub use scratch::{Scratch, ScratchCache, ScratchStats};

pub mod attn;
pub mod blas;
pub mod compile;
pub mod device;
pub mod gdr;
pub mod graph;
pub mod kda;
pub(crate) mod kimi;
pub mod lightning;
pub mod load;
pub mod model;
pub mod moe;
pub mod nccl;
pub mod ops;
pub mod peer;
pub mod pic;
pub mod random;
pub mod sample;
pub mod scratch;
pub mod transition;

use compile::KernelSource;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No driver, no device, or a library that cannot be loaded.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// NVRTC failed (the message holds the compiler log).
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Cublas(String),
    /// Buffer lengths or dimensions do not fit the operation.
    #[error("shape: {0}")]
    Shape(String),
}

/// A device failure seen through the engine interface: [`crate::Error::Device`]
/// with the message.
impl From<CudaError> for crate::Error {
    fn from(e: CudaError) -> Self {
        crate::Error::Device(e.to_string())
    }
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(format!("{e:?}"))
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Cublas(format!("{e:?}"))
    }
}

/// Result alias of the CUDA backend.
pub type Result<T> = std::result::Result<T, CudaError>;

/// Element types the kernels are instantiated for (`f32`, `half::bf16`). Kernel
/// names carry [`Elem::SUFFIX`].
pub trait Elem:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + Send + Sync + 'static
{
    /// Kernel-name suffix (`f32` / `bf16`).
    const SUFFIX: &'static str;
    /// Round-to-nearest conversion from fp32.
    fn from_f32(x: f32) -> Self;
    /// Widening conversion to fp32.
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for half::bf16 {
    const SUFFIX: &'static str = "bf16";
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// A CUDA device: context, its stream (all work of this backend is issued on it, in
/// order), a cuBLAS handle bound to that stream, and the loaded kernel modules.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    /// cuBLAS's workspace (after `blas`: dropped after the handle).
    _blas_ws: CudaSlice<u8>,
    arch: String,
    name: String,
    cache_dir: Option<PathBuf>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    funcs: Mutex<HashMap<String, CudaFunction>>,
    compile_log: Mutex<Vec<(String, compile::Origin, f64)>>,
    /// `HYPIC_CUDA_POISON=1`: [`Gpu::scratch`] fills its buffers with 0xFF bytes.
    poison: bool,
    /// Buffers of [`Gpu::scratch`] come back here when dropped.
    scratch_cache: Arc<ScratchCache>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

/// Device memory the default pool keeps mapped after it is freed: [`keep_pool_memory`].
pub const POOL_KEEP_BYTES: u64 = 8 << 30;

/// Sets the release threshold of the device's default memory pool (the one
/// `cuMemAllocAsync` draws from) to [`POOL_KEEP_BYTES`]: up to that much freed device
/// memory stays mapped in the pool and is handed out again, instead of being unmapped
/// at the next stream synchronisation (the driver's default threshold is 0) and mapped
/// again by the next allocation. The forward allocates its activations per call and
/// every decode step synchronises. Bounded so that a long prefill's activations are
/// returned for allocations outside the pool (cuBLAS, kernel modules loaded later).
fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut keep: u64 = POOL_KEEP_BYTES;
    // SAFETY: plain driver calls on this context's device; `pool` and `keep` outlive them.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}

/// Bytes of the workspace given to cuBLAS ([`Gpu::blas`]): 32 MiB.
pub const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Whether CUDA graphs for the decode step are on: `HYPIC_CUDA_GRAPHS` unset or any
/// value but `0` (read when a [`Gpu`] is opened and when a model is built). With `0`
/// the backend issues its work on the device's legacy default stream and every decode
/// step is launched kernel by kernel.
pub fn graphs_enabled_by_env() -> bool {
    std::env::var("HYPIC_CUDA_GRAPHS").map_or(true, |v| v.trim() != "0")
}

/// Whether the CUDA driver library can be loaded at all (no device is touched).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Gpu {
    /// Opens device `ordinal` with the default kernel cache folder
    /// ([`compile::default_cache_dir`]). Fails with [`CudaError::Unavailable`] when the
    /// driver, the device, NVRTC or cuBLAS cannot be loaded (never panics for that).
    pub fn new(ordinal: usize) -> Result<Arc<Gpu>> {
        Self::with_cache(ordinal, Some(compile::default_cache_dir()))
    }

    /// As [`Gpu::new`] with an explicit cache folder (`None`: always compile).
    pub fn with_cache(ordinal: usize, cache_dir: Option<PathBuf>) -> Result<Arc<Gpu>> {
        if !driver_present() {
            return Err(CudaError::Unavailable(
                "libcuda (the NVIDIA driver) could not be loaded".into(),
            ));
        }
        compile::ensure_nvrtc()?;
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "libcublas could not be loaded".into(),
            ));
        }
        let n = CudaContext::device_count()
            .map_err(|e| CudaError::Unavailable(format!("cuInit/device count: {e:?}")))?;
        if ordinal as i32 >= n {
            return Err(CudaError::Unavailable(format!(
                "device {ordinal} requested, {n} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::Unavailable(format!("context: {e:?}")))?;
        // One stream, in-order: cudarc's per-buffer event tracking is not needed.
        // SAFETY: all buffers of this backend are used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        // Not fatal: without a default memory pool (some virtualised devices) cudarc
        // allocates synchronously and there is nothing to tune.
        let _ = keep_pool_memory(&ctx);
        let (maj, min) = ctx.compute_capability()?;
        let name = ctx.name()?;
        // A stream of its own rather than the legacy default stream, which cannot be
        // captured into a CUDA graph (the decode step's graphs, `graph.rs`);
        // `HYPIC_CUDA_GRAPHS=0` keeps the default stream (and turns the graphs off).
        let stream = if graphs_enabled_by_env() {
            ctx.new_stream()?
        } else {
            ctx.default_stream()
        };
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())?;
        // A workspace of our own for cuBLAS, so that no cuBLAS call allocates during a
        // stream capture (cuBLAS's guidance for CUDA graphs); it lives as long as the handle.
        let blas_ws = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        {
            use cudarc::driver::DevicePtr;
            let (p, _rec) = blas_ws.device_ptr(&stream);
            // SAFETY: `blas_ws` is a live device allocation of BLAS_WORKSPACE_BYTES on this
            // context, kept in the Gpu beside the handle (dropped after it: field order).
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    p as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        let cache_bytes = match std::env::var("HYPIC_SCRATCH_CACHE_MB") {
            Ok(v) => v.trim().parse::<usize>().map(|mb| mb << 20).map_err(|_| {
                CudaError::Shape(format!(
                    "HYPIC_SCRATCH_CACHE_MB must be a whole number of MiB (0: off), got {v:?}"
                ))
            })?,
            Err(_) => scratch::DEFAULT_CAPACITY,
        };
        let scratch_cache = ScratchCache::new(stream.clone(), cache_bytes);
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            blas,
            _blas_ws: blas_ws,
            arch: compile::arch_for(maj, min),
            name,
            cache_dir,
            modules: Mutex::new(HashMap::new()),
            funcs: Mutex::new(HashMap::new()),
            compile_log: Mutex::new(Vec::new()),
            poison: std::env::var("HYPIC_CUDA_POISON").is_ok_and(|v| v == "1"),
            scratch_cache,
        }))
    }

    /// Device name (e.g. "NVIDIA H200").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Device ordinal (0 for the first GPU).
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// NVRTC target (e.g. `sm_90a`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The stream all work is issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The driver context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// cuBLAS handle bound to [`Gpu::stream`].
    pub fn blas(&self) -> &cudarc::cublas::CudaBlas {
        &self.blas
    }

    /// (module, origin, seconds) of every module loaded so far.
    pub fn compile_log(&self) -> Vec<(String, compile::Origin, f64)> {
        self.compile_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Copies a host slice to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, x: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(x)?)
    }

    /// Copies a device buffer back to the host (waits for the stream).
    pub fn download<T: DeviceRepr>(&self, x: &CudaSlice<T>) -> Result<Vec<T>> {
        let v = self.stream.clone_dtoh(x)?;
        self.stream.synchronize()?;
        Ok(v)
    }

    /// A zero-filled device buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// A device buffer of `n` elements (at least one) for a kernel that writes every
    /// element before anything reads it: no zero fill, so it costs no memset launch on
    /// the hot path. With `HYPIC_CUDA_POISON=1` in the environment when the device was
    /// opened, the buffer is filled with 0xFF bytes (NaN in f32 and bf16, −1 in
    /// integers) so that a kernel reading an element nobody wrote shows up in the
    /// GPU-vs-CPU tests (scripts/gpu-check.sh sets it for the test steps).
    ///
    /// The buffer comes from, and returns to when dropped, the device's scratch cache
    /// ([`scratch`](self::scratch): no driver call when a buffer of the same byte size
    /// was dropped before). An allocation that fails for memory empties the cache and
    /// retries once.
    pub fn scratch<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<Scratch<T>> {
        let n = n.max(1);
        let bytes = n * std::mem::size_of::<T>();
        let mut b = match self.scratch_cache.take(bytes) {
            // SAFETY: `p` is a live allocation of exactly `bytes` bytes on this stream,
            // owned by the cache until now; callers write every element before reading
            // it (see above), the poison mode checks that in the tests.
            Some(p) => unsafe { self.stream.upgrade_device_ptr::<T>(p, n) },
            // SAFETY: as above (uninitialised memory, written before it is read).
            // A capture is open: an allocation the graph does not own (cuMemAlloc is
            // not recorded by a relaxed-mode capture), kept with the graph.
            None if self.scratch_cache.capturing() => {
                let mut p: cudarc::driver::sys::CUdeviceptr = 0;
                // SAFETY: plain allocation of `bytes` bytes on this context.
                unsafe { cudarc::driver::sys::cuMemAlloc_v2(&mut p, bytes) }.result()?;
                self.scratch_cache.note_raw(p, bytes);
                // SAFETY: `p` is a live allocation of `bytes` bytes; it goes to the capture's
                // keep list when dropped (never freed through the slice).
                unsafe { self.stream.upgrade_device_ptr::<T>(p, n) }
            }
            None => match unsafe { self.stream.alloc::<T>(n) } {
                Ok(b) => b,
                Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    self.scratch_cache.flush();
                    // SAFETY: as above.
                    unsafe { self.stream.alloc::<T>(n) }?
                }
                Err(e) => return Err(e.into()),
            },
        };
        if self.poison {
            use cudarc::driver::DevicePtrMut;
            let bytes = b.num_bytes();
            let (ptr, _rec) = b.device_ptr_mut(&self.stream);
            // SAFETY: `ptr` is the live allocation above, on `stream`; 0xFF bytes are a
            // valid bit pattern for the float and integer element types used here.
            unsafe {
                cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, self.stream.cu_stream())
            }?;
        }
        Ok(Scratch::new(b, self.scratch_cache.clone()))
    }

    /// A zero-filled [`Gpu::scratch`] buffer (one memset on the stream).
    pub fn scratch_zeroed<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<Scratch<T>> {
        let mut b = self.scratch::<T>(n)?;
        self.stream.memset_zeros(&mut *b)?;
        Ok(b)
    }

    /// A [`Gpu::scratch`] copy of `src` (a slice or a view; one device copy).
    pub fn scratch_copy<T, S>(&self, src: &S) -> Result<Scratch<T>>
    where
        T: DeviceRepr + ValidAsZeroBits,
        S: cudarc::driver::DevicePtr<T>,
    {
        let mut b = self.scratch::<T>(src.len())?;
        if src.len() > 0 {
            self.stream.memcpy_dtod(src, &mut *b)?;
        }
        Ok(b)
    }

    /// The cache behind [`Gpu::scratch`] (capacity, counters, flush).
    pub fn scratch_cache(&self) -> &Arc<ScratchCache> {
        &self.scratch_cache
    }

    /// Whether [`Gpu::scratch`] poisons its buffers (`HYPIC_CUDA_POISON=1`).
    pub fn poisons_scratch(&self) -> bool {
        self.poison
    }

    /// Waits for all work issued so far; surfaces asynchronous kernel faults.
    pub fn sync(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    fn module(&self, src: &KernelSource) -> Result<Arc<CudaModule>> {
        let mut mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = mods.get(src.name) {
            return Ok(m.clone());
        }
        let t0 = std::time::Instant::now();
        let (cubin, origin) = compile::compile_cubin(src, &self.arch, self.cache_dir.as_deref())?;
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
        self.compile_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((src.name.to_string(), origin, t0.elapsed().as_secs_f64()));
        mods.insert(src.name, m.clone());
        Ok(m)
    }

    /// Kernel `name` of module `src` (compiled or read from the cache on first use).
    /// `dyn_smem` > 48 KiB raises the function's dynamic shared-memory limit.
    pub fn function(&self, src: &KernelSource, name: &str, dyn_smem: u32) -> Result<CudaFunction> {
        let key = format!("{}::{name}", src.name);
        if let Some(f) = self
            .funcs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(f.clone());
        }
        let m = self.module(src)?;
        let f = m.load_function(name)?;
        if dyn_smem > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dyn_smem as i32,
            )?;
        }
        self.funcs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, f.clone());
        Ok(f)
    }

    /// Compiles (or loads from the cache) every kernel module now, so that timings
    /// and first requests do not pay for NVRTC.
    pub fn warm_up(&self) -> Result<()> {
        for s in compile::ALL.iter() {
            self.module(s)?;
        }
        Ok(())
    }
}

/// Checks `buf.len() >= need` for a named buffer.
pub(crate) fn check_len<T>(name: &str, buf: &CudaSlice<T>, need: usize) -> Result<()> {
    if buf.len() < need {
        return Err(CudaError::Shape(format!(
            "`{name}` holds {} elements, needs {need}",
            buf.len()
        )));
    }
    Ok(())
}

/// Errors unless `buf` starts at a multiple of 16 bytes (kernels that copy it with
/// 16-byte `cp.async` need that; allocations do, views at an offset may not).
pub(crate) fn check_align16<T>(gpu: &Gpu, name: &str, buf: &CudaSlice<T>) -> Result<()> {
    use cudarc::driver::DevicePtr;
    let (p, _rec) = buf.device_ptr(gpu.stream());
    if p % 16 != 0 {
        return Err(CudaError::Shape(format!(
            "`{name}` starts at {p:#x}, not a multiple of 16 bytes"
        )));
    }
    Ok(())
}

/// Grid size for a grid-stride loop over `n` items with `block` threads.
pub(crate) fn grid_for(n: usize, block: u32) -> u32 {
    (n.div_ceil(block as usize)).clamp(1, 65_535 * 16) as u32
}

/// 1-D launch configuration of a grid-stride kernel over `n` items (256 threads).
pub(crate) fn cfg1(n: usize) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (grid_for(n, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// [`CudaError::Shape`] with `msg`.
pub(crate) fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(msg)
}

/// `v` as an `i32` kernel argument.
///
/// Errors: [`CudaError::Shape`] naming `name` when `v` does not fit in `i32`.
pub(crate) fn dim_i32(name: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape_err(format!("{name} = {v} does not fit in i32")))
}
