//! The RL frameworks' own clients against ferry: for each framework, the requests its client
//! code sends (the shapes copied from slime's `sglang_rollout.py`, miles' external-engine
//! check, AReaL's `sglang_remote.py`, prime-rl's renderers client and weight sync, SkyRL's
//! `remote_inference_client.py`, TRL's async GRPO `async_rollout_worker.py`), read the way
//! that client reads the answer. `docs/rl-frameworks.md` lists each call and its test here.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::admin::{bounded, BOUND};
use crate::native::prompt_ids;
use crate::support::{ids, start, Options, Server, MODEL};

async fn admin_server(step_delay: Duration) -> Server {
    start(Options {
        admin_api: true,
        step_delay,
        ..Options::default()
    })
    .await
}

/// Waits (bounded) until the engine has generated `n` more tokens than `from`.
async fn wait_for_tokens(s: &Server, from: u64, n: u64) {
    let deadline = Instant::now() + BOUND;
    while s.engine.stats().n_generated_tokens_total < from + n {
        assert!(Instant::now() < deadline, "no tokens are flowing");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// POSTs `body` from a task of its own; the task returns the status and the JSON answer.
fn spawn_json(
    s: &Server,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> tokio::task::JoinHandle<(u16, Value)> {
    let mut req = s.http.post(s.url(path)).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    tokio::spawn(async move {
        let resp = req.send().await.unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    })
}

/// The tiny model as a folder whose final-norm weights are negated: loading it changes what
/// greedy decoding picks.
fn write_changed_weights(dir: &Path) {
    ferry_engine::testing::write_tiny_folder(dir).unwrap();
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let info = meta.metadata().clone();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let norm = tensors
        .iter_mut()
        .find(|t| t.0 == "model.norm.weight")
        .expect("the tiny model has a final norm");
    assert_eq!(norm.1, safetensors::Dtype::F32);
    norm.3 = norm
        .3
        .chunks_exact(4)
        .flat_map(|b| (-f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, data)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), data).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, info, &path).unwrap();
}

/// slime (`slime/rollout/sglang_rollout.py`): `POST /generate` with `input_ids`, its
/// sampling dict (null `stop` and `stop_token_ids` when unset, `no_stop_trim`,
/// `spaces_between_special_tokens`, `sampling_seed` in deterministic mode) and
/// `return_logprob`; it reads the tokens and logprobs from `output_token_logprobs`, the text,
/// `finish_reason.type` and `weight_version`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slime_generates_and_reads_output_token_logprobs() {
    let s = start(Options::default()).await;
    let prompt = prompt_ids(&s, "the quick brown fox").await;
    let payload = json!({
        "sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8,
            "stop": null, "stop_token_ids": null, "skip_special_tokens": false,
            "no_stop_trim": true, "spaces_between_special_tokens": false,
            "sampling_seed": 1234,
        },
        "return_logprob": true,
        "input_ids": prompt,
    });
    let output = s.ok("/generate", &payload).await;
    let meta = &output["meta_info"];
    let triples = meta["output_token_logprobs"].as_array().unwrap();
    let tokens: Vec<u64> = triples.iter().map(|t| t[1].as_u64().unwrap()).collect();
    let logprobs: Vec<f64> = triples.iter().map(|t| t[0].as_f64().unwrap()).collect();
    assert_eq!(tokens, ids(&output["output_ids"]));
    assert!(logprobs.iter().all(|&l| l <= 0.0), "{logprobs:?}");
    assert!(["stop", "length"].contains(&meta["finish_reason"]["type"].as_str().unwrap()));
    assert_eq!(meta["weight_version"], "0");
    assert_eq!(meta["completion_tokens"], tokens.len());
    // The same request as a completion: the same tokens, text and logprobs.
    let completion = s
        .ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 1234,
                    "logprobs": 0, "return_token_ids": true}),
        )
        .await;
    let c = &completion["choices"][0];
    assert_eq!(ids(&c["token_ids"]), tokens);
    assert_eq!(output["text"], c["text"]);
    let want: Vec<f64> = c["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(logprobs, want);
}

