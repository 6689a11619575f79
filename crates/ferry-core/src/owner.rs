//! Who holds a KV block: a request, or a transfer hold with its holder and purpose.
//!
//! Below the block pool, so that the pool can name the owner on whose behalf a reference is
//! taken or given back: a broken precondition (a double free, a block reused while held)
//! panics naming the block, that owner and the operation. The ledger (`ownership.rs`) lists
//! every block's owners; the holds table (`holds.rs`) hands out the holds.

use std::fmt;

use crate::ids::{ConnectorId, ReqIdx, TransferId};

/// Who frees a transfer hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Holder {
    /// Whoever made the hold frees it with `Scheduler::release_transfer`; a cache reset
    /// releases it at once (no connector reads or writes its blocks).
    Caller,
    /// The connector frees it by reporting it in `take_finished_transfers`; a cache reset
    /// asks it to (`abort_transfers`) and waits.
    Connector(ConnectorId),
}

/// What a transfer hold is for; the ownership ledger shows it with the holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HoldKind {
    /// A finished request's KV, kept for a remote reader (P of P/D).
    Export,
    /// Blocks a remote load writes (D of P/D).
    Import,
    /// Blocks a store job reads (offload tier).
    Store,
    /// Blocks a local tier's load writes (offload tier).
    Load,
    /// A hold made by the caller (`Scheduler::hold_blocks_for_transfer`).
    Caller,
}

/// Someone who holds a reference to a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Owner {
    Request(ReqIdx),
    /// A transfer hold, with who frees it and what it is for.
    Transfer {
        hold: TransferId,
        holder: Holder,
        kind: HoldKind,
    },
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Caller => f.write_str("the caller"),
            Self::Connector(c) => write!(f, "connector {}", c.0),
        }
    }
}

impl fmt::Display for HoldKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Export => "export",
            Self::Import => "import",
            Self::Store => "store",
            Self::Load => "load",
            Self::Caller => "caller's",
        })
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Request(r) => write!(f, "request #{}", r.0),
            Self::Transfer { hold, holder, kind } => {
                write!(f, "{kind} hold {} (ended by {holder})", hold.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_reads_as_who_it_is() {
        assert_eq!(Owner::Request(ReqIdx(4)).to_string(), "request #4");
        let export = Owner::Transfer {
            hold: TransferId(7),
            holder: Holder::Connector(ConnectorId(1)),
            kind: HoldKind::Export,
        };
        assert_eq!(export.to_string(), "export hold 7 (ended by connector 1)");
        let caller = Owner::Transfer {
            hold: TransferId(0),
            holder: Holder::Caller,
            kind: HoldKind::Caller,
        };
        assert_eq!(caller.to_string(), "caller's hold 0 (ended by the caller)");
    }
}
