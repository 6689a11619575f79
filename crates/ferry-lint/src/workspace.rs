//! The workspace's crates (`crates/*`, each a folder with a `Cargo.toml`), read from disk,
//! and the rings of each, crate by crate and target by target.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::graph::{graph, n_edges};
use crate::report::{render, rings_of, Ring};
use crate::tree::targets;

/// One crate's source.
#[derive(Debug, Clone)]
pub struct CrateSource {
    /// Its package name (`ferry-core`).
    pub name: String,
    pub dir: PathBuf,
    /// Every `.rs` file under `src/`: path relative to `src/` → source.
    pub files: BTreeMap<String, String>,
}

/// What the check found in one target of a crate.
#[derive(Debug, Clone)]
pub struct TargetReport {
    /// Its root file, relative to `src/`.
    pub root: String,
    pub n_modules: usize,
    pub n_edges: usize,
    pub rings: Vec<Ring>,
}

/// What the check found in one crate.
#[derive(Debug, Clone)]
pub struct CrateReport {
    pub name: String,
    pub targets: Vec<TargetReport>,
}

impl CrateReport {
    pub fn has_rings(&self) -> bool {
        self.targets.iter().any(|t| !t.rings.is_empty())
    }

    /// Every ring, by target (`ferry-sim (src/lib.rs)`); empty when there is none.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for t in self.targets.iter().filter(|t| !t.rings.is_empty()) {
            let _ = writeln!(s, "{} (src/{}):", self.name, t.root);
            s += &render(&t.rings);
        }
        s
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// Every crate under `workspace/crates`, by name.
pub fn workspace_crates(workspace: &Path) -> Result<Vec<CrateSource>, Error> {
    let crates = workspace.join("crates");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .map_err(io(&crates))?
        .map(|e| e.map(|e| e.path()).map_err(io(&crates)))
        .collect::<Result<_, _>>()?;
    dirs.retain(|d| d.join("Cargo.toml").is_file());
    let mut out = dirs
        .into_iter()
        .map(|d| read_crate(&d))
        .collect::<Result<Vec<_>, _>>()?;
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The crate in `dir`: its package name and its `src/` files.
pub fn read_crate(dir: &Path) -> Result<CrateSource, Error> {
    let manifest = dir.join("Cargo.toml");
    let toml = std::fs::read_to_string(&manifest).map_err(io(&manifest))?;
    let name = package_name(&toml).ok_or_else(|| Error::NoPackageName {
        manifest: manifest.clone(),
    })?;
    let src = dir.join("src");
    let mut files = BTreeMap::new();
    read_dir(&src, &src, &mut files)?;
    Ok(CrateSource {
        name,
        dir: dir.to_owned(),
        files,
    })
}

/// The `name` of a manifest's `[package]`.
fn package_name(toml: &str) -> Option<String> {
    let mut in_package = false;
    for line in toml.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package {
            if let Some(value) = line.strip_prefix("name").map(str::trim_start) {
                if let Some(value) = value.strip_prefix('=') {
                    return Some(value.trim().trim_matches('"').to_owned());
                }
            }
        }
    }
    None
}

/// Every `.rs` file under `dir`, keyed by its path relative to `root`.
fn read_dir(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) -> Result<(), Error> {
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            read_dir(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .replace('\\', "/");
            let src = std::fs::read_to_string(&path).map_err(io(&path))?;
            out.insert(rel, src);
        }
    }
    Ok(())
}

/// The rings of every target of `krate`.
pub fn check(krate: &CrateSource) -> Result<CrateReport, Error> {
    let targets = targets(&krate.files)?
        .iter()
        .map(|t| {
            let g = graph(t);
            TargetReport {
                root: t.root.clone(),
                n_modules: t.modules.len(),
                n_edges: n_edges(&g),
                rings: rings_of(&g),
            }
        })
        .collect();
    Ok(CrateReport {
        name: krate.name.clone(),
        targets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_package_name_is_read_from_its_section() {
        let toml = "[workspace]\nname = \"no\"\n\n[package]\nversion = \"1\"\nname = \"ferry-x\"\n";
        assert_eq!(package_name(toml), Some("ferry-x".to_owned()));
        assert_eq!(package_name("[lib]\nname = \"y\"\n"), None);
    }
}
