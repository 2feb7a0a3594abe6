//! Guest SDK for HYPIC cache policies (ABI v2, documented in `policies/ABI.md`).
//!
//! A policy crate is a `#![no_std]` `cdylib` that calls exactly one of the
//! `eviction_policy!`, `admission_policy!`, `invalidation_policy!` or
//! `isolation_policy!` macros with a plain Rust function. The macro emits the
//! ABI exports (`hypic_abi_version`, `hypic_policy_kind`, `hypic_buf`,
//! `hypic_buf_cap`, `hypic_configure` and the hook), decodes the records the
//! host wrote into the exchange buffer, and encodes the answer. Every policy
//! also calls [`policy_params!`] once with its parameter schema (JSON, an
//! empty list for a policy without parameters): ABI v2 requires it, and the
//! console renders the parameters as a form from it.
#![no_std]

/// ABI version implemented by this SDK: 2, ABI v1 plus the `hypic.params`
/// custom section declaring the parameters (see [`policy_params!`]) and typed
/// parameter values (floats and strings besides integers and booleans).
pub const ABI_VERSION: i32 = 2;

/// Name of the Wasm custom section holding the parameter schema (JSON).
pub const PARAMS_SECTION: &str = "hypic.params";
/// Size of the exchange buffer in bytes.
pub const BUF_CAP: usize = 64 * 1024;
/// Size of one eviction candidate record.
pub const ENTRY_SIZE: usize = 56;
/// Size of the admission record.
pub const ADMIT_SIZE: usize = 56;
/// Size of the invalidation record.
pub const INVALIDATE_SIZE: usize = 48;
/// Size of the isolation record.
pub const ISOLATION_SIZE: usize = 24;
/// Maximum number of eviction candidates per call.
pub const MAX_CANDIDATES: usize = BUF_CAP / ENTRY_SIZE;
/// Maximum number of bytes of parameters kept by `hypic_configure`.
pub const PARAMS_CAP: usize = 4096;

/// Policy kind codes returned by `hypic_policy_kind`.
pub mod kind {
    /// Chooses a victim among cache entries.
    pub const EVICTION: i32 = 1;
    /// Decides whether a new entry enters the cache.
    pub const ADMISSION: i32 = 2;
    /// Decides whether an existing entry must be dropped.
    pub const INVALIDATION: i32 = 3;
    /// Decides whether a public segment may use the shared cache namespace.
    pub const ISOLATION: i32 = 4;
}

/// The exchange buffer shared with the host. Single-threaded guest.
#[doc(hidden)]
pub static mut BUF: [u8; BUF_CAP] = [0; BUF_CAP];
#[doc(hidden)]
pub static mut PARAMS: [u8; PARAMS_CAP] = [0; PARAMS_CAP];
#[doc(hidden)]
pub static mut PARAMS_LEN: usize = 0;

#[inline]
fn rd_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

#[inline]
fn rd_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

/// The exchange buffer as a byte slice.
#[doc(hidden)]
#[allow(static_mut_refs)]
pub fn buf() -> &'static [u8] {
    // SAFETY: wasm32-unknown-unknown guests are single-threaded and the host
    // only touches the buffer between calls.
    unsafe { &BUF[..] }
}

/// One cache entry offered as an eviction candidate.
#[derive(Clone, Copy, Debug, Default)]
pub struct Entry {
    /// Opaque entry id (hash of cache key).
    pub id: u64,
    /// Opaque tenant id (hash), 0 for the shared namespace.
    pub tenant: u64,
    /// Bytes the entry occupies.
    pub bytes: u64,
    /// Tokens that must be recomputed if the entry is evicted and needed again.
    pub recompute_tokens: u64,
    /// Last use, milliseconds since the epoch.
    pub last_use_ms: u64,
    /// Insertion time, milliseconds since the epoch.
    pub inserted_ms: u64,
    /// Number of hits since insertion.
    pub hits: u32,
    /// Flags: bit 0 = shared (public) entry, bit 1 = version superseded.
    pub flags: u32,
}

