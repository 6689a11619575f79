//! ARCHITECTURE.md's "Dependency edges" says which ferry crate depends on which: the test holds
//! it to `cargo metadata`, so the map cannot drift from the build. Every workspace crate is in
//! the diagram once, with exactly its ferry dependencies (normal ones on its line; those only
//! its tests take on the `tests only:` line), no more and no fewer.
//!
//! The diagram's grammar, one crate a line inside the section's code block:
//!
//! ```text
//! NAME [(note)] ──▶ DEP, DEP, ...,  [(note)]
//!                   DEP, ...                        (indented: the line above goes on)
//! NAME [(note)]                       [(note)]      no ferry dependency
//! tests only: NAME ──▶ DEP, ...                     dependencies only its tests take
//! ```

use std::collections::{BTreeMap, BTreeSet};

use ferry_lint::{cargo, this_workspace};
use serde_json::Value;

type Edges = BTreeMap<String, BTreeSet<String>>;

/// Normal and test-only ferry edges, as `cargo metadata` has them.
fn from_metadata() -> (Edges, Edges) {
    let out = cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ]);
    let meta: Value = serde_json::from_str(&out).expect("cargo metadata's JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let names: BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .collect();
    let (mut normal, mut dev) = (Edges::new(), Edges::new());
    for p in packages {
        let name = p["name"].as_str().unwrap().to_owned();
        let (n, d) = (
            normal.entry(name.clone()).or_default(),
            dev.entry(name.clone()).or_default(),
        );
        for dep in p["dependencies"].as_array().unwrap() {
            let to = dep["name"].as_str().unwrap();
            if !names.contains(to) {
                continue;
            }
            match dep["kind"].as_str() {
                None | Some("build") => drop(n.insert(to.to_owned())),
                Some("dev") => drop(d.insert(to.to_owned())),
                Some(other) => panic!("{name} → {to}: unknown dependency kind {other}"),
            }
        }
    }
    // A test-only edge is one the crate does not have anyway.
    for (name, d) in &mut dev {
        d.retain(|to| !normal[name].contains(to));
    }
    dev.retain(|_, d| !d.is_empty());
    (normal, dev)
}

/// `text` without its parenthesised notes.
fn without_notes(text: &str) -> String {
    let mut out = String::new();
    let mut depth = 0;
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            c if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// The diagram's normal and test-only edges; a crate named twice is an error.
fn from_diagram(architecture: &str) -> Result<(Edges, Edges), String> {
    let section = architecture
        .split("\n## Dependency edges\n")
        .nth(1)
        .ok_or("ARCHITECTURE.md has no \"## Dependency edges\" section")?;
    let block = section
        .split("```")
        .nth(1)
        .ok_or("the section has no code block")?;
    let (mut normal, mut dev) = (Edges::new(), Edges::new());
    let mut last: Option<(bool, String)> = None;
    for line in block.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        if line.starts_with(char::is_whitespace) {
            let (is_dev, from) = last.as_ref().ok_or("a continuation line comes first")?;
            let edges = if *is_dev { &mut dev } else { &mut normal };
            let deps = edges.get_mut(from).expect("the line it continues");
            deps.extend(
                without_notes(line)
                    .split(',')
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .map(str::to_owned),
            );
            continue;
        }
        let is_dev = line.starts_with("tests only:");
        let (edges, line) = match line.strip_prefix("tests only:") {
            Some(rest) => (&mut dev, rest),
            None => (&mut normal, line),
        };
        let line = without_notes(line);
        let (from, to) = line.split_once("──▶").unwrap_or((&line, ""));
        let from = from.trim().to_owned();
        if from.is_empty() || from.contains(char::is_whitespace) {
            return Err(format!("a line that names no one crate: {line:?}"));
        }
        let to: BTreeSet<String> = to
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect();
        if edges.insert(from.clone(), to).is_some() {
            return Err(format!("{from} is on two lines"));
        }
        last = Some((is_dev, from));
    }
    Ok((normal, dev))
}

/// Each difference between what the diagram says and what the build has.
fn differences(said: &Edges, built: &Edges, kind: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (name, deps) in built {
        match said.get(name) {
            None => out.push(format!("{name} is not in the diagram")),
            Some(said) => {
                for missing in deps.difference(said) {
                    out.push(format!("{name} ──▶ {missing} ({kind}) is built, not drawn"));
                }
                for extra in said.difference(deps) {
                    out.push(format!("{name} ──▶ {extra} ({kind}) is drawn, not built"));
                }
            }
        }
    }
    for name in said.keys().filter(|n| !built.contains_key(*n)) {
        out.push(format!(
            "{name} is drawn ({kind}) but is no crate with such edges"
        ));
    }
    out
}

#[test]
fn architecture_md_draws_every_edge_between_ferry_crates_and_no_other() {
    let root = this_workspace();
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let (normal, dev) = from_diagram(&text).unwrap_or_else(|e| panic!("ARCHITECTURE.md: {e}"));
    let (built_normal, built_dev) = from_metadata();
    assert!(built_normal.len() >= 10, "{built_normal:?}");
    let mut wrong = differences(&normal, &built_normal, "normal");
    wrong.extend(differences(&dev, &built_dev, "tests only"));
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's dependency edges differ from Cargo.toml (update the diagram, and \
         the design, in the same change):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_sees_a_missing_edge_an_extra_one_and_a_crate_drawn_twice() {
    let diagram = "x\n## Dependency edges\n\n```\na (bin) ──▶ b,   (note, with a comma)\n   c\nb\nc ──▶ b\ntests only: a ──▶ d\n```\n";
    let (normal, dev) = from_diagram(diagram).unwrap();
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(normal["a"], set(&["b", "c"]));
    assert!(normal["b"].is_empty());
    assert_eq!(dev["a"], set(&["d"]));
    let mut built = normal.clone();
    built.get_mut("c").unwrap().clear();
    built.get_mut("b").unwrap().insert("c".into());
    let diff = differences(&normal, &built, "normal");
    assert_eq!(
        diff,
        [
            "b ──▶ c (normal) is built, not drawn",
            "c ──▶ b (normal) is drawn, not built"
        ]
    );
    let twice = "\n## Dependency edges\n```\na ──▶ b\na\n```\n";
    assert_eq!(from_diagram(twice).unwrap_err(), "a is on two lines");
}
