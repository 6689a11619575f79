//! The generation requests in flight, by the HTTP request id (`X-Request-Id`) they came
//! with, so `POST /abort_requests` can name a request as its client knows it.
//!
//! The engine's ids extend the HTTP id with a process-wide sequence number and the choice
//! index (clients may reuse an `X-Request-Id`; engine ids must stay unique), so a client
//! cannot guess them. Each HTTP request registers its engine ids here; the registration is
//! shared by the request's choice streams and removed when the last one is dropped (finished
//! or disconnected), so the map never outgrows the requests in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// HTTP request id → engine request ids of the requests in flight.
#[derive(Debug, Default)]
pub struct LiveRequests {
    map: Mutex<HashMap<String, Vec<String>>>,
}

impl LiveRequests {
    /// Registers `engine_ids` under `http_id` until the returned guard is dropped.
    pub fn register(self: &Arc<Self>, http_id: &str, engine_ids: Vec<String>) -> Registration {
        self.lock()
            .entry(http_id.to_owned())
            .or_default()
            .extend(engine_ids.iter().cloned());
        Registration {
            live: Arc::clone(self),
            http_id: http_id.to_owned(),
            engine_ids,
        }
    }

    /// Each id as the engine ids it stands for: an HTTP id becomes its requests' engine
    /// ids; any other id is kept (it may be an engine id).
    pub fn expand(&self, ids: &[String]) -> Vec<String> {
        let map = self.lock();
        let mut out = Vec::new();
        for id in ids {
            match map.get(id) {
                Some(engine_ids) => out.extend(engine_ids.iter().cloned()),
                None => out.push(id.clone()),
            }
        }
        out
    }

    /// Number of HTTP requests in flight.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<String>>> {
        // A panic while holding this lock cannot leave the map inconsistent (every update
        // is one call), so a poisoned lock is still usable.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Removes its engine ids from [`LiveRequests`] when dropped.
#[derive(Debug)]
pub struct Registration {
    live: Arc<LiveRequests>,
    http_id: String,
    engine_ids: Vec<String>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.live.lock();
        if let Some(ids) = map.get_mut(&self.http_id) {
            ids.retain(|id| !self.engine_ids.contains(id));
            if ids.is_empty() {
                map.remove(&self.http_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_http_ids_until_the_registration_drops() {
        let live = Arc::new(LiveRequests::default());
        let a = live.register("req", vec!["req-1-0".into(), "req-1-1".into()]);
        let b = live.register("req", vec!["req-2-0".into()]);
        let ids = ["req".to_owned(), "other".to_owned()];
        assert_eq!(
            live.expand(&ids),
            ["req-1-0", "req-1-1", "req-2-0", "other"]
        );
        drop(a);
        assert_eq!(live.expand(&ids), ["req-2-0", "other"]);
        drop(b);
        assert!(live.is_empty());
        assert_eq!(live.expand(&ids), ["req", "other"]);
    }
}
