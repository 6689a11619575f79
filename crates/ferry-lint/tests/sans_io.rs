//! The engine core is sans-IO, checked: `ferry-engine`'s `engine_core` (the engine without its
//! thread, which the engine thread and the simulation drive) and `reload` (the reload from
//! disk as a state machine, which the handle and the simulation drive), with every module of
//! ferry-engine they reach by the ring check's edges ([`ferry_lint::reach`]), name no async
//! runtime, thread, clock, channel, file, socket or process: time is passed in, and parallel
//! work goes out through the core's `CoreEnv`. Today that is the modules in [`PROVED`].
//!
//! ferry-engine itself depends on tokio (its handle and the engine thread's queue), so the
//! check is on modules, not on the crate; the crates those modules name are then checked in
//! cargo's graph (`cargo tree -e normal`): none of them reaches tokio or a transport.

use std::collections::{BTreeMap, BTreeSet};

use ferry_lint::{cargo, reach, read_crate, this_workspace, CrateSource, Reach};

/// Where the check starts, in ferry-engine's library.
const ROOTS: [&str; 2] = ["engine_core", "reload"];

/// The modules the check proved sans-IO, as ARCHITECTURE.md lists them: a module the core
/// reaches that is not here (or one here that it no longer reaches) fails the test until
/// this list and ARCHITECTURE.md say so.
const PROVED: [&str; 8] = [
    "connector",
    "constraint",
    "engine_core",
    "error",
    "event",
    "lora",
    "reload",
    "transfer_stats",
];

/// What none of those modules may name, and why. A name is matched as a path or a part of one
/// (`Instant` in `std::time::Instant`), in `use` trees too, never in comments or strings.
const FORBIDDEN: [(&str, &str); 9] = [
    ("tokio", "the async runtime"),
    ("std::thread", "a thread"),
    (
        "rayon",
        "a thread pool (parallel work goes out through CoreEnv)",
    ),
    ("Instant", "the clock (time is passed in)"),
    ("SystemTime", "the wall clock (time is passed in)"),
    ("mpsc", "a channel"),
    ("std::fs", "files"),
    ("std::net", "sockets"),
    ("std::process", "processes"),
];

/// Crates none of the crates the modules name may reach: the async runtime with its I/O
/// driver and socket layers, and the transports.
const NETWORKED: [&str; 5] = ["tokio", "mio", "socket2", "ferry-kv", "nixl-sys"];

/// What is wrong with what `reach` found: each forbidden name, where it is written, and each
/// reference the walk could not follow. Empty when the modules are sans-IO.
fn findings(reach: &Reach) -> Vec<String> {
    let mut wrong = Vec::new();
    for m in &reach.modules {
        let mut found: Vec<(usize, &str, &str)> = FORBIDDEN
            .iter()
            .flat_map(|&(name, what)| {
                m.lines_naming(name)
                    .into_iter()
                    .map(move |l| (l, name, what))
            })
            .collect();
        found.sort_by_key(|f| f.0);
        let via = match &m.via {
            Some(e) => format!(" (reached by src/{}:{} `{}`)", e.file, e.line, e.text),
            None => String::new(),
        };
        for (line, name, what) in found {
            wrong.push(format!("src/{}:{line} names `{name}`: {what}{via}", m.file));
        }
    }
    for e in &reach.into_enclosing {
        wrong.push(format!(
            "src/{}:{} `{}` is an item of an enclosing module, which the check cannot follow \
             (it encloses every module): import it from the module that defines it, or move \
             it into one",
            e.evidence.file, e.evidence.line, e.evidence.text
        ));
    }
    wrong
}

fn reach_of(krate: &CrateSource, roots: &[&str]) -> Reach {
    let roots: Vec<Vec<String>> = roots
        .iter()
        .map(|r| r.split("::").map(str::to_owned).collect())
        .collect();
    reach(krate, "lib.rs", &roots).unwrap_or_else(|e| panic!("{}: {e}", krate.name))
}

