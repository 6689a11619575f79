//! ferry-admin: every admin call of ferry's HTTP API, declared once.
//!
//! An admin call is one route of the lifecycle and weight API (`/pause`, SGLang's
//! `/pause_generation`, `/update_weights`, the bucketed uploads, ...). Each is a variant of
//! [`Args`], its arguments as read, and so of [`AdminCall`] (the variant's name, derived). For
//! every call this crate says, in one place:
//!
//! * its path, methods, dialect (vLLM's name, SGLang's or ferry's own), summary, query
//!   parameters and body ([`AdminCall::decl`], the table, in [`calls`]);
//! * how its arguments are read from the query string and the JSON body, with a 400 naming
//!   the parameter at fault ([`AdminCall::read`], in [`read`]);
//! * what it may do given those arguments: clear the prefix cache, change the weights, abort
//!   requests, release memory ([`Args::effects`]).
//!
//! Everything else derives from it: the server's router (`ferry_server::admin::routes`,
//! one route per call, its methods from the table, the handler an exhaustive `match` on
//! [`Args`]), its `/openapi.json`, the proxy's routes and fan-out (`ferry_proxy::admin`,
//! another exhaustive `match`), and the proxy's fencing: a call whose arguments may clear an
//! instance's cache empties that instance's prefix index before the proxy answers. Adding a
//! call is adding a variant here; the compiler then asks the server and the proxy what they
//! do with it.
//!
//! Modules, bottom up: [`query`] and [`bodies`] (the query string and the JSON bodies as
//! read), [`args`] (the calls and their effects), [`calls`] (the table), [`read`].
//!
//! The key decision: the crate knows HTTP and the lifecycle's vocabulary (`ferry-core`'s
//! pause modes, sleep levels and wake-up tags), nothing of the engine or the model, so the
//! proxy depends on it and still builds no model.

pub mod args;
pub mod bodies;
pub mod calls;
pub mod query;
pub mod read;

pub use args::{AdminCall, Args, Effects, Pausing, UpdateWeights};
pub use calls::{Body, CallDecl, Dialect, Method, Param};
pub use query::QueryArgs;
pub use read::Request;
