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
    /// Write a random-weight mixture-of-experts model (the tiny model's tokenizer and chat
    /// template, so it can be served) as a Hugging Face folder.
    Moe {
        /// Folder to write (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Architecture: qwen3_moe, qwen2_moe, olmoe or mixtral (transformers' model types).
        #[arg(long, default_value = "qwen3_moe")]
        arch: String,
        /// `small` (hidden 64, 8 experts: tests) or `bench` (hidden 1024, 32 experts, top-8,
        /// 224M parameters: benchmarks).
        #[arg(long, default_value = "small")]
        size: String,
        /// Seed of the weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
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
        MakeModelCommand::Moe {
            out,
            arch,
            size,
            seed,
        } => {
            let architecture = match arch.as_str() {
                "qwen3_moe" => "Qwen3MoeForCausalLM",
                "qwen2_moe" => "Qwen2MoeForCausalLM",
                "olmoe" => "OlmoeForCausalLM",
                "mixtral" => "MixtralForCausalLM",
                other => anyhow::bail!(
                    "--arch {other:?}: expected qwen3_moe, qwen2_moe, olmoe or mixtral"
                ),
            };
            let size = match size.as_str() {
                "small" => tiny::MoeSize::Small,
                "bench" => tiny::MoeSize::Bench,
                other => anyhow::bail!("--size {other:?}: expected small or bench"),
            };
            write(&tiny::moe_model(architecture, size, seed), &out)
        }
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
    fn make_model_moe_writes_a_servable_folder_of_each_architecture() {
        let tmp = tempfile::tempdir().unwrap();
        for arch in ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"] {
            let out = tmp.path().join(arch);
            let cmd = MakeModelCommand::Moe {
                out: out.clone(),
                arch: arch.into(),
                size: "small".into(),
                seed: 3,
            };
            run(cmd).unwrap();
            let loaded = ferry_model::load_model(&out).unwrap();
            assert!(loaded.config.moe.is_some(), "{arch}");
            assert!(loaded.tokenizer.is_some() && loaded.chat_template.is_some());
            assert_eq!(
                loaded.config.vocab_size,
                tiny::tiny_model().config.vocab_size
            );
        }
        let bad = MakeModelCommand::Moe {
            out: tmp.path().join("x"),
            arch: "deepseek_v3".into(),
            size: "small".into(),
            seed: 0,
        };
        assert!(run(bad).unwrap_err().to_string().contains("--arch"));
    }

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
