//! A bucket's body to every instance without copying it through the proxy (Linux).
//!
//! The caller's socket is spliced into a pipe (`splice(2)`: the kernel moves references to
//! the socket buffer's pages, not bytes), the pipe is duplicated into one pipe per instance
//! (`tee(2)`, references again), and each of those is spliced into its instance's socket.
//! The proxy's core touches no byte of the body, so a bucketed upload through the proxy costs
//! about what the caller's own fan-out to the instances costs
//! ([docs/weight-sync.md](../../../docs/weight-sync.md)).
//!
//! The calling thread (a blocking one) takes what the caller has sent into the input pipe
//! and duplicates it into every instance's pipe once each has room (`feed_body`); a thread
//! per instance splices its pipe into its socket and then reads its answer (`Leg::run`).
//! Each instance gets its own connection with `Connection: close`, so its answer is what it
//! sends until it closes. An instance that
//! fails mid-body (it answered early, refusing the bucket, or went away) stops receiving;
//! the others and the caller go on, and the route reports every instance's result.
//!
//! No crate offers splice and tee fan-out; `libc` gives the calls, wrapped here.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The most an instance's pipe is asked to hold (the default `/proc/sys/fs/pipe-max-size`).
const LEG_PIPE_BYTES: usize = 1 << 20;
/// How many of the input pipe's batches an instance's pipe holds.
const BATCHES_PER_LEG: usize = 4;
/// The longest answer read from an instance.
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// One instance to send the body to.
#[derive(Debug)]
pub struct Target {
    /// `host:port`, resolved when the connection opens.
    pub addr: String,
    /// The request's head (ending in its blank line), written before the body.
    pub head: Vec<u8>,
}

/// Why an instance has no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// No connection opened.
    Unreachable(String),
    /// It stopped taking the body, or gave no answer, within the time allowed.
    Timeout,
    /// The connection broke, or the answer was not HTTP.
    Broken(String),
}

/// What moving one body did.
#[derive(Debug)]
pub struct Fanned {
    /// Whether the caller's whole body was read; else why not.
    pub body: Result<(), String>,
    /// Each target's answer (status, body), in order.
    pub answers: Vec<Result<(u16, Vec<u8>), Failure>>,
}

/// How long each part of a fan-out may take.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a connection may take to open.
    pub connect: Duration,
    /// How long any one wait (the caller sending, an instance taking the body) may last.
    pub stall: Duration,
    /// How long the instances may take to answer once the body is sent.
    pub answer_within: Duration,
}

/// Sends the body (`prefix`, then `in_socket` bytes from `client`) to every target, each
/// after its head, and reads their answers.
///
/// The calling thread feeds: it takes the caller's bytes into the input pipe and duplicates
/// them into every instance's pipe. One scoped thread per instance sends: it splices its
/// pipe into its socket, then reads the instance's answer. One thread per instance because
/// on loopback a send also runs the receiver's TCP processing on the sender's core: one
/// thread sending to two instances in turn moved half what the caller's own two sockets
/// moved (docs/weight-sync.md).
pub fn fan_out(
    client: RawFd,
    prefix: &[u8],
    in_socket: u64,
    expect_continue: bool,
    targets: &[Target],
    limits: Limits,
) -> Fanned {
    let Limits {
        connect,
        stall,
        answer_within,
    } = limits;
    let mut legs: Vec<Leg> = targets
        .iter()
        .map(|t| Leg::open(t, prefix, connect, stall))
        .collect();
    let shared: Vec<Shared> = legs.iter().map(|_| Shared::default()).collect();
    let signal = Signal::default();
    let mut feeds: Vec<Option<Feed>> = Vec::with_capacity(legs.len());
    let mut pipes: Vec<Option<OwnedFd>> = Vec::with_capacity(legs.len());
    for leg in &mut legs {
        let pipe = match (in_socket > 0 && leg.live()).then(|| Pipe::new(LEG_PIPE_BYTES)) {
            Some(Ok(p)) => Some(p),
            Some(Err(e)) => {
                leg.fail(Failure::Broken(format!("no pipe: {e}")));
                None
            }
            None => None,
        };
        let (read, feed) = match pipe {
            Some(p) => (Some(p.read), Some(Feed::new(p.write, p.capacity))),
            None => (None, None),
        };
        pipes.push(read);
        feeds.push(feed);
    }
    // The smallest instance pipe sets the batch: a quarter of it (a refused size keeps a
    // pipe's default, 64 KiB).
    let smallest = feeds.iter().flatten().map(|f| f.capacity).min();
    let input = match smallest.map(|bytes| Pipe::new(bytes / BATCHES_PER_LEG)) {
        Some(Ok(input)) => Some(input),
        Some(Err(e)) => {
            for leg in &mut legs {
                leg.fail(Failure::Broken(format!("no pipe: {e}")));
            }
            feeds.iter_mut().for_each(|f| *f = None);
            None
        }
        None => None,
    };
    if let Some(input) = &input {
        for (slot, leg) in feeds.iter_mut().zip(&mut legs) {
            let Some(feed) = slot else { continue };
            feed.room = feed.capacity / input.capacity;
            if feed.room == 0 {
                leg.fail(Failure::Broken("a pipe smaller than the input's".into()));
                *slot = None;
            }
        }
    }
    std::thread::scope(|scope| {
        let senders: Vec<_> = legs
            .into_iter()
            .zip(pipes)
            .zip(&shared)
            .map(|((leg, pipe), shared)| {
                let signal = &signal;
                scope.spawn(move || leg.run(pipe, shared, signal, answer_within, stall))
            })
            .collect();
        let body = match &input {
            Some(input) => feed_body(
                client,
                in_socket,
                expect_continue,
                input,
                &mut feeds,
                &shared,
                &signal,
                stall,
            ),
            None if in_socket == 0 => Ok(()),
            None => Err("no instance could take the body".into()),
        };
        if body.is_err() {
            // The instances see a body cut short and discard their uploads.
            shared
                .iter()
                .for_each(|s| s.cut.store(true, Ordering::SeqCst));
        }
        // The end of every instance's pipe: its sender sends what is left, then reads.
        drop(feeds);
        let answers = senders
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Failure::Broken("its sender panicked".into())))
            })
            .collect();
        Fanned { body, answers }
    })
}

