//! The wasmtime sandbox around one policy module (ABI v1 and v2,
//! `policies/ABI.md`).

use wasmtime::{
    Config, Engine, Instance, Memory, Module, Store, StoreLimits, StoreLimitsBuilder, Trap,
    TypedFunc, ValType,
};

use super::params::{encode_resolved, read_schema, resolve, ParamSchema, PARAMS_SECTION};
use super::{PolicyKind, PolicyLimits};

/// The `hypic_abi_version` answers the host accepts: 1 (integer parameters,
/// schema optional) and 2 (parameter schema required, typed values).
pub const ABI_VERSIONS: [i32; 2] = [1, 2];

/// Why a policy module could not be loaded or a call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The module failed validation (compile, imports, exports, signatures,
    /// limits, ABI version, kind, buffer).
    #[error("invalid policy module: {0}")]
    Invalid(String),
    /// The call ran out of fuel (time budget).
    #[error("policy ran out of fuel (timeout)")]
    Timeout,
    /// The call hit the memory limit.
    #[error("policy exceeded its memory limit")]
    Memory,
    /// The call trapped.
    #[error("policy trapped: {0}")]
    Trap(String),
    /// The call returned a value outside the allowed range.
    #[error("policy returned an invalid value: {0}")]
    BadReturn(String),
    /// The module is larger than the configured limit (nothing was compiled).
    #[error(
        "policy module is {bytes} bytes, over the limit of {limit} bytes (policy_max_module_bytes)"
    )]
    TooLarge {
        /// Size of the module, bytes.
        bytes: usize,
        /// The limit, bytes.
        limit: usize,
    },
    /// The module's parameter schema (`hypic.params` section) is malformed.
    #[error("invalid parameter schema: {0}")]
    Schema(String),
    /// A parameter value does not match the module's schema (`name` is the
    /// parameter, empty when `params` itself is not an object).
    #[error("invalid parameter: {message}")]
    Param {
        /// The parameter.
        name: String,
        /// What is wrong with it.
        message: String,
    },
    /// As many modules as allowed are compiling already; try again later.
    #[error("{limit} policy module(s) are compiling already (policy_max_concurrent_compiles); retry later")]
    Busy {
        /// The cap on concurrent compilations.
        limit: usize,
    },
}

impl PolicyError {
    /// Short label used in metrics and audit rows.
    pub fn label(&self) -> &'static str {
        match self {
            PolicyError::Invalid(_)
            | PolicyError::TooLarge { .. }
            | PolicyError::Schema(_)
            | PolicyError::Param { .. } => "load",
            PolicyError::Busy { .. } => "busy",
            PolicyError::Timeout => "timeout",
            PolicyError::Memory => "memory",
            PolicyError::Trap(_) => "trap",
            PolicyError::BadReturn(_) => "bad_return",
        }
    }
}

/// Creates the wasmtime engine used for policies (fuel metering on).
pub fn policy_engine() -> Engine {
    let mut c = Config::new();
    c.consume_fuel(true);
    c.max_wasm_stack(256 * 1024);
    c.cranelift_opt_level(wasmtime::OptLevel::Speed);
    Engine::new(&c).expect("static wasmtime config is valid")
}

struct Host {
    limits: StoreLimits,
}

enum Hook {
    Evict(TypedFunc<(i32, i64), i32>),
    Admit(TypedFunc<i64, i32>),
    Invalidate(TypedFunc<i64, i32>),
    Isolation(TypedFunc<(), i32>),
}

/// An instantiated, validated policy module.
pub struct WasmPolicy {
    engine: Engine,
    module: Module,
    kind: PolicyKind,
    params: Vec<u8>,
    has_schema: bool,
    limits: PolicyLimits,
    inst: Option<Live>,
}

struct Live {
    store: Store<Host>,
    memory: Memory,
    buf: usize,
    cap: usize,
    hook: Hook,
}

/// `s` on one line: runs of whitespace (line breaks included) become one space.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn classify(e: wasmtime::Error) -> PolicyError {
    if let Some(t) = e.downcast_ref::<Trap>() {
        return match t {
            Trap::OutOfFuel => PolicyError::Timeout,
            Trap::AllocationTooLarge => PolicyError::Memory,
            other => PolicyError::Trap(other.to_string()),
        };
    }
    // One line: a backtrace's frames run on after a colon.
    let msg = one_line(&format!("{e:#}"));
    if msg.contains("memory") && (msg.contains("grow") || msg.contains("limit")) {
        PolicyError::Memory
    } else {
        PolicyError::Trap(msg)
    }
}

