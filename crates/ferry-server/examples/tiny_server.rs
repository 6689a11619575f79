//! Serves the built-in tiny model (random weights, no files) on `127.0.0.1:<port>` (default
//! 8000) until Ctrl-C: a quick target for curl or the `openai` client while developing the
//! server. `ferry serve --model tiny` is the real entry point.
//!
//! `cargo run -p ferry-server --example tiny_server -- 8000`

use ferry_engine::{start_model, ModelEngineConfig, ModelSpec};
use ferry_server::{router, serve, ServerConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = std::env::args()
        .nth(1)
        .map(|p| p.parse())
        .transpose()?
        .unwrap_or(8000);
    let config = ModelEngineConfig {
        max_model_len: Some(512),
        ..ModelEngineConfig::default()
    };
    let started = start_model(ModelSpec::Tiny.load()?, &config)?;
    let engine = started.handle;
    let server_config = ServerConfig::for_model("tiny", &started.model);
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
