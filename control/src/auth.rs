//! Authentication (bearer JWTs), first-start bootstrap, `hypic token`, and
//! server-side derivation of cache isolation keys.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use hmac::{Hmac, Mac};
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::catalog::{validate_id, Role, SnapshotEntry};

/// Audience every HYPIC token must carry unless configured otherwise.
pub const DEFAULT_AUDIENCE: &str = "hypic";
/// Default longest token lifetime (`exp - iat`) that `hypic token` mints and the
/// verifier accepts: 90 days, in seconds.
pub const DEFAULT_MAX_TOKEN_LIFETIME_S: u64 = 90 * 86400;
/// File in the data directory holding the HS256 signing secret (hex).
pub const SECRET_FILE: &str = "jwt-secret";
/// Tenant whose token is printed at first start.
pub const DEMO_TENANT: &str = "demo";
/// Tenant of the operator token printed at first start.
pub const OPERATOR_TENANT: &str = "ops";

/// The claims of a HYPIC token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Subject (principal name).
    pub sub: String,
    /// Tenant the principal belongs to.
    pub tenant: String,
    /// `tenant` or `operator`.
    pub role: String,
    /// Audience; must equal the server's.
    pub aud: String,
    /// Expiry, seconds since the epoch.
    pub exp: u64,
    /// Issue time, seconds since the epoch.
    #[serde(default)]
    pub iat: u64,
}

/// A verified caller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Principal {
    /// Subject.
    pub sub: String,
    /// Tenant, taken from the verified token only.
    pub tenant: String,
    /// Role.
    pub role: Role,
}

impl Principal {
    /// True for operators.
    pub fn is_operator(&self) -> bool {
        self.role == Role::Operator
    }
}

/// Why a token was refused (all map to HTTP 401).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("missing bearer token: send 'Authorization: Bearer <jwt>'")]
    Missing,
    /// The token has expired.
    #[error("token expired")]
    Expired,
    /// The token was issued for another audience.
    #[error("token audience is not {0:?}")]
    WrongAudience(String),
    /// Bad signature, unknown key, malformed token or claims.
    #[error("invalid token: {0}")]
    Invalid(String),
}

impl AuthError {
    /// Machine-readable code for the error body.
    pub fn code(&self) -> &'static str {
        match self {
            AuthError::Missing => "missing_token",
            AuthError::Expired => "token_expired",
            AuthError::WrongAudience(_) => "wrong_audience",
            AuthError::Invalid(_) => "invalid_token",
        }
    }
}

struct JwksKey {
    kid: Option<String>,
    alg: Algorithm,
    key: DecodingKey,
}

/// Parses the RS256 and EdDSA public keys of a JWKS document.
fn jwks_keys(set: &JwkSet) -> anyhow::Result<Vec<JwksKey>> {
    let mut keys = Vec::with_capacity(set.keys.len());
    for jwk in &set.keys {
        let alg = match &jwk.algorithm {
            jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => Algorithm::RS256,
            jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
            _ => anyhow::bail!(
                "JWKS key {:?}: only RSA (RS256) and OKP (EdDSA) keys are accepted",
                jwk.common.key_id
            ),
        };
        let key = DecodingKey::from_jwk(jwk)
            .with_context(|| format!("JWKS key {:?} is malformed", jwk.common.key_id))?;
        keys.push(JwksKey {
            kid: jwk.common.key_id.clone(),
            alg,
            key,
        });
    }
    Ok(keys)
}

/// Reads and parses a JWKS file; returns its keys and the SHA-256 of its bytes.
fn read_jwks_file(path: &Path) -> anyhow::Result<(Vec<JwksKey>, [u8; 32])> {
    use sha2::Digest;
    let bytes =
        std::fs::read(path).with_context(|| format!("reading JWKS file {}", path.display()))?;
    let set: JwkSet = serde_json::from_slice(&bytes)
        .with_context(|| format!("parsing JWKS file {}", path.display()))?;
    let keys = jwks_keys(&set).with_context(|| format!("JWKS file {}", path.display()))?;
    Ok((keys, Sha256::digest(&bytes).into()))
}

