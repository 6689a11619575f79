//! No import ring in any crate of the workspace (see the crate docs for the rule and what
//! counts as an import), but for the crates still to fix, whose rings are printed.

use ferry_lint::{check, this_workspace, workspace_crates, CrateReport};

/// Crates whose rings are still to break (issue 51: their code is being moved). A crate here
/// that has no ring any more fails the test until it is removed, so the list only shrinks;
/// nothing may be added to it.
const STILL_TO_FIX: &[&str] = &["ferry-model"];

/// What is wrong with the workspace given each crate's report: a ring outside
/// `still_to_fix`, a crate in `still_to_fix` with none (or that does not exist). Each line
/// says what to do.
fn verdict(reports: &[CrateReport], still_to_fix: &[&str]) -> Vec<String> {
    let mut wrong = Vec::new();
    for r in reports {
        match (still_to_fix.contains(&r.name.as_str()), r.has_rings()) {
            (false, true) => wrong.push(format!(
                "{} has import rings (a module imports one that imports it back); break \
                 them (move what both need into a module below them, split the module, or \
                 move a function to the module whose job it is):\n{}",
                r.name,
                r.render()
            )),
            (true, false) => wrong.push(format!(
                "{} has no import ring any more: remove it from STILL_TO_FIX",
                r.name
            )),
            _ => {}
        }
    }
    for name in still_to_fix {
        if !reports.iter().any(|r| r.name == *name) {
            wrong.push(format!(
                "STILL_TO_FIX names {name}, which is no crate of the workspace: remove it"
            ));
        }
    }
    wrong
}

#[test]
fn no_crate_has_an_import_ring() {
    let crates = workspace_crates(&this_workspace()).expect("the workspace's crates");
    let reports: Vec<CrateReport> = crates
        .iter()
        .map(|c| check(c).unwrap_or_else(|e| panic!("{}: {e}", c.name)))
        .collect();
    // The scan sees the workspace's crates and their real imports (not empty graphs that pass
    // trivially: 214 modules and 327 edges when this was written).
    let names: Vec<&str> = reports.iter().map(|r| r.name.as_str()).collect();
    for expected in [
        "ferry",
        "ferry-core",
        "ferry-server",
        "ferry-proxy",
        "ferry-lint",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} not found in {names:?}"
        );
    }
    let n_modules: usize = reports
        .iter()
        .flat_map(|r| &r.targets)
        .map(|t| t.n_modules)
        .sum();
    let n_edges: usize = reports
        .iter()
        .flat_map(|r| &r.targets)
        .map(|t| t.n_edges)
        .sum();
    assert!(n_modules > 150, "only {n_modules} modules found");
    assert!(n_edges > 200, "only {n_edges} module edges found");
    for r in reports
        .iter()
        .filter(|r| STILL_TO_FIX.contains(&r.name.as_str()))
    {
        // For whoever breaks them next (`cargo test -p ferry-lint -- --nocapture`, or
        // `cargo run -p ferry-lint -- CRATE`).
        println!("still to fix: {}", r.render());
    }
    let wrong = verdict(&reports, STILL_TO_FIX);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_list_of_crates_still_to_fix_can_only_shrink() {
    let crate_with = |name: &str, files: &[(&str, &str)]| {
        let source = ferry_lint::CrateSource {
            name: name.to_owned(),
            dir: std::path::PathBuf::new(),
            files: files
                .iter()
                .map(|(p, s)| (p.to_string(), s.to_string()))
                .collect(),
        };
        check(&source).unwrap()
    };
    let ring = [
        ("lib.rs", "mod a; mod b;"),
        ("a.rs", "use crate::b::B; pub struct A;"),
        ("b.rs", "use crate::a::A; pub struct B;"),
    ];
    let clean = [
        ("lib.rs", "mod a; mod b;"),
        ("a.rs", "use crate::b::B;"),
        ("b.rs", ""),
    ];
    let reports = [crate_with("x", &ring), crate_with("y", &clean)];
    // A ring in a listed crate is allowed; in any other it is not.
    assert_eq!(verdict(&reports, &["x"]), Vec::<String>::new());
    let wrong = verdict(&reports, &[]);
    assert_eq!(wrong.len(), 1, "{wrong:?}");
    assert!(wrong[0].starts_with("x has import rings"), "{}", wrong[0]);
    assert!(wrong[0].contains("ring among a, b"), "{}", wrong[0]);
    // A listed crate without a ring, or a name that is no crate, fails until removed.
    assert_eq!(
        verdict(&reports, &["x", "y", "z"]),
        vec![
            "y has no import ring any more: remove it from STILL_TO_FIX".to_owned(),
            "STILL_TO_FIX names z, which is no crate of the workspace: remove it".to_owned(),
        ]
    );
}
