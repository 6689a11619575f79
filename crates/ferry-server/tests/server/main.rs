//! Integration tests: the real engine (tiny Llama) and the server on a loopback port, driven
//! over HTTP.

mod admin;
mod admin_load;
mod auth;
mod beam;
mod chat;
mod completions;
mod conformance;
mod errors;
mod failure;
mod lifecycle;
mod logprobs_mode;
mod misc;
mod native;
mod openapi;
mod pd;
mod reasoning;
mod rl_fields;
mod rl_frameworks;
mod routed_experts;
mod structured;
mod support;
mod templates;
mod tools;
mod upload;