/// The keys loaded from one JWKS file, replaced as a whole on reload.
struct FileKeys {
    digest: [u8; 32],
    keys: Vec<JwksKey>,
}

/// A JWKS file whose keys can be re-read while the server runs.
struct JwksFile {
    path: PathBuf,
    current: RwLock<Arc<FileKeys>>,
}

/// What [`Authenticator::reload_jwks`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct JwksReload {
    /// Files whose content changed and whose keys were replaced.
    pub reloaded: Vec<PathBuf>,
    /// Files that could not be read or parsed, with the error; their previous
    /// keys stay in force.
    pub failed: Vec<(PathBuf, String)>,
    /// Keys accepted now, over every file and static set.
    pub keys: usize,
}

/// Verifies bearer tokens: HS256 with the server's shared secret, and
/// RS256/EdDSA with public keys from JWKS documents or files. Keys from a
/// file are replaced by [`Authenticator::reload_jwks`] when the file's
/// content changes (key rotation without a restart).
pub struct Authenticator {
    audience: String,
    max_lifetime_s: u64,
    hs256: Option<DecodingKey>,
    jwks: Vec<JwksKey>,
    files: Vec<JwksFile>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("audience", &self.audience)
            .field("hs256", &self.hs256.is_some())
            .field("jwks_keys", &self.key_count())
            .field(
                "jwks_files",
                &self.files.iter().map(|f| &f.path).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Authenticator {
    /// An authenticator accepting HS256 tokens signed with `secret`.
    pub fn hs256(secret: &[u8], audience: &str) -> anyhow::Result<Authenticator> {
        anyhow::ensure!(secret.len() >= 32, "HS256 secret must be at least 32 bytes");
        Ok(Authenticator {
            audience: audience.to_string(),
            max_lifetime_s: DEFAULT_MAX_TOKEN_LIFETIME_S,
            hs256: Some(DecodingKey::from_secret(secret)?),
            jwks: vec![],
            files: vec![],
        })
    }

    /// An authenticator with no keys yet (add a JWKS).
    pub fn without_keys(audience: &str) -> Authenticator {
        Authenticator {
            audience: audience.to_string(),
            max_lifetime_s: DEFAULT_MAX_TOKEN_LIFETIME_S,
            hs256: None,
            jwks: vec![],
            files: vec![],
        }
    }

    /// Sets the longest token lifetime accepted, seconds: a token whose `exp - iat`
    /// (or, without `iat`, whose remaining time `exp - now`) exceeds it is refused
    /// (default [`DEFAULT_MAX_TOKEN_LIFETIME_S`]).
    pub fn with_max_lifetime(mut self, max_lifetime_s: u64) -> Authenticator {
        self.max_lifetime_s = max_lifetime_s;
        self
    }

    /// Adds the RS256 and EdDSA public keys of a JWKS document (fixed for the
    /// authenticator's lifetime).
    pub fn with_jwks(mut self, set: &JwkSet) -> anyhow::Result<Authenticator> {
        self.jwks.extend(jwks_keys(set)?);
        Ok(self)
    }

    /// Adds the keys of a JWKS file, which [`Authenticator::reload_jwks`]
    /// re-reads. Fails if the file cannot be read or parsed now.
    pub fn with_jwks_file(mut self, path: &Path) -> anyhow::Result<Authenticator> {
        let (keys, digest) = read_jwks_file(path)?;
        self.files.push(JwksFile {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(FileKeys { digest, keys })),
        });
        Ok(self)
    }

    /// The JWKS files this authenticator reloads.
    pub fn jwks_files(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }

    /// Number of RS256/EdDSA keys accepted now.
    pub fn key_count(&self) -> usize {
        self.jwks.len()
            + self
                .files
                .iter()
                .map(|f| f.keys().keys.len())
                .sum::<usize>()
    }

    /// Re-reads every JWKS file and replaces the keys of each file whose
    /// content changed: tokens signed by added keys are accepted and tokens
    /// signed by removed keys are refused from the next request on. A file
    /// that cannot be read or parsed keeps its previous keys (and is
    /// reported in [`JwksReload::failed`]), so a half-written file never
    /// locks everyone out.
    pub fn reload_jwks(&self) -> JwksReload {
        let mut out = JwksReload {
            reloaded: vec![],
            failed: vec![],
            keys: 0,
        };
        for f in &self.files {
            match read_jwks_file(&f.path) {
                Ok((keys, digest)) => {
                    if digest != f.keys().digest {
                        *f.current.write().unwrap_or_else(|p| p.into_inner()) =
                            Arc::new(FileKeys { digest, keys });
                        out.reloaded.push(f.path.clone());
                    }
                }
                Err(e) => out.failed.push((f.path.clone(), format!("{e:#}"))),
            }
        }
        out.keys = self.key_count();
        out
    }

    /// The audience tokens must carry.
    pub fn audience(&self) -> &str {
        &self.audience
    }

    /// Verifies a token and returns the caller.
    pub fn verify(&self, token: &str) -> Result<Principal, AuthError> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| {
            AuthError::Invalid(format!(
                "not a JWT (expected header.payload.signature, base64url-encoded): {e}"
            ))
        })?;
        let mut validation = Validation::new(header.alg);
        validation.set_audience(&[self.audience.as_str()]);
        validation.set_required_spec_claims(&["exp", "aud", "sub"]);
        validation.leeway = 5;
        // A token with `nbf` ("not before") in the future is refused until then.
        validation.validate_nbf = true;
        let result = match header.alg {
            Algorithm::HS256 => {
                let key = self
                    .hs256
                    .as_ref()
                    .ok_or_else(|| AuthError::Invalid("HS256 tokens are not accepted".into()))?;
                jsonwebtoken::decode::<Claims>(token, key, &validation)
            }
            Algorithm::RS256 | Algorithm::EdDSA => {
                let mut last = None;
                let mut any = false;
                let file_keys: Vec<Arc<FileKeys>> = self.files.iter().map(|f| f.keys()).collect();
                let all = self
                    .jwks
                    .iter()
                    .chain(file_keys.iter().flat_map(|f| f.keys.iter()));
                for k in all.filter(|k| k.alg == header.alg) {
                    if let (Some(want), Some(have)) = (&header.kid, &k.kid) {
                        if want != have {
                            continue;
                        }
                    }
                    any = true;
                    match jsonwebtoken::decode::<Claims>(token, &k.key, &validation) {
                        Ok(d) => {
                            last = Some(Ok(d));
                            break;
                        }
                        Err(e) => last = Some(Err(e)),
                    }
                }
                if !any {
                    return Err(AuthError::Invalid(format!(
                        "no {:?} key matches kid {:?}",
                        header.alg, header.kid
                    )));
                }
                last.expect("at least one key was tried")
            }
            other => {
                return Err(AuthError::Invalid(format!(
                    "algorithm {other:?} is not accepted"
                )))
            }
        };
        let data = result.map_err(|e| match e.kind() {
            jsonwebtoken::errors::ErrorKind::ExpiredSignature => AuthError::Expired,
            jsonwebtoken::errors::ErrorKind::ImmatureSignature => {
                AuthError::Invalid("token not valid yet (nbf is in the future)".into())
            }
            jsonwebtoken::errors::ErrorKind::InvalidAudience => {
                AuthError::WrongAudience(self.audience.clone())
            }
            _ => AuthError::Invalid(e.to_string()),
        })?;
        let c = data.claims;
        let now = now_s();
        if c.iat > now.saturating_add(validation.leeway) {
            return Err(AuthError::Invalid(format!(
                "token issued in the future (iat {} is {} s ahead of this server's clock)",
                c.iat,
                c.iat - now
            )));
        }
        // The token is usable from now (or its issue time) until it expires.
        let lifetime = c
            .exp
            .saturating_sub(if c.iat > 0 { c.iat.min(now) } else { now });
        if lifetime > self.max_lifetime_s.saturating_add(validation.leeway) {
            return Err(AuthError::Invalid(format!(
                "token lifetime of {lifetime} s exceeds this server's maximum of {} s",
                self.max_lifetime_s
            )));
        }
        let role: Role = c.role.parse().map_err(AuthError::Invalid)?;
        validate_id("tenant", &c.tenant).map_err(|e| AuthError::Invalid(e.to_string()))?;
        if c.sub.is_empty() || c.sub.len() > 256 || c.sub.chars().any(unsafe_in_names) {
            return Err(AuthError::Invalid(
                "sub must be 1..=256 characters with no control, bidirectional or zero-width characters"
                    .into(),
            ));
        }
        Ok(Principal {
            sub: c.sub,
            tenant: c.tenant,
            role,
        })
    }
}