/// What the feeding thread and one instance's sending thread share.
#[derive(Default)]
struct Shared {
    /// Bytes sent from its pipe into its socket.
    sent: AtomicU64,
    /// Its sender has stopped (failed, or reached the end of its pipe).
    stopped: AtomicBool,
    /// Its body was cut short: its sender fails it at the end of its pipe.
    cut: AtomicBool,
}

/// Wakes the feeding thread when a sender has moved bytes or stopped.
#[derive(Default)]
struct Signal {
    lock: Mutex<()>,
    moved: Condvar,
}

impl Signal {
    fn notify(&self) {
        // Taken so the wake cannot fall between the feeder's check and its wait.
        drop(self.lock.lock());
        self.moved.notify_all();
    }
}

/// The feeding thread's end of one instance's pipe.
struct Feed {
    write: OwnedFd,
    capacity: usize,
    /// Where each batch in the pipe ends, counted from the start of the body.
    batches: VecDeque<u64>,
    teed: u64,
    /// How many batches of the input its pipe surely has slots for (set once the input
    /// is made).
    room: usize,
}

impl Feed {
    fn new(write: OwnedFd, capacity: usize) -> Self {
        Self {
            write,
            capacity,
            batches: VecDeque::new(),
            teed: 0,
            room: 0,
        }
    }

    /// Whether its pipe has slots for another batch (or its sender has stopped).
    fn ready(&mut self, shared: &Shared) -> bool {
        let sent = shared.sent.load(Ordering::SeqCst);
        while self.batches.front().is_some_and(|&end| end <= sent) {
            self.batches.pop_front();
        }
        shared.stopped.load(Ordering::SeqCst) || self.batches.len() < self.room
    }
}

