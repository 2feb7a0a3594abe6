//! Memory-mapped safetensors checkpoints (single file or sharded with
//! `model.safetensors.index.json`): read as fp32 per tensor ([`Checkpoint::get`]), or
//! as the raw bytes of one tensor in its own dtype ([`Checkpoint::raw`], for the GPU
//! loader that streams tensors to the device without a whole-model host copy).
use crate::error::{io_err, Error, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct Shard {
    path: PathBuf,
    mmap: Arc<Mmap>,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
}

struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the data section.
    range: (usize, usize),
}

/// A checkpoint: every tensor name mapped to its bytes in a memory-mapped shard.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or else `dir/model.safetensors`,
    /// or else every `*.safetensors` file in `dir`.
    ///
    /// Errors: no weight files, unreadable file, corrupt header (names the file).
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
                path: index.clone(),
                msg: e.to_string(),
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Json {
                    path: index.clone(),
                    msg: "missing object `weight_map`".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|x| x.as_str().map(String::from))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            let rd = std::fs::read_dir(dir).map_err(io_err(dir))?;
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            if v.is_empty() {
                return Err(Error::Io {
                    path: dir.join("model.safetensors"),
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "no *.safetensors weight files",
                    ),
                });
            }
            v
        };
        let mut shards = Vec::new();
        let mut entries = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(io_err(&path))?;
            // SAFETY: the file is opened read-only; checkpoints are not modified while served.
            let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
            let (header_len, meta) =
                SafeTensors::read_metadata(&mmap[..]).map_err(|e| Error::Safetensors {
                    path: path.clone(),
                    msg: e.to_string(),
                })?;
            let data_start = 8 + header_len;
            let data_len = mmap.len() - data_start;
            for (name, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                if b > data_len || a > b {
                    return Err(Error::Safetensors {
                        path: path.clone(),
                        msg: format!("tensor `{name}` data offsets {a}..{b} exceed the data section ({data_len} bytes)"),
                    });
                }
                entries.insert(
                    name.clone(),
                    Entry {
                        shard: shards.len(),
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        range: (a, b),
                    },
                );
            }
            shards.push(Shard {
                path,
                mmap: Arc::new(mmap),
                data_start,
            });
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            entries,
        })
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// True when the checkpoint has no tensors.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// True when a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }
    /// Shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }
    /// Stored dtype of a tensor, if present.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.entries.get(name).map(|e| e.dtype)
    }
    /// Paths of the shard files.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// The index entry of tensor `name`, checking its shape equals `expected` when
    /// given. Errors: missing tensor, wrong shape.
    fn entry(&self, name: &str, expected: Option<&[usize]>) -> Result<&Entry> {
        let e = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        })?;
        if let Some(expected) = expected.filter(|x| e.shape != *x) {
            return Err(Error::Shape {
                name: name.to_string(),
                got: e.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        Ok(e)
    }

    /// Loads tensor `name` as fp32 (row-major), checking its shape equals `expected`.
    ///
    /// Errors: missing tensor, wrong shape, unsupported dtype.
    pub fn get(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let e = self.entry(name, Some(expected))?;
        self.read(name, e)
    }

    /// `−exp(A_log)` of the GDN decay tensor `name` `[n]` (the model's stored `−A`):
    /// computed in f64 when the checkpoint stores `A_log` as `F64` (so that a value
    /// written as `ln(A)` in f64 gives back the f32 `A` exactly, as
    /// `random-checkpoint` does), else in f32 from the fp32 widening (HF checkpoints).
    ///
    /// Errors: as [`Checkpoint::get`].
    pub fn neg_a(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        self.neg_a_shaped(name, &[n])
    }

    /// [`Checkpoint::neg_a`] for a tensor stored with shape `shape` (e.g. Kimi-Linear's
    /// `A_log [1, 1, H, 1]`): `−exp` of every element, in storage order.
    ///
    /// Errors: as [`Checkpoint::get`].
    pub fn neg_a_shaped(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let raw = self.raw(name, shape)?;
        if raw.dtype == Dtype::F64 {
            return Ok(raw
                .bytes
                .chunks_exact(8)
                .map(|c| -(f64::from_le_bytes(c.try_into().expect("8-byte chunk")).exp() as f32))
                .collect());
        }
        Ok(self.get(name, shape)?.iter().map(|a| -a.exp()).collect())
    }

    /// Tensor `name` as fp32 weight storage, checking its shape equals `expected`:
    /// the mapping itself, no copy, when the tensor is stored as `F32` at a 4-byte
    /// aligned offset (an f32 checkpoint); else converted into an owned buffer as
    /// [`Checkpoint::get`] does (and the tensor's pages released).
    ///
    /// Errors: as [`Checkpoint::get`].
    pub fn get_buf(&self, name: &str, expected: &[usize]) -> Result<F32Buf> {
        let raw = self.raw(name, expected)?;
        if cfg!(target_endian = "little")
            && raw.dtype == Dtype::F32
            && (raw.bytes.as_ptr() as usize).is_multiple_of(4)
        {
            let e = &self.entries[name];
            let shard = &self.shards[e.shard];
            let start = shard.data_start + e.range.0;
            return Ok(F32Buf(Repr::Mapped {
                map: shard.mmap.clone(),
                start,
                len: raw.bytes.len() / 4,
            }));
        }
        let v = self.get(name, expected)?;
        self.release(name);
        Ok(F32Buf(Repr::Owned(v)))
    }

    /// Loads tensor `name` as fp32 with whatever shape it has.
    pub fn get_any(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let e = self.entry(name, None)?;
        Ok((e.shape.clone(), self.read(name, e)?))
    }

    /// The stored bytes of tensor `name` (little-endian, row-major, in the mapping:
    /// no copy), checking its shape equals `expected` and its byte length matches the
    /// dtype (`F32`, `F64`, `BF16` or `F16`).
    ///
    /// Errors: missing tensor, wrong shape, unsupported dtype, inconsistent length.
    pub fn raw(&self, name: &str, expected: &[usize]) -> Result<RawTensor<'_>> {
        let e = self.entry(name, Some(expected))?;
        Ok(RawTensor {
            dtype: e.dtype,
            bytes: self.bytes(name, e)?,
        })
    }

    /// Tells the kernel that the pages of tensor `name` are not needed any more
    /// (`madvise(MADV_DONTNEED)` on the mapping): they leave this process's resident
    /// set (the file's data stays in the page cache, or in tmpfs), so a loader that
    /// releases each tensor after copying it keeps its peak resident memory at about
    /// one tensor instead of the whole checkpoint. The range is widened to whole
    /// pages; a neighbouring tensor that shares a page is read again from the page
    /// cache if touched later. A missing name is ignored.
    pub fn release(&self, name: &str) {
        let Some(e) = self.entries.get(name) else {
            return;
        };
        let shard = &self.shards[e.shard];
        let (a, b) = (shard.data_start + e.range.0, shard.data_start + e.range.1);
        if b > a {
            // SAFETY: the mapping is a read-only shared file mapping: MADV_DONTNEED drops
            // only this process's page-table entries, and a later access reads the same
            // bytes back from the file. No `&[u8]` into the range outlives a loader's use
            // of it being finished (callers release a tensor after its copy).
            let _ = unsafe {
                shard
                    .mmap
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, b - a)
            };
        }
    }

    fn bytes(&self, name: &str, e: &Entry) -> Result<&[u8]> {
        let shard = &self.shards[e.shard];
        let bytes = &shard.mmap[shard.data_start + e.range.0..shard.data_start + e.range.1];
        let n: usize = e.shape.iter().product();
        let width = match e.dtype {
            Dtype::F64 => 8,
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            d => {
                return Err(Error::Dtype {
                    name: name.to_string(),
                    dtype: format!("{d:?}"),
                })
            }
        };
        if bytes.len() != n * width {
            return Err(Error::Safetensors {
                path: shard.path.clone(),
                msg: format!(
                    "tensor `{name}` has {} bytes, shape {:?} needs {}",
                    bytes.len(),
                    e.shape,
                    n * width
                ),
            });
        }
        Ok(bytes)
    }

    fn read(&self, name: &str, e: &Entry) -> Result<Vec<f32>> {
        let bytes = self.bytes(name, e)?;
        Ok(match e.dtype {
            Dtype::F64 => bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8-byte chunk")) as f32)
                .collect(),
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        })
    }
}