impl JwksFile {
    fn keys(&self) -> Arc<FileKeys> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Seconds since the epoch.
fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Mints an HS256 token.
pub fn mint_token(
    secret: &[u8],
    audience: &str,
    tenant: &str,
    sub: &str,
    role: Role,
    ttl_s: u64,
) -> anyhow::Result<String> {
    validate_id("tenant", tenant)?;
    let now = now_s();
    let claims = Claims {
        sub: sub.to_string(),
        tenant: tenant.to_string(),
        role: role.as_str().to_string(),
        aud: audience.to_string(),
        exp: now + ttl_s,
        iat: now,
    };
    Ok(jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret)?,
    )?)
}

/// Parses a duration such as `3600`, `90s`, `15m`, `24h` or `7d` into seconds.
pub fn parse_ttl(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('s') => (&s[..s.len() - 1], 1),
        Some('m') => (&s[..s.len() - 1], 60),
        Some('h') => (&s[..s.len() - 1], 3600),
        Some('d') => (&s[..s.len() - 1], 86400),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .with_context(|| format!("invalid duration {s:?} (use e.g. 3600, 15m, 24h, 7d)"))?;
    anyhow::ensure!(n > 0, "duration must be positive");
    n.checked_mul(mult)
        .ok_or_else(|| anyhow::anyhow!("duration {s:?} is too large"))
}

