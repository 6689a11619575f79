//! The checker on small made-up crates: what it takes for a ring and what it does not.

use std::collections::BTreeMap;

use ferry_lint::graph::graph;
use ferry_lint::report::{render, target_rings};
use ferry_lint::tree::{targets, Target};

fn target(files: &[(&str, &str)]) -> Target {
    let files: BTreeMap<String, String> = files
        .iter()
        .map(|(p, s)| (p.to_string(), s.to_string()))
        .collect();
    targets(&files).expect("a crate").remove(0)
}

/// The report of every ring, `None` if there is none.
fn report(files: &[(&str, &str)]) -> Option<String> {
    let rings = target_rings(&target(files));
    (!rings.is_empty()).then(|| render(&rings))
}

fn m(s: &str) -> Vec<String> {
    s.split("::").map(str::to_owned).collect()
}

#[test]
fn a_ring_through_use_lines_and_inline_paths_is_named_with_its_imports() {
    let report = report(&[
        ("lib.rs", "pub mod a; pub mod b; pub mod c; pub use c::Thing;"),
        ("a.rs", "use crate::b::{X, y::Z};\nuse crate::b::W;\n"),
        ("b.rs", "fn f() -> crate::Thing { todo!() }\n"),
        (
            "c.rs",
            "// use crate::a::Nope;\nconst S: &str = \"crate::a::Nope\";\nfn g() { let _ = crate::a::f(); }\n",
        ),
    ])
    .expect("a -> b -> c -> a is a ring");
    assert_eq!(
        report,
        "ring among a, b, c:\n\
         \x20 a shortest cycle: a -> b -> c -> a\n\
         \x20 the imports inside the ring:\n\
         \x20   a -> b: src/a.rs:1 `crate::b::X` (also src/a.rs:2)\n\
         \x20   b -> c: src/b.rs:1 `crate::Thing`\n\
         \x20   c -> a: src/c.rs:3 `crate::a::f`\n"
    );
}

#[test]
fn a_module_and_its_submodules_are_one_but_siblings_are_checked() {
    // The parent uses its submodules and they use the parent: no ring.
    let split_impl = [
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
    ];
    assert_eq!(report(&split_impl), None);
    let edges = graph(&target(&split_impl));
    assert!(edges[&m("s")].contains_key(&m("t")));
    assert!(edges[&m("s::two")].contains_key(&m("s::one")));
    // Two submodules that use each other are a ring; so is a submodule that goes around
    // through another top-level module.
    let siblings = report(&[
        ("lib.rs", "mod s;"),
        ("s.rs", "mod one; mod two;"),
        ("s/one.rs", "use super::two::B; pub struct A;"),
        ("s/two.rs", "pub struct B(super::one::A);"),
    ])
    .expect("one and two use each other");
    assert!(siblings.contains("ring among s::one, s::two"), "{siblings}");
    let around = report(&[
        ("lib.rs", "mod s; mod t;"),
        ("s.rs", "mod one;"),
        ("s/one.rs", "use crate::t::T;"),
        ("t.rs", "pub struct T; fn f(_: crate::s::S) {}"),
    ])
    .expect("s::one uses t, t uses s");
    assert!(around.contains("ring among s, t"), "{around}");
}

#[test]
fn a_tests_file_named_by_path_is_its_module_s_own() {
    // `arena_tests.rs` is `arena::tests` (`#[path]`): its `super::` is `arena`, and its
    // imports are arena's.
    let files = [
        ("lib.rs", "mod access; mod arena;"),
        (
            "arena.rs",
            "pub struct KvArena; #[cfg(test)] #[path = \"arena_tests.rs\"] mod tests;",
        ),
        (
            "arena_tests.rs",
            "use super::KvArena; use crate::access::Grant;",
        ),
        (
            "access.rs",
            "pub struct Grant; fn f(_: &crate::arena::KvArena) {}",
        ),
    ];
    let report = report(&files).expect("arena's tests use access, access uses arena");
    assert!(report.contains("ring among access, arena"), "{report}");
    assert!(
        report.contains("arena -> access: src/arena_tests.rs:1 `crate::access::Grant`"),
        "{report}"
    );
}

#[test]
fn a_path_through_a_parent_s_import_counts_as_the_module_it_comes_from() {
    // `two` reaches `one`'s item through its parent's `use`: that is an import of `one`.
    let report = report(&[
        ("lib.rs", "mod s;"),
        ("s.rs", "mod one; mod two; use one::A;"),
        ("s/one.rs", "pub struct A; fn f(_: super::two::B) {}"),
        ("s/two.rs", "pub struct B(super::A);"),
    ])
    .expect("one and two use each other");
    assert!(
        report.contains("s::two -> s::one: src/s/two.rs:1 `super::A`"),
        "{report}"
    );
}