/// Flattens a params JSON object to the `name=value\n` lines of the ABI.
pub fn encode_params(params: &serde_json::Value) -> Result<Vec<u8>, PolicyError> {
    let obj = match params {
        serde_json::Value::Null => return Ok(vec![]),
        serde_json::Value::Object(o) => o,
        _ => {
            return Err(PolicyError::Param {
                name: String::new(),
                message: "params must be a JSON object".into(),
            })
        }
    };
    let mut out = String::new();
    for (k, v) in obj {
        if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(PolicyError::Param {
                name: k.clone(),
                message: format!("param name {k:?} must be [A-Za-z0-9_]+"),
            });
        }
        let n = match v {
            serde_json::Value::Bool(b) => *b as i64,
            serde_json::Value::Number(n) => n.as_i64().ok_or_else(|| PolicyError::Param {
                name: k.clone(),
                message: format!(
                    "{k} must be an integer (allowed: from {} to {}), got {n}",
                    i64::MIN,
                    i64::MAX
                ),
            })?,
            _ => {
                return Err(PolicyError::Param {
                    name: k.clone(),
                    message: format!("{k} must be an integer or boolean, got {v}"),
                })
            }
        };
        out.push_str(&format!("{k}={n}\n"));
    }
    if out.len() > 4096 {
        return Err(PolicyError::Invalid("params exceed 4096 bytes".into()));
    }
    Ok(out.into_bytes())
}

impl WasmPolicy {
    /// Compiles, instantiates and validates a module of `kind` (compiles on the
    /// calling thread; the server goes through [`super::PolicyRuntime`]'s module
    /// cache instead).
    pub fn load(
        engine: &Engine,
        kind: PolicyKind,
        bytes: &[u8],
        params: &serde_json::Value,
        limits: PolicyLimits,
    ) -> Result<WasmPolicy, PolicyError> {
        let module = compile(engine, bytes, limits.max_module_bytes)?;
        let schema = read_schema(bytes)?;
        WasmPolicy::from_module(engine, kind, module, schema.as_ref(), params, limits)
    }

    /// Instantiates and validates an already compiled module of `kind` (see
    /// [`compile`]). Cheap next to compiling: no code generation happens here.
    /// `schema` is the module's declared parameter schema ([`read_schema`] of
    /// its bytes): with one, `params` is checked against it and completed with
    /// the defaults ([`resolve`]); without, `params` must be integers and
    /// booleans (ABI v1).
    ///
    /// Errors: [`PolicyError::Param`] for a parameter the schema refuses,
    /// [`PolicyError::Invalid`] for a module that does not load.
    pub fn from_module(
        engine: &Engine,
        kind: PolicyKind,
        module: Module,
        schema: Option<&ParamSchema>,
        params: &serde_json::Value,
        limits: PolicyLimits,
    ) -> Result<WasmPolicy, PolicyError> {
        let params = match schema {
            Some(s) => encode_resolved(&resolve(s, params)?)?,
            None => encode_params(params)?,
        };
        check_exports(&module, kind)?;
        let mut p = WasmPolicy {
            engine: engine.clone(),
            module,
            kind,
            params,
            has_schema: schema.is_some(),
            limits,
            inst: None,
        };
        p.instantiate()?;
        Ok(p)
    }