/// Reads the signing secret from `data_dir`, creating it (32 random bytes,
/// mode 0600) if missing. Returns the secret and whether it was created.
pub fn load_or_create_secret(data_dir: &Path) -> anyhow::Result<(Vec<u8>, bool)> {
    let path = data_dir.join(SECRET_FILE);
    if path.exists() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let secret =
            hex::decode(text.trim()).with_context(|| format!("{} is not hex", path.display()))?;
        anyhow::ensure!(
            secret.len() >= 32,
            "{} holds fewer than 32 bytes",
            path.display()
        );
        return Ok((secret, false));
    }
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    let secret: [u8; 32] = rand::random();
    let tmp = data_dir.join(format!("{SECRET_FILE}.tmp"));
    {
        use std::io::Write;
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let mut f = opts
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(hex::encode(secret).as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &path)?;
    Ok((secret.to_vec(), true))
}

/// What the first start of the embedded server produced.
#[derive(Clone, Debug)]
pub struct FirstStart {
    /// The signing secret (existing or new).
    pub secret: Vec<u8>,
    /// True when the secret was created now.
    pub created: bool,
    /// Operator token (only when created).
    pub operator_token: Option<String>,
    /// Demo-tenant token (only when created).
    pub demo_token: Option<String>,
}

/// Ensures the data directory has a signing secret; on first start also mints
/// an operator token (tenant `ops`) and a demo-tenant token, valid `ttl_s`.
pub fn first_start(data_dir: &Path, audience: &str, ttl_s: u64) -> anyhow::Result<FirstStart> {
    let (secret, created) = load_or_create_secret(data_dir)?;
    let (operator_token, demo_token) = if created {
        (
            Some(mint_token(
                &secret,
                audience,
                OPERATOR_TENANT,
                "operator",
                Role::Operator,
                ttl_s,
            )?),
            Some(mint_token(
                &secret,
                audience,
                DEMO_TENANT,
                "demo-user",
                Role::Tenant,
                ttl_s,
            )?),
        )
    } else {
        (None, None)
    };
    Ok(FirstStart {
        secret,
        created,
        operator_token,
        demo_token,
    })
}

