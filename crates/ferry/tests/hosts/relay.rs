//! A userspace TCP fault relay: what `tc netem` would do if this kernel had it. It listens on
//! one address and forwards each connection to a target; the bytes from the target back to
//! the client (P's answers and blocks, for D) pass, stall, stop or wait as its [`Fault`] says.
//! The client's bytes to the target always pass.
//!
//! A fault counts the target's bytes from the moment it is set, across every connection, so a
//! test can measure one transfer's bytes ([`Relay::forwarded`] after [`Fault::Pass`]) and then
//! break the next one at half of them, whether the transfer opens a connection or reuses one.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What happens to the target's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    /// Forward this many bytes, then nothing more (the connections stay open and silent).
    StallAfter(u64),
    /// Forward this many bytes, then close both directions.
    CloseAfter(u64),
    /// Hold the first byte (and all after it) for this long, then pass.
    DelayFirst(Duration),
}

struct State {
    fault: Fault,
    /// The target's bytes forwarded since the fault was set.
    forwarded: u64,
    /// When `DelayFirst` was set: whether its wait is over.
    delayed: bool,
}

pub struct Relay {
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    /// Listens on `listen` (port included) and forwards to `target`.
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> Relay {
        let listener = TcpListener::bind(listen)
            .await
            .unwrap_or_else(|e| panic!("relay on {listen}: {e}"));
        let state = Arc::new(Mutex::new(State {
            fault: Fault::Pass,
            forwarded: 0,
            delayed: false,
        }));
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let state = Arc::clone(&shared);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(target).await {
                        relay(client, server, state).await;
                    }
                });
            }
        });
        Relay { state, task }
    }

    /// Sets the fault for every byte from now on, and starts counting again.
    pub fn set(&self, fault: Fault) {
        let mut s = self.state.lock().unwrap();
        s.fault = fault;
        s.forwarded = 0;
        s.delayed = false;
    }

    /// The target's bytes forwarded since the last [`Relay::set`].
    pub fn forwarded(&self) -> u64 {
        self.state.lock().unwrap().forwarded
    }
}

/// How many of `n` bytes may pass now; `None`: close the connection.
enum Verdict {
    Pass(usize),
    Stall,
    Close,
    Wait(Duration),
}

fn verdict(state: &Mutex<State>, n: usize) -> Verdict {
    let mut s = state.lock().unwrap();
    let (fault, done) = (s.fault, s.forwarded);
    let limited = |limit: u64| (limit.saturating_sub(done)).min(n as u64) as usize;
    let v = match fault {
        Fault::Pass => Verdict::Pass(n),
        Fault::DelayFirst(d) if !s.delayed => {
            s.delayed = true;
            return Verdict::Wait(d);
        }
        Fault::DelayFirst(_) => Verdict::Pass(n),
        Fault::StallAfter(limit) => match limited(limit) {
            0 => Verdict::Stall,
            k => Verdict::Pass(k),
        },
        Fault::CloseAfter(limit) => match limited(limit) {
            0 => Verdict::Close,
            k => Verdict::Pass(k),
        },
    };
    if let Verdict::Pass(k) = v {
        s.forwarded += k as u64;
    }
    v
}

async fn relay(client: TcpStream, server: TcpStream, state: Arc<Mutex<State>>) {
    client.set_nodelay(true).ok();
    server.set_nodelay(true).ok();
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut at = 0;
            while at < n {
                match verdict(&state, n - at) {
                    Verdict::Pass(k) => {
                        if client_write.write_all(&buf[at..at + k]).await.is_err() {
                            return;
                        }
                        at += k;
                    }
                    Verdict::Wait(d) => tokio::time::sleep(d).await,
                    // Silent forever: hold both connections open until the test ends.
                    Verdict::Stall => std::future::pending::<()>().await,
                    Verdict::Close => return,
                }
            }
        }
        let _ = client_write.shutdown().await;
    };
    // A closing relay drops both halves of both connections.
    tokio::select! {
        () = downstream => {}
        () = async { upstream.await; std::future::pending::<()>().await } => {}
    }
}
