//! Serves the built-in tiny model (random weights, no files) on `127.0.0.1:<port>` (default
//! 8000) until Ctrl-C: a quick target for curl or the `openai` client while developing the
//! server. `ferry serve --model tiny` is the real entry point.
//!
//! `cargo run -p ferry-server --example tiny_server -- 8000`

use std::sync::Arc;

use ferry_core::SchedulerConfig;
use ferry_engine::{spawn, EngineConfig};
use ferry_model::tiny::{tiny_model, ENDOFTEXT, IM_END};
use ferry_model::LlamaModel;
use ferry_server::{router, serve, ServerConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = std::env::args()
        .nth(1)
        .map(|p| p.parse())
        .transpose()?
        .unwrap_or(8000);
    let tiny = tiny_model();
    let scheduler = SchedulerConfig {
        max_model_len: 512,
        eos_token_ids: tiny.config.eos_token_ids.clone(),
        ..SchedulerConfig::default()
    };
    let executor = LlamaModel::new(&tiny.config, &tiny.weights)?;
    let config = EngineConfig {
        scheduler,
        ..EngineConfig::default()
    };
    let engine = spawn(config, Box::new(executor), tiny.tokenizer.map(Arc::new))?;
    let server_config = ServerConfig {
        chat_template: tiny.chat_template.clone(),
        bos_token: ENDOFTEXT.into(),
        eos_token: IM_END.into(),
        vocab_size: Some(tiny.config.vocab_size),
        ..ServerConfig::new("tiny")
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    eprintln!(
        "serving the tiny model on http://{}",
        listener.local_addr()?
    );
    let shutdown_engine = engine.clone();
    serve(listener, router(engine, server_config), async move {
        let _ = tokio::signal::ctrl_c().await;
        // Abort in-flight requests first, so open streams end and the server can stop.
        let _ = shutdown_engine.shutdown().await;
    })
    .await?;
    Ok(())
}