/// slime drains its engines before a weight update with SGLang's `POST /abort_request
/// {"abort_all": true}`; a request in flight then ends with `finish_reason.type` `abort`,
/// which slime keeps as a partial sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slime_aborts_every_request_with_abort_request() {
    let s = admin_server(Duration::from_millis(5)).await;
    let prompt = prompt_ids(&s, "hello there").await;
    let from = s.engine.stats().n_generated_tokens_total;
    let running = spawn_json(
        &s,
        "/generate",
        &[("x-request-id", "slime-1")],
        &json!({"input_ids": prompt, "return_logprob": true,
                "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": true}}),
    );
    wait_for_tokens(&s, from, 2).await;
    let reply = s
        .admin_json_ok("/abort_request", &json!({"abort_all": true}))
        .await;
    assert_eq!(reply, json!({"success": true, "aborted": 1}));
    let (status, out) = bounded("aborted request", running).await.unwrap();
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort", "{out}");
    assert_eq!(out["meta_info"]["id"], "slime-1");
    let n = out["output_ids"].as_array().unwrap().len();
    assert!(n < 60, "{out}");
    assert_eq!(
        out["meta_info"]["output_token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        n
    );
    // By id: the request's `meta_info.id`.
    let from = s.engine.stats().n_generated_tokens_total;
    let running = spawn_json(
        &s,
        "/generate",
        &[("x-request-id", "slime-2")],
        &json!({"input_ids": prompt,
                "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": true}}),
    );
    wait_for_tokens(&s, from, 2).await;
    let reply = s
        .admin_json_ok("/abort_request", &json!({"rid": "slime-2"}))
        .await;
    assert_eq!(reply["aborted"], 1, "{reply}");
    let (_, out) = bounded("aborted request", running).await.unwrap();
    assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort", "{out}");
    s.expect_admin_error(
        s.http.post(s.url("/abort_request")).json(&json!({})),
        "abort_request without rid",
        400,
        Some("rid"),
    )
    .await;
}

/// miles (slime's fork) in external-engine mode reads `GET /get_server_info` and compares
/// the parallel sizes and paths with its own arguments, waits for `GET /health_generate`,
/// then generates from `text` as slime does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miles_checks_the_external_engine_then_generates_from_text() {
    let s = start(Options::default()).await;
    let info = s.get_json("/get_server_info").await;
    let want = json!({"tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1,
                      "model_path": "tiny", "served_model_name": MODEL});
    for (k, v) in want.as_object().unwrap() {
        assert_eq!(&info[k], v, "{k}: {info}");
    }
    assert_eq!(s.get("/health_generate").await.status().as_u16(), 200);
    let out = s
        .ok(
            "/generate",
            &json!({"text": "hello there", "return_logprob": true,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                        "ignore_eos": true, "no_stop_trim": true}}),
        )
        .await;
    let by_ids = s
        .ok(
            "/generate",
            &json!({"input_ids": prompt_ids(&s, "hello there").await, "return_logprob": true,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(out["output_ids"], by_ids["output_ids"]);
    assert_eq!(out["text"], by_ids["text"]);
    assert_eq!(
        out["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 4})
    );
}

/// AReaL (`areal/engine/sglang_remote.py`): `POST /generate` with `input_ids`, `top_p`,
/// `top_k`, `max_new_tokens`, `temperature`, `stop_token_ids`, `return_logprob` and `stream:
/// false`; reads `output_token_logprobs` and `finish_reason.type`. Its disk weight update is
/// `POST /update_weights_from_disk {"model_path", "abort_all_requests": true}`: a request
/// in flight ends with `abort` (AReaL resubmits it with the tokens so far), the update
/// lands, and the next generation runs on the new weights under the new version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn areal_generates_and_updates_from_disk_aborting_what_runs() {
    let s = admin_server(Duration::from_millis(5)).await;
    let prompt = prompt_ids(&s, "one two three").await;
    let eos = s.engine.scheduler_config().eos_token_ids.clone();
    let payload = |max: u64| {
        json!({"input_ids": prompt, "return_logprob": true, "stream": false,
               "sampling_params": {"top_p": 1.0, "top_k": 100000, "max_new_tokens": max,
                                   "temperature": 0.0, "stop_token_ids": eos,
                                   "ignore_eos": false, "frequency_penalty": 0.0}})
    };
    let before = s.ok("/generate", &payload(6)).await;
    let tokens: Vec<u64> = before["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[1].as_u64().unwrap())
        .collect();
    assert_eq!(tokens, ids(&before["output_ids"]));

    let dir = tempfile::tempdir().unwrap();
    write_changed_weights(dir.path());
    let from = s.engine.stats().n_generated_tokens_total;
    let mut long = payload(60);
    long["sampling_params"]["ignore_eos"] = json!(true);
    let running = spawn_json(&s, "/generate", &[], &long);
    wait_for_tokens(&s, from, 2).await;
    let reply = s
        .admin_json_ok(
            "/update_weights_from_disk",
            &json!({"model_path": dir.path(), "abort_all_requests": true,
                    "weight_version": "areal-1"}),
        )
        .await;
    assert_eq!(reply["weight_version"], "areal-1");
    let (_, aborted) = bounded("aborted request", running).await.unwrap();
    assert_eq!(
        aborted["meta_info"]["finish_reason"]["type"], "abort",
        "{aborted}"
    );
    let after = s.ok("/generate", &payload(6)).await;
    assert_eq!(after["meta_info"]["weight_version"], "areal-1");
    assert_ne!(
        after["output_ids"], before["output_ids"],
        "the weights did not change"
    );
}

/// prime-rl: generation through `POST /inference/v1/generate` (`model`, `token_ids`,
/// `sampling_params` with `logprobs`), read as its renderers client reads it (every
/// `logprobs.content[i].token` is `token_id:<id>`, the logprobs are real, never vLLM's
/// -9999 sentinel); its weight sync is `/pause?mode=keep`, `POST /update_weights
/// {"weight_dir": ...}` as JSON, `/resume`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prime_rl_generates_token_ids_and_syncs_weights_from_a_folder() {
    let s = admin_server(Duration::ZERO).await;
    let prompt = prompt_ids(&s, "the quick brown fox").await;
    let body = json!({"model": MODEL, "token_ids": prompt,
                      "sampling_params": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 6,
                                          "logprobs": 2, "ignore_eos": true}});
    let before = s.ok("/inference/v1/generate", &body).await;
    let choice = &before["choices"][0];
    let completion_ids = ids(&choice["token_ids"]);
    assert_eq!(completion_ids.len(), 6);
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), completion_ids.len());
    for (entry, id) in content.iter().zip(&completion_ids) {
        assert_eq!(entry["token"], format!("token_id:{id}"));
        let lp = entry["logprob"].as_f64().unwrap();
        assert!(lp.is_finite() && lp <= 0.0 && lp != -9999.0, "{entry}");
        let top: Vec<&str> = entry["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["token"].as_str().unwrap())
            .collect();
        assert_eq!(top.len(), 2, "{entry}");
        assert_eq!(top[0], entry["token"]);
        assert_ne!(top[0], top[1], "a top logprob token repeats: {entry}");
    }

    let dir = tempfile::tempdir().unwrap();
    write_changed_weights(dir.path());
    s.admin_ok("/pause?mode=keep").await;
    let (status, reply) = bounded(
        "update_weights",
        s.send_json(
            s.http
                .post(s.url("/update_weights"))
                .json(&json!({"weight_dir": dir.path(), "weight_version": "step-3"})),
        ),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["weight_version"], "step-3");
    assert_eq!(reply["complete"], true);
    s.admin_ok("/resume").await;
    let after = s.ok("/inference/v1/generate", &body).await;
    assert_ne!(
        after["choices"][0]["token_ids"], choice["token_ids"],
        "the weights did not change"
    );
    assert_eq!(s.get_json("/model_info").await["weight_version"], "step-3");
    // Without a version the reload bumps it, as a reload from disk does.
    let (status, reply) = s
        .send_json(
            s.http
                .post(s.url("/update_weights"))
                .json(&json!({"weight_dir": dir.path()})),
        )
        .await;
    assert_eq!(status, 200, "{reply}");
    assert_ne!(reply["weight_version"], "step-3");
    // A JSON body without a folder, and a folder that is not there, are 400s naming it.
    for body in [
        json!({}),
        json!({"weight_dir": "/nonexistent/ferry-weights"}),
    ] {
        s.expect_admin_error(
            s.http.post(s.url("/update_weights")).json(&body),
            "update_weights",
            400,
            Some("weight_dir"),
        )
        .await;
    }
}