/// Prints the tokens of a first start (nothing on later starts).
pub fn print_first_start(fs: &FirstStart, data_dir: &Path) {
    if let (Some(op), Some(demo)) = (&fs.operator_token, &fs.demo_token) {
        println!(
            "hypic: created signing secret {}",
            data_dir.join(SECRET_FILE).display()
        );
        println!("hypic: operator token (tenant {OPERATOR_TENANT}):\n{op}");
        println!("hypic: demo tenant token (tenant {DEMO_TENANT}):\n{demo}");
        println!(
            "hypic: mint more with `hypic token --data-dir {} --tenant NAME --role tenant|operator`",
            data_dir.display()
        );
    } else {
        println!(
            "hypic: using signing secret {}; mint tokens with `hypic token --data-dir {} --tenant NAME --role tenant|operator`",
            data_dir.join(SECRET_FILE).display(),
            data_dir.display()
        );
    }
}

/// Refuses to run without auth unless bound to a loopback address.
pub fn check_auth_disable(bind: SocketAddr, disable_auth: bool) -> anyhow::Result<()> {
    if disable_auth && !bind.ip().is_loopback() {
        anyhow::bail!(
            "--disable-auth is only allowed on a loopback bind address (127.0.0.1 or ::1), not {bind}"
        );
    }
    Ok(())
}

/// Arguments of `hypic token`.
#[derive(clap::Args, Debug, Clone)]
pub struct TokenArgs {
    /// Tenant the token belongs to.
    #[arg(long, default_value = DEMO_TENANT)]
    pub tenant: String,
    /// Role: `tenant` or `operator`.
    #[arg(long, default_value = "tenant")]
    pub role: String,
    /// Lifetime, e.g. 3600, 15m, 24h, 7d.
    #[arg(long, default_value = "24h")]
    pub ttl: String,
    /// Subject (defaults to `<role>@<tenant>`).
    #[arg(long)]
    pub sub: Option<String>,
    /// Audience.
    #[arg(long, default_value = DEFAULT_AUDIENCE)]
    pub audience: String,
    /// Data directory holding the signing secret (created if missing).
    #[arg(long, env = "HYPIC_DATA_DIR", default_value = "hypic-data")]
    pub data_dir: PathBuf,
    /// Longest lifetime `--ttl` may ask for (servers refuse longer tokens).
    #[arg(long, env = "HYPIC_MAX_TOKEN_LIFETIME", default_value = "90d")]
    pub max_lifetime: String,
}

/// Mints a token from `args` and returns it.
pub fn token_from_args(args: &TokenArgs) -> anyhow::Result<String> {
    let role: Role = args.role.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    let max = parse_ttl(&args.max_lifetime).context("--max-lifetime")?;
    let allowed = format!(
        "allowed: 1 s to {max} s, --max-lifetime {}",
        args.max_lifetime.trim()
    );
    let ttl = parse_ttl(&args.ttl).with_context(|| format!("--ttl ({allowed})"))?;
    anyhow::ensure!(
        ttl <= max,
        "--ttl {} is longer than the maximum token lifetime of {max} s ({allowed}); \
         servers refuse such tokens",
        args.ttl,
    );
    let (secret, created) = load_or_create_secret(&args.data_dir)?;
    if created {
        eprintln!(
            "hypic token: warning: created a new signing secret in {}; a server started with \
             another --data-dir will reject this token (pass the server's --data-dir)",
            args.data_dir.display()
        );
    }
    let sub = args
        .sub
        .clone()
        .unwrap_or_else(|| format!("{}@{}", role.as_str(), args.tenant));
    mint_token(&secret, &args.audience, &args.tenant, &sub, role, ttl)
}

