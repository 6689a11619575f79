//! ferry-core's import rule: no module imports one that imports it back, directly or around a
//! ring. The modules then stack bottom up (`lib.rs` lists them in that order), and each can be
//! read, tested and changed knowing only the ones below it.
//!
//! The check reads every file under `src/`, finds what each refers to through `crate::`,
//! `super::` and `self::` paths (in `use` declarations and inline, test modules included;
//! comments and string literals skipped) and builds the graph of modules. What counts as an
//! edge:
//!
//! * A file is a module (`src/a.rs` and `src/a/mod.rs` are `a`, `src/a/b.rs` is `a::b`); an
//!   inline `mod x { .. }` is part of its file.
//! * A module and its submodules are one unit to everyone outside them, and a submodule may
//!   use its parent's items (`use super::Scheduler` in `scheduler/offer.rs`) and its parent
//!   its submodules' (the split-`impl` pattern): references between a module and its own
//!   submodules, either way, are no edge. `mod` declarations are no edge either.
//! * Any other reference is an edge between the two sibling modules it crosses: a reference
//!   from `a::b` to `c::d` is the edge `a -> c`, one from `a::b` to `a::e` the edge
//!   `a::b -> a::e`. So loops are found among the crate's top-level modules and, separately,
//!   among the submodules of each module.
//! * A path through the crate root's re-exports (`crate::StepPlan`) counts as the module that
//!   defines the item (`lib.rs`'s `pub use plan::StepPlan`).
//!
//! A loop fails the test, naming the modules in it, one shortest ring and every import that
//! keeps them in it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

/// A module's path from the crate root (`[]` is the root, `["scheduler", "offer"]` is
/// `scheduler::offer`).
type ModPath = Vec<String>;

/// One token of Rust source, with the line it is on.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