/// The feeding thread: the caller's bytes into the input pipe, the input into every
/// instance's pipe once each has room for it.
///
/// `tee` copies from the head of the input pipe and needs a free pipe slot per slot of the
/// input, not free bytes (a slot holds one socket-buffer fragment, a page or less), and no
/// call tells a pipe's free slots. So the input pipe is a quarter of an instance's, and the
/// feeder counts the batches each instance's pipe holds: with fewer than four, it has room
/// for the input whatever their fragments. An instance can then fall up to three batches
/// behind the others while the caller keeps sending.
#[allow(clippy::too_many_arguments)] // The feeder's whole state, passed once.
fn feed_body(
    client: RawFd,
    mut left: u64,
    expect_continue: bool,
    input: &Pipe,
    feeds: &mut [Option<Feed>],
    shared: &[Shared],
    signal: &Signal,
    stall: Duration,
) -> Result<(), String> {
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .map_err(|e| format!("opening /dev/null: {e}"))?;
    if expect_continue {
        write_all_nonblocking(client, b"HTTP/1.1 100 Continue\r\n\r\n", stall)
            .map_err(|e| format!("writing 100 Continue: {e}"))?;
    }
    // Bytes in the input pipe.
    let mut held = 0usize;
    while left > 0 || held > 0 {
        // All the caller has sent, until the input is full.
        if left > 0 {
            let want = usize::try_from(left).unwrap_or(usize::MAX);
            match splice(client, input.write.as_raw_fd(), want, false) {
                Ok(0) => return Err("the connection closed mid-body".into()),
                Ok(n) => {
                    held += n;
                    left -= n as u64;
                    continue;
                }
                // Nothing more sent yet, or the input is full.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        if held == 0 {
            if !wait(&[(client, libc::POLLIN)], stall).map_err(|e| e.to_string())? {
                return Err(format!(
                    "the caller sent nothing for {} s",
                    stall.as_secs_f64()
                ));
            }
            continue;
        }
        // Every instance's sender times out by itself when its socket takes nothing for
        // `stall`, so this wait ends.
        let mut guard = signal.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !feeds
            .iter_mut()
            .zip(shared)
            .all(|(f, s)| f.as_mut().is_none_or(|f| f.ready(s)))
        {
            guard = signal
                .moved
                .wait_timeout(guard, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(guard);
        for (feed, shared) in feeds.iter_mut().zip(shared) {
            let Some(f) = feed else { continue };
            if shared.stopped.load(Ordering::SeqCst) {
                *feed = None;
                continue;
            }
            match tee(input.read.as_raw_fd(), f.write.as_raw_fd(), held) {
                Ok(n) if n == held => {
                    f.teed += held as u64;
                    f.batches.push_back(f.teed);
                }
                // Not expected (the batch count leaves room); the instance is cut off.
                _ => {
                    shared.cut.store(true, Ordering::SeqCst);
                    *feed = None;
                }
            }
        }
        discard(input.read.as_raw_fd(), null.as_raw_fd(), held).map_err(|e| e.to_string())?;
        held = 0;
    }
    Ok(())
}

/// One instance's connection.
#[derive(Debug)]
struct Leg {
    socket: Option<TcpStream>,
    failure: Option<Failure>,
    /// What it has answered so far.
    answer: Vec<u8>,
}

impl Leg {
    fn open(target: &Target, prefix: &[u8], connect: Duration, stall: Duration) -> Self {
        let mut leg = Self {
            socket: None,
            failure: None,
            answer: Vec::new(),
        };
        let mut last = format!("{}: no address", target.addr);
        let addrs: Vec<SocketAddr> = match target.addr.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                leg.failure = Some(Failure::Unreachable(format!("{}: {e}", target.addr)));
                return leg;
            }
        };
        let socket = addrs.iter().find_map(|a| {
            TcpStream::connect_timeout(a, connect)
                .map_err(|e| last = format!("{a}: {e}"))
                .ok()
        });
        let Some(mut socket) = socket else {
            leg.failure = Some(Failure::Unreachable(last));
            return leg;
        };
        // Blocking, with `stall` as the longest any send waits (splice keeps it too).
        let sent = (|| {
            socket.set_nodelay(true)?;
            socket.set_write_timeout(Some(stall))?;
            socket.write_all(&target.head)?;
            socket.write_all(prefix)
        })();
        match sent {
            Ok(()) => leg.socket = Some(socket),
            Err(e) => leg.failure = Some(Failure::Broken(format!("sending the head: {e}"))),
        }
        leg
    }

    fn live(&self) -> bool {
        self.failure.is_none()
    }

    fn fail(&mut self, why: Failure) {
        if self.failure.is_none() {
            self.failure = Some(why);
        }
    }

    /// The sending thread: its pipe into its socket until the pipe ends, then its answer.
    fn run(
        mut self,
        pipe: Option<OwnedFd>,
        shared: &Shared,
        signal: &Signal,
        answer_within: Duration,
        stall: Duration,
    ) -> Result<(u16, Vec<u8>), Failure> {
        if let (Some(pipe), Some(socket)) = (&pipe, &self.socket) {
            let socket = socket.as_raw_fd();
            while self.live() {
                match splice(pipe.as_raw_fd(), socket, LEG_PIPE_BYTES, true) {
                    // The end of the pipe: the feeder is done.
                    Ok(0) => break,
                    Ok(n) => {
                        shared.sent.fetch_add(n as u64, Ordering::SeqCst);
                        signal.notify();
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        self.fail(Failure::Timeout)
                    }
                    Err(e) => {
                        // An instance that answered early (a refused bucket) closed its
                        // end: its answer is what it said.
                        self.read_early_answer(stall);
                        self.fail(Failure::Broken(format!("sending the bucket: {e}")));
                    }
                }
            }
        }
        shared.stopped.store(true, Ordering::SeqCst);
        signal.notify();
        if shared.cut.load(Ordering::SeqCst) {
            self.fail(Failure::Broken("the caller's body ended early".into()));
        }
        self.answer(Instant::now() + answer_within)
    }

    /// Whatever the instance has sent already (it may have answered before taking the
    /// whole body).
    fn read_early_answer(&mut self, stall: Duration) {
        let Some(socket) = &mut self.socket else {
            return;
        };
        let _ = socket.set_read_timeout(Some(stall));
        let mut buf = [0u8; 16 * 1024];
        while self.answer.len() < MAX_ANSWER_BYTES {
            match socket.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => self.answer.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// The instance's answer, read until it closes (or `deadline`).
    fn answer(mut self, deadline: Instant) -> Result<(u16, Vec<u8>), Failure> {
        if let Some(failure) = self.failure.take() {
            // A complete answer sent before the failure is the instance's word.
            return parse_answer(&self.answer).map_err(|_| failure);
        }
        let Some(mut socket) = self.socket.take() else {
            return Err(Failure::Broken("no connection".into()));
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Failure::Timeout);
            }
            let _ = socket.set_read_timeout(Some(left));
            match socket.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    self.answer.extend_from_slice(&buf[..n]);
                    if self.answer.len() > MAX_ANSWER_BYTES {
                        return Err(Failure::Broken("an answer over 16 MiB".into()));
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(Failure::Timeout)
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // A reset after a complete answer leaves the answer.
                Err(e) => {
                    return parse_answer(&self.answer).map_err(|_| Failure::Broken(e.to_string()))
                }
            }
        }
        parse_answer(&self.answer).map_err(Failure::Broken)
    }
}

/// An HTTP/1.1 answer's status and body.
pub fn parse_answer(bytes: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut response = httparse::Response::new(&mut headers);
    let head = match response.parse(bytes) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Err("the answer ended in its head".into()),
        Err(e) => return Err(format!("not an HTTP answer: {e}")),
    };
    let status = response.code.unwrap_or(0);
    let rest = &bytes[head..];
    let header = |name: &str| {
        response
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value)
    };
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case(b"chunked")) {
        return dechunk(rest).map(|b| (status, b));
    }
    match header("content-length") {
        Some(v) => {
            let n: usize = std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .ok_or("a bad Content-Length")?;
            if rest.len() < n {
                return Err(format!(
                    "the answer ended after {} of {n} bytes",
                    rest.len()
                ));
            }
            Ok((status, rest[..n].to_vec()))
        }
        None => Ok((status, rest.to_vec())),
    }
}