impl Entry {
    /// Decodes candidate `i` from the buffer.
    pub fn read(i: usize) -> Entry {
        let b = &buf()[i * ENTRY_SIZE..(i + 1) * ENTRY_SIZE];
        Entry {
            id: rd_u64(b, 0),
            tenant: rd_u64(b, 8),
            bytes: rd_u64(b, 16),
            recompute_tokens: rd_u64(b, 24),
            last_use_ms: rd_u64(b, 32),
            inserted_ms: rd_u64(b, 40),
            hits: rd_u32(b, 48),
            flags: rd_u32(b, 52),
        }
    }
}

/// Read-only view of the eviction candidates.
pub struct Candidates {
    n: usize,
}

impl Candidates {
    #[doc(hidden)]
    pub fn new(n: usize) -> Candidates {
        Candidates { n: if n > MAX_CANDIDATES { MAX_CANDIDATES } else { n } }
    }
    /// Number of candidates.
    pub fn len(&self) -> usize {
        self.n
    }
    /// True when there are no candidates.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Candidate `i` (`i < len()`).
    pub fn get(&self, i: usize) -> Entry {
        Entry::read(i)
    }
}

/// A new entry asking to be admitted.
#[derive(Clone, Copy, Debug, Default)]
pub struct Admit {
    /// Opaque entry id.
    pub id: u64,
    /// Opaque tenant id (hash).
    pub tenant: u64,
    /// Bytes the entry would occupy.
    pub bytes: u64,
    /// Tokens the entry saves on a hit.
    pub recompute_tokens: u64,
    /// Bytes the tenant already holds in this cache.
    pub tenant_used_bytes: u64,
    /// Total capacity of the cache in bytes.
    pub capacity_bytes: u64,
    /// How many times this entry has been requested, including now.
    pub seen_count: u32,
    /// Flags: bit 0 = shared (public) entry.
    pub flags: u32,
}

impl Admit {
    #[doc(hidden)]
    pub fn read() -> Admit {
        let b = buf();
        Admit {
            id: rd_u64(b, 0),
            tenant: rd_u64(b, 8),
            bytes: rd_u64(b, 16),
            recompute_tokens: rd_u64(b, 24),
            tenant_used_bytes: rd_u64(b, 32),
            capacity_bytes: rd_u64(b, 40),
            seen_count: rd_u32(b, 48),
            flags: rd_u32(b, 52),
        }
    }
}

/// An existing entry checked for invalidation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Check {
    /// Opaque entry id.
    pub id: u64,
    /// Opaque tenant id (hash).
    pub tenant: u64,
    /// Bytes the entry occupies.
    pub bytes: u64,
    /// Insertion time, milliseconds since the epoch.
    pub inserted_ms: u64,
    /// Last use, milliseconds since the epoch.
    pub last_use_ms: u64,
    /// Flags: bit 0 = shared entry, bit 1 = the segment version was superseded.
    pub flags: u32,
}

impl Check {
    /// True when a newer version of the segment exists.
    pub fn superseded(&self) -> bool {
        self.flags & 2 != 0
    }
    #[doc(hidden)]
    pub fn read() -> Check {
        let b = buf();
        Check {
            id: rd_u64(b, 0),
            tenant: rd_u64(b, 8),
            bytes: rd_u64(b, 16),
            inserted_ms: rd_u64(b, 24),
            last_use_ms: rd_u64(b, 32),
            flags: rd_u32(b, 40),
        }
    }
}

/// A segment about to be given a cache namespace.
#[derive(Clone, Copy, Debug, Default)]
pub struct Isolation {
    /// Opaque segment id.
    pub segment: u64,
    /// Opaque tenant id (hash).
    pub tenant: u64,
    /// Flags: bit 0 = segment is explicitly public, bit 1 = tenant owns it.
    pub flags: u32,
}

impl Isolation {
    /// True when the segment is explicitly public.
    pub fn public(&self) -> bool {
        self.flags & 1 != 0
    }
    #[doc(hidden)]
    pub fn read() -> Isolation {
        let b = buf();
        Isolation { segment: rd_u64(b, 0), tenant: rd_u64(b, 8), flags: rd_u32(b, 16) }
    }
}

