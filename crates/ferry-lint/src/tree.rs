//! A crate's modules as rustc sees them: from each crate root (`lib.rs`, `main.rs`, `bin/`)
//! through its `mod` declarations (`#[path]` included) to every file, and where each path a
//! file writes lands.
//!
//! A file is a module (`a.rs` and `a/mod.rs` are `a`, `a/b.rs` is `a::b`, a `#[path]` file is
//! the module that declares it); an inline `mod x { .. }` is part of its file. A path lands
//! in the deepest module it names; where it goes on through a name a module brings in with
//! `use` (a re-export such as `lib.rs`'s `pub use plan::StepPlan`, or a parent's import that
//! a submodule reaches as `super::Name`), it lands where that `use` points.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::Error;
use crate::paths::{scan, FileScan};
use crate::tokens::tokenize;

/// A module's path from the crate root (`[]` is the root, `["scheduler", "offer"]` is
/// `scheduler::offer`).
pub type ModPath = Vec<String>;

/// `crate::a::b`, or `crate` for the root.
pub fn name(m: &[String]) -> String {
    if m.is_empty() {
        "crate".to_owned()
    } else {
        m.join("::")
    }
}

/// One file module.
#[derive(Debug, Clone)]
pub struct Module {
    /// Its file, relative to `src/`.
    pub file: String,
    pub scan: FileScan,
}

/// A path one module writes, and the module it lands in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ref {
    pub line: usize,
    /// As written (`crate::plan::BlockId`, `super::Scheduler`).
    pub text: String,
    pub target: ModPath,
}

/// One crate target (the library, or a binary): its root file and its modules.
#[derive(Debug, Clone)]
pub struct Target {
    /// Its root file, relative to `src/` (`lib.rs`, `main.rs`, `bin/x.rs`).
    pub root: String,
    pub modules: BTreeMap<ModPath, Module>,
    /// Each module's names brought in by `use`: name → the path as written there.
    names: BTreeMap<ModPath, BTreeMap<String, Vec<String>>>,
}

/// The crate roots among `files` (paths relative to `src/`).
fn roots(files: &BTreeMap<String, String>) -> Vec<String> {
    files
        .keys()
        .filter(|f| {
            let parts: Vec<&str> = f.split('/').collect();
            matches!(
                parts.as_slice(),
                ["lib.rs"] | ["main.rs"] | ["bin", _] | ["bin", _, "main.rs"]
            )
        })
        .cloned()
        .collect()
}

/// Every target of a crate whose `src/` holds `files` (path relative to `src/` → source).
/// Every file must belong to one, else it would go unchecked.
pub fn targets(files: &BTreeMap<String, String>) -> Result<Vec<Target>, Error> {
    let roots = roots(files);
    if roots.is_empty() {
        return Err(Error::NoRoot);
    }
    let mut reached = BTreeSet::new();
    let mut out = Vec::new();
    for root in roots {
        let target = Target::build(files, &root)?;
        reached.extend(target.modules.values().map(|m| m.file.clone()));
        out.push(target);
    }
    let unreached: Vec<String> = files
        .keys()
        .filter(|f| !reached.contains(*f))
        .cloned()
        .collect();
    if !unreached.is_empty() {
        return Err(Error::Unreached { files: unreached });
    }
    Ok(out)
}

