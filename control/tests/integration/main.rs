//! The control plane's integration tests, one module per area, linked into one test
//! binary (each separate test binary linked the whole dependency tree: wasmtime, sqlx,
//! axum; twelve of them took about five minutes of CI's build).
//!
//! `cargo test -p hypic-control --test integration <area>::` runs one area.

#[macro_use]
mod common;
mod serve_common;

mod api;
mod auth_unit;
mod catalog;
mod catalog_bench;
mod catalog_scope;
mod console_trial;
mod jwks_reload;
mod openapi;
mod policy;
mod policy_area;
mod policy_console;
mod residency_db;
mod review7;
mod serve_api;
mod serve_bad_input;
mod serve_bounds;
mod serve_control;
mod serve_device;
mod serve_families;
mod serve_load;
mod serve_netops;
mod serve_parallel;
mod serve_persist;
mod serve_residency;
mod serve_responses;
mod serve_reuse;
mod serve_sampling;
mod serve_structured;
mod serve_tools;
mod serve_ui;
mod serve_why;
mod tenants_db;