/// The raw text of parameter `name` from the `name=value` lines the host
/// passed to `hypic_configure` (the policy's params, flattened and completed
/// with the schema's defaults), `None` when absent or not UTF-8.
#[allow(static_mut_refs)]
pub fn param_str(name: &str) -> Option<&'static str> {
    // SAFETY: single-threaded guest; PARAMS is only written by hypic_configure.
    let p: &'static [u8] = unsafe { &PARAMS[..PARAMS_LEN] };
    for line in p.split(|&c| c == b'\n') {
        let mut it = line.splitn(2, |&c| c == b'=');
        let k = it.next().unwrap_or(&[]);
        let v = match it.next() {
            Some(v) => v,
            None => continue,
        };
        if k == name.as_bytes() {
            return core::str::from_utf8(v).ok();
        }
    }
    None
}

/// Integer parameter `name` (declared `int`, or `bool` as `0`/`1`); `None`
/// when absent or not an integer.
pub fn param(name: &str) -> Option<i64> {
    param_str(name).and_then(|v| parse_i64(v.as_bytes()))
}

/// Floating-point parameter `name` (declared `float`; an integer value reads
/// too); `None` when absent or not a number.
pub fn param_f64(name: &str) -> Option<f64> {
    param_str(name).and_then(|v| v.parse::<f64>().ok())
}

/// Boolean parameter `name` (declared `bool`, passed as `0` or `1`).
pub fn param_bool(name: &str) -> Option<bool> {
    match param_str(name) {
        Some("1") => Some(true),
        Some("0") => Some(false),
        _ => None,
    }
}

fn parse_i64(v: &[u8]) -> Option<i64> {
    let (neg, digits) = match v.first() {
        Some(b'-') => (true, &v[1..]),
        _ => (false, v),
    };
    if digits.is_empty() {
        return None;
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add((d - b'0') as i64)?;
    }
    Some(if neg { -n } else { n })
}

#[doc(hidden)]
#[allow(static_mut_refs)]
pub fn configure(len: i32) -> i32 {
    if len < 0 || len as usize > PARAMS_CAP || len as usize > BUF_CAP {
        return -1;
    }
    let len = len as usize;
    // SAFETY: single-threaded guest.
    unsafe {
        PARAMS[..len].copy_from_slice(&BUF[..len]);
        PARAMS_LEN = len;
    }
    0
}

/// Declares the policy's parameters: emits the `hypic.params` custom section
/// with `$json`, a string constant holding the schema, e.g.
///
/// ```ignore
/// hypic_policy_sdk::policy_params!(r#"{"params": [
///   {"name": "ttl_ms", "type": "int", "min": 0, "default": 3600000,
///    "description": "entries older than this are dropped, ms"}
/// ]}"#);
/// ```
///
/// Types: `int` (`min`/`max` integers), `float` (`min`/`max` numbers),
/// `bool`, `string` (`max_len`, default 256), `enum` (`choices`, a list of
/// strings). `default` is required; `description` is optional. The host
/// checks the schema at upload and every parameter value against it.
#[macro_export]
macro_rules! policy_params {
    ($json:expr) => {
        const __HYPIC_PARAMS_JSON: &str = $json;
        #[link_section = "hypic.params"]
        #[used]
        static __HYPIC_PARAMS: [u8; __HYPIC_PARAMS_JSON.len()] = {
            let b = __HYPIC_PARAMS_JSON.as_bytes();
            let mut a = [0u8; __HYPIC_PARAMS_JSON.len()];
            let mut i = 0;
            while i < b.len() {
                a[i] = b[i];
                i += 1;
            }
            a
        };
    };
}

