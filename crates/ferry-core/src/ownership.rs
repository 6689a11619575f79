//! Block ownership as a named ledger, and the checker that proves it.
//!
//! Every usable block is either free (in the pool's free queue, maybe still cached) or held by
//! one or more named owners: a request, or a transfer (an export held for a remote reader, an
//! import being written). The pool only counts references; the ledger says *who* holds them,
//! and the checker verifies that the two agree. Tests call it after every step: a leaked
//! block, a double free or a block both free and held shows up at the step that caused it.

use crate::block_pool::{BlockPool, NULL_BLOCK};
use crate::ids::BlockId;
pub use crate::owner::Owner;

/// One block's line in the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockStatus {
    /// The null block: padding only, never owned.
    Null,
    /// In the free queue; `cached` if its contents can still be hit.
    Free { cached: bool },
    /// Held by these owners (sorted).
    Held(Vec<Owner>),
}

/// A broken ownership invariant, naming the block and who is involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OwnershipError {
    #[error("block {block} is out of range (pool has {n_blocks} blocks), listed by {owner:?}")]
    OutOfRange {
        block: BlockId,
        n_blocks: usize,
        owner: Owner,
    },
    #[error("the null block is listed by {owner:?}")]
    NullBlockOwned { owner: Owner },
    #[error("block {block} is listed twice by {owner:?}")]
    ListedTwice { block: BlockId, owner: Owner },
    #[error("block {block} has ref count {ref_cnt} but {n_owners} owners {owners:?}")]
    RefCountMismatch {
        block: BlockId,
        ref_cnt: u32,
        n_owners: u32,
        owners: Vec<Owner>,
    },
    #[error("block {block} is in the free queue but held by {owners:?}")]
    FreeButHeld { block: BlockId, owners: Vec<Owner> },
    #[error("block {block} is neither free nor held by anyone (leaked)")]
    Leaked { block: BlockId },
    #[error("the free queue holds {listed} blocks but the pool counts {counted} free")]
    FreeCountMismatch { listed: usize, counted: usize },
    #[error("block {block} appears twice in the free queue, or the null block is in it")]
    FreeQueueCorrupt { block: BlockId },
    #[error("the prefix-cache index maps a hash to block {block}, which is not cached under it")]
    StaleCacheEntry { block: BlockId },
}

/// Builds the ledger: one [`BlockStatus`] per block, from the pool and every owner's list.
/// Fails on an owner listing a block out of range, the null block, or a block twice.
pub fn ledger<'a>(
    pool: &BlockPool,
    owners: impl IntoIterator<Item = (Owner, &'a [BlockId])>,
) -> Result<Vec<BlockStatus>, OwnershipError> {
    let n_blocks = pool.n_blocks();
    let mut held: Vec<Vec<Owner>> = vec![Vec::new(); n_blocks];
    for (owner, blocks) in owners {
        for &block in blocks {
            let slot = held
                .get_mut(block.index())
                .ok_or(OwnershipError::OutOfRange {
                    block,
                    n_blocks,
                    owner,
                })?;
            if block == NULL_BLOCK {
                return Err(OwnershipError::NullBlockOwned { owner });
            }
            if slot.last() == Some(&owner) || slot.contains(&owner) {
                return Err(OwnershipError::ListedTwice { block, owner });
            }
            slot.push(owner);
        }
    }
    Ok(held
        .into_iter()
        .enumerate()
        .map(|(b, mut owners)| {
            let b = BlockId(b as u32);
            if b == NULL_BLOCK {
                BlockStatus::Null
            } else if owners.is_empty() {
                BlockStatus::Free {
                    cached: pool.cached_hash(b).is_some(),
                }
            } else {
                owners.sort();
                BlockStatus::Held(owners)
            }
        })
        .collect())
}

