//! Memory-mapped safetensors checkpoints (single file or sharded with
//! `model.safetensors.index.json`), converted to fp32 on access.
use crate::error::{io_err, Error, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

struct Shard {
    path: PathBuf,
    mmap: Mmap,
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
                mmap,
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
    /// Paths of the shard files.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// Loads tensor `name` as fp32 (row-major), checking its shape equals `expected`.
    ///
    /// Errors: missing tensor, wrong shape, unsupported dtype.
    pub fn get(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let e = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        })?;
        if e.shape != expected {
            return Err(Error::Shape {
                name: name.to_string(),
                got: e.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        self.read(name, e)
    }

    /// Loads tensor `name` as fp32 with whatever shape it has.
    pub fn get_any(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let e = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        })?;
        Ok((e.shape.clone(), self.read(name, e)?))
    }

    fn read(&self, name: &str, e: &Entry) -> Result<Vec<f32>> {
        let shard = &self.shards[e.shard];
        let bytes = &shard.mmap[shard.data_start + e.range.0..shard.data_start + e.range.1];
        let n: usize = e.shape.iter().product();
        let width = match e.dtype {
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
        Ok(match e.dtype {
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