    /// The policy kind.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    fn instantiate(&mut self) -> Result<(), PolicyError> {
        self.inst = None;
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.limits.max_memory_bytes)
            .table_elements(10_000)
            .instances(1)
            .memories(1)
            .tables(1)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(&self.engine, Host { limits });
        store.limiter(|h| &mut h.limits);
        store
            .set_fuel(self.limits.fuel_per_call)
            .map_err(|e| PolicyError::Invalid(e.to_string()))?;
        let instance =
            Instance::new(&mut store, &self.module, &[]).map_err(|e| match classify(e) {
                PolicyError::Trap(m) => PolicyError::Invalid(format!("instantiation failed: {m}")),
                PolicyError::Memory => {
                    PolicyError::Invalid("initial memory exceeds the limit".into())
                }
                PolicyError::Timeout => {
                    PolicyError::Invalid("start function ran out of fuel".into())
                }
                other => other,
            })?;
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| PolicyError::Invalid("missing export `memory`".into()))?;
        let get0 =
            |store: &mut Store<Host>, name: &str| -> Result<TypedFunc<(), i32>, PolicyError> {
                instance
                    .get_typed_func::<(), i32>(&mut *store, name)
                    .map_err(|e| PolicyError::Invalid(format!("export `{name}`: {e:#}")))
            };
        let version = get0(&mut store, "hypic_abi_version")?
            .call(&mut store, ())
            .map_err(classify)?;
        if !ABI_VERSIONS.contains(&version) {
            return Err(PolicyError::Invalid(format!(
                "hypic_abi_version returned {version}, expected 1 or 2"
            )));
        }
        if version == 2 && !self.has_schema {
            return Err(PolicyError::Invalid(format!(
                "ABI version 2 requires a `{PARAMS_SECTION}` custom section declaring the parameters"
            )));
        }
        let k = get0(&mut store, "hypic_policy_kind")?
            .call(&mut store, ())
            .map_err(classify)?;
        if k != self.kind.code() {
            return Err(PolicyError::Invalid(format!(
                "hypic_policy_kind returned {k}, expected {} ({})",
                self.kind.code(),
                self.kind.as_str()
            )));
        }
        let buf = get0(&mut store, "hypic_buf")?
            .call(&mut store, ())
            .map_err(classify)?;
        let cap = get0(&mut store, "hypic_buf_cap")?
            .call(&mut store, ())
            .map_err(classify)?;
        let mem_len = memory.data_size(&store);
        if buf < 0
            || cap < 4096
            || (buf as usize)
                .checked_add(cap as usize)
                .is_none_or(|end| end > mem_len)
        {
            return Err(PolicyError::Invalid(format!(
                "exchange buffer [{buf}, +{cap}) must be at least 4096 bytes inside memory ({mem_len} bytes)"
            )));
        }
        let (buf, cap) = (buf as usize, cap as usize);
        let configure = instance
            .get_typed_func::<i32, i32>(&mut store, "hypic_configure")
            .map_err(|e| PolicyError::Invalid(format!("export `hypic_configure`: {e:#}")))?;
        let hook = match self.kind {
            PolicyKind::Eviction => Hook::Evict(
                instance
                    .get_typed_func(&mut store, "hypic_evict")
                    .map_err(|e| PolicyError::Invalid(format!("export `hypic_evict`: {e:#}")))?,
            ),
            PolicyKind::Admission => Hook::Admit(
                instance
                    .get_typed_func(&mut store, "hypic_admit")
                    .map_err(|e| PolicyError::Invalid(format!("export `hypic_admit`: {e:#}")))?,
            ),
            PolicyKind::Invalidation => Hook::Invalidate(
                instance
                    .get_typed_func(&mut store, "hypic_invalidate")
                    .map_err(|e| {
                        PolicyError::Invalid(format!("export `hypic_invalidate`: {e:#}"))
                    })?,
            ),
            PolicyKind::Isolation => Hook::Isolation(
                instance
                    .get_typed_func(&mut store, "hypic_isolation")
                    .map_err(|e| {
                        PolicyError::Invalid(format!("export `hypic_isolation`: {e:#}"))
                    })?,
            ),
        };
        if self.params.len() > cap {
            return Err(PolicyError::Invalid(
                "params do not fit in the exchange buffer".into(),
            ));
        }
        memory.data_mut(&mut store)[buf..buf + self.params.len()].copy_from_slice(&self.params);
        store
            .set_fuel(self.limits.fuel_per_call)
            .map_err(|e| PolicyError::Invalid(e.to_string()))?;
        let rc = configure
            .call(&mut store, self.params.len() as i32)
            .map_err(|e| match classify(e) {
                PolicyError::Timeout => {
                    PolicyError::Invalid("hypic_configure ran out of fuel".into())
                }
                other => PolicyError::Invalid(format!("hypic_configure failed: {other}")),
            })?;
        if rc != 0 {
            return Err(PolicyError::Invalid(format!(
                "hypic_configure rejected the params (returned {rc})"
            )));
        }
        self.inst = Some(Live {
            store,
            memory,
            buf,
            cap,
            hook,
        });
        Ok(())
    }

    /// Capacity of the exchange buffer in bytes.
    pub fn buf_cap(&self) -> usize {
        self.inst.as_ref().map(|l| l.cap).unwrap_or(0)
    }

    fn live(&mut self) -> Result<&mut Live, PolicyError> {
        if self.inst.is_none() {
            self.instantiate()?;
        }
        Ok(self.inst.as_mut().expect("instantiated above"))
    }

    /// Runs `f` with the live instance; on any fault the instance is dropped
    /// and a fresh one is made for the next call.
    fn with_live<T>(
        &mut self,
        input: &[u8],
        f: impl FnOnce(&mut Live) -> Result<T, PolicyError>,
    ) -> Result<T, PolicyError> {
        let fuel = self.limits.fuel_per_call;
        let live = self.live()?;
        if input.len() > live.cap {
            return Err(PolicyError::BadReturn(
                "input larger than the exchange buffer".into(),
            ));
        }
        let (buf, memory) = (live.buf, live.memory);
        let data = memory.data_mut(&mut live.store);
        if buf + input.len() > data.len() {
            self.inst = None;
            return Err(PolicyError::Trap(
                "exchange buffer no longer inside memory".into(),
            ));
        }
        data[buf..buf + input.len()].copy_from_slice(input);
        let r = live
            .store
            .set_fuel(fuel)
            .map_err(|e| PolicyError::Trap(e.to_string()))
            .and_then(|_| f(live));
        if r.is_err() {
            self.inst = None;
        }
        r
    }

    /// Calls `hypic_evict` with `input` (n records already encoded).
    pub fn call_evict(
        &mut self,
        input: &[u8],
        n: usize,
        now_ms: i64,
    ) -> Result<usize, PolicyError> {
        let v = self.with_live(input, |l| match &l.hook {
            Hook::Evict(f) => f.call(&mut l.store, (n as i32, now_ms)).map_err(classify),
            _ => Err(PolicyError::Invalid("not an eviction policy".into())),
        })?;
        if v < 0 || v as usize >= n {
            // A bad return is handled like a trap (ABI.md): the instance, whose
            // state produced it, is discarded.
            self.inst = None;
            return Err(PolicyError::BadReturn(format!(
                "victim index {v} not in 0..{n}"
            )));
        }
        Ok(v as usize)
    }

    /// Calls the single-record hook (admission, invalidation, isolation) and
    /// checks the answer is 0 or 1.
    pub fn call_bool(&mut self, input: &[u8], now_ms: i64) -> Result<bool, PolicyError> {
        let v = self.with_live(input, |l| match &l.hook {
            Hook::Admit(f) => f.call(&mut l.store, now_ms).map_err(classify),
            Hook::Invalidate(f) => f.call(&mut l.store, now_ms).map_err(classify),
            Hook::Isolation(f) => f.call(&mut l.store, ()).map_err(classify),
            Hook::Evict(_) => Err(PolicyError::Invalid(
                "eviction policies have no boolean hook".into(),
            )),
        })?;
        match v {
            0 => Ok(false),
            1 => Ok(true),
            other => {
                // Handled like a trap (ABI.md): a fresh instance for the next call.
                self.inst = None;
                Err(PolicyError::BadReturn(format!(
                    "returned {other}, expected 0 or 1"
                )))
            }
        }
    }
}

