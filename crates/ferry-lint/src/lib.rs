//! ferry-lint: rules about the workspace's own source, checked as tests.
//!
//! The rules it holds:
//! * no module imports one that imports it back, directly or around a ring, in any crate
//!   (`tests/import_rings.rs`);
//! * the engine core is sans-IO: ferry-engine's `engine_core` and `reload`, and every module
//!   they reach by the same import edges ([`mod@reach`]), name no async runtime, thread, clock,
//!   channel, file, socket or process, and the crates they name reach no tokio or transport
//!   in cargo's graph (`tests/sans_io.rs`);
//! * `ferry-model` and `ferry-arena` reach no transport and no async runtime in cargo's graph,
//!   and name none of std's sockets (`tests/networked.rs`);
//! * ARCHITECTURE.md's dependency diagram has exactly the build's ferry edges
//!   (`tests/dependency_edges.rs`, against `cargo metadata`).
//!
//! Without rings, the modules of a crate stack bottom up, and each can be read, tested and
//! changed knowing only the ones below it. A ring is broken the way ferry-core's `ids.rs`
//! says: move what both need into a module below them, split the module that does two jobs,
//! or move a function to the module whose job it is.
//!
//! The check reads every file under a crate's `src/`, follows each crate root's `mod`
//! declarations to its modules ([`tree`]: a library and a binary are checked apart), finds
//! what each file refers to through `crate::`, `super::` and `self::` paths (in `use`
//! declarations and inline, test modules included; comments and string literals skipped:
//! [`tokens`], [`paths`]) and builds the graph of modules ([`graph`], which says what counts
//! as an edge). A ring is reported with the modules in it, one shortest cycle and every import
//! that keeps them in it ([`report`]); [`workspace`] runs that on each crate of the workspace.
//! `cargo run -p ferry-lint -- CRATE...` prints the rings of the named crates (all without
//! names; `--workspace DIR` reads another checkout). [`reach()`] walks the same edges from
//! some modules and hands back the tokens of every module it reaches.
//!
//! The key decision: it reads source, not the compiler's resolution, so it builds in seconds
//! with no crate of the workspace. What it cannot see (a method called on a value, a macro's
//! expansion) is no edge; every path written is.

pub mod error;
pub mod graph;
pub mod paths;
pub mod reach;
pub mod report;
pub mod tokens;
pub mod tree;
pub mod workspace;

pub use error::Error;
pub use reach::{reach, Reach, Reached};
pub use report::{render, Ring};
pub use workspace::{check, read_crate, workspace_crates, CrateReport, CrateSource};

/// The workspace this crate was built in (`crates/ferry-lint/../..`).
pub fn this_workspace() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the cargo that runs the tests (`$CARGO`, else `cargo` on the path) with `args` in this
/// workspace and returns what it printed; panics naming the command and cargo's error if it
/// fails. The tests that hold the build graph to a rule (`cargo tree`, `cargo metadata`) ask
/// cargo itself rather than parse manifests.
pub fn cargo(args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(&cargo)
        .args(args)
        .current_dir(this_workspace())
        .output()
        .unwrap_or_else(|e| panic!("running {cargo}: {e}"));
    assert!(
        out.status.success(),
        "cargo {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("cargo prints UTF-8")
}
