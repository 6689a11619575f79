//! What one file names: every path it writes (in `use` declarations and inline, test modules
//! included) and every module it declares with `mod name;` (with its `#[path]`, if any).
//!
//! Paths inside an inline module (`mod tests { .. }`) are rewritten relative to the file's
//! module, which the inline module is part of: `super::` inside `mod tests { .. }` is the
//! file's own module (`self::`).

use crate::tokens::{Tok, Token};

/// A path the file writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathRef {
    /// Its segments, relative to the file's module (`["crate", "plan", "BlockId"]`,
    /// `["super", "Scheduler"]`, `["std", "sync", "Arc"]`).
    pub segments: Vec<String>,
    /// For a `use` leaf, the name it brings into scope (its alias, if any); else the path's
    /// last segment.
    pub name: String,
    pub line: usize,
    /// A leaf of a `use` declaration (else a path written inline).
    pub is_use: bool,
}

/// A `mod name;` declaration: a module whose source is another file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModDecl {
    /// The inline modules it is declared in, outermost first, as (name, the folder they stand
    /// for: their name, or their `#[path]`).
    pub inline: Vec<(String, String)>,
    pub name: String,
    /// Its `#[path = "..."]`.
    pub path_attr: Option<String>,
    pub line: usize,
}

/// Everything the checker needs from one file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileScan {
    pub paths: Vec<PathRef>,
    pub mods: Vec<ModDecl>,
}

/// Reads a file's paths and module declarations from its tokens.
pub fn scan(toks: &[Token]) -> FileScan {
    let mut out = FileScan::default();
    // Inline modules open around the cursor: (name, folder, the brace depth inside them).
    let mut inline: Vec<(String, String, usize)> = Vec::new();
    let mut depth = 0usize;
    // A `#[path = "..."]` waiting for its item.
    let mut path_attr: Option<String> = None;
    let mut i = 0;
    let tok = |i: usize| toks.get(i).map(|t| &t.tok);
    let ident = |i: usize| match tok(i) {
        Some(Tok::Ident(s)) => Some(s.as_str()),
        _ => None,
    };
    let is = |i: usize, t: &Tok| tok(i) == Some(t);
    while i < toks.len() {
        let line = toks[i].line;
        match &toks[i].tok {
            Tok::Punct('#')
                if is(i + 1, &Tok::Punct('['))
                    && ident(i + 2) == Some("path")
                    && is(i + 3, &Tok::Punct('='))
                    && is(i + 5, &Tok::Punct(']')) =>
            {
                if let Some(Tok::Str(p)) = tok(i + 4) {
                    path_attr = Some(p.clone());
                }
                i += 6;
            }
            Tok::Punct('{') => {
                depth += 1;
                path_attr = None;
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|m| m.2 == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                path_attr = None;
                i += 1;
            }
            Tok::Punct(';') => {
                path_attr = None;
                i += 1;
            }
            Tok::Ident(w) if w == "mod" && ident(i + 1).is_some() => {
                let name = ident(i + 1).unwrap_or_default().to_owned();
                if is(i + 2, &Tok::Punct('{')) {
                    let folder = path_attr.take().unwrap_or_else(|| name.clone());
                    inline.push((name, folder, depth + 1));
                } else if is(i + 2, &Tok::Punct(';')) {
                    out.mods.push(ModDecl {
                        inline: inline.iter().map(|m| (m.0.clone(), m.1.clone())).collect(),
                        name,
                        path_attr: path_attr.take(),
                        line,
                    });
                }
                i += 2;
            }
            Tok::Ident(w) if w == "use" => {
                let mut leaves = Vec::new();
                i = use_tree(toks, i + 1, Vec::new(), &mut leaves, true);
                for (segments, name) in leaves {
                    out.paths.push(PathRef {
                        segments: relative_to_file(segments, inline.len()),
                        name,
                        line,
                        is_use: true,
                    });
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
                out.paths.push(PathRef {
                    segments: relative_to_file(segments, inline.len()),
                    name,
                    line,
                    is_use: false,
                });
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
/// `;` when `top`: the whole declaration). A `self` leaf (`use a::{self, B}`) is its parent.
fn use_tree(
    toks: &[Token],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, String)>,
    top: bool,
) -> usize {
    let tok = |i: usize| toks.get(i).map(|t| &t.tok);
    if tok(i) == Some(&Tok::PathSep) {
        i += 1;
    }
    loop {
        match tok(i) {
            Some(Tok::Ident(s)) if s != "as" => {
                // `a::{self}` is `a` itself.
                if s != "self" || prefix.is_empty() {
                    prefix.push(s.clone());
                }
                i += 1;
                if tok(i) == Some(&Tok::PathSep) {
                    i += 1;
                    continue;
                }
                let mut name = prefix.last().cloned().unwrap_or_default();
                if matches!(tok(i), Some(Tok::Ident(a)) if a == "as") {
                    if let Some(Tok::Ident(alias)) = tok(i + 1) {
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
                    match tok(i) {
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
        while i < toks.len() && toks[i].tok != Tok::Punct(';') {
            i += 1;
        }
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::tokenize;

    fn paths(src: &str) -> Vec<(String, String, bool)> {
        scan(&tokenize(src))
            .paths
            .into_iter()
            .map(|p| (p.segments.join("::"), p.name, p.is_use))
            .collect()
    }

    #[test]
    fn use_trees_aliases_and_inline_paths() {
        let found = paths(
            "use crate::a::{self, b::C as D, e::*};\nfn f() { super::g::h(); let _ = x::y; }",
        );
        assert_eq!(
            found,
            vec![
                ("crate::a".into(), "a".into(), true),
                ("crate::a::b::C".into(), "D".into(), true),
                ("crate::a::e".into(), "*".into(), true),
                ("super::g::h".into(), "h".into(), false),
            ]
        );
    }

    #[test]
    fn super_in_an_inline_module_is_the_file_itself() {
        let found = paths("mod tests { use super::*; fn f() { super::super::x::Y; } }");
        assert_eq!(
            found,
            vec![
                ("self".into(), "*".into(), true),
                ("super::x::Y".into(), "Y".into(), false),
            ]
        );
    }

    #[test]
    fn module_declarations_with_their_path_and_inline_modules() {
        let mods = scan(&tokenize(
            "pub mod a;\n#[cfg(test)]\n#[path = \"a_tests.rs\"]\nmod tests;\n\
             mod inline { pub(crate) mod deep; }\n#[path = \"ignored.rs\"] fn f() {}\nmod plain;",
        ))
        .mods;
        let found: Vec<_> = mods
            .iter()
            .map(|m| {
                (
                    m.inline.iter().map(|i| i.0.as_str()).collect::<Vec<_>>(),
                    m.name.as_str(),
                    m.path_attr.as_deref(),
                    m.line,
                )
            })
            .collect();
        assert_eq!(
            found,
            vec![
                (vec![], "a", None, 1),
                (vec![], "tests", Some("a_tests.rs"), 4),
                (vec!["inline"], "deep", None, 5),
                (vec![], "plain", None, 7),
            ]
        );
    }
}