/// Emits the exports shared by every policy kind.
#[doc(hidden)]
#[macro_export]
macro_rules! __common_exports {
    ($kind:expr) => {
        #[no_mangle]
        pub extern "C" fn hypic_abi_version() -> i32 {
            $crate::ABI_VERSION
        }
        #[no_mangle]
        pub extern "C" fn hypic_policy_kind() -> i32 {
            $kind
        }
        #[no_mangle]
        #[allow(static_mut_refs)]
        pub extern "C" fn hypic_buf() -> i32 {
            // SAFETY: address of a static; wasm32 pointers fit in i32.
            unsafe { $crate::BUF.as_ptr() as i32 }
        }
        #[no_mangle]
        pub extern "C" fn hypic_buf_cap() -> i32 {
            $crate::BUF_CAP as i32
        }
        #[no_mangle]
        pub extern "C" fn hypic_configure(len: i32) -> i32 {
            $crate::configure(len)
        }
        #[cfg(target_arch = "wasm32")]
        #[panic_handler]
        fn panic(_: &core::panic::PanicInfo) -> ! {
            core::arch::wasm32::unreachable()
        }
    };
}

/// Declares an eviction policy: `fn(&Candidates, now_ms: u64) -> usize`
/// returning the index of the victim.
#[macro_export]
macro_rules! eviction_policy {
    ($f:path) => {
        $crate::__common_exports!($crate::kind::EVICTION);
        #[no_mangle]
        pub extern "C" fn hypic_evict(n: i32, now_ms: i64) -> i32 {
            let c = $crate::Candidates::new(if n < 0 { 0 } else { n as usize });
            $f(&c, now_ms as u64) as i32
        }
    };
}

/// Declares an admission policy: `fn(&Admit, now_ms: u64) -> bool`.
#[macro_export]
macro_rules! admission_policy {
    ($f:path) => {
        $crate::__common_exports!($crate::kind::ADMISSION);
        #[no_mangle]
        pub extern "C" fn hypic_admit(now_ms: i64) -> i32 {
            $f(&$crate::Admit::read(), now_ms as u64) as i32
        }
    };
}

/// Declares an invalidation policy: `fn(&Check, now_ms: u64) -> bool`
/// returning true when the entry must be dropped.
#[macro_export]
macro_rules! invalidation_policy {
    ($f:path) => {
        $crate::__common_exports!($crate::kind::INVALIDATION);
        #[no_mangle]
        pub extern "C" fn hypic_invalidate(now_ms: i64) -> i32 {
            $f(&$crate::Check::read(), now_ms as u64) as i32
        }
    };
}

/// Declares an isolation policy: `fn(&Isolation) -> bool` returning true when
/// the segment may use the shared namespace (the host only honours it for
/// explicitly public segments).
#[macro_export]
macro_rules! isolation_policy {
    ($f:path) => {
        $crate::__common_exports!($crate::kind::ISOLATION);
        #[no_mangle]
        pub extern "C" fn hypic_isolation() -> i32 {
            $f(&$crate::Isolation::read()) as i32
        }
    };
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    /// Writes `lines` into the exchange buffer and configures, as the host does.
    #[allow(static_mut_refs)]
    fn configure_with(lines: &str) {
        // SAFETY: the tests run one at a time (see `params_read_back_by_type`).
        unsafe {
            BUF[..lines.len()].copy_from_slice(lines.as_bytes());
        }
        assert_eq!(configure(lines.len() as i32), 0);
    }

    #[test]
    fn params_read_back_by_type() {
        configure_with("limit=7\nratio=0.25\nstrict=1\nmode=lfu\nneg=-3\n");
        assert_eq!(param("limit"), Some(7));
        assert_eq!(param("neg"), Some(-3));
        assert_eq!(param_f64("ratio"), Some(0.25));
        assert_eq!(param_f64("limit"), Some(7.0));
        assert_eq!(param_bool("strict"), Some(true));
        assert_eq!(param_str("mode"), Some("lfu"));
        assert_eq!(param("mode"), None, "not an integer");
        assert_eq!(param("ratio"), None, "not an integer");
        assert_eq!(param_bool("limit"), None);
        assert_eq!(param("missing"), None);
        assert_eq!(configure(-1), -1);
        assert_eq!(configure((PARAMS_CAP + 1) as i32), -1);
        configure_with("");
        assert_eq!(param("limit"), None);
    }
}
