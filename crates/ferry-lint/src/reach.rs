//! What a module reaches: the modules it imports, the ones those import, and so on, by the
//! same edges the ring check uses ([`crate::graph::edge`]), each with its tokens, so a test
//! can say what none of them may name (the engine core's sans-IO check, `tests/sans_io.rs`).
//!
//! Reaching a module reaches its submodules too (a module and its submodules are one unit to
//! everyone outside them). A reference into an enclosing module's own items (`crate::Thing`
//! defined in `lib.rs`) is not followed: the crate root encloses every module, so following
//! it would reach the whole crate. Such references are listed instead
//! ([`Reach::into_enclosing`]), for a check that must see everything to refuse them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::error::Error;
use crate::graph::{edge, Evidence};
use crate::paths::FileScan;
use crate::tokens::{tokenize, Tok, Token};
use crate::tree::{name, targets, ModPath};
use crate::workspace::CrateSource;

/// One module reached, with its file's tokens (inline modules, tests included).
#[derive(Debug, Clone)]
pub struct Reached {
    pub module: ModPath,
    /// Its file, relative to `src/`.
    pub file: String,
    pub tokens: Vec<Token>,
    /// Its paths and module declarations.
    pub scan: FileScan,
    /// The reference that first reached it (or the module it is part of), breadth first:
    /// none for the modules the walk started from.
    pub via: Option<Evidence>,
}

impl Reached {
    /// The lines where the file writes `path` (`tokio`, `std::thread`, `Instant::now`): its
    /// identifiers in a row, joined by `::`, as a whole path or a part of a longer one
    /// (`std::thread` is found in `std::thread::spawn`, `Instant` in `std::time::Instant`),
    /// or as a part of a path a `use` tree brings in (`use std::{thread, time}`). Comments
    /// and strings never count.
    pub fn lines_naming(&self, path: &str) -> Vec<usize> {
        let segs: Vec<&str> = path.split("::").collect();
        let want: Vec<Tok> = segs
            .iter()
            .enumerate()
            .flat_map(|(i, seg)| {
                let sep = (i > 0).then_some(Tok::PathSep);
                sep.into_iter().chain([Tok::Ident((*seg).to_owned())])
            })
            .collect();
        let in_tokens = self
            .tokens
            .windows(want.len())
            .filter(|w| w.iter().zip(&want).all(|(t, w)| &t.tok == w))
            .map(|w| w[0].line);
        let in_uses = self
            .scan
            .paths
            .iter()
            .filter(|p| p.is_use && p.segments.windows(segs.len()).any(|w| w == segs))
            .map(|p| p.line);
        let lines: BTreeSet<usize> = in_tokens.chain(in_uses).collect();
        lines.into_iter().collect()
    }