/// Checks that the ledger and the pool agree on every block: ref counts equal the number of
/// owners, free blocks are exactly the free queue, and the prefix-cache index is consistent.
pub fn check<'a>(
    pool: &BlockPool,
    owners: impl IntoIterator<Item = (Owner, &'a [BlockId])>,
) -> Result<(), OwnershipError> {
    let ledger = ledger(pool, owners)?;
    check_free_queue(pool)?;
    for (b, status) in ledger.iter().enumerate() {
        let block = BlockId(b as u32);
        let ref_cnt = pool.ref_cnt(block);
        match status {
            BlockStatus::Null => {}
            BlockStatus::Free { .. } if ref_cnt != 0 => {
                return Err(OwnershipError::RefCountMismatch {
                    block,
                    ref_cnt,
                    n_owners: 0,
                    owners: Vec::new(),
                });
            }
            BlockStatus::Free { .. } if !pool.is_in_free_queue(block) => {
                return Err(OwnershipError::Leaked { block });
            }
            BlockStatus::Free { .. } => {}
            BlockStatus::Held(owners) => {
                if ref_cnt as usize != owners.len() {
                    return Err(OwnershipError::RefCountMismatch {
                        block,
                        ref_cnt,
                        n_owners: owners.len() as u32,
                        owners: owners.clone(),
                    });
                }
                if pool.is_in_free_queue(block) {
                    return Err(OwnershipError::FreeButHeld {
                        block,
                        owners: owners.clone(),
                    });
                }
            }
        }
    }
    for (hash, &block) in pool.cached_entries() {
        if pool.cached_hash(block) != Some(*hash) {
            return Err(OwnershipError::StaleCacheEntry { block });
        }
    }
    Ok(())
}

fn check_free_queue(pool: &BlockPool) -> Result<(), OwnershipError> {
    let mut seen = vec![false; pool.n_blocks()];
    let mut listed = 0;
    for block in pool.free_queue() {
        let b = block.index();
        if block == NULL_BLOCK || seen[b] || !pool.is_in_free_queue(block) {
            return Err(OwnershipError::FreeQueueCorrupt { block });
        }
        seen[b] = true;
        listed += 1;
    }
    let marked = (1..pool.n_blocks() as u32)
        .filter(|&b| pool.is_in_free_queue(BlockId(b)))
        .count();
    if listed != pool.n_free() || marked != listed {
        return Err(OwnershipError::FreeCountMismatch {
            listed,
            counted: pool.n_free(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{ReqIdx, TransferId};
    use crate::owner::{HoldKind, Holder};

    const A: Owner = Owner::Request(ReqIdx(0));
    const T: Owner = Owner::Transfer {
        hold: TransferId(7),
        holder: Holder::Caller,
        kind: HoldKind::Caller,
    };

    #[test]
    fn agreeing_pool_and_owners_pass() {
        let mut p = BlockPool::new(4);
        let mut a = Vec::new();
        p.take(2, &mut a, A);
        p.touch(a[1], T);
        let t = [a[1]];
        check(&p, [(A, &a[..]), (T, &t[..])]).unwrap();
        let l = ledger(&p, [(A, &a[..]), (T, &t[..])]).unwrap();
        assert_eq!(
            l,
            vec![
                BlockStatus::Null,
                BlockStatus::Held(vec![A]),
                BlockStatus::Held(vec![A, T]),
                BlockStatus::Free { cached: false },
            ]
        );
    }

    #[test]
    fn leaked_block_is_reported() {
        let mut p = BlockPool::new(3);
        let mut a = Vec::new();
        p.take(1, &mut a, A);
        assert_eq!(
            check(&p, []),
            Err(OwnershipError::RefCountMismatch {
                block: BlockId(1),
                ref_cnt: 1,
                n_owners: 0,
                owners: vec![],
            })
        );
    }

    #[test]
    fn missing_reference_is_reported() {
        let mut p = BlockPool::new(3);
        let mut a = Vec::new();
        p.take(1, &mut a, A);
        let t = a.clone();
        assert!(matches!(
            check(&p, [(A, &a[..]), (T, &t[..])]),
            Err(OwnershipError::RefCountMismatch {
                block: BlockId(1),
                ref_cnt: 1,
                n_owners: 2,
                ..
            })
        ));
    }

    #[test]
    fn held_block_in_free_queue_is_reported() {
        let p = BlockPool::new(3);
        assert!(matches!(
            check(&p, [(A, &BlockId::list([1])[..])]),
            Err(OwnershipError::RefCountMismatch {
                block: BlockId(1),
                ref_cnt: 0,
                ..
            })
        ));
    }

    #[test]
    fn null_duplicate_and_out_of_range_are_reported() {
        let p = BlockPool::new(3);
        assert_eq!(
            check(&p, [(A, &BlockId::list([0])[..])]),
            Err(OwnershipError::NullBlockOwned { owner: A })
        );
        assert_eq!(
            check(&p, [(A, &BlockId::list([1, 1])[..])]),
            Err(OwnershipError::ListedTwice {
                block: BlockId(1),
                owner: A
            })
        );
        assert!(matches!(
            check(&p, [(A, &BlockId::list([9])[..])]),
            Err(OwnershipError::OutOfRange {
                block: BlockId(9),
                ..
            })
        ));
    }
}
