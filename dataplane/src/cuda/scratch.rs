//! Host-side cache of the forward's scratch buffers ([`Gpu::scratch`](super::Gpu::scratch)).
//!
//! Every forward allocates its activations per call: a decode step of the
//! Qwen3.5-35B-A3B shape takes hundreds of small buffers, and each stream-ordered
//! allocation plus its free costs two driver calls of host time (gpu_bench, "host cost
//! per device operation"; figures in benches/results/gpu-2026-11-30.md). Decode and HYPIC's per-segment work are bound by that host
//! time. A [`Scratch`] buffer goes back to this cache when dropped, keyed by its byte
//! size, and the next request of that size takes it without a driver call; decode asks
//! for the same sizes every step.
//!
//! Ordering: all work of a [`Gpu`](super::Gpu) is issued on its one stream, so a buffer
//! handed out again after a drop is only touched by work queued after everything that
//! used it before (the same guarantee `cuMemFreeAsync` / `cuMemAllocAsync` give on one
//! stream).
//!
//! Bounds: at most [`ScratchCache::capacity`] bytes are held (default
//! [`DEFAULT_CAPACITY`], `HYPIC_SCRATCH_CACHE_MB` overrides it, 0 turns the cache off),
//! and buffers larger than an eighth of that are never cached (a long prefill's
//! activations go back to the driver's pool). An allocation that fails for memory
//! flushes the cache and retries once.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, LaunchArgs, PushKernelArg};

/// Default bytes held by a [`ScratchCache`]: 512 MiB.
pub const DEFAULT_CAPACITY: usize = 512 << 20;

/// Cached device buffers by byte size, on one stream (see the module docs).
pub struct ScratchCache {
    stream: Arc<CudaStream>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    free: HashMap<usize, Vec<CUdeviceptr>>,
    held: usize,
    capacity: usize,
    hits: u64,
    misses: u64,
    /// While a CUDA graph is being captured: every buffer handed back is kept here
    /// (the graph refers to it), and buffers allocated for the capture.
    capture: Option<CaptureKeep>,
}

/// The scratch buffers a captured CUDA graph refers to ([`ScratchCache::begin_capture`],
/// [`ScratchCache::end_capture`]): they must live as long as the graph. Give them back
/// with [`ScratchCache::release`] once the graph can no longer run.
#[derive(Debug, Default)]
pub struct CaptureKeep {
    /// `(address, bytes)` of buffers that came from the cache.
    cached: Vec<(CUdeviceptr, usize)>,
    /// `(address, bytes)` of buffers allocated during the capture (`cuMemAlloc`).
    raw: Vec<(CUdeviceptr, usize)>,
}

impl CaptureKeep {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.cached.iter().chain(&self.raw).map(|b| b.1).sum()
    }
}

/// Counters of a [`ScratchCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScratchStats {
    /// Bytes held (cached, not handed out).
    pub held_bytes: usize,
    /// Capacity, bytes.
    pub capacity_bytes: usize,
    /// Requests served from the cache.
    pub hits: u64,
    /// Requests that went to the driver.
    pub misses: u64,
}

