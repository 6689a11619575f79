//! [`Connector`]: one KV connector as the engine core takes it, its scheduler side and its
//! worker side. Plain data below the core: the constructors of ferry-kv's connectors, whose
//! workers run transports and threads, are the handle's (`handle.rs`).

use ferry_arena::WorkerConnector;
use ferry_core::KvConnector;

/// One KV connector: its scheduler side, which the core drives, and its worker side, which
/// the engine thread hands each step's jobs to (none for a connector that plans no jobs).
#[derive(Debug)]
pub struct Connector {
    pub scheduler: Box<dyn KvConnector>,
    pub worker: Option<Box<dyn WorkerConnector>>,
}

impl Connector {
    pub fn new(scheduler: Box<dyn KvConnector>, worker: Box<dyn WorkerConnector>) -> Self {
        Self {
            scheduler,
            worker: Some(worker),
        }
    }
}

impl From<Box<dyn KvConnector>> for Connector {
    fn from(scheduler: Box<dyn KvConnector>) -> Self {
        Self {
            scheduler,
            worker: None,
        }
    }
}