/// Compiles `bytes` to native code (CPU-heavy: seconds for a module of
/// megabytes) and checks it has no imports.
///
/// Errors: [`PolicyError::TooLarge`] when `bytes` is longer than
/// `max_module_bytes`; [`PolicyError::Invalid`] when it does not compile or
/// imports anything.
pub fn compile(
    engine: &Engine,
    bytes: &[u8],
    max_module_bytes: usize,
) -> Result<Module, PolicyError> {
    if bytes.len() > max_module_bytes {
        return Err(PolicyError::TooLarge {
            bytes: bytes.len(),
            limit: max_module_bytes,
        });
    }
    check_header(bytes)?;
    let module = Module::new(engine, bytes).map_err(|e| {
        // One line: wasmtime's chain of causes joined, the first cause first.
        let chain: Vec<String> = e.chain().map(|c| one_line(&c.to_string())).collect();
        PolicyError::Invalid(format!("does not compile: {}", chain.join(": ")))
    })?;
    if let Some(imp) = module.imports().next() {
        return Err(PolicyError::Invalid(format!(
            "imports are not allowed (found {}::{})",
            imp.module(),
            imp.name()
        )));
    }
    Ok(module)
}

/// The Wasm binary header: the magic `\0asm` and version 1.
const WASM_HEADER: [u8; 8] = [0, b'a', b's', b'm', 1, 0, 0, 0];