impl ScratchCache {
    /// An empty cache of `capacity` bytes for buffers of `stream`.
    pub fn new(stream: Arc<CudaStream>, capacity: usize) -> Arc<Self> {
        Arc::new(ScratchCache {
            stream,
            inner: Mutex::new(Inner {
                capacity,
                ..Inner::default()
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Capacity, bytes.
    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    /// Sets the capacity (0: no caching); buffers beyond it are freed.
    pub fn set_capacity(&self, bytes: usize) {
        let spill = {
            let mut g = self.lock();
            g.capacity = bytes;
            if g.held > bytes {
                g.held = 0;
                std::mem::take(&mut g.free)
            } else {
                HashMap::new()
            }
        };
        self.free_all(spill);
    }

    /// Frees every cached buffer (stream-ordered).
    pub fn flush(&self) {
        let spill = {
            let mut g = self.lock();
            g.held = 0;
            std::mem::take(&mut g.free)
        };
        self.free_all(spill);
    }

    /// Counters.
    pub fn stats(&self) -> ScratchStats {
        let g = self.lock();
        ScratchStats {
            held_bytes: g.held,
            capacity_bytes: g.capacity,
            hits: g.hits,
            misses: g.misses,
        }
    }

    /// A cached buffer of exactly `bytes`, if any (counts a hit or a miss).
    pub(crate) fn take(&self, bytes: usize) -> Option<CUdeviceptr> {
        let mut g = self.lock();
        let p = g.free.get_mut(&bytes).and_then(|v| v.pop());
        if p.is_some() {
            g.held -= bytes;
            g.hits += 1;
        } else {
            g.misses += 1;
        }
        p
    }

    /// Starts keeping every buffer handed back (see [`CaptureKeep`]) until
    /// [`ScratchCache::end_capture`]. Errors: a capture is already open.
    pub(crate) fn begin_capture(&self) -> Result<(), String> {
        let mut g = self.lock();
        if g.capture.is_some() {
            return Err("a scratch capture is already open".into());
        }
        g.capture = Some(CaptureKeep::default());
        Ok(())
    }

    /// Whether a capture is open ([`super::Gpu::scratch`] then allocates its misses with
    /// `cuMemAlloc`, which a stream capture does not record).
    pub(crate) fn capturing(&self) -> bool {
        self.lock().capture.is_some()
    }

    /// Records a buffer allocated for the open capture (kept until released).
    pub(crate) fn note_raw(&self, p: CUdeviceptr, bytes: usize) {
        if let Some(c) = self.lock().capture.as_mut() {
            c.raw.push((p, bytes));
        }
    }

    /// Ends the capture: the buffers kept since [`ScratchCache::begin_capture`].
    pub(crate) fn end_capture(&self) -> CaptureKeep {
        self.lock().capture.take().unwrap_or_default()
    }

    /// Gives back the buffers of a graph that can no longer run (the caller has waited
    /// for the stream): cached ones to the cache, allocated ones to the driver.
    pub(crate) fn release(&self, keep: CaptureKeep) {
        let raw: std::collections::HashSet<CUdeviceptr> = keep.raw.iter().map(|r| r.0).collect();
        for (p, bytes) in keep.cached {
            if raw.contains(&p) {
                continue;
            }
            // SAFETY: `p` is a live allocation of `bytes` bytes on this stream that came
            // from this cache (or cudarc's allocator) and is owned by the keep list alone.
            let b = unsafe { self.stream.upgrade_device_ptr::<u8>(p, bytes) };
            self.give(b);
        }
        for (p, _) in keep.raw {
            // SAFETY: `p` came from `cuMemAlloc_v2` during the capture and nothing refers
            // to it any more (the graph is gone and the stream was waited for).
            unsafe {
                let _ = cudarc::driver::sys::cuMemFree_v2(p);
            }
        }
    }

    /// Keeps `b` for the next request of its size, or frees it (too large, or the
    /// cache is full). While a capture is open it is kept for the graph instead.
    fn give<T>(&self, b: CudaSlice<T>) {
        let bytes = b.num_bytes();
        {
            let mut g = self.lock();
            if g.capture.is_some() {
                let p = b.leak();
                if let Some(c) = g.capture.as_mut() {
                    c.cached.push((p, bytes));
                }
                return;
            }
            if bytes > 0 && bytes <= g.capacity / 8 && g.held + bytes <= g.capacity {
                g.held += bytes;
                g.free.entry(bytes).or_default().push(b.leak());
                return;
            }
        }
        drop(b);
    }

    fn free_all(&self, bufs: HashMap<usize, Vec<CUdeviceptr>>) {
        for (bytes, ptrs) in bufs {
            for p in ptrs {
                // SAFETY: `p` came from `CudaSlice::leak` of a live allocation of `bytes`
                // bytes on this stream and is owned by the cache alone; dropping the
                // slice frees it the way cudarc frees its own (stream-ordered).
                drop(unsafe { self.stream.upgrade_device_ptr::<u8>(p, bytes) });
            }
        }
    }
}

impl Drop for ScratchCache {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A device buffer of [`Gpu::scratch`](super::Gpu::scratch): dereferences to its
/// `CudaSlice<T>` and returns to the [`ScratchCache`] when dropped. Kernel-argument
/// builders take `&*buf` / `&mut *buf`; [`Scratch::into_slice`] gives the plain slice for
/// buffers that outlive the forward (states, cache entries).
pub struct Scratch<T> {
    buf: ManuallyDrop<CudaSlice<T>>,
    cache: Arc<ScratchCache>,
}

impl<T> Scratch<T> {
    pub(crate) fn new(buf: CudaSlice<T>, cache: Arc<ScratchCache>) -> Self {
        Scratch {
            buf: ManuallyDrop::new(buf),
            cache,
        }
    }

    /// The plain buffer, no longer returned to the cache (freed when dropped).
    pub fn into_slice(self) -> CudaSlice<T> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so `buf` is taken exactly once and `cache` is
        // dropped exactly once here.
        unsafe {
            std::ptr::drop_in_place(&mut me.cache);
            ManuallyDrop::take(&mut me.buf)
        }
    }
}

impl<T> Deref for Scratch<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.buf
    }
}

impl<T> DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.buf
    }
}

impl<T> Drop for Scratch<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, in drop; `buf` is not used afterwards.
        let b = unsafe { ManuallyDrop::take(&mut self.buf) };
        self.cache.give(b);
    }
}

impl<T> std::fmt::Debug for Scratch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scratch({} elements)", self.buf.len())
    }
}

// Kernel arguments: a scratch buffer passes as its device pointer, like the slice.
// SAFETY: delegates to cudarc's impls for `&CudaSlice<T>` / `&mut CudaSlice<T>`, with the
// same lifetimes (the buffer outlives the launch arguments).
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b Scratch<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Scratch<T>) -> &mut Self {
        let s: &'b CudaSlice<T> = &arg.buf;
        <Self as PushKernelArg<&'b CudaSlice<T>>>::arg(self, s)
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut Scratch<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut Scratch<T>) -> &mut Self {
        let s: &'b mut CudaSlice<T> = &mut arg.buf;
        <Self as PushKernelArg<&'b mut CudaSlice<T>>>::arg(self, s)
    }
}
