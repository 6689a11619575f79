//! `cargo run -p ferry-lint -- [--workspace DIR] [CRATE...]`: the import rings of the named
//! crates of this workspace, or of the one in `DIR` (another checkout), every crate when none
//! is named, as the test reports them. Exits 1 when there is one.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut workspace = ferry_lint::this_workspace();
    if let Some(i) = args.iter().position(|a| a == "--workspace") {
        let Some(dir) = args.get(i + 1).cloned() else {
            eprintln!("ferry-lint: --workspace needs a folder");
            return ExitCode::from(2);
        };
        workspace = dir.into();
        args.drain(i..i + 2);
    }
    let wanted = args;
    let crates = match ferry_lint::workspace_crates(&workspace) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferry-lint: {e}");
            return ExitCode::from(2);
        }
    };
    for name in &wanted {
        if !crates.iter().any(|c| &c.name == name) {
            let names: Vec<&str> = crates.iter().map(|c| c.name.as_str()).collect();
            eprintln!(
                "ferry-lint: no crate `{name}` (the workspace has {})",
                names.join(", ")
            );
            return ExitCode::from(2);
        }
    }
    let mut any = false;
    for krate in crates
        .iter()
        .filter(|c| wanted.is_empty() || wanted.contains(&c.name))
    {
        match ferry_lint::check(krate) {
            Ok(report) if report.has_rings() => {
                any = true;
                print!("{}", report.render());
            }
            Ok(_) => println!("{}: no import ring", krate.name),
            Err(e) => {
                eprintln!("ferry-lint: {}: {e}", krate.name);
                return ExitCode::from(2);
            }
        }
    }
    if any {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