/// SkyRL (`remote_inference_client.py`): `POST /inference/v1/generate` with an
/// `X-Session-ID` header, read from `choices[0]` (`token_ids`, `finish_reason`,
/// `logprobs.content[].logprob`); `GET /get_world_size`; `POST /reset_prefix_cache
/// {"reset_running_requests": ...}` as a JSON body; its NCCL weight sync
/// (`/init_weight_transfer_engine`, `/update_weights {"update_info"}`) is a 400 naming what
/// ferry offers instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skyrl_generates_with_a_session_and_resets_the_cache_by_json_body() {
    let s = admin_server(Duration::from_millis(5)).await;
    let prompt = prompt_ids(&s, "hello there").await;
    let body = |max: u64| {
        json!({"sampling_params": {"temperature": 0.0, "max_tokens": max, "logprobs": 0,
                                   "ignore_eos": true},
               "model": MODEL, "token_ids": prompt})
    };
    let want = s.ok("/inference/v1/generate", &body(40)).await;
    let from = s.engine.stats().n_generated_tokens_total;
    let running = spawn_json(
        &s,
        "/inference/v1/generate",
        &[("X-Session-ID", "session-7")],
        &body(40),
    );
    wait_for_tokens(&s, from, 2).await;
    // The running request holds blocks: the reset only goes through when the body asks to
    // preempt it.
    let reset = |running: bool| {
        s.send_json(
            s.http
                .post(s.url("/reset_prefix_cache"))
                .json(&json!({"reset_running_requests": running})),
        )
    };
    assert_eq!(reset(false).await, (200, json!({"success": false})));
    assert_eq!(
        reset(true).await,
        (200, json!({"success": true, "cleared": ["device"]}))
    );
    let (status, response) = bounded("session request", running).await.unwrap();
    assert_eq!(status, 200, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["token_ids"], want["choices"][0]["token_ids"]);
    let response_logprobs: Vec<f64> = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["logprob"].as_f64().unwrap())
        .collect();
    assert_eq!(response_logprobs.len(), 40);

    // A `null` body is no arguments, as an empty one is (a client that always sends a body).
    let (status, reply) = s
        .send_json(s.http.post(s.url("/reset_prefix_cache")).json(&Value::Null))
        .await;
    assert_eq!(
        (status, reply),
        (200, json!({"success": true, "cleared": ["device"]}))
    );
    assert_eq!(s.get_json("/get_world_size").await["world_size"], 1);
    let update_info = json!({"update_info": {"names": ["model.norm.weight"],
        "dtype_names": ["float32"], "shapes": [[64]], "packed": true}});
    let err = s
        .expect_admin_error(
            s.http.post(s.url("/update_weights")).json(&update_info),
            "update_info",
            400,
            Some("update_info"),
        )
        .await;
    let message = err["error"]["message"].as_str().unwrap();
    for offer in [
        "GPU collective",
        "weight_dir",
        "update_weights_from_disk",
        "octet-stream",
    ] {
        assert!(message.contains(offer), "{offer}: {message}");
    }
    s.expect_admin_error(
        s.http
            .post(s.url("/init_weight_transfer_engine"))
            .json(&json!({"init_info": {"master_address": "127.0.0.1"}})),
        "init_weight_transfer_engine",
        400,
        Some("init_info"),
    )
    .await;
    assert_eq!(s.engine.weight_info().await.unwrap().n_weight_updates, 0);

    // Its sleep and wake-up, arguments in JSON bodies (level 1, given rather than defaulted):
    // waking the weights alone leaves the KV cache asleep.
    let post = |path: &'static str, body: Value| s.send_json(s.http.post(s.url(path)).json(&body));
    let (status, reply) = post("/sleep", json!({"level": 1})).await;
    assert_eq!((status, &reply["level"]), (200, &json!(1)), "{reply}");
    let (status, reply) = post("/wake_up", json!({"tags": ["weights"]})).await;
    assert_eq!((status, reply), (200, json!({"is_sleeping": true})));
    let (status, reply) = post("/wake_up", json!({"tags": ["kv_cache"]})).await;
    assert_eq!((status, reply), (200, json!({"is_sleeping": false})));
    let (status, reply) = post("/sleep", json!({"level": 7})).await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["param"], "level", "{reply}");
}

