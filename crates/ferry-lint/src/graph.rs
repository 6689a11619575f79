//! The module graph of one target and its import rings.
//!
//! What counts as an edge:
//!
//! * A module and its submodules are one unit to everyone outside them, and a submodule may
//!   use its parent's items (`use super::Scheduler` in `scheduler/offer.rs`) and its parent
//!   its submodules' (the split-`impl` pattern): references between a module and its own
//!   submodules, either way, are no edge. `mod` declarations are no edge either.
//! * Any other reference is an edge between the two sibling modules it crosses: a reference
//!   from `a::b` to `c::d` is the edge `a -> c`, one from `a::b` to `a::e` the edge
//!   `a::b -> a::e`. So rings are found among the crate's top-level modules and, separately,
//!   among the submodules of each module.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::tree::{ModPath, Target};

/// A reference that makes an edge: where it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// The file, relative to `src/`.
    pub file: String,
    pub line: usize,
    /// The path as written.
    pub text: String,
}

/// Edges between sibling modules, each with the references that make it, in file order.
pub type Graph = BTreeMap<ModPath, BTreeMap<ModPath, Vec<Evidence>>>;

/// The target's module graph.
pub fn graph(target: &Target) -> Graph {
    let mut edges = Graph::new();
    for (from, refs) in target.refs() {
        let file = &target.modules[&from].file;
        for r in refs {
            let Some((a, b)) = edge(&from, &r.target) else {
                continue;
            };
            edges
                .entry(a)
                .or_default()
                .entry(b)
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

/// The edge a reference from module `from` to module `to` makes: the two sibling modules it
/// crosses (`a::b` → `c::d` is `a -> c`), or none when one of the two is inside the other.
pub fn edge(from: &[String], to: &[String]) -> Option<(ModPath, ModPath)> {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    if common >= from.len() || common >= to.len() {
        // Inside one module and its submodules.
        return None;
    }
    Some((from[..=common].to_vec(), to[..=common].to_vec()))
}

/// How many edges the graph has.
pub fn n_edges(graph: &Graph) -> usize {
    graph.values().map(BTreeMap::len).sum()
}

/// The graph's strongly connected components of more than one module: each set of modules
/// that all reach each other, in module order.
pub fn rings(graph: &Graph) -> Vec<BTreeSet<ModPath>> {
    let nodes: BTreeSet<&ModPath> = graph
        .iter()
        .flat_map(|(a, to)| std::iter::once(a).chain(to.keys()))
        .collect();
    let reach = |start: &ModPath| -> BTreeSet<ModPath> {
        let mut seen = BTreeSet::new();
        let mut queue = VecDeque::from([start.clone()]);
        while let Some(n) = queue.pop_front() {
            for m in graph.get(&n).into_iter().flat_map(BTreeMap::keys) {
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

/// A shortest cycle inside `scc`, from and back to its first module in module order among
/// the shortest: `[a, b, a]`.
pub fn shortest_ring(graph: &Graph, scc: &BTreeSet<ModPath>) -> Vec<ModPath> {
    scc.iter()
        .filter_map(|start| ring_through(graph, scc, start))
        .min_by_key(Vec::len)
        .unwrap_or_default()
}

/// A shortest cycle through `start` inside `scc` (breadth first).
fn ring_through(graph: &Graph, scc: &BTreeSet<ModPath>, start: &ModPath) -> Option<Vec<ModPath>> {
    let mut prev: BTreeMap<ModPath, ModPath> = BTreeMap::new();
    let mut queue = VecDeque::from([start.clone()]);
    while let Some(n) = queue.pop_front() {
        for m in graph.get(&n).into_iter().flat_map(BTreeMap::keys) {
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
                return Some(path);
            }
            queue.push_back(m.clone());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> ModPath {
        s.split("::").map(str::to_owned).collect()
    }

    fn graph_of(edges: &[(&str, &str)]) -> Graph {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry(m(a)).or_default().insert(m(b), Vec::new());
        }
        g
    }

    #[test]
    fn every_ring_is_found_and_a_shortest_cycle_named() {
        // One component: a -> b -> c -> d -> a, with the shortcut c -> b (b and c alone are
        // a shorter cycle than through a); x <-> y another; z outside both.
        let g = graph_of(&[
            ("a", "b"),
            ("b", "c"),
            ("c", "d"),
            ("d", "a"),
            ("c", "b"),
            ("x", "y"),
            ("y", "x"),
            ("y", "z"),
        ]);
        let found = rings(&g);
        assert_eq!(
            found,
            vec![
                [m("a"), m("b"), m("c"), m("d")].into_iter().collect(),
                [m("x"), m("y")].into_iter().collect(),
            ]
        );
        assert_eq!(shortest_ring(&g, &found[0]), vec![m("b"), m("c"), m("b")]);
        assert_eq!(shortest_ring(&g, &found[1]), vec![m("x"), m("y"), m("x")]);
        assert!(rings(&graph_of(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
    }
}
