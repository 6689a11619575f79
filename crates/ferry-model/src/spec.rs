//! [`ModelSpec`]: the model a command names, the built-in `tiny` model or a folder or GGUF
//! path, and loading it. Above both the loaders (`load.rs`) and the tiny model (`tiny.rs`,
//! which is built with the loaders' tokenizer and config writers), since it picks one of them.

use std::path::{Path, PathBuf};

use crate::load::{default_model_path, load_any, LoadError, LoadedModel, Precision, Progress};

/// A model as named on the command line: the built-in `tiny` model, or a folder / GGUF path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// The deterministic random-weight model built into the binary ([`crate::tiny`]).
    Tiny,
    Path(PathBuf),
}

/// `tiny`, or the path as written (what start-up errors name).
impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tiny => f.write_str("tiny"),
            Self::Path(path) => write!(f, "{}", path.display()),
        }
    }
}

impl ModelSpec {
    /// `tiny` → [`ModelSpec::Tiny`]; no argument → the default model in `cache_dir`; anything
    /// else is a path.
    pub fn resolve(arg: Option<&str>, cache_dir: &Path) -> Self {
        match arg {
            Some("tiny") => Self::Tiny,
            Some(path) => Self::Path(PathBuf::from(path)),
            None => Self::Path(default_model_path(cache_dir)),
        }
    }

    pub fn load(&self) -> Result<LoadedModel, LoadError> {
        self.load_with_progress(&mut |_, _, _| {})
    }

    /// [`ModelSpec::load`], every tensor f32, reporting each converted tensor to `progress`.
    pub fn load_with_progress(&self, progress: Progress<'_>) -> Result<LoadedModel, LoadError> {
        self.load_as(Precision::F32, progress)
    }

    /// The model in `precision` (the built-in model is f32 either way), reporting each
    /// tensor read to `progress`.
    pub fn load_as(
        &self,
        precision: Precision,
        progress: Progress<'_>,
    ) -> Result<LoadedModel, LoadError> {
        match self {
            Self::Tiny => Ok(crate::tiny::tiny_model()),
            Self::Path(path) => {
                if !path.exists() {
                    return Err(LoadError::invalid(
                        path,
                        "no such model file or folder (the default model is fetched by \
                         scripts/fetch-model.sh)",
                    ));
                }
                load_any(path, precision, progress)
            }
        }
    }
}