/// `cargo tree --prefix depth` as a graph: each package's normal dependencies, by name
/// (versions merged), from `0name v1 (...)` lines, a package's dependencies listed under its
/// first appearance and each `(*)` repeat an edge only.
fn dependency_graph(tree: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut path: Vec<String> = Vec::new();
    for line in tree.lines() {
        let digits = line.chars().take_while(char::is_ascii_digit).count();
        let Ok(depth) = line[..digits].parse::<usize>() else {
            continue;
        };
        let Some(name) = line[digits..].split_whitespace().next() else {
            continue;
        };
        path.truncate(depth);
        if let Some(parent) = path.last() {
            graph
                .entry(parent.clone())
                .or_default()
                .insert(name.to_owned());
        }
        graph.entry(name.to_owned()).or_default();
        path.push(name.to_owned());
    }
    graph
}

/// Every package `from` reaches in `graph`, itself included.
fn reached(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::from([from.to_owned()]);
    let mut todo = vec![from.to_owned()];
    while let Some(p) = todo.pop() {
        for d in graph.get(&p).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

fn cargo_tree(package: &str) -> String {
    cargo(&[
        "tree", "--locked", "-p", package, "-e", "normal", "--prefix", "depth", "--format", "{p}",
    ])
}

#[test]
fn the_engine_core_and_what_it_imports_do_no_io() {
    let engine = read_crate(&this_workspace().join("crates/ferry-engine")).expect("ferry-engine");
    let reach = reach_of(&engine, &ROOTS);
    let names = reach.names();
    let wrong = findings(&reach);
    assert!(
        wrong.is_empty(),
        "the engine core reaches I/O (modules reached from {}: {}):\n{}",
        ROOTS.join(", "),
        names.join(", "),
        wrong.join("\n")
    );
    assert_eq!(
        names, PROVED,
        "the modules reached from {ROOTS:?} changed (they passed the check): say so in PROVED \
         and in ARCHITECTURE.md's sans-IO invariant"
    );

    // The crates they name, in cargo's graph of ferry-engine's normal dependencies.
    let graph = dependency_graph(&cargo_tree("ferry-engine"));
    let direct = &graph["ferry-engine"];
    assert!(
        direct.contains("tokio") && direct.contains("ferry-kv"),
        "ferry-engine's dependencies as read from cargo tree: {direct:?}"
    );
    let heads: BTreeSet<String> = reach.modules.iter().flat_map(|m| m.path_heads()).collect();
    let named: Vec<&String> = direct
        .iter()
        .filter(|d| heads.contains(&d.replace('-', "_")))
        .collect();
    for expected in ["ferry-core", "ferry-arena", "ferry-model"] {
        assert!(
            named.iter().any(|n| *n == expected),
            "{expected} not among the crates the core names: {named:?}"
        );
    }
    println!(
        "crates they name: {}",
        named
            .iter()
            .map(|n| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut bad = Vec::new();
    for krate in &named {
        let reaches = reached(&graph, krate);
        for n in NETWORKED.into_iter().filter(|n| reaches.contains(*n)) {
            bad.push(format!("{krate} reaches {n}"));
        }
    }
    assert!(
        bad.is_empty(),
        "the engine core names crates that reach I/O (see `cargo tree -p ferry-engine -e \
         normal -i CRATE`):\n{}",
        bad.join("\n")
    );
    println!(
        "proved sans-IO (ferry-engine, from {}): {}",
        ROOTS.join(", "),
        names.join(", ")
    );
}

fn made_up(files: &[(&str, &str)]) -> CrateSource {
    CrateSource {
        name: "made-up".to_owned(),
        dir: std::path::PathBuf::new(),
        files: files
            .iter()
            .map(|(p, s)| (p.to_string(), s.to_string()))
            .collect(),
    }
}

#[test]
fn a_core_that_imports_a_module_naming_io_fails_with_where() {
    // The shape of ferry-engine before the core's own modules: the core imports the
    // connector from the handle, which names tokio; the input module's events come with
    // its channel.
    let before = made_up(&[
        (
            "lib.rs",
            "mod engine_core; mod handle; mod input; mod constraint; pub struct Info;",
        ),
        (
            "engine_core.rs",
            "use crate::handle::Connector;\nuse crate::constraint::Next;\n\
             // tokio is named in a comment only\nconst S: &str = \"std::thread\";",
        ),
        (
            "handle.rs",
            "use crate::input::Event;\npub struct Connector;\n\
             fn spawn() { let (tx, rx) = tokio::sync::mpsc::unbounded_channel(); }",
        ),
        (
            "input.rs",
            "use std::{thread, time::{Duration, Instant}};\npub enum Event {}",
        ),
        ("constraint.rs", "pub enum Next {}"),
    ]);
    let reach = reach_of(&before, &["engine_core"]);
    assert_eq!(
        reach.names(),
        vec!["constraint", "engine_core", "handle", "input"]
    );
    assert_eq!(
        findings(&reach),
        vec![
            "src/handle.rs:3 names `tokio`: the async runtime (reached by src/engine_core.rs:1 \
             `crate::handle::Connector`)"
                .to_owned(),
            "src/handle.rs:3 names `mpsc`: a channel (reached by src/engine_core.rs:1 \
             `crate::handle::Connector`)"
                .to_owned(),
            "src/input.rs:1 names `std::thread`: a thread (reached by src/handle.rs:1 \
             `crate::input::Event`)"
                .to_owned(),
            "src/input.rs:1 names `Instant`: the clock (time is passed in) (reached by \
             src/handle.rs:1 `crate::input::Event`)"
                .to_owned(),
        ]
    );
    // After: the core's own modules, below the handle; the handle may name what it likes.
    let after = made_up(&[
        (
            "lib.rs",
            "mod engine_core; mod handle; mod connector; mod event;",
        ),
        (
            "engine_core.rs",
            "use crate::connector::Connector; use crate::event::Event;",
        ),
        ("connector.rs", "pub struct Connector;"),
        ("event.rs", "pub enum Event {}"),
        (
            "handle.rs",
            "use crate::connector::Connector; use tokio::sync::mpsc;",
        ),
    ]);
    let reach = reach_of(&after, &["engine_core"]);
    assert_eq!(reach.names(), vec!["connector", "engine_core", "event"]);
    assert_eq!(findings(&reach), Vec::<String>::new());
    // An item of the crate root is not followed (the root encloses the handle too): refused.
    let root_item = made_up(&[
        ("lib.rs", "mod engine_core; mod handle; pub struct Info;"),
        ("engine_core.rs", "fn f(_: crate::Info) {}"),
        ("handle.rs", "use tokio::sync::mpsc;"),
    ]);
    let wrong = findings(&reach_of(&root_item, &["engine_core"]));
    assert_eq!(wrong.len(), 1, "{wrong:?}");
    assert!(
        wrong[0].starts_with("src/engine_core.rs:1 `crate::Info` is an item of an enclosing"),
        "{}",
        wrong[0]
    );
}

#[test]
fn the_crate_graph_is_read_from_cargo_tree_with_its_repeats() {
    let tree = "0ferry-engine v0.1.0 (/x)\n1ferry-core v0.1.0 (/y)\n2blake3 v1.8.7\n\
                1ferry-kv v0.1.0 (/z)\n2tokio v1.54.1\n3mio v1.0.0\n2ferry-core v0.1.0 (/y) (*)\n\
                1tokio v1.54.1 (*)\n";
    let graph = dependency_graph(tree);
    assert_eq!(
        graph["ferry-engine"],
        BTreeSet::from(["ferry-core".into(), "ferry-kv".into(), "tokio".into()])
    );
    assert_eq!(
        reached(&graph, "ferry-kv"),
        BTreeSet::from([
            "blake3".into(),
            "ferry-core".into(),
            "ferry-kv".into(),
            "mio".into(),
            "tokio".into()
        ])
    );
    assert!(!reached(&graph, "ferry-core").contains("tokio"));
}
