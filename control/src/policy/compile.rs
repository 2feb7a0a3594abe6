//! Compiled policy modules, cached by content hash.
//!
//! Compiling a Wasm module to native code is CPU-heavy (seconds for a module of
//! megabytes), so the server never does it on an async worker thread: the
//! async path ([`ModuleCache::get`]) compiles on tokio's blocking pool, at most
//! `max_concurrent` modules at once, and each distinct module (SHA-256 of its
//! bytes) is compiled once while it stays in the cache: upload, activation,
//! rollback and dry run of the same module share one compilation. Concurrent
//! requests for the same module wait for the one compilation in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tokio::sync::{OnceCell, Semaphore};
use wasmtime::{Engine, Module};

use super::wasm::{compile, PolicyError};

/// Compiled modules kept (least recently used dropped first).
pub const MODULE_CACHE_ENTRIES: usize = 16;

type Slot = Arc<OnceCell<Module>>;

/// A bounded cache of compiled modules keyed by the SHA-256 of their bytes,
/// with a cap on concurrent compilations and a compilation counter.
pub struct ModuleCache {
    engine: Engine,
    max_module_bytes: usize,
    max_concurrent: usize,
    permits: Arc<Semaphore>,
    slots: Mutex<hashlink::LruCache<[u8; 32], Slot>>,
    compiles: Arc<AtomicU64>,
}

impl ModuleCache {
    /// A cache over `engine` refusing modules over `max_module_bytes` and
    /// compiling at most `max_concurrent` (at least 1) modules at once.
    pub fn new(engine: Engine, max_module_bytes: usize, max_concurrent: usize) -> ModuleCache {
        let max_concurrent = max_concurrent.max(1);
        ModuleCache {
            engine,
            max_module_bytes,
            max_concurrent,
            permits: Arc::new(Semaphore::new(max_concurrent)),
            slots: Mutex::new(hashlink::LruCache::new(MODULE_CACHE_ENTRIES)),
            compiles: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Modules compiled so far (cache hits not counted).
    pub fn compiles(&self) -> u64 {
        self.compiles.load(Ordering::Relaxed)
    }

    /// Compiled modules held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no module is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, hashlink::LruCache<[u8; 32], Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, bytes: &[u8]) -> Slot {
        let key: [u8; 32] = Sha256::digest(bytes).into();
        let mut m = self.lock();
        if let Some(s) = m.get(&key) {
            return s.clone();
        }
        let s: Slot = Arc::default();
        m.insert(key, s.clone());
        s
    }

    fn check_size(&self, bytes: &[u8]) -> Result<(), PolicyError> {
        if bytes.len() > self.max_module_bytes {
            return Err(PolicyError::TooLarge {
                bytes: bytes.len(),
                limit: self.max_module_bytes,
            });
        }
        Ok(())
    }

    /// The compiled module of `bytes`, compiling it on the calling thread on a
    /// miss (for tools, tests and other synchronous callers; servers use
    /// [`ModuleCache::get`]).
    pub fn get_blocking(&self, bytes: &[u8]) -> Result<Module, PolicyError> {
        self.check_size(bytes)?;
        let slot = self.slot(bytes);
        if let Some(m) = slot.get() {
            return Ok(m.clone());
        }
        let m = compile(&self.engine, bytes, self.max_module_bytes)?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let _ = slot.set(m.clone());
        Ok(m)
    }

    /// The compiled module of `bytes`: from the cache, or compiled on the
    /// blocking pool. With `wait` false, a compilation that would exceed the
    /// concurrency cap is refused with [`PolicyError::Busy`] instead of
    /// queueing; with `wait` true it waits for a free slot.
    ///
    /// Errors: [`PolicyError::TooLarge`] (nothing compiled),
    /// [`PolicyError::Busy`], [`PolicyError::Invalid`] (does not compile or
    /// imports something).
    pub async fn get(&self, bytes: Arc<[u8]>, wait: bool) -> Result<Module, PolicyError> {
        self.check_size(&bytes)?;
        let slot = self.slot(&bytes);
        let m = slot
            .get_or_try_init(|| async {
                let permit = if wait {
                    self.permits.clone().acquire_owned().await.map_err(|_| {
                        PolicyError::Invalid("the module compiler is shut down".into())
                    })?
                } else {
                    self.permits
                        .clone()
                        .try_acquire_owned()
                        .map_err(|_| PolicyError::Busy {
                            limit: self.max_concurrent,
                        })?
                };
                let (engine, limit, count) = (
                    self.engine.clone(),
                    self.max_module_bytes,
                    self.compiles.clone(),
                );
                // The permit travels with the job: a cancelled request does not
                // free the slot before the compiler is really done.
                tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    let r = compile(&engine, &bytes, limit);
                    if r.is_ok() {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                    r
                })
                .await
                .map_err(|e| PolicyError::Invalid(format!("the compiler failed: {e}")))?
            })
            .await?;
        Ok(m.clone())
    }
}
