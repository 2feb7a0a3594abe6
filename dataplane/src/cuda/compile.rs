//! NVRTC compilation of the CUDA C sources under `dataplane/kernels/` to device code
//! (CUBIN for the device's architecture, e.g. `sm_90a` on H200), cached on disk.
//!
//! The sources are embedded in the binary (`include_str!`), so a built test or bench
//! executable needs no source tree on the GPU machine. Each [`KernelSource`] is
//! compiled as `common.cuh` followed by its own text. The cache key is the SHA-256 of
//! (source text, architecture, NVRTC options other than include paths, NVRTC
//! version); entries are written
//! atomically (temp file + rename), so concurrent processes never read a torn file.
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{CudaError, Result};

const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One CUDA C translation unit of `dataplane/kernels/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// Module name (the file stem), used in cache file names and errors.
    pub name: &'static str,
    /// The file's text (without `common.cuh`, which is prepended at compile time).
    pub text: &'static str,
}

impl KernelSource {
    /// Full text handed to NVRTC: `common.cuh` then the module.
    pub fn full_text(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", self.name, self.text)
    }
}

/// RMSNorm variants (`kernels/norm.cu`).
pub const NORM: KernelSource = KernelSource {
    name: "norm",
    text: include_str!("../../kernels/norm.cu"),
};
/// Partial RoPE and re-rotation (`kernels/rope.cu`).
pub const ROPE: KernelSource = KernelSource {
    name: "rope",
    text: include_str!("../../kernels/rope.cu"),
};
/// Causal depthwise conv1d (`kernels/conv.cu`).
pub const CONV: KernelSource = KernelSource {
    name: "conv",
    text: include_str!("../../kernels/conv.cu"),
};
/// Gated delta rule: recurrent decode and chunked prefill (`kernels/gdr.cu`).
pub const GDR: KernelSource = KernelSource {
    name: "gdr",
    text: include_str!("../../kernels/gdr.cu"),
};
/// Gated delta rule chunked prefill on tensor cores for bf16 inputs (`kernels/gdr_tc.cu`).
pub const GDR_TC: KernelSource = KernelSource {
    name: "gdr_tc",
    text: include_str!("../../kernels/gdr_tc.cu"),
};
/// Causal attention prefill at arbitrary positions (`kernels/attn.cu`).
pub const ATTN: KernelSource = KernelSource {
    name: "attn",
    text: include_str!("../../kernels/attn.cu"),
};

/// Tensor-core flash attention for bf16 (`kernels/flash.cu`, `attn::prefill_flash`).
pub const FLASH: KernelSource = KernelSource {
    name: "flash",
    text: include_str!("../../kernels/flash.cu"),
};

/// Hopper (sm_90a) wgmma flash attention for bf16 (`kernels/flash_wg.cu`,
/// `attn::prefill_flash_wg`); uses FLASH's tile-summary and merge kernels.
pub const FLASH_WG: KernelSource = KernelSource {
    name: "flash_wg",
    text: include_str!("../../kernels/flash_wg.cu"),
};

/// Glue kernels of the whole-model forward (`kernels/model.cu`): embedding, residual
/// add, GDN input preparation, attention split and gate, SwiGLU, host-routed MoE
/// gather/scatter, generic-head-dim fallbacks of the GDR recurrence and attention.
pub const MODEL: KernelSource = KernelSource {
    name: "model",
    text: include_str!("../../kernels/model.cu"),
};

/// Small-batch bf16 projections, one warp per output row (`kernels/gemv.cu`,
/// `blas::linear` for at most `blas::GEMV_MAX_ROWS` rows).
pub const GEMV: KernelSource = KernelSource {
    name: "gemv",
    text: include_str!("../../kernels/gemv.cu"),
};

/// Mixture-of-experts routing, grouped GEMMs, combine, SwiGLU (`kernels/moe.cu`).
pub const MOE: KernelSource = KernelSource {
    name: "moe",
    text: include_str!("../../kernels/moe.cu"),
};
/// Greedy argmax and seeded temperature / top-k / top-p sampling (`kernels/sample.cu`).
pub const SAMPLE: KernelSource = KernelSource {
    name: "sample",
    text: include_str!("../../kernels/sample.cu"),
};

/// PIC glue: generic GDR transition build, fp32 state arithmetic (`kernels/pic.cu`).
pub const PIC: KernelSource = KernelSource {
    name: "pic",
    text: include_str!("../../kernels/pic.cu"),
};

/// Deterministic random weights (`kernels/init.cu`; generator in `crate::random`).
pub const INIT: KernelSource = KernelSource {
    name: "init",
    text: include_str!("../../kernels/init.cu"),
};

/// Checksum of shipped cache entries on the device (`kernels/hash.cu`; CPU
/// reference in `crate::parallel::checksum`).
pub const HASH: KernelSource = KernelSource {
    name: "hash",
    text: include_str!("../../kernels/hash.cu"),
};

/// Lightning attention (Ring-linear): input preparation, the token recurrence, the
/// chunked prefill, group norm and gate, PIC state rotation (`kernels/lightning.cu`).
pub const LIGHTNING: KernelSource = KernelSource {
    name: "lightning",
    text: include_str!("../../kernels/lightning.cu"),
};

/// Lightning attention's chunked prefill on tensor cores for bf16
/// (`kernels/lightning_tc.cu`, [`super::lightning::chunked_tc`]).
pub const LIGHTNING_TC: KernelSource = KernelSource {
    name: "lightning_tc",
    text: include_str!("../../kernels/lightning_tc.cu"),
};

/// Kimi Delta Attention: input preparation, forget gate, per-token recurrence,
/// chunked prefill with `T_C`, sigmoid-gated norm (`kernels/kda.cu`, [`super::kda`]).
pub const KDA: KernelSource = KernelSource {
    name: "kda",
    text: include_str!("../../kernels/kda.cu"),
};

/// Chunked KDA prefill on tensor cores for bf16 with dk = dv = 128
/// (`kernels/kda_tc.cu`, [`super::kda::chunked_tc`]).
pub const KDA_TC: KernelSource = KernelSource {
    name: "kda_tc",
    text: include_str!("../../kernels/kda_tc.cu"),
};

/// Latent attention (MLA, NoPE): latent rows, absorbed queries, value expansion
/// (`kernels/mla.cu`, `cuda/kimi.rs`).
pub const MLA: KernelSource = KernelSource {
    name: "mla",
    text: include_str!("../../kernels/mla.cu"),
};

/// Every kernel module (used by the compile check and to warm the cache).
pub const ALL: [KernelSource; 20] = [
    NORM,
    ROPE,
    CONV,
    GDR,
    GDR_TC,
    ATTN,
    FLASH,
    FLASH_WG,
    MODEL,
    GEMV,
    MOE,
    SAMPLE,
    PIC,
    INIT,
    HASH,
    LIGHTNING,
    LIGHTNING_TC,
    KDA,
    KDA_TC,
    MLA,
];

/// NVRTC target name for a compute capability: `sm_90a` for 9.0 (Hopper, so that
/// arch-specific instructions are allowed), `sm_{major}{minor}` otherwise.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Directories passed to NVRTC with `--include-path` (for `cuda_bf16.h` and what it
/// includes). First match wins among `$HYPIC_CUDA_INCLUDE`, `$CUDA_HOME/include`,
/// `$CUDA_PATH/include`, `/usr/local/cuda/include`: the first that holds
/// `cuda_bf16.h`, plus its `cccl/` subfolder when present (CUDA 13 layout).
pub fn include_paths() -> Vec<String> {
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("HYPIC_CUDA_INCLUDE") {
        cands.push(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(p) = std::env::var(var) {
            cands.push(Path::new(&p).join("include"));
        }
    }
    cands.push(PathBuf::from("/usr/local/cuda/include"));
    for c in cands {
        if c.join("cuda_bf16.h").exists() {
            let mut v = vec![c.display().to_string()];
            let cccl = c.join("cccl");
            if cccl.is_dir() {
                v.push(cccl.display().to_string());
            }
            return v;
        }
    }
    Vec::new()
}

/// Default on-disk cache folder: `$HYPIC_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/hypic/kernels`, else `$HOME/.cache/hypic/kernels`, else
/// `/tmp/hypic-kernels`.
pub fn default_cache_dir() -> PathBuf {
    if let Ok(p) = std::env::var("HYPIC_KERNEL_CACHE") {
        return PathBuf::from(p);
    }
    if let Ok(p) = std::env::var("XDG_CACHE_HOME") {
        return Path::new(&p).join("hypic/kernels");
    }
    if let Ok(p) = std::env::var("HOME") {
        return Path::new(&p).join(".cache/hypic/kernels");
    }
    PathBuf::from("/tmp/hypic-kernels")
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    ensure_nvrtc()?;
    let (mut a, mut b) = (0i32, 0i32);
    // SAFETY: plain out-pointers to two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| CudaError::Nvrtc(format!("nvrtcVersion: {e:?}")))?;
    Ok((a, b))
}

/// Fails (instead of panicking inside cudarc) when libnvrtc cannot be loaded.
pub fn ensure_nvrtc() -> Result<()> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable(
            "libnvrtc could not be loaded (add the CUDA lib64 folder to LD_LIBRARY_PATH)".into(),
        ))
    }
}

/// The NVRTC options used for `arch` (besides the include paths).
pub fn options(arch: &str, includes: &[String]) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
    ];
    for i in includes {
        o.push(format!("--include-path={i}"));
    }
    o
}

/// Where a compiled module came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Read from the on-disk cache.
    DiskCache,
    /// Compiled by NVRTC now (and written to the cache when it is writable).
    Compiled,
}

/// Compiles `src` for `arch` (an `sm_XX[a]` name) to a CUBIN, using the disk cache in
/// `cache_dir` when given. Returns the CUBIN bytes and where they came from.
/// Errors carry the NVRTC log.
pub fn compile_cubin(
    src: &KernelSource,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<(Vec<u8>, Origin)> {
    ensure_nvrtc()?;
    let includes = include_paths();
    let opts = options(arch, &includes);
    let text = src.full_text();
    let (vmaj, vmin) = nvrtc_version()?;
    let mut hasher = Sha256::new();
    hasher.update(text.as_bytes());
    hasher.update([0]);
    hasher.update(arch.as_bytes());
    hasher.update([0]);
    // Include paths are where the headers live, not what is compiled: they stay out
    // of the key so that a cache built on one machine serves another with the same
    // NVRTC version (gpu-check.sh carries one).
    for o in opts.iter().filter(|o| !o.starts_with("--include-path=")) {
        hasher.update(o.as_bytes());
        hasher.update([0]);
    }
    hasher.update(format!("nvrtc {vmaj}.{vmin}").as_bytes());
    let key = hex::encode(&hasher.finalize()[..12]);
    let path = cache_dir.map(|d| d.join(format!("{}-{arch}-{key}.cubin", src.name)));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok((bytes, Origin::DiskCache));
            }
        }
    }
    let cubin = nvrtc_compile(&text, src.name, &opts)?;
    if let (Some(p), Some(d)) = (&path, cache_dir) {
        // The cache is an optimisation: an unwritable folder is not an error.
        if std::fs::create_dir_all(d).is_ok() {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &cubin).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    Ok((cubin, Origin::Compiled))
}

/// Runs NVRTC on `text` with `opts` and returns the CUBIN.
fn nvrtc_compile(text: &str, name: &str, opts: &[String]) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::{CStr, CString};
    let c_src =
        CString::new(text).map_err(|_| CudaError::Nvrtc("source holds a NUL byte".into()))?;
    let c_name = CString::new(format!("{name}.cu")).expect("no NUL in module names");
    let prog = result::create_program(&c_src, Some(&c_name))
        .map_err(|e| CudaError::Nvrtc(format!("{name}: create program: {e:?}")))?;
    // SAFETY: `prog` is a live program until destroyed at the end of this block; the
    // buffers handed to NVRTC are sized by the size queries just before.
    let out = unsafe {
        let r = result::compile_program(prog, opts);
        let out = match r {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(CudaError::Nvrtc(format!(
                    "{name}.cu failed to compile ({e:?}), options {opts:?}:\n{log}"
                )))
            }
            Ok(()) => {
                let mut n = 0usize;
                let mut buf = Vec::new();
                let r = sys::nvrtcGetCUBINSize(prog, &mut n).result().and_then(|_| {
                    buf = vec![0u8; n];
                    sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _).result()
                });
                if let Err(e) = r {
                    Err(CudaError::Nvrtc(format!("{name}: nvrtcGetCUBIN: {e:?}")))
                } else if buf.is_empty() {
                    Err(CudaError::Nvrtc(format!(
                        "{name}: NVRTC returned an empty CUBIN for {opts:?}"
                    )))
                } else {
                    Ok(buf)
                }
            }
        };
        let _ = result::destroy_program(prog);
        out
    };
    out
}
