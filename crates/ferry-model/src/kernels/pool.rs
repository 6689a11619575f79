//! The forward's fork-join pool: the calling thread and `threads() - 1` helpers that spin
//! between jobs.
//!
//! Why not rayon here: a batch-1 decode step of the default model is ~120 matmuls of 20-60 µs
//! each, and rayon's idle workers go to sleep within microseconds, so nearly every matmul paid
//! a futex wake-up of the other core (tens of µs under a hypervisor) and a sleep after it: the
//! two-thread step ran slower than one thread alone (10.3 ms against 9.3 ms on Zen 5). Here a
//! helper spins on an atomic for [`SPIN`] after its last job before it parks, so the jobs of a
//! step start on both cores at once, as llama.cpp's thread pool does. No crate offers a
//! spinning fork-join over borrowed closures; this is ~150 lines.
//!
//! A job is `n` tasks numbered `0..n`, taken in order from a shared counter by whoever is
//! free; the caller always takes part, so a job finishes even when no helper comes (a helper
//! asleep, or the pool busy with another caller's job: then the caller runs every task
//! itself). Which thread runs a task never changes what it computes: the kernels split work
//! by output rows only.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper spins after its last job before it parks: a decode step's gaps between
/// matmuls are microseconds, so a step pays at most one wake-up (at its start); a longer spin
/// took cores from the engines' copier threads on a shared machine.
const SPIN: Duration = Duration::from_micros(200);

/// One job, on its caller's stack for as long as [`run`] lasts.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    /// Distinguishes jobs that reuse the same stack address.
    generation: u64,
    next: AtomicUsize,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Job<'_> {
    /// Takes and runs tasks until none is left.
    fn work(&self) {
        loop {
            let t = self.next.fetch_add(1, SeqCst);
            if t >= self.n {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(t))) {
                self.panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(p);
            }
            self.done.fetch_add(1, SeqCst);
        }
    }

    /// Raises the first panic of a task, if one panicked.
    fn raise(self) {
        if let Some(p) = self.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }
}

struct Pool {
    /// The job being run, or null. A helper may touch the job only between raising `active`
    /// and lowering it, and only after it saw this still pointing at the job once `active`
    /// was raised: the caller clears it and then waits for `active` to fall to 0 before the
    /// job leaves its stack.
    current: AtomicPtr<Job<'static>>,
    active: AtomicUsize,
    /// Held by the caller whose job is `current` (callers on other threads run serially).
    busy: AtomicBool,
    generation: AtomicU64,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    helpers: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            current: AtomicPtr::new(std::ptr::null_mut()),
            active: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            helpers: super::threads().saturating_sub(1),
        }));
        for i in 0..pool.helpers {
            std::thread::Builder::new()
                .name(format!("ferry-kernels-{i}"))
                .spawn(move || helper(pool))
                .expect("starting a kernel thread");
        }
        pool
    })
}

/// Runs `f(0)`, ..., `f(n - 1)` over the pool's threads, the caller's included, and returns
/// once all have. A panic in a task is raised again here, after every task has ended.
pub fn run(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let pool = pool();
    let job = Job {
        f,
        n,
        generation: pool.generation.fetch_add(1, SeqCst) + 1,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panic: Mutex::new(None),
    };
    if n <= 1 || pool.helpers == 0 || pool.busy.swap(true, SeqCst) {
        // On this thread alone, with the same rule for a panic: every task still runs.
        job.work();
        return job.raise();
    }
    // SAFETY (of the erased lifetime): the pointer is withdrawn below, and no helper holds it
    // once `active` is 0, before `job` goes out of scope.
    let ptr = (&job as *const Job<'_>).cast_mut().cast::<Job<'static>>();
    pool.current.store(ptr, SeqCst);
    if pool.sleepers.load(SeqCst) > 0 {
        let _guard = pool.lock.lock().unwrap_or_else(|e| e.into_inner());
        pool.wake.notify_all();
    }
    job.work();
    crate::profile::timed(crate::profile::Phase::PoolWait, || {
        while job.done.load(SeqCst) < n {
            std::hint::spin_loop();
        }
    });
    pool.current.store(std::ptr::null_mut(), SeqCst);
    while pool.active.load(SeqCst) > 0 {
        std::hint::spin_loop();
    }
    pool.busy.store(false, SeqCst);
    job.raise();
}

/// `f(i, chunk)` for every `chunk`-long piece `i` of `data` (a whole number of them), over
/// the pool: a few tasks per thread, each a run of consecutive pieces.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    assert!(
        chunk > 0 && data.len().is_multiple_of(chunk),
        "for_each_chunk_mut: {} items are not pieces of {chunk}",
        data.len()
    );
    let n = data.len() / chunk;
    let tasks = n.min(super::threads() * 4);
    let base = SharedMut(data.as_mut_ptr());
    run(tasks, &|t| {
        for i in t * n / tasks..(t + 1) * n / tasks {
            // SAFETY: piece i lies inside `data`, and each piece goes to one task only (the
            // tasks' ranges of pieces are disjoint); `data` stays borrowed until `run` returns.
            let piece = unsafe { std::slice::from_raw_parts_mut(base.get().add(i * chunk), chunk) };
            f(i, piece);
        }
    });
}