/// `hypic token`: prints a token for local use.
pub async fn run_token_command(args: TokenArgs) -> anyhow::Result<()> {
    println!("{}", token_from_args(&args)?);
    Ok(())
}

type HmacSha256 = Hmac<Sha256>;

/// Derives cache isolation keys server-side from a secret, the verified
/// tenant and the segment's sharing state.
#[derive(Clone)]
pub struct IsolationKeyer {
    secret: Vec<u8>,
}

impl std::fmt::Debug for IsolationKeyer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IsolationKeyer(..)")
    }
}

impl IsolationKeyer {
    /// A keyer whose keys are bound to `server_secret` (the signing secret is
    /// fine: it is domain-separated here).
    pub fn new(server_secret: &[u8]) -> IsolationKeyer {
        let mut m = HmacSha256::new_from_slice(server_secret).expect("HMAC accepts any key length");
        m.update(b"hypic-isolation-v1");
        IsolationKeyer {
            secret: m.finalize().into_bytes().to_vec(),
        }
    }

    fn mac(&self, parts: &[&[u8]]) -> String {
        let mut m = HmacSha256::new_from_slice(&self.secret).expect("HMAC accepts any key length");
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        hex::encode(m.finalize().into_bytes())
    }

    /// The isolation key of `segment` for `tenant`.
    ///
    /// Shared only when the segment is explicitly public **and** the isolation
    /// policy allows sharing (`policy_allows_shared`); everything else gets a
    /// per-tenant key. A client `salt` is mixed into whatever key was chosen,
    /// so it can split a namespace but never reach another tenant's.
    ///
    /// The key is `{account}/{mac}`: `account` names who the cache bytes are
    /// charged to for per-tenant fairness in the pools
    /// (`dataplane::pic::pool::owner_group`): `shared` for the shared namespace,
    /// else a per-tenant pseudonym (salted namespaces are charged to the tenant,
    /// so salts cannot multiply a tenant's share).
    pub fn isolation_key(
        &self,
        tenant: &str,
        segment: &SnapshotEntry,
        policy_allows_shared: bool,
        salt: Option<&str>,
    ) -> String {
        let shared = segment.public && policy_allows_shared;
        let base = if shared {
            self.mac(&[b"shared"])
        } else {
            self.mac(&[b"tenant", tenant.as_bytes()])
        };
        let (account, key) = match salt {
            Some(s) if !s.is_empty() => (
                self.tenant_account(tenant),
                self.mac(&[b"salted", base.as_bytes(), s.as_bytes()]),
            ),
            _ if shared => ("shared".to_string(), base),
            _ => (self.tenant_account(tenant), base),
        };
        format!("{account}/{key}")
    }

    /// The pseudonym cache bytes of `tenant` are charged to (16 hex digits).
    pub fn tenant_account(&self, tenant: &str) -> String {
        let mut m = self.mac(&[b"account", tenant.as_bytes()]);
        m.truncate(16);
        m
    }

    /// A short keyed hash of `tenant` for logs (12 hex digits): stable for a server
    /// secret, not reversible without it.
    pub fn pseudonym(&self, tenant: &str) -> String {
        let mut h = self.mac(&[b"log-pseudonym", tenant.as_bytes()]);
        h.truncate(12);
        format!("t-{h}")
    }

    /// The cache key of one segment version under an isolation key.
    pub fn cache_key(&self, isolation_key: &str, segment: &SnapshotEntry) -> String {
        self.mac(&[
            b"entry",
            isolation_key.as_bytes(),
            segment.segment_id.as_bytes(),
            &segment.version.to_le_bytes(),
            segment.content_hash.as_bytes(),
        ])
    }
}

/// Characters refused in names that are logged and shown to operators (a token's
/// `sub`): control characters (line breaks included), the Unicode bidirectional
/// marks, overrides and isolates, which reorder the text around them, and the
/// zero-width characters, which make two names look alike.
pub fn unsafe_in_names(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}'
                | '\u{200B}'..='\u{200F}'
                | '\u{202A}'..='\u{202E}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{2066}'..='\u{2069}'
                | '\u{FEFF}'
        )
}
