//! Integration tests: the real engine (tiny Llama) and the server on a loopback port, driven
//! over HTTP.

mod chat;
mod completions;
mod errors;
mod lifecycle;
mod misc;
mod support;