/// A chunked body's bytes.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunked answer cut off")?;
        let size = std::str::from_utf8(&rest[..line])
            .ok()
            .map(|s| s.split(';').next().unwrap_or("").trim())
            .and_then(|s| usize::from_str_radix(s, 16).ok())
            .ok_or("a bad chunk size")?;
        rest = &rest[line + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size + 2 {
            return Err("a chunked answer cut off".into());
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// A pipe, as large as the kernel allows up to [`PIPE_BYTES`].
#[derive(Debug)]
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

impl Pipe {
    /// A pipe asked to hold `bytes` (it may hold less where the system says no).
    fn new(bytes: usize) -> io::Result<Self> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are open descriptors that nothing else owns.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let size = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
        // SAFETY: fcntl on an open descriptor; a refusal (a smaller limit) keeps the default.
        unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, size) };
        // SAFETY: as above.
        let capacity = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ) };
        if capacity <= 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            read,
            write,
            capacity: capacity as usize,
        })
    }
}

fn result(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Up to `len` bytes from `from` to `to`, one of them a pipe; without waiting unless `block`.
fn splice(from: RawFd, to: RawFd, len: usize, block: bool) -> io::Result<usize> {
    let flags = if block {
        libc::SPLICE_F_MOVE
    } else {
        libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK
    };
    loop {
        // SAFETY: plain descriptors, no offsets (null: the files' own positions).
        let n = unsafe {
            libc::splice(
                from,
                std::ptr::null_mut(),
                to,
                std::ptr::null_mut(),
                len,
                flags,
            )
        };
        match result(n) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// Up to `len` bytes of pipe `from` duplicated into pipe `to`, `from` left as it was.
fn tee(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    loop {
        // SAFETY: plain pipe descriptors.
        let n = unsafe { libc::tee(from, to, len, libc::SPLICE_F_NONBLOCK) };
        match result(n) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// `len` bytes of pipe `from` dropped (into /dev/null, which takes them as they are).
fn discard(from: RawFd, null: RawFd, mut len: usize) -> io::Result<()> {
    while len > 0 {
        match splice(from, null, len, false)? {
            0 => break,
            n => len -= n,
        }
    }
    Ok(())
}

/// Waits until one of `fds` is ready for its events (or has failed); `false` after `limit`.
fn wait(fds: &[(RawFd, i16)], limit: Duration) -> io::Result<bool> {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    let ms = libc::c_int::try_from(limit.as_millis()).unwrap_or(libc::c_int::MAX);
    loop {
        // SAFETY: `polled` is a valid array of its length.
        let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, ms) };
        match result(n as isize) {
            Ok(n) => return Ok(n > 0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// All of `bytes` to non-blocking `fd`.
fn write_all_nonblocking(fd: RawFd, mut bytes: &[u8], stall: Duration) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is valid for its length.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        match result(n) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if !wait(&[(fd, libc::POLLOUT)], stall)? {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    /// Generous: the tests' peers are threads on this machine.
    const LIMITS: Limits = Limits {
        connect: Duration::from_secs(5),
        stall: Duration::from_secs(20),
        answer_within: Duration::from_secs(20),
    };

    /// A server that reads a request with a `Content-Length` body and answers with the
    /// body's length and checksum; `refuse_after`: answer 400 and close after that many body
    /// bytes.
    fn sink(refuse_after: Option<usize>) -> (SocketAddr, thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let handle = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 65536];
            let head_end = loop {
                let n = s.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
                if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
            };
            let head = String::from_utf8_lossy(&got[..head_end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let mut body = got[head_end..].to_vec();
            while body.len() < len {
                if refuse_after.is_some_and(|r| body.len() >= r) {
                    let msg = br#"{"error":{"message":"bad tensor `x`"}}"#;
                    let answer = format!(
                        "HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\n\r\n",
                        msg.len()
                    );
                    s.write_all(answer.as_bytes()).unwrap();
                    s.write_all(msg).unwrap();
                    return body;
                }
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "the body ended early");
                body.extend_from_slice(&buf[..n]);
            }
            let sum: u64 = body.iter().map(|b| u64::from(*b)).sum();
            let reply = format!("{{\"n\":{},\"sum\":{sum}}}", body.len());
            let answer = format!(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{reply}\r\n0\r\n\r\n",
                reply.len()
            );
            s.write_all(answer.as_bytes()).unwrap();
            body
        });
        (addr, handle)
    }

    fn target(addr: SocketAddr, len: usize) -> Target {
        Target {
            addr: addr.to_string(),
            head: format!("POST /b HTTP/1.1\r\ncontent-length: {len}\r\nconnection: close\r\n\r\n")
                .into_bytes(),
        }
    }

    /// A caller's socket pair: the proxy's end (non-blocking, as tokio keeps it) and a thread
    /// writing `body[from..]` into the other.
    fn caller(body: Vec<u8>, from: usize) -> (TcpStream, thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            // Small pieces with pauses: the proxy waits for the caller.
            for piece in body[from..].chunks(300_000) {
                s.write_all(piece).unwrap();
                thread::sleep(Duration::from_millis(2));
            }
        });
        let (proxy_end, _) = listener.accept().unwrap();
        proxy_end.set_nonblocking(true).unwrap();
        (proxy_end, writer)
    }

    #[test]
    fn every_instance_gets_every_byte_and_a_refusal_is_the_instances_answer() {
        let body: Vec<u8> = (0..5_000_003u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let prefix = 1234;
        let (a, got_a) = sink(None);
        let (b, got_b) = sink(None);
        let (c, got_c) = sink(Some(100_000));
        let (client, writer) = caller(body.clone(), prefix);
        let fanned = fan_out(
            client.as_raw_fd(),
            &body[..prefix],
            (body.len() - prefix) as u64,
            false,
            &[
                target(a, body.len()),
                target(b, body.len()),
                target(c, body.len()),
            ],
            LIMITS,
        );
        writer.join().unwrap();
        assert_eq!(fanned.body, Ok(()));
        let sum: u64 = body.iter().map(|b| u64::from(*b)).sum();
        let expected = format!("{{\"n\":{},\"sum\":{sum}}}", body.len()).into_bytes();
        assert_eq!(fanned.answers[0], Ok((200, expected.clone())));
        assert_eq!(fanned.answers[1], Ok((200, expected)));
        assert_eq!(got_a.join().unwrap(), body);
        assert_eq!(got_b.join().unwrap(), body);
        match &fanned.answers[2] {
            Ok((400, msg)) => assert!(String::from_utf8_lossy(msg).contains("bad tensor")),
            // The refusal raced the reset: still a failure, never a success.
            Err(Failure::Broken(_)) => {}
            other => panic!("{other:?}"),
        }
        assert!(got_c.join().unwrap().len() >= 100_000);
    }

    #[test]
    fn a_caller_gone_mid_body_fails_every_instance_and_an_unreachable_one_is_named() {
        let body = vec![7u8; 3_000_000];
        let (a, got_a) = sink(None);
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        // The caller sends a third of the body and closes.
        let (client, writer) = caller(body[..1_000_000].to_vec(), 0);
        let fanned = fan_out(
            client.as_raw_fd(),
            &[],
            body.len() as u64,
            false,
            &[target(a, body.len()), target(closed, body.len())],
            LIMITS,
        );
        writer.join().unwrap();
        assert!(
            fanned
                .body
                .as_ref()
                .unwrap_err()
                .contains("closed mid-body"),
            "{fanned:?}"
        );
        assert!(matches!(&fanned.answers[0], Err(Failure::Broken(m)) if m.contains("ended early")));
        assert!(
            matches!(&fanned.answers[1], Err(Failure::Unreachable(_))),
            "{fanned:?}"
        );
        drop(client);
        // The instance saw a body cut short (its read ends without the whole body).
        assert!(got_a.join().is_err());
    }

    #[test]
    fn an_instance_that_stops_reading_times_out_alone_and_the_others_get_every_byte() {
        // More than the stuck instance's socket buffers and pipe hold, so its sender and the
        // feeder both have to give up on it for the others to get the rest.
        let body: Vec<u8> = (0..40_000_000u32).map(|i| (i % 251) as u8).collect();
        let (a, got_a) = sink(None);
        let stuck = TcpListener::bind("127.0.0.1:0").unwrap();
        let stuck_addr = stuck.local_addr().unwrap();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let holder = thread::spawn(move || {
            let (s, _) = stuck.accept().unwrap();
            // Reads nothing, and stays connected, until the fan-out has returned.
            let _ = released.recv();
            drop(s);
        });
        let (client, writer) = caller(body.clone(), 0);
        let limits = Limits {
            stall: Duration::from_millis(500),
            ..LIMITS
        };
        let fanned = fan_out(
            client.as_raw_fd(),
            &[],
            body.len() as u64,
            false,
            &[target(a, body.len()), target(stuck_addr, body.len())],
            limits,
        );
        release.send(()).unwrap();
        writer.join().unwrap();
        assert_eq!(fanned.body, Ok(()), "{fanned:?}");
        assert!(
            matches!(&fanned.answers[0], Ok((200, _))),
            "{:?}",
            fanned.answers[0]
        );
        assert_eq!(fanned.answers[1], Err(Failure::Timeout));
        assert_eq!(got_a.join().unwrap(), body);
        holder.join().unwrap();
    }

    #[test]
    fn answers_are_parsed_with_a_length_chunked_or_to_the_end() {
        assert_eq!(
            parse_answer(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nokjunk"),
            Ok((201, b"ok".to_vec()))
        );
        assert_eq!(
            parse_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1;x\r\nc\r\n0\r\n\r\n"),
            Ok((200, b"abc".to_vec()))
        );
        assert_eq!(
            parse_answer(b"HTTP/1.1 500 X\r\n\r\nall of it"),
            Ok((500, b"all of it".to_vec()))
        );
        assert!(parse_answer(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort").is_err());
        assert!(parse_answer(b"HTTP/1.1 200 OK\r\ncontent").is_err());
        assert!(parse_answer(b"garbage\r\n\r\n").is_err());
    }
}
