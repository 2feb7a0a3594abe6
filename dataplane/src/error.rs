//! Data-plane error type: every variant names the file, tensor or field at fault.
use std::path::PathBuf;

/// Errors from model loading and execution. Messages name what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read (missing, permissions, …).
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON or lacks a field.
    #[error("{path}: {msg}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A config.json field is missing or has the wrong type/value.
    #[error("config field `{field}`: {msg}")]
    Config {
        /// The field name.
        field: String,
        /// What is wrong.
        msg: String,
    },
    /// The model type is not one this data plane runs (no family in
    /// `models::FAMILIES` reads it); the message lists the supported types.
    #[error("unsupported model_type `{0}` (supported: {supported})", supported = crate::models::supported_model_types().join(", "))]
    UnsupportedModel(String),
    /// A safetensors file is corrupt.
    #[error("corrupt safetensors file {path}: {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A tensor is missing from the checkpoint.
    #[error("tensor `{name}` not found in the checkpoint ({dir})")]
    MissingTensor {
        /// Tensor name.
        name: String,
        /// Model directory.
        dir: PathBuf,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Shape in the file.
        got: Vec<usize>,
        /// Shape the config implies.
        expected: Vec<usize>,
    },
    /// A tensor has a dtype we do not load.
    #[error("tensor `{name}` has dtype {dtype}, expected F32, BF16 or F16")]
    Dtype {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// Tokenizer or chat-template failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Bad request input (empty prompt, token out of vocabulary, context too long, …).
    #[error("invalid input: {0}")]
    Input(String),
    /// The compute device failed (driver, kernel or library error of the GPU backend).
    #[error("device: {0}")]
    Device(String),
}

/// Result alias for the data plane.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}
