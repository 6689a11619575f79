//! `ferry make-model`: writes model fixtures as Hugging Face folders.
//!
//! `tiny` writes the deterministic random-weight model the tests and golden data use;
//! `convert` writes any loadable model (a GGUF file, a folder, `tiny`) as an f32 Hugging Face
//! folder, so a GGUF model can be checked with tools that read only folders.

use std::path::PathBuf;

use anyhow::Context;
use ferry_model::{tiny, ModelSpec};

#[derive(Debug, clap::Subcommand)]
pub enum MakeModelCommand {
    /// Write the built-in `tiny` model (random weights, fixed seed) as a Hugging Face folder.
    Tiny {
        /// Folder to write (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
    /// Load a model (`tiny`, a Hugging Face folder or a .gguf file; default: the model that
    /// scripts/fetch-model.sh fetches) and write it as an f32 Hugging Face folder.
    Convert {
        /// The model to convert.
        #[arg(long)]
        model: Option<String>,
        /// Folder to write (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(cmd: MakeModelCommand) -> anyhow::Result<()> {
    match cmd {
        MakeModelCommand::Tiny { out } => write(&tiny::tiny_model(), &out),
        MakeModelCommand::Convert { model, out } => {
            let spec = ModelSpec::resolve(model.as_deref(), &ferry_cli::cache_dir()?);
            let loaded = spec.load().with_context(|| format!("loading {spec}"))?;
            write(&loaded, &out)
        }
    }
}

fn write(model: &ferry_model::LoadedModel, out: &std::path::Path) -> anyhow::Result<()> {
    tiny::write_hf_folder(model, out)
        .with_context(|| format!("writing model folder {}", out.display()))?;
    println!("{}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn make_model_tiny_writes_a_loadable_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("tiny");
        run(MakeModelCommand::Tiny { out: out.clone() }).unwrap();
        let loaded = ferry_model::load_model(&out).unwrap();
        assert_eq!(loaded.weights, tiny::tiny_model().weights);

        let copy = tmp.path().join("copy");
        let model = Some(out.display().to_string());
        run(MakeModelCommand::Convert {
            model,
            out: copy.clone(),
        })
        .unwrap();
        let reloaded = ferry_model::load_model(&copy).unwrap();
        assert_eq!(reloaded.config, loaded.config);
        assert_eq!(reloaded.weights, loaded.weights);
    }
}
