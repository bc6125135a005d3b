//! The budget of nodes a YAML document may expand to through its aliases.
//!
//! An alias (`*a`) stands for the whole node its anchor (`&a`) names, so
//! a few KB of nested aliases ("billion laughs") stand for millions of
//! listeners, prefixes or backends. Without aliases a document has at most
//! about one node per byte (`[a,b]`, `{a, b}`: an entry and a separator);
//! a document may expand to `max_nodes(len)`: twice its size in bytes, or
//! `MIN_NODE_BUDGET`, whichever is more. A small document may still share a
//! health check or an ACL through an alias; no document becomes much
//! larger in memory than it is on disk. The parser (`yaml.rs`) counts the
//! nodes its aliases replay and stops at the budget, so a bomb costs as
//! much time and memory as a document of its budget.

/// Nodes any document may expand to (aliases included), however short.
pub const MIN_NODE_BUDGET: u64 = 100_000;

/// Nodes a document of `len` bytes may expand to.
pub fn max_nodes(len: usize) -> u64 {
    (2 * len as u64).max(MIN_NODE_BUDGET)
}

/// The message when a document expands to more than `budget` nodes.
pub fn too_many(budget: u64) -> String {
    format!(
        "the document expands to more than {budget} nodes through YAML aliases (`*name`: a document may expand to \
         twice its size in bytes, or {MIN_NODE_BUDGET} nodes); write the repeated parts out"
    )
}
