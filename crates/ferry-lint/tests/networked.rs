//! What the arena and the model may reach, held by the build graph rather than by review:
//! `ferry-model` (the forward, the sampler, the loaders) and `ferry-arena` (the KV memory and
//! the workers' interface, which the engine core drives) reach no transport and no async
//! runtime, so neither can open a socket through a dependency (ARCHITECTURE.md, Invariants).
//!
//! The graph is cargo's own: `cargo tree -e normal` (what a build of the crate links; tests'
//! and build scripts' dependencies are not part of it). std's sockets need no dependency, so
//! the crates' sources are also searched for them.

use std::collections::BTreeSet;
use std::path::Path;

use ferry_lint::{cargo, this_workspace};

/// Crates that move bytes over a network or run the async runtime that would: the transports
/// (`ferry-kv`, NIXL's bindings) and tokio with its I/O driver and socket layers.
const NETWORKED: [&str; 5] = ["ferry-kv", "nixl-sys", "tokio", "mio", "socket2"];

/// Names of std's socket types and module; none belongs in these crates' code.
const SOCKETS: [&str; 5] = [
    "std::net",
    "TcpStream",
    "TcpListener",
    "UdpSocket",
    "UnixStream",
];

/// Every package `package` reaches through normal dependencies, itself included.
fn reached(package: &str) -> BTreeSet<String> {
    let tree = cargo(&[
        "tree", "--locked", "-p", package, "-e", "normal", "--prefix", "none", "--format", "{p}",
    ]);
    // One package a line: `name vX.Y.Z`, a path or ` (*)` after it for some.
    tree.lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Fails naming each networked crate `package` reaches, with the path it reaches it by.
fn assert_reaches_nothing_networked(package: &str) {
    let reached = reached(package);
    assert!(
        reached.contains(package) && reached.contains("ferry-core"),
        "cargo tree of {package} lists {reached:?}"
    );
    let bad: Vec<&str> = NETWORKED
        .into_iter()
        .filter(|c| reached.contains(*c))
        .collect();
    let paths: Vec<String> = bad
        .iter()
        .map(|c| cargo(&["tree", "--locked", "-p", package, "-e", "normal", "-i", c]))
        .collect();
    assert!(
        bad.is_empty(),
        "{package} reaches {bad:?}, which it must not (ARCHITECTURE.md, Invariants):\n{}",
        paths.join("\n")
    );
}

/// Every `.rs` file under `dir` that names one of std's sockets, with the name.
fn socket_uses(dir: &Path, found: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            socket_uses(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let src = std::fs::read_to_string(&path).unwrap();
            for name in SOCKETS.into_iter().filter(|n| src.contains(*n)) {
                found.push(format!("{}: {name}", path.display()));
            }
        }
    }
}

fn crate_dir(name: &str) -> std::path::PathBuf {
    this_workspace().join("crates").join(name)
}

#[test]
fn ferry_model_reaches_no_transport_and_no_async_runtime() {
    assert_reaches_nothing_networked("ferry-model");
    assert!(reached("ferry-model").contains("ferry-arena"));
}

#[test]
fn ferry_arena_reaches_no_transport_and_no_async_runtime() {
    assert_reaches_nothing_networked("ferry-arena");
}

#[test]
fn neither_names_a_socket() {
    let mut found = Vec::new();
    for name in ["ferry-arena", "ferry-model"] {
        socket_uses(&crate_dir(name).join("src"), &mut found);
    }
    assert!(found.is_empty(), "sockets named in: {found:#?}");
}
