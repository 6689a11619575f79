//! Checks of the scheduler that need its private state.

use super::*;

/// The ownership check really looks: a reference that no request or transfer owns, added
/// behind the scheduler's back, is reported.
fn running_one() -> (Scheduler, ReqIdx) {
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: 4,
        n_blocks: 8,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let r = s
        .add_request(
            "x",
            (1..10).map(TokenId).collect(),
            SamplingParams::greedy(2),
        )
        .unwrap();
    let plan = s.schedule();
    assert_eq!(plan.reqs.len(), 1);
    assert_eq!(s.check_ownership(), Ok(()));
    assert_eq!(s.check_queues(), Ok(()));
    (s, r)
}

/// The ownership check really looks: a reference that no request or transfer owns, added
/// behind the scheduler's back, is reported.
#[test]
fn check_ownership_reports_a_reference_nobody_owns() {
    let (mut s, _) = running_one();
    let free = (1..8)
        .find(|&b| s.kv.pool().ref_cnt(BlockId(b)) == 0)
        .expect("a free block");
    s.kv.pool_mut().touch(
        BlockId(free),
        crate::owner::Owner::Request(crate::ids::ReqIdx(99)),
    );
    assert!(s.check_ownership().is_err(), "block {free} has no owner");
}

/// The queue check really looks: a running request also listed as waiting is reported.
#[test]
fn check_queues_reports_a_request_in_two_queues() {
    let (mut s, r) = running_one();
    s.waiting.push_back(r);
    assert!(matches!(
        s.check_queues(),
        Err(QueueError::Misplaced {
            queue: "running",
            n_listed: 1,
            ..
        })
    ));
}

/// A request in a state that belongs to no queue must be in none.
#[test]
fn check_queues_reports_a_finished_request_still_running() {
    let (mut s, r) = running_one();
    s.requests[r.0 as usize].as_mut().unwrap().state = RequestState::Finished(FinishReason::Length);
    assert!(matches!(
        s.check_queues(),
        Err(QueueError::Misplaced {
            queue: "none",
            n_listed: 1,
            ..
        })
    ));
}
