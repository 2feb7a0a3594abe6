//! Rebuilds the crate when a catalog migration is added or changed: the
//! migrations under `../migrations` are embedded by `sqlx::migrate!`.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
