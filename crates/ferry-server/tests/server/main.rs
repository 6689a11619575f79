//! Integration tests: the real engine (tiny Llama) and the server on a loopback port, driven
//! over HTTP.

mod admin;
mod admin_load;
mod chat;
mod completions;
mod conformance;
mod errors;
mod lifecycle;
mod misc;
mod support;
