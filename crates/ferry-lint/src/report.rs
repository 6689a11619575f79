//! Import rings as a reader fixes them: the modules in each, one shortest cycle, and every
//! import that keeps them in it (where it is written).

use std::fmt::Write as _;

use crate::graph::{graph, rings, shortest_ring, Evidence, Graph};
use crate::tree::{name, ModPath, Target};

/// One edge inside a ring and the references that make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Import {
    pub from: ModPath,
    pub to: ModPath,
    pub evidence: Vec<Evidence>,
}

/// A set of modules that all import each other, directly or around.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    /// In module order.
    pub modules: Vec<ModPath>,
    /// A shortest cycle among them, back to where it starts: `[a, b, a]`.
    pub shortest: Vec<ModPath>,
    /// Every edge between two of them.
    pub imports: Vec<Import>,
}

/// The rings of `graph`.
pub fn rings_of(graph: &Graph) -> Vec<Ring> {
    rings(graph)
        .into_iter()
        .map(|scc| {
            let imports = scc
                .iter()
                .flat_map(|a| {
                    graph
                        .get(a)
                        .into_iter()
                        .flatten()
                        .filter(|(b, _)| scc.contains(*b))
                        .map(|(b, evidence)| Import {
                            from: a.clone(),
                            to: b.clone(),
                            evidence: evidence.clone(),
                        })
                })
                .collect();
            Ring {
                shortest: shortest_ring(graph, &scc),
                modules: scc.into_iter().collect(),
                imports,
            }
        })
        .collect()
}

/// The rings of `target`'s modules.
pub fn target_rings(target: &Target) -> Vec<Ring> {
    rings_of(&graph(target))
}

/// `rings` as text, one block per ring:
///
/// ```text
/// ring among a, b, c:
///   a shortest cycle: a -> b -> c -> a
///   the imports inside the ring:
///     a -> b: src/a.rs:1 `crate::b::X` (also src/a.rs:7)
/// ```
pub fn render(rings: &[Ring]) -> String {
    let mut s = String::new();
    for ring in rings {
        let members: Vec<String> = ring.modules.iter().map(|m| name(m)).collect();
        let cycle: Vec<String> = ring.shortest.iter().map(|m| name(m)).collect();
        let _ = writeln!(s, "ring among {}:", members.join(", "));
        let _ = writeln!(s, "  a shortest cycle: {}", cycle.join(" -> "));
        s += "  the imports inside the ring:\n";
        for import in &ring.imports {
            let Some(first) = import.evidence.first() else {
                continue;
            };
            // The other places it is written (one per line: a `use` of several items is one).
            let mut elsewhere: Vec<String> = Vec::new();
            for e in &import.evidence {
                let at = format!("src/{}:{}", e.file, e.line);
                if (e.file != first.file || e.line != first.line) && !elsewhere.contains(&at) {
                    elsewhere.push(at);
                }
            }
            let more = if elsewhere.is_empty() {
                String::new()
            } else {
                format!(" (also {})", elsewhere.join(", "))
            };
            let _ = writeln!(
                s,
                "    {} -> {}: src/{}:{} `{}`{more}",
                name(&import.from),
                name(&import.to),
                first.file,
                first.line,
                first.text
            );
        }
    }
    s
}