/// Splits Rust source into identifiers, `::` and punctuation, dropping comments, string and
/// character literals, lifetimes and numbers.
fn tokenize(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                // An escaped character literal: up to its closing quote.
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or label: its name follows as an identifier, which is harmless.
                i += 1;
            }
        } else if ch == '_' || ch.is_alphabetic() {
            let start = i;
            while i < c.len() && (c[i] == '_' || c[i].is_alphanumeric()) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            if raw_prefix && (at(i) == '"' || at(i) == '#') {
                let mut hashes = 0;
                let mut j = i;
                while at(j) == '#' {
                    hashes += 1;
                    j += 1;
                }
                if at(j) == '"' {
                    // A raw string: up to a quote followed by as many hashes.
                    j += 1;
                    loop {
                        if j >= c.len() {
                            break;
                        }
                        if c[j] == '"' && (1..=hashes).all(|k| at(j + k) == '#') {
                            j += 1 + hashes;
                            break;
                        }
                        if c[j] == '\n' {
                            line += 1;
                        }
                        j += 1;
                    }
                    i = j;
                    continue;
                }
                // A raw identifier (`r#type`): the identifier follows.
                i = j;
                continue;
            }
            out.push((Tok::Ident(word), line));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i] == '_' || c[i].is_alphanumeric()) {
                i += 1;
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((Tok::PathSep, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// A path one file refers to.
#[derive(Debug, Clone)]
struct Ref {
    line: usize,
    /// The path as written (`crate::plan::BlockId`, `super::Scheduler`).
    text: String,
    /// The module it lands in.
    target: ModPath,
}

/// The crate's files as modules, and how paths resolve among them.
struct Crate {
    /// Every file's module, with the file's path (relative to `src/`) and source.
    files: BTreeMap<ModPath, (String, String)>,
    /// Items the crate root re-exports (`pub use plan::StepPlan`): name → defining module.
    root_exports: BTreeMap<String, ModPath>,
}

impl Crate {
    /// `files`: (path relative to `src/`, source).
    fn new(files: Vec<(String, String)>) -> Self {
        let mut krate = Crate {
            files: BTreeMap::new(),
            root_exports: BTreeMap::new(),
        };
        for (rel, src) in files {
            krate.files.insert(module_of(&rel), (rel, src));
        }
        if let Some((_, src)) = krate.files.get(&Vec::new()) {
            let refs = scan(&tokenize(src));
            let mut exports = BTreeMap::new();
            for (segments, name, _, _) in refs.iter().filter(|r| r.3) {
                let target = krate.resolve(&[], segments);
                if !target.is_empty() {
                    exports.insert(name.clone(), target);
                }
            }
            krate.root_exports = exports;
        }
        krate
    }

    /// The module `segments` (a path written in module `cur`) lands in: the deepest file
    /// module it names, or the module a root re-export comes from.
    fn resolve(&self, cur: &[String], segments: &[String]) -> ModPath {
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
        while !base.is_empty() && !self.files.contains_key(&base) {
            // Inside an inline module: its file's module.
            base.pop();
        }
        for seg in rest {
            let mut next = base.clone();
            next.push(seg.clone());
            if self.files.contains_key(&next) {
                base = next;
            } else {
                if base.is_empty() {
                    if let Some(m) = self.root_exports.get(seg) {
                        return m.clone();
                    }
                }
                break;
            }
        }
        base
    }

    /// Every `crate::`/`super::`/`self::` reference of each file.
    fn refs(&self) -> BTreeMap<ModPath, Vec<Ref>> {
        let mut all = BTreeMap::new();
        for (module, (_, src)) in &self.files {
            let refs = scan(&tokenize(src))
                .into_iter()
                .filter(|(segments, _, _, _)| {
                    matches!(segments[0].as_str(), "crate" | "super" | "self")
                })
                .map(|(segments, _, line, _)| Ref {
                    line,
                    text: segments.join("::"),
                    target: self.resolve(module, &segments),
                })
                .collect();
            all.insert(module.clone(), refs);
        }
        all
    }
}

/// The module of a file at `rel` (relative to `src/`).
fn module_of(rel: &str) -> ModPath {
    let rel = rel.trim_end_matches(".rs");
    let mut parts: ModPath = rel.split('/').map(str::to_owned).collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The paths a file's tokens refer to, each as (segments, the name it brings into scope, line,
/// whether it is a `pub use`). Paths inside inline modules are rewritten relative to the
/// file's module: `super::` inside `mod tests { .. }` is the file's own module (`self::`).
fn scan(toks: &[(Tok, usize)]) -> Vec<(Vec<String>, String, usize, bool)> {
    let mut out = Vec::new();
    // Brace depths at which inline modules opened.
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let ident = |i: usize| match toks.get(i) {
        Some((Tok::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    let is = |i: usize, t: &Tok| toks.get(i).map(|(x, _)| x) == Some(t);
    while i < toks.len() {
        let line = toks[i].1;
        match &toks[i].0 {
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last() == Some(&depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(w)
                if w == "mod" && ident(i + 1).is_some() && is(i + 2, &Tok::Punct('{')) =>
            {
                inline.push(depth + 1);
                i += 2;
            }
            Tok::Ident(w) if w == "use" => {
                let public = i > 0 && (ident(i - 1) == Some("pub") || is(i - 1, &Tok::Punct(')')));
                let mut trees = Vec::new();
                i = use_tree(toks, i + 1, Vec::new(), &mut trees, true);
                for (segments, name) in trees {
                    let segments = relative_to_file(segments, inline.len());
                    out.push((segments, name, line, public));
                }
            }
            Tok::Ident(w)
                if matches!(w.as_str(), "crate" | "super" | "self") && is(i + 1, &Tok::PathSep) =>
            {
                let mut segments = vec![w.clone()];
                let mut j = i + 1;
                while is(j, &Tok::PathSep) {
                    match ident(j + 1) {
                        Some(s) => {
                            segments.push(s.to_owned());
                            j += 2;
                        }
                        None => break,
                    }
                }
                let name = segments.last().cloned().unwrap_or_default();
                out.push((relative_to_file(segments, inline.len()), name, line, false));
                i = j;
            }
            _ => i += 1,
        }
    }
    out
}

/// Rewrites a path written `n_inline` inline modules deep so that it is relative to the
/// file's module: each leading `super` climbs out of one inline module first.
fn relative_to_file(mut segments: Vec<String>, n_inline: usize) -> Vec<String> {
    if segments.first().map(String::as_str) == Some("super") {
        let n_super = segments.iter().take_while(|s| *s == "super").count();
        let climbed_inline = n_super.min(n_inline);
        segments.drain(..climbed_inline);
        if segments.first().map(String::as_str) != Some("super") {
            segments.insert(0, "self".to_owned());
        }
    }
    segments
}

/// Parses a `use` tree starting at token `i` under `prefix`; appends each leaf as (full path,
/// the name it brings into scope) to `out` and returns the index after the tree (after the
/// `;` when `top`: the whole declaration).
fn use_tree(
    toks: &[(Tok, usize)],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, String)>,
    top: bool,
) -> usize {
    if matches!(toks.get(i), Some((Tok::PathSep, _))) {
        i += 1;
    }
    loop {
        match toks.get(i).map(|(t, _)| t) {
            Some(Tok::Ident(s)) if s != "as" => {
                prefix.push(s.clone());
                i += 1;
                if matches!(toks.get(i), Some((Tok::PathSep, _))) {
                    i += 1;
                    continue;
                }
                let mut name = prefix.last().cloned().unwrap_or_default();
                if matches!(toks.get(i), Some((Tok::Ident(a), _)) if a == "as") {
                    if let Some((Tok::Ident(alias), _)) = toks.get(i + 1) {
                        name = alias.clone();
                    }
                    i += 2;
                }
                out.push((prefix.clone(), name));
                break;
            }
            Some(Tok::Punct('*')) => {
                i += 1;
                out.push((prefix.clone(), "*".to_owned()));
                break;
            }
            Some(Tok::Punct('{')) => {
                i += 1;
                loop {
                    match toks.get(i).map(|(t, _)| t) {
                        Some(Tok::Punct('}')) => {
                            i += 1;
                            break;
                        }
                        Some(Tok::Punct(',')) => i += 1,
                        None => break,
                        _ => i = use_tree(toks, i, prefix.clone(), out, false),
                    }
                }
                break;
            }
            _ => break,
        }
    }
    if top {
        while i < toks.len() && toks[i].0 != Tok::Punct(';') {
            i += 1;
        }
        i += 1;
    }
    i
}

/// One edge of the module graph, with the reference that makes it.
#[derive(Debug, Clone)]
struct Evidence {
    file: String,
    line: usize,
    text: String,
}

/// The module graph: edges between sibling modules (see the module docs), each with the
/// references that make it.
fn graph(krate: &Crate) -> BTreeMap<ModPath, BTreeMap<ModPath, Vec<Evidence>>> {
    let mut edges: BTreeMap<ModPath, BTreeMap<ModPath, Vec<Evidence>>> = BTreeMap::new();
    for (from, refs) in krate.refs() {
        let file = &krate.files[&from].0;
        for r in refs {
            let common = from
                .iter()
                .zip(&r.target)
                .take_while(|(a, b)| a == b)
                .count();
            if common >= from.len() || common >= r.target.len() {
                // Inside one module and its submodules.
                continue;
            }
            edges
                .entry(from[..=common].to_vec())
                .or_default()
                .entry(r.target[..=common].to_vec())
                .or_default()
                .push(Evidence {
                    file: file.clone(),
                    line: r.line,
                    text: r.text,
                });
        }
    }
    edges
}

/// The graph's strongly connected components of more than one module: its import loops.
fn loops(edges: &BTreeMap<ModPath, BTreeMap<ModPath, Vec<Evidence>>>) -> Vec<BTreeSet<ModPath>> {
    let nodes: BTreeSet<&ModPath> = edges
        .iter()
        .flat_map(|(a, to)| std::iter::once(a).chain(to.keys()))
        .collect();
    let reach = |start: &ModPath| -> BTreeSet<ModPath> {
        let mut seen = BTreeSet::new();
        let mut queue = VecDeque::from([start.clone()]);
        while let Some(n) = queue.pop_front() {
            for m in edges.get(&n).into_iter().flat_map(BTreeMap::keys) {
                if seen.insert(m.clone()) {
                    queue.push_back(m.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&ModPath, BTreeSet<ModPath>> =
        nodes.iter().map(|&n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for &n in &nodes {
        if done.contains(n) || !reachable[n].contains(n) {
            continue;
        }
        let scc: BTreeSet<ModPath> = reachable[n]
            .iter()
            .filter(|m| reachable[m].contains(n))
            .cloned()
            .collect();
        done.extend(scc.iter().cloned());
        out.push(scc);
    }
    out
}

/// A shortest ring through `start` inside `scc`.
fn ring(
    edges: &BTreeMap<ModPath, BTreeMap<ModPath, Vec<Evidence>>>,
    scc: &BTreeSet<ModPath>,
    start: &ModPath,
) -> Vec<ModPath> {
    let mut prev: BTreeMap<ModPath, ModPath> = BTreeMap::new();
    let mut queue = VecDeque::from([start.clone()]);
    while let Some(n) = queue.pop_front() {
        for m in edges.get(&n).into_iter().flat_map(BTreeMap::keys) {
            if !scc.contains(m) || prev.contains_key(m) {
                continue;
            }
            prev.insert(m.clone(), n.clone());
            if m == start {
                let mut path = vec![start.clone()];
                let mut at = n.clone();
                while &at != start {
                    path.push(at.clone());
                    at = prev[&at].clone();
                }
                path.push(start.clone());
                path.reverse();
                return path;
            }
            queue.push_back(m.clone());
        }
    }
    Vec::new()
}

fn name(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".to_owned()
    } else {
        m.join("::")
    }
}

/// The report of every import loop of `krate`; `None` if there is none.
fn report(krate: &Crate) -> Option<String> {
    let edges = graph(krate);
    let loops = loops(&edges);
    if loops.is_empty() {
        return None;
    }
    let mut s = String::from("import loops (a module imports one that imports it back):\n");
    for scc in &loops {
        let members: Vec<String> = scc.iter().map(name).collect();
        s += &format!("loop among {}:\n", members.join(", "));
        let first = scc.iter().next().expect("a loop has modules");
        let ring = ring(&edges, scc, first);
        let ring_names: Vec<String> = ring.iter().map(name).collect();
        s += &format!("  a shortest ring: {}\n", ring_names.join(" -> "));
        s += "  the imports inside the loop:\n";
        for a in scc {
            for (b, evidence) in edges.get(a).into_iter().flatten() {
                if !scc.contains(b) {
                    continue;
                }
                let e = &evidence[0];
                let more = match evidence.len() {
                    1 => String::new(),
                    n => format!(" (and {} more)", n - 1),
                };
                s += &format!(
                    "    {} -> {}: src/{}:{} `{}`{more}\n",
                    name(a),
                    name(b),
                    e.file,
                    e.line,
                    e.text
                );
            }
        }
    }
    Some(s)
}

/// Every `.rs` file under `dir`, as (path relative to `root`, source).
fn read_dir(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_dir(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path
                .strip_prefix(root)
                .expect("under src/")
                .to_string_lossy()
                .replace('\\', "/");
            let src = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            out.push((rel, src));
        }
    }
}

#[test]
fn ferry_core_has_no_import_loop() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_dir(&src, &src, &mut files);
    let krate = Crate::new(files);
    assert!(
        krate.files.len() > 10,
        "found only {} files",
        krate.files.len()
    );
    // The scan sees the crate's real imports (not an empty graph that passes trivially).
    let edges = graph(&krate);
    let n_edges: usize = edges.values().map(BTreeMap::len).sum();
    assert!(n_edges > 20, "only {n_edges} module edges found");
    if let Some(report) = report(&krate) {
        panic!("ferry-core has {report}");
    }
}

fn fake(files: &[(&str, &str)]) -> Crate {
    Crate::new(
        files
            .iter()
            .map(|(p, s)| (p.to_string(), s.to_string()))
            .collect(),
    )
}

#[test]
fn the_checker_finds_a_loop_through_use_lines_and_inline_paths() {
    let krate = fake(&[
        ("lib.rs", "pub mod a; pub mod b; pub mod c; pub use c::Thing;"),
        ("a.rs", "use crate::b::{X, y::Z};\n"),
        ("b.rs", "fn f() -> crate::Thing { todo!() }\n"),
        ("c.rs", "// use crate::a::Nope;\nconst S: &str = \"crate::a::Nope\";\nfn g() { let _ = crate::a::f(); }\n"),
    ]);
    let report = report(&krate).expect("a -> b -> c -> a is a loop");
    assert!(report.contains("loop among a, b, c"), "{report}");
    assert!(
        report.contains("a shortest ring: a -> b -> c -> a"),
        "{report}"
    );
    assert!(
        report.contains("c -> a: src/c.rs:3 `crate::a::f`"),
        "{report}"
    );
    assert!(
        report.contains("b -> c: src/b.rs:1 `crate::Thing`"),
        "{report}"
    );
}

#[test]
fn the_checker_takes_a_module_and_its_submodules_as_one_but_checks_siblings() {
    // The parent uses its submodules and they use the parent: no loop.
    let split_impl = fake(&[
        ("lib.rs", "mod s; mod t;"),
        ("s.rs", "mod one; mod two; pub struct S(one::Part);"),
        (
            "s/one.rs",
            "use super::S; use crate::t::T; pub struct Part;",
        ),
        ("s/two.rs", "use super::{one::Part, S};"),
        (
            "t.rs",
            "pub struct T; #[cfg(test)] mod tests { use super::*; use crate::t::T; }",
        ),
    ]);
    assert_eq!(report(&split_impl), None);
    let edges = graph(&split_impl);
    assert!(edges[&vec!["s".to_owned()]].contains_key(&vec!["t".to_owned()]));
    assert!(edges[&vec!["s".to_owned(), "two".to_owned()]]
        .contains_key(&vec!["s".to_owned(), "one".to_owned()]));
    // Two submodules that use each other are a loop; so is a submodule that goes around
    // through another top-level module.
    let siblings = fake(&[
        ("lib.rs", "mod s;"),
        ("s.rs", "mod one; mod two;"),
        ("s/one.rs", "use super::two::B; pub struct A;"),
        ("s/two.rs", "pub struct B(super::one::A);"),
    ]);
    let report_siblings = report(&siblings).expect("one and two use each other");
    assert!(
        report_siblings.contains("loop among s::one, s::two"),
        "{report_siblings}"
    );
    let around = fake(&[
        ("lib.rs", "mod s; mod t;"),
        ("s.rs", "mod one;"),
        ("s/one.rs", "use crate::t::T;"),
        ("t.rs", "pub struct T; fn f(_: crate::s::S) {}"),
    ]);
    let report_around = report(&around).expect("s::one uses t, t uses s");
    assert!(report_around.contains("loop among s, t"), "{report_around}");
}