/// TRL's async GRPO (`trl/experimental/async_grpo/async_rollout_worker.py`): waits on `GET
/// /health`, reads `GET /get_world_size`, generates with `POST /v1/completions` (`prompt`
/// ids, `n: 1`, `return_token_ids`, `logprobs: 0`; reads `choices[0].token_ids` and
/// `logprobs.token_logprobs`), pauses with `/pause?mode=keep` around its weight sync, which
/// is vLLM's NCCL transfer: refused with the 400 naming the alternatives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trl_async_grpo_generates_and_its_nccl_sync_is_refused() {
    let s = admin_server(Duration::ZERO).await;
    assert_eq!(s.get("/health").await.status().as_u16(), 200);
    assert_eq!(s.get_json("/get_world_size").await["world_size"], 1);
    let prompt = prompt_ids(&s, "one two three").await;
    let output = s
        .ok(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 1.0,
                    "n": 1, "return_token_ids": true, "logprobs": 0}),
        )
        .await;
    let choice = &output["choices"][0];
    let completion_ids = ids(&choice["token_ids"]);
    let completion_logprobs = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(completion_ids.len(), completion_logprobs.len());
    s.admin_ok("/pause?mode=keep").await;
    s.expect_admin_error(
        s.http.post(s.url("/init_weight_transfer_engine")).json(
            &json!({"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                        "rank_offset": 1, "world_size": 2}}),
        ),
        "init_weight_transfer_engine",
        400,
        Some("init_info"),
    )
    .await;
    s.expect_admin_error(
        s.http
            .post(s.url("/update_weights"))
            .json(&json!({"update_info": {
            "names": [], "dtype_names": [], "shapes": [], "packed": true,
            "is_checkpoint_format": true}})),
        "update_weights",
        400,
        Some("update_info"),
    )
    .await;
    s.admin_ok("/resume").await;
    assert!(!s.is_paused().await);
}