/// Refuses bytes that are not a Wasm binary module with a one-line message
/// (what the first bytes are instead), before the compiler is asked.
///
/// Errors: [`PolicyError::Invalid`].
pub fn check_header(bytes: &[u8]) -> Result<(), PolicyError> {
    if bytes.len() >= 8 && bytes[..8] == WASM_HEADER {
        return Ok(());
    }
    if bytes.len() >= 4 && bytes[..4] == WASM_HEADER[..4] {
        return Err(PolicyError::Invalid(format!(
            "not a Wasm module this host reads: Wasm binary version {:?}, only version 1 is supported",
            &bytes[4..bytes.len().min(8)]
        )));
    }
    let shown: String = bytes
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ");
    let hint = if bytes.starts_with(b"(module") || bytes.starts_with(b"(") {
        " (WebAssembly text: compile it to a .wasm binary first)"
    } else {
        ""
    };
    Err(PolicyError::Invalid(format!(
        "not a Wasm module: a module starts with the bytes 00 61 73 6d 01 00 00 00 (\\0asm, version 1), this one with {}{hint}",
        if shown.is_empty() { "nothing (it is empty)".to_string() } else { shown }
    )))
}

fn check_exports(module: &Module, kind: PolicyKind) -> Result<(), PolicyError> {
    use wasmtime::ExternType;
    let want: &[(&str, &[ValType], &[ValType])] = &[
        ("hypic_abi_version", &[], &[ValType::I32]),
        ("hypic_policy_kind", &[], &[ValType::I32]),
        ("hypic_buf", &[], &[ValType::I32]),
        ("hypic_buf_cap", &[], &[ValType::I32]),
        ("hypic_configure", &[ValType::I32], &[ValType::I32]),
    ];
    let hook: (&str, &[ValType], &[ValType]) = match kind {
        PolicyKind::Eviction => (
            "hypic_evict",
            &[ValType::I32, ValType::I64],
            &[ValType::I32],
        ),
        PolicyKind::Admission => ("hypic_admit", &[ValType::I64], &[ValType::I32]),
        PolicyKind::Invalidation => ("hypic_invalidate", &[ValType::I64], &[ValType::I32]),
        PolicyKind::Isolation => ("hypic_isolation", &[], &[ValType::I32]),
    };
    if module.get_export(hook.0).is_none() {
        let hooks = [
            ("hypic_evict", "eviction"),
            ("hypic_admit", "admission"),
            ("hypic_invalidate", "invalidation"),
            ("hypic_isolation", "isolation"),
        ];
        if let Some((_, other)) = hooks.iter().find(|(h, _)| module.get_export(h).is_some()) {
            return Err(PolicyError::Invalid(format!(
                "missing export `{}`: this looks like an {other} policy, not an {} policy",
                hook.0,
                kind.as_str()
            )));
        }
    }
    match module.get_export("memory") {
        Some(ExternType::Memory(_)) => {}
        _ => {
            return Err(PolicyError::Invalid(
                "missing export `memory` (a memory)".into(),
            ))
        }
    }
    for (name, params, results) in want.iter().copied().chain(std::iter::once(hook)) {
        let ft = match module.get_export(name) {
            Some(ExternType::Func(ft)) => ft,
            Some(_) => {
                return Err(PolicyError::Invalid(format!(
                    "export `{name}` is not a function"
                )))
            }
            None => return Err(PolicyError::Invalid(format!("missing export `{name}`"))),
        };
        let p: Vec<ValType> = ft.params().collect();
        let r: Vec<ValType> = ft.results().collect();
        let same = |a: &[ValType], b: &[ValType]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| ValType::eq(x, y))
        };
        if !same(&p, params) || !same(&r, results) {
            return Err(PolicyError::Invalid(format!(
                "export `{name}` has signature {p:?} -> {r:?}, expected {params:?} -> {results:?}"
            )));
        }
    }
    Ok(())
}
