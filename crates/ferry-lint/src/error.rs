//! What can stop the checker from reading a crate: a file it cannot read, a module whose file
//! it cannot find, a file no crate root reaches (a module it would not see), a target or
//! module asked for that the crate does not have.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{manifest}: no `name` in its [package]")]
    NoPackageName { manifest: PathBuf },
    #[error("src/ has no crate root (lib.rs, main.rs, bin/*.rs or bin/*/main.rs)")]
    NoRoot,
    #[error("src/{file}:{line}: `mod {name};` has no file (tried {})", tried.join(", "))]
    NoModuleFile {
        file: String,
        line: usize,
        name: String,
        tried: Vec<String>,
    },
    #[error(
        "no crate root reaches {} through its `mod` declarations, so its imports would go \
         unchecked",
        files.iter().map(|f| format!("src/{f}")).collect::<Vec<_>>().join(", ")
    )]
    Unreached { files: Vec<String> },
    #[error("src/ has no crate root {root}")]
    NoTarget { root: String },
    #[error("src/{root}'s crate has no module {module}")]
    NoModule { root: String, module: String },
}