/// One tensor's stored bytes ([`Checkpoint::raw`]).
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    /// Stored element type (`F32`, `F64`, `BF16` or `F16`).
    pub dtype: Dtype,
    /// Little-endian elements, row-major; `len = elements · width(dtype)`.
    pub bytes: &'a [u8],
}

/// fp32 weight storage of the CPU model: an owned buffer, or a range of a checkpoint's
/// memory mapping used in place ([`Checkpoint::get_buf`]). Reads through `Deref` to
/// `[f32]`; a mutable access to a mapped buffer first copies it (copy on write).
#[derive(Clone)]
pub struct F32Buf(Repr);

#[derive(Clone)]
enum Repr {
    Owned(Vec<f32>),
    /// `len` f32 values at byte `start` of `map` (4-byte aligned, checked at creation).
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
    },
}

impl F32Buf {
    /// True when the values are read in place from a checkpoint mapping.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Repr::Mapped { .. })
    }

    /// Elements `a..b` as a buffer of their own (sharing the mapping when mapped).
    ///
    /// Panics when the range is out of bounds.
    pub fn range(&self, a: usize, b: usize) -> F32Buf {
        assert!(
            a <= b && b <= self.len(),
            "range {a}..{b} of {}",
            self.len()
        );
        match &self.0 {
            Repr::Owned(v) => F32Buf(Repr::Owned(v[a..b].to_vec())),
            Repr::Mapped { map, start, .. } => F32Buf(Repr::Mapped {
                map: map.clone(),
                start: start + 4 * a,
                len: b - a,
            }),
        }
    }
}

impl From<Vec<f32>> for F32Buf {
    fn from(v: Vec<f32>) -> Self {
        F32Buf(Repr::Owned(v))
    }
}

impl std::ops::Deref for F32Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.0 {
            Repr::Owned(v) => v,
            Repr::Mapped { map, start, len } => {
                let bytes = &map[*start..*start + 4 * len];
                // SAFETY: `start` is 4-byte aligned in a page-aligned mapping (checked in
                // `get_buf`, kept by `range`), the bytes are in bounds, every bit
                // pattern is a valid f32, and the host is little-endian like the file.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), *len) }
            }
        }
    }
}

impl std::ops::DerefMut for F32Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        if let Repr::Mapped { .. } = self.0 {
            self.0 = Repr::Owned(self.to_vec());
        }
        match &mut self.0 {
            Repr::Owned(v) => v,
            Repr::Mapped { .. } => unreachable!("converted to owned above"),
        }
    }
}

impl PartialEq for F32Buf {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for F32Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "F32Buf({} values, {})",
            self.len(),
            if self.is_mapped() { "mapped" } else { "owned" }
        )
    }
}