/// `dir/rel` with `.` and `..` folded (`""` is `src/` itself).
fn join(dir: &str, rel: &str) -> String {
    let mut parts: Vec<&str> = dir.split('/').filter(|p| !p.is_empty()).collect();
    for p in rel.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

/// The folder a file is in (`""` for `src/` itself).
fn dir_of(file: &str) -> &str {
    file.rsplit_once('/').map_or("", |(d, _)| d)
}

impl Target {
    /// The target rooted at `root`, following its `mod` declarations through `files`.
    pub fn build(files: &BTreeMap<String, String>, root: &str) -> Result<Target, Error> {
        let mut modules = BTreeMap::new();
        let mut seen = BTreeSet::new();
        // (file, module, whether its submodules' files sit beside it, as for `mod.rs`)
        let mut queue = vec![(root.to_owned(), ModPath::new(), true)];
        while let Some((file, module, mod_rs)) = queue.pop() {
            if !seen.insert(file.clone()) {
                continue;
            }
            let scan = scan(&tokenize(&files[&file]));
            let dir = dir_of(&file);
            let children = if mod_rs {
                dir.to_owned()
            } else {
                let stem = file.rsplit('/').next().unwrap_or(&file);
                join(dir, stem.trim_end_matches(".rs"))
            };
            for decl in &scan.mods {
                let inline_dir: Vec<&str> = decl.inline.iter().map(|m| m.1.as_str()).collect();
                let inline_dir = join(&children, &inline_dir.join("/"));
                let tried = match &decl.path_attr {
                    // Outside inline modules, relative to the declaring file's folder.
                    Some(p) if decl.inline.is_empty() => vec![join(dir, p)],
                    Some(p) => vec![join(&inline_dir, p)],
                    None => vec![
                        join(&inline_dir, &format!("{}.rs", decl.name)),
                        join(&inline_dir, &format!("{}/mod.rs", decl.name)),
                    ],
                };
                let Some(found) = tried.iter().find(|f| files.contains_key(*f)) else {
                    return Err(Error::NoModuleFile {
                        file: file.clone(),
                        line: decl.line,
                        name: decl.name.clone(),
                        tried,
                    });
                };
                let mut sub = module.clone();
                sub.extend(decl.inline.iter().map(|m| m.0.clone()));
                sub.push(decl.name.clone());
                let sub_mod_rs = decl.path_attr.is_some() || found.ends_with("mod.rs");
                queue.push((found.clone(), sub, sub_mod_rs));
            }
            modules.insert(module, Module { file, scan });
        }
        let names = modules
            .iter()
            .map(|(m, module)| {
                let names = module
                    .scan
                    .paths
                    .iter()
                    .filter(|p| p.is_use && p.name != "*")
                    .map(|p| (p.name.clone(), p.segments.clone()))
                    .collect();
                (m.clone(), names)
            })
            .collect();
        Ok(Target {
            root: root.to_owned(),
            modules,
            names,
        })
    }

    /// The module `segments` (a path written in module `cur`) lands in.
    pub fn resolve(&self, cur: &[String], segments: &[String]) -> ModPath {
        self.resolve_within(cur, segments, 0)
    }

    fn resolve_within(&self, cur: &[String], segments: &[String], hops: usize) -> ModPath {
        let mut base: ModPath = cur.to_vec();
        let mut rest = segments;
        match segments.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &segments[1..];
            }
            Some("self") => rest = &segments[1..],
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop();
                    rest = &rest[1..];
                }
            }
            _ => {}
        }
        while !base.is_empty() && !self.modules.contains_key(&base) {
            // Inside an inline module: its file's module.
            base.pop();
        }
        for seg in rest {
            let mut next = base.clone();
            next.push(seg.clone());
            if self.modules.contains_key(&next) {
                base = next;
                continue;
            }
            // A name the module brings in with `use`: where that points (a bounded number
            // of hops, so that a `use` naming itself cannot loop).
            if let Some(path) = self.names.get(&base).and_then(|n| n.get(seg)) {
                if hops < 16 {
                    return self.resolve_within(&base, path, hops + 1);
                }
            }
            break;
        }
        base
    }

    /// Every path each module writes into this crate (`crate::`, `super::`, `self::`, or
    /// through a name it brought in with `use`), with the module it lands in.
    pub fn refs(&self) -> BTreeMap<ModPath, Vec<Ref>> {
        self.modules
            .iter()
            .map(|(module, m)| {
                let refs = m
                    .scan
                    .paths
                    .iter()
                    .filter(|p| matches!(p.segments[0].as_str(), "crate" | "super" | "self"))
                    .map(|p| Ref {
                        line: p.line,
                        text: p.segments.join("::"),
                        target: self.resolve(module, &p.segments),
                    })
                    .collect();
                (module.clone(), refs)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(list: &[(&str, &str)]) -> BTreeMap<String, String> {
        list.iter()
            .map(|(p, s)| (p.to_string(), s.to_string()))
            .collect()
    }

    fn modules(t: &Target) -> Vec<(String, String)> {
        t.modules
            .iter()
            .map(|(m, module)| (name(m), module.file.clone()))
            .collect()
    }

    #[test]
    fn modules_follow_mod_declarations_and_path_attributes() {
        let crate_files = files(&[
            ("lib.rs", "mod a; mod b; mod inline { mod deep; }"),
            (
                "a.rs",
                "mod sub; #[cfg(test)] #[path = \"a_tests.rs\"] mod tests;",
            ),
            ("a/sub.rs", ""),
            ("a_tests.rs", "use super::sub::X;"),
            ("b/mod.rs", "mod c;"),
            ("b/c.rs", ""),
            ("inline/deep.rs", ""),
        ]);
        let t = &targets(&crate_files).unwrap()[0];
        assert_eq!(
            modules(t),
            vec![
                ("crate".into(), "lib.rs".into()),
                ("a".into(), "a.rs".into()),
                ("a::sub".into(), "a/sub.rs".into()),
                ("a::tests".into(), "a_tests.rs".into()),
                ("b".into(), "b/mod.rs".into()),
                ("b::c".into(), "b/c.rs".into()),
                ("inline::deep".into(), "inline/deep.rs".into()),
            ]
        );
        // `super::` in the #[path] file is `a`, whose submodule `sub` it names.
        let refs = &t.refs()[&vec!["a".to_owned(), "tests".to_owned()]];
        assert_eq!(refs[0].target, vec!["a".to_owned(), "sub".to_owned()]);
    }

    #[test]
    fn a_library_and_a_binary_are_two_targets_and_no_file_goes_unseen() {
        let both = files(&[
            ("lib.rs", "pub mod a;"),
            ("a.rs", ""),
            ("main.rs", "mod cli;"),
            ("cli.rs", "use crate::x;"),
        ]);
        let ts = targets(&both).unwrap();
        let roots: Vec<&str> = ts.iter().map(|t| t.root.as_str()).collect();
        assert_eq!(roots, vec!["lib.rs", "main.rs"]);
        assert_eq!(
            modules(&ts[1]),
            vec![
                ("crate".into(), "main.rs".into()),
                ("cli".into(), "cli.rs".into())
            ]
        );
        let stray = files(&[("lib.rs", "mod a;"), ("a.rs", ""), ("old.rs", "")]);
        match targets(&stray) {
            Err(Error::Unreached { files }) => assert_eq!(files, vec!["old.rs".to_owned()]),
            other => panic!("{other:?}"),
        }
        match targets(&files(&[("lib.rs", "mod gone;")])) {
            Err(Error::NoModuleFile { name, tried, .. }) => {
                assert_eq!(name, "gone");
                assert_eq!(tried, vec!["gone.rs".to_owned(), "gone/mod.rs".to_owned()]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_path_through_a_use_lands_where_the_use_points() {
        let t = Target::build(
            &files(&[
                ("lib.rs", "mod a; mod b; mod c; pub use a::Thing;"),
                ("a.rs", "pub struct Thing;"),
                (
                    "b.rs",
                    "pub use crate::c::Other as Renamed; use crate::a::Thing as T;",
                ),
                ("c.rs", "pub struct Other;"),
            ]),
            "lib.rs",
        )
        .unwrap();
        let at = |cur: &[&str], path: &str| {
            let cur: Vec<String> = cur.iter().map(|s| s.to_string()).collect();
            let segs: Vec<String> = path.split("::").map(str::to_owned).collect();
            name(&t.resolve(&cur, &segs))
        };
        assert_eq!(at(&["c"], "crate::Thing"), "a");
        assert_eq!(at(&["a"], "crate::b::Renamed"), "c");
        assert_eq!(at(&["b"], "self::T"), "a");
        assert_eq!(at(&["a"], "crate::b::Missing"), "b");
        assert_eq!(at(&["a"], "crate::c::Other"), "c");
    }
}