    /// Every identifier the file writes before a `::` (`ferry_core` in
    /// `use ferry_core::TokenId`): the crates it can name are among them.
    pub fn path_heads(&self) -> BTreeSet<String> {
        self.tokens
            .windows(2)
            .filter_map(|w| match (&w[0].tok, &w[1].tok) {
                (Tok::Ident(s), Tok::PathSep) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }
}

/// A reference from a reached module into an enclosing module's own items, not followed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntoEnclosing {
    pub from: ModPath,
    pub to: ModPath,
    pub evidence: Evidence,
}

/// What some modules of one target reach.
#[derive(Debug, Clone)]
pub struct Reach {
    /// In module order, the starting modules included.
    pub modules: Vec<Reached>,
    pub into_enclosing: Vec<IntoEnclosing>,
}

impl Reach {
    /// The modules' names (`engine_core`, `constraint`, ...), in module order.
    pub fn names(&self) -> Vec<String> {
        self.modules.iter().map(|m| name(&m.module)).collect()
    }
}

/// Every module of `krate`'s target rooted at `root` (`lib.rs`) that the modules `from`
/// (`["engine_core"]`) reach, and the references into enclosing modules they make.
pub fn reach(krate: &CrateSource, root: &str, from: &[ModPath]) -> Result<Reach, Error> {
    let target = targets(&krate.files)?
        .into_iter()
        .find(|t| t.root == root)
        .ok_or_else(|| Error::NoTarget {
            root: root.to_owned(),
        })?;
    let refs = target.refs();
    let mut units: BTreeMap<ModPath, Option<Evidence>> = BTreeMap::new();
    let mut queue: VecDeque<(ModPath, Option<Evidence>)> = VecDeque::new();
    for m in from {
        if m.is_empty() || !target.modules.contains_key(m) {
            return Err(Error::NoModule {
                root: root.to_owned(),
                module: name(m),
            });
        }
        queue.push_back((m.clone(), None));
    }
    let unit_of = |units: &BTreeMap<ModPath, Option<Evidence>>, m: &ModPath| {
        units.keys().find(|u| m.starts_with(u)).cloned()
    };
    let mut enclosing: Vec<IntoEnclosing> = Vec::new();
    while let Some((unit, via)) = queue.pop_front() {
        if unit_of(&units, &unit).is_some() {
            continue;
        }
        units.insert(unit.clone(), via);
        for (module, module_refs) in refs.iter().filter(|(m, _)| m.starts_with(&unit)) {
            for r in module_refs {
                let evidence = Evidence {
                    file: target.modules[module].file.clone(),
                    line: r.line,
                    text: r.text.clone(),
                };
                match edge(module, &r.target) {
                    Some((_, to)) => queue.push_back((to, Some(evidence))),
                    None if module.starts_with(&r.target) && r.target != *module => {
                        enclosing.push(IntoEnclosing {
                            from: module.clone(),
                            to: r.target.clone(),
                            evidence,
                        })
                    }
                    // Itself, or one of its own submodules (reached with it).
                    None => {}
                }
            }
        }
    }
    // A reference into an enclosing module that the walk reached as a unit of its own is
    // followed after all (a submodule started from, whose parent was reached later).
    enclosing.retain(|e| unit_of(&units, &e.to).is_none());
    let modules = target
        .modules
        .iter()
        .filter_map(|(m, module)| {
            let unit = unit_of(&units, m)?;
            Some(Reached {
                module: m.clone(),
                file: module.file.clone(),
                tokens: tokenize(&krate.files[&module.file]),
                scan: module.scan.clone(),
                via: units[&unit].clone(),
            })
        })
        .collect();
    Ok(Reach {
        modules,
        into_enclosing: enclosing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn krate(files: &[(&str, &str)]) -> CrateSource {
        CrateSource {
            name: "x".to_owned(),
            dir: std::path::PathBuf::new(),
            files: files
                .iter()
                .map(|(p, s)| (p.to_string(), s.to_string()))
                .collect(),
        }
    }

    fn m(s: &str) -> ModPath {
        s.split("::").map(str::to_owned).collect()
    }

    #[test]
    fn a_module_reaches_its_imports_with_their_submodules_and_nothing_else() {
        let files = krate(&[
            (
                "lib.rs",
                "mod core; mod a; mod b; mod c; mod top; pub struct Root;",
            ),
            ("core.rs", "mod inner; use crate::a::sub::X;"),
            (
                "core/inner.rs",
                "use super::super::b::Y; fn f(_: crate::Root) {}",
            ),
            ("a.rs", "pub mod sub; pub mod other;"),
            ("a/sub.rs", "pub struct X;"),
            ("a/other.rs", "use std::{thread, time::Instant};"),
            (
                "b.rs",
                "pub struct Y; fn g() -> std::thread::JoinHandle<()> { todo!() }",
            ),
            ("c.rs", "use crate::core::Z; // tokio"),
            ("top.rs", "use crate::core::Z;"),
        ]);
        let reach = reach(&files, "lib.rs", &[m("core")]).unwrap();
        // `a::sub` is reached as part of `a` (the ring check's edge core -> a), with `a::other`.
        assert_eq!(
            reach.names(),
            vec!["a", "a::other", "a::sub", "b", "core", "core::inner"]
        );
        let via: Vec<Option<String>> = reach
            .modules
            .iter()
            .map(|r| r.via.as_ref().map(|e| format!("{}:{}", e.file, e.line)))
            .collect();
        assert_eq!(
            via,
            vec![
                Some("core.rs:1".into()),
                Some("core.rs:1".into()),
                Some("core.rs:1".into()),
                Some("core/inner.rs:1".into()),
                None,
                None,
            ]
        );
        assert_eq!(
            reach.into_enclosing,
            vec![IntoEnclosing {
                from: m("core::inner"),
                to: vec![],
                evidence: Evidence {
                    file: "core/inner.rs".into(),
                    line: 1,
                    text: "crate::Root".into()
                }
            }]
        );
        let other = &reach.modules[1];
        assert_eq!(other.lines_naming("std::thread"), vec![1]);
        assert_eq!(other.lines_naming("Instant"), vec![1]);
        assert_eq!(other.lines_naming("time::Instant"), vec![1]);
        assert_eq!(other.lines_naming("std::time::Instant"), vec![1]);
        assert_eq!(other.lines_naming("tokio"), Vec::<usize>::new());
        assert_eq!(reach.modules[3].lines_naming("std::thread"), vec![1]);
        assert_eq!(
            reach.modules[3].lines_naming("thread::std"),
            Vec::<usize>::new()
        );
        assert!(matches!(
            super::reach(&files, "lib.rs", &[m("nope")]),
            Err(Error::NoModule { .. })
        ));
        assert!(matches!(
            super::reach(&files, "main.rs", &[m("core")]),
            Err(Error::NoTarget { .. })
        ));
    }
}
