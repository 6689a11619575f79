//! `ferry make-model`: writes model fixtures as Hugging Face folders.
//!
//! `tiny` writes the deterministic random-weight model the tests and golden data use;
//! `convert` writes any loadable model (a GGUF file, a folder, `tiny`) as an f32 Hugging Face
//! folder, so a GGUF model can be checked with tools that read only folders; `lora` writes a
//! random LoRA adapter for a base model as a PEFT folder.

use std::path::PathBuf;

use anyhow::Context;
use ferry_model::lora::random::{random_lora, write_peft_folder, RandomLora};
use ferry_model::{tiny, LlamaConfig, LoraAdapter, ModelSpec, TargetModule, WeightFiles};

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
    /// Write a random LoRA adapter for a base model as a PEFT folder (adapter_config.json,
    /// adapter_model.safetensors in f32): lora_B is random too (PEFT starts it at zero), so
    /// the adapter changes the outputs. For tests and benchmarks.
    Lora {
        /// The base model: `tiny`, a Hugging Face folder or a .gguf file (only its config is
        /// read).
        #[arg(long)]
        base: String,
        /// The adapter's rank `r`.
        #[arg(long)]
        rank: usize,
        /// `lora_alpha` (default: twice the rank, a scale of 2).
        #[arg(long)]
        alpha: Option<f64>,
        /// The modules adapted in every layer, comma-separated, among q_proj, k_proj, v_proj,
        /// o_proj, gate_proj, up_proj and down_proj.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "q_proj,k_proj,v_proj,o_proj"
        )]
        targets: Vec<String>,
        /// Scale by alpha / sqrt(rank) (rsLoRA) rather than alpha / rank.
        #[arg(long)]
        rslora: bool,
        /// Seed of the values.
        #[arg(long, default_value_t = 0)]
        seed: u64,
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
        MakeModelCommand::Lora {
            base,
            rank,
            alpha,
            targets,
            rslora,
            seed,
            out,
        } => {
            let config = base_config(&base)?;
            let targets = targets
                .iter()
                .map(|t| {
                    TargetModule::from_name(t.trim()).ok_or_else(|| {
                        anyhow::anyhow!(
                            "--targets {t:?}: expected q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj or down_proj"
                        )
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            anyhow::ensure!(rank > 0, "--rank must be at least 1");
            let spec = RandomLora {
                rank,
                alpha: alpha.unwrap_or(2.0 * rank as f64),
                targets,
                use_rslora: rslora,
                seed,
            };
            let (lora_config, tensors) = random_lora(&config, &spec);
            write_peft_folder(&out, &lora_config, &tensors)
                .with_context(|| format!("writing adapter folder {}", out.display()))?;
            // What was written loads back for this base.
            LoraAdapter::load(&out, &config, rank)
                .with_context(|| format!("checking the adapter written to {}", out.display()))?;
            println!("{}", out.display());
            Ok(())
        }
        MakeModelCommand::Convert { model, out } => {
            let spec = ModelSpec::resolve(model.as_deref(), &ferry_cli::cache_dir()?);
            let loaded = spec.load().with_context(|| format!("loading {spec}"))?;
            write(&loaded, &out)
        }
    }
}

/// The config of the base model `base` names (`tiny` or a path), without reading its weights.
fn base_config(base: &str) -> anyhow::Result<LlamaConfig> {
    match ModelSpec::resolve(Some(base), &ferry_cli::cache_dir()?) {
        ModelSpec::Tiny => Ok(tiny::tiny_config()),
        ModelSpec::Path(path) => {
            let files = WeightFiles::open(&path).with_context(|| format!("reading {base}"))?;
            Ok(files.config().clone())
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
    fn make_model_lora_writes_a_peft_folder_the_base_loads() {
        let tmp = tempfile::tempdir().unwrap();
        let base_dir = tmp.path().join("tiny");
        run(MakeModelCommand::Tiny {
            out: base_dir.clone(),
        })
        .unwrap();
        let lora = |base: &str, targets: &[&str], rslora: bool, out: &str| MakeModelCommand::Lora {
            base: base.into(),
            rank: 4,
            alpha: None,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            rslora,
            seed: 1,
            out: tmp.path().join(out),
        };
        let base = base_dir.display().to_string();
        run(lora(&base, &["q_proj", "down_proj"], true, "a")).unwrap();
        run(lora("tiny", &["q_proj", "down_proj"], true, "b")).unwrap();
        let config = tiny::tiny_config();
        let a = LoraAdapter::load(&tmp.path().join("a"), &config, 4).unwrap();
        let b = LoraAdapter::load(&tmp.path().join("b"), &config, 4).unwrap();
        assert_eq!(a.digest(), b.digest(), "same base, spec and seed");
        assert_eq!(a.targets(), [TargetModule::QProj, TargetModule::DownProj]);
        assert_eq!(a.rank_and_scale(0, TargetModule::QProj), Some((4, 4.0)));
        let text = std::fs::read_to_string(tmp.path().join("a/adapter_config.json")).unwrap();
        assert!(text.contains("\"use_rslora\": true"), "{text}");

        let err = run(lora("tiny", &["lm_head"], false, "c")).unwrap_err();
        assert!(err.to_string().contains("--targets \"lm_head\""), "{err}");
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