/// A pointer to the items of a slice borrowed mutably, shared by the tasks that write its
/// disjoint pieces.
pub(crate) struct SharedMut<T>(pub(crate) *mut T);
// SAFETY: the tasks write disjoint pieces of items that may cross threads (`T: Send`).
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not the raw field).
    pub(crate) fn get(&self) -> *mut T {
        self.0
    }
}

fn helper(pool: &'static Pool) {
    let mut last = 0u64;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        let p = pool.current.load(SeqCst);
        if !p.is_null() {
            pool.active.fetch_add(1, SeqCst);
            if pool.current.load(SeqCst) == p {
                // SAFETY: `current` still points at the job after `active` was raised, so
                // its caller waits for `active` to fall before the job is dropped.
                let job = unsafe { &*p };
                if job.generation != last {
                    last = job.generation;
                    job.work();
                    idle_since = Instant::now();
                }
            }
            pool.active.fetch_sub(1, SeqCst);
        }
        spins += 1;
        if !spins.is_multiple_of(256) {
            std::hint::spin_loop();
            continue;
        }
        if idle_since.elapsed() < SPIN {
            std::thread::yield_now();
            continue;
        }
        // Park until the next job. `sleepers` is raised before the last look at `current`,
        // and a caller raises `current` before it reads `sleepers`, so one of the two sees
        // the other (and a job missed would still finish on its caller's thread).
        pool.sleepers.fetch_add(1, SeqCst);
        let mut guard = pool.lock.lock().unwrap_or_else(|e| e.into_inner());
        while pool.current.load(SeqCst).is_null() {
            guard = pool.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        drop(guard);
        pool.sleepers.fetch_sub(1, SeqCst);
        idle_since = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task runs exactly once, for jobs of every size, one after another and from
    /// several callers at once (a busy pool runs a caller's job on the caller's thread).
    #[test]
    fn every_task_runs_once() {
        std::thread::scope(|s| {
            for caller in 0..3 {
                s.spawn(move || {
                    for n in (0..200).map(|i| (i * 7 + caller) % 50) {
                        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                        run(n, &|t| {
                            hits[t].fetch_add(1, SeqCst);
                        });
                        assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "job of {n} tasks");
                    }
                });
            }
        });
    }

    /// Every piece is handed to `f` once, with its index.
    #[test]
    fn for_each_chunk_mut_hands_out_every_piece_once() {
        for n in [1, 3, 8, 9, 100] {
            let mut data = vec![0usize; n * 3];
            for_each_chunk_mut(&mut data, 3, &|i, piece| {
                piece.iter_mut().for_each(|v| *v += i + 1);
            });
            let want: Vec<usize> = (0..n * 3).map(|j| j / 3 + 1).collect();
            assert_eq!(data, want);
        }
    }

    /// A panic in a task reaches the caller, after the other tasks ran, and the pool still
    /// runs the next job.
    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_goes_on() {
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            run(16, &|t| {
                ran.fetch_add(1, SeqCst);
                assert_ne!(t, 5, "task 5 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(SeqCst), 16);
        let sum = AtomicUsize::new(0);
        run(10, &|t| {
            sum.fetch_add(t, SeqCst);
        });
        assert_eq!(sum.load(SeqCst), 45);
    }
}
