//! LoRA adapters as a user serves them: `ferry make-model lora` writes random PEFT folders
//! for the `tiny` model, `ferry serve --enable-lora --lora-modules ...` serves them, and the
//! admin routes load, replace and unload them at run time.
//!
//! What must hold: each adapter's first token and its logprob are the model's own in process
//! with that adapter loaded; requests of the base and of several adapters in one batch give
//! exactly the tokens and logprobs they give alone; a request names its adapter by `model`
//! (SGLang's `/generate`: `lora_path`) and an unknown one is a 404; an in-place load gives
//! the adapter its next version, every later token reports it (`lora_versions`), and no
//! prefix the old version cached is hit again; an unloaded adapter is a 404; a bad folder, a
//! rank above `--max-lora-rank` and a load beyond `--max-cpu-loras` are refused naming why,
//! and nothing loaded changes. An adapter pushed over HTTP (`/v1/push_lora_adapter`: its
//! tensors as the body, its config in the query) computes exactly what its folder computes,
//! and a push of new tensors is its next version.

#[allow(dead_code)] // Shared with the proxy tests; this file uses `make_model` and `post`.
#[path = "proxy/procs.rs"]
mod procs;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use procs::{make_model, post, url, Proc};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// The `tiny` model's folder and random adapters for it, `names[i]` with seed `i + 1`.
struct Folders {
    _dir: tempfile::TempDir,
    model: PathBuf,
    adapters: Vec<(String, PathBuf)>,
}

fn folders(names: &[&str], extra: &[&str]) -> Folders {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    make_model(&["tiny"], &model);
    let adapters = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let path = dir.path().join(name);
            let seed = (i + 1).to_string();
            let mut args = vec!["lora", "--base", "tiny", "--rank", "8", "--seed", &seed];
            args.extend_from_slice(extra);
            make_model(&args, &path);
            (name.to_string(), path)
        })
        .collect();
    Folders {
        _dir: dir,
        model,
        adapters,
    }
}

/// `ferry serve` of the tiny model's folder with adapters on and the admin API, `modules`
/// loaded at start.
fn serve(f: &Folders, modules: &[(String, PathBuf)], extra: &[&str]) -> Proc {
    let mut args: Vec<String> = [
        "serve",
        "--model",
        f.model.to_str().unwrap(),
        "--port",
        "0",
        "--enable-admin-api",
        "--enable-lora",
        "--kv-cache-bytes",
        "16MiB",
        "--max-model-len",
        "1024",
    ]
    .map(String::from)
    .to_vec();
    if !modules.is_empty() {
        args.push("--lora-modules".into());
        args.extend(modules.iter().map(|(n, p)| format!("{n}={}", p.display())));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    procs::spawn(&args, &[]).ready()
}

/// A greedy completion of `prompt` under `model`: its token ids, their logprobs, the
/// response.
async fn complete(base: &str, model: &str, prompt: &[u32], n: u32) -> (Vec<u64>, Vec<f64>, Value) {
    let body = json!({
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "logprobs": 0, "return_token_ids": true, "ignore_eos": true,
    });
    let (status, out) = post(&url(base, "/v1/completions"), &body).await;
    assert_eq!(status, 200, "{model}: {out}");
    let choice = &out["choices"][0];
    let ids = choice["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let lps = choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    (ids, lps, out)
}

/// The greedy first token of `prompt` and its logprob, computed in process by the model in
/// `model_dir` with the adapter in `adapter` (or none).
fn first_token_in_process(model_dir: &Path, adapter: Option<&Path>, prompt: &[u32]) -> (u32, f32) {
    use ferry_core::{
        BlockId, LoraId, ReqIdx, SampleSpec, SamplerSpec, ScheduledReq, StepPlan, TokenId,
    };
    use ferry_model::Executor;
    let m = ferry_model::load_model(model_dir).unwrap();
    let mut model = ferry_model::LlamaModel::new(&m.config, &m.weights).unwrap();
    let lora = adapter.map(|dir| {
        let a = ferry_model::LoraAdapter::load(dir, &m.config, 16).unwrap();
        model.load_lora(LoraId(0), std::sync::Arc::new(a)).unwrap();
        LoraId(0)
    });
    let (bs, n) = (16, prompt.len());
    let blocks = n.div_ceil(bs);
    let mut kv = ferry_arena::KvArena::new(model.kv_layout(bs), blocks + 1);
    let plan = StepPlan {
        block_size: bs,
        reqs: vec![ScheduledReq {
            lora,
            req: ReqIdx(0),
            start_pos: 0,
            tokens: 0..n,
            blocks: 0..blocks,
            sample: Some(SampleSpec {
                params: SamplerSpec {
                    logprobs: Some(0),
                    ..SamplerSpec::default()
                },
                output_idx: 0,
                mask: None,
                adjust: None,
            }),
        }],
        token_ids: TokenId::from_raw_slice(prompt).to_vec(),
        block_tables: (1..=blocks as u32).map(BlockId).collect(),
        ..StepPlan::default()
    };
    let out = model.execute(&plan, &mut kv).unwrap();
    (out.sampled[0].token.0, out.sampled[0].logprob)
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..21).map(|i| 3 + (i * 7 + seed * 13) % 250).collect()
}

async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("the test ran past its bound")
}

/// Adapters from `--lora-modules`: each computes what the model computes in process with
/// that adapter, differs from the base, and a batch mixing the base and both adapters gives
/// every request exactly the tokens and logprobs it gets alone. `/v1/models` lists them with
/// the base as `parent`; an unknown model is a 404 naming what is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_compute_their_own_tokens_alone_and_in_a_mixed_batch() {
    within(180, async {
        let f = folders(&["a", "b"], &[]);
        let server = serve(&f, &f.adapters, &[]);
        let base = &server.url;
        let (_, models) = procs::get(&url(base, "/v1/models")).await;
        let cards = models["data"].as_array().unwrap();
        let ids: Vec<&str> = cards.iter().map(|c| c["id"].as_str().unwrap()).collect();
        let served = ids[0].to_owned();
        assert_eq!(&ids[1..], ["a", "b"], "{models}");
        assert!(cards[0]["parent"].is_null(), "{models}");
        for card in &cards[1..] {
            assert_eq!(card["parent"], served.as_str(), "{models}");
        }

        // The first token and its logprob, against the model in process.
        let p = prompt(0);
        let mut firsts = Vec::new();
        for (model, adapter) in [
            (served.as_str(), None),
            ("a", Some(f.adapters[0].1.as_path())),
            ("b", Some(f.adapters[1].1.as_path())),
        ] {
            let (ids, lps, out) = complete(base, model, &p, 1).await;
            assert_eq!(out["model"], model, "{out}");
            let want = first_token_in_process(&f.model, adapter, &p);
            assert_eq!((ids[0] as u32, lps[0] as f32), want, "{model}");
            firsts.push((ids[0], lps[0]));
        }
        assert!(
            firsts[1] != firsts[0] && firsts[2] != firsts[0],
            "{firsts:?}"
        );

        // Alone, then all at once (one batch), bit for bit.
        let models = [served.as_str(), "a", "b", "a", served.as_str(), "b"];
        let mut alone = Vec::new();
        for (i, m) in models.iter().enumerate() {
            let (ids, lps, _) = complete(base, m, &prompt(i as u32 + 1), 8).await;
            alone.push((ids, lps));
        }
        let prompts: Vec<Vec<u32>> = (0..models.len()).map(|i| prompt(i as u32 + 1)).collect();
        let together = futures_util::future::join_all(
            models
                .iter()
                .zip(&prompts)
                .map(|(m, p)| complete(base, m, p, 8)),
        )
        .await;
        for (i, (ids, lps, out)) in together.into_iter().enumerate() {
            assert_eq!(
                (&ids, &lps),
                (&alone[i].0, &alone[i].1),
                "{}: {out}",
                models[i]
            );
            let versions = &out["choices"][0]["lora_versions"];
            if models[i] == served {
                assert!(versions.is_null(), "{out}");
            } else {
                assert_eq!(versions, &json!([1]), "{out}");
            }
        }

        let body = json!({"model": "c", "prompt": [1, 2, 3], "max_tokens": 1});
        let (status, out) = post(&url(base, "/v1/completions"), &body).await;
        assert_eq!(status, 404, "{out}");
        let message = out["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("`c` does not exist") && message.contains("`a`"),
            "{out}"
        );
    })
    .await;
}

/// An RL step's adapter sync: load at run time, replace in place (version 2: new tokens,
/// `lora_versions` [2], no hit on the prefix version 1 cached, the tokens a fresh server
/// computes with the new weights), SGLang's `/generate` by `lora_path`, unload (then a 404),
/// and every refusal naming why with nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_load_replace_and_unload_at_run_time() {
    within(240, async {
        let f = folders(&["v1", "v2", "other"], &[]);
        let server = serve(&f, &[], &["--max-cpu-loras", "2"]);
        let base = &server.url;
        let load = |name: &str, path: &Path, inplace: bool| {
            json!({"lora_name": name, "lora_path": path, "load_inplace": inplace})
        };
        let (v1, v2, other) = (&f.adapters[0].1, &f.adapters[1].1, &f.adapters[2].1);

        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("pol", v1, false)).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["lora_version"], 1, "{out}");
        let p = prompt(3);
        let (ids1, _, out1) = complete(base, "pol", &p, 6).await;
        assert_eq!(out1["choices"][0]["lora_versions"], json!([1]), "{out1}");
        let (again, _, out) = complete(base, "pol", &p, 6).await;
        assert_eq!(again, ids1);
        assert!(out["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{out}");

        // A second load under the same name needs load_inplace.
        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("pol", v2, false)).await;
        assert_eq!(status, 400, "{out}");
        assert!(out["error"]["message"].as_str().unwrap().contains("load_inplace"), "{out}");

        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("pol", v2, true)).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["lora_version"], 2, "{out}");
        let (ids2, _, out2) = complete(base, "pol", &p, 6).await;
        assert_eq!(out2["choices"][0]["lora_versions"], json!([2]), "{out2}");
        assert_eq!(out2["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{out2}");
        assert_ne!(ids2, ids1);
        // The new version's tokens are v2's own: what a server started with v2 computes.
        {
            let fresh = serve(&f, &[("pol".into(), v2.clone())], &[]);
            let (want, _, _) = complete(&fresh.url, "pol", &p, 6).await;
            assert_eq!(ids2, want);
        }

        // SGLang's route names the adapter by lora_path.
        let body = json!({"input_ids": p, "lora_path": "pol",
                          "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}});
        let (status, out) = post(&url(base, "/generate"), &body).await;
        assert_eq!(status, 200, "{out}");
        let got: Vec<u64> = out["output_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(got, ids2, "{out}");
        let body = json!({"input_ids": p, "lora_path": "nope", "sampling_params": {"max_new_tokens": 1}});
        let (status, out) = post(&url(base, "/generate"), &body).await;
        assert_eq!(status, 404, "{out}");
        assert_eq!(out["error"]["param"], "lora_path", "{out}");

        // Refusals: a folder that is not an adapter, a rank above the limit, the name of the
        // base, and a third adapter beyond --max-cpu-loras 2.
        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("x", &f.model, false)).await;
        assert_eq!((status, out["error"]["param"].as_str()), (400, Some("lora_path")), "{out}");
        let big = f._dir.path().join("big");
        make_model(&["lora", "--base", "tiny", "--rank", "32"], &big);
        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("big", &big, false)).await;
        assert_eq!(status, 400, "{out}");
        assert!(out["error"]["message"].as_str().unwrap().contains("32"), "{out}");
        let (status, out) = post(&url(base, "/load_lora_adapter"), &json!({"lora_name": "o", "lora_path": other})).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["loaded_adapters"].as_object().unwrap().len(), 2, "{out}");
        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("third", other, false)).await;
        assert_eq!(status, 409, "{out}");
        assert!(out["error"]["message"].as_str().unwrap().contains("`pol`"), "{out}");
        let (_, models) = procs::get(&url(base, "/v1/models")).await;
        assert_eq!(models["data"].as_array().unwrap().len(), 3, "{models}");

        // Unload: then the name is a 404, and unloading it again too.
        let (status, out) = post(&url(base, "/v1/unload_lora_adapter"), &json!({"lora_name": "pol"})).await;
        assert_eq!(status, 200, "{out}");
        let body = json!({"model": "pol", "prompt": p, "max_tokens": 1});
        let (status, out) = post(&url(base, "/v1/completions"), &body).await;
        assert_eq!(status, 404, "{out}");
        let (status, out) = post(&url(base, "/v1/unload_lora_adapter"), &json!({"lora_name": "pol"})).await;
        assert_eq!(status, 404, "{out}");
        // Loaded again, it is version 3: a name never gets a version it had.
        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("pol", v1, false)).await;
        assert_eq!((status, out["lora_version"].as_u64()), (200, Some(3)), "{out}");
        let (ids3, _, _) = complete(base, "pol", &p, 6).await;
        assert_eq!(ids3, ids1, "v1's weights again");
    })
    .await;
}

/// `POST /v1/push_lora_adapter`: `config` (an `adapter_config.json`'s text) in the query,
/// the tensors' safetensors bytes as the body.
async fn push_lora(
    base: &str,
    name: &str,
    config: &str,
    tensors: Vec<u8>,
    inplace: bool,
) -> (u16, Value) {
    let inplace = inplace.to_string();
    let response = procs::client()
        .post(url(base, "/v1/push_lora_adapter"))
        .query(&[
            ("lora_name", name),
            ("config", config),
            ("load_inplace", &inplace),
        ])
        .header("content-type", "application/octet-stream")
        .body(tensors)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// A PEFT folder's `adapter_config.json` text and `adapter_model.safetensors` bytes.
fn adapter_files(dir: &Path) -> (String, Vec<u8>) {
    let config = std::fs::read_to_string(dir.join("adapter_config.json")).unwrap();
    (
        config,
        std::fs::read(dir.join("adapter_model.safetensors")).unwrap(),
    )
}

/// Adapter-only weight sync: an adapter pushed over HTTP (no folder on the server) computes
/// bit for bit what the same adapter loaded from its folder computes; a push of another
/// adapter's tensors under the same name with `load_inplace` is version 2 (`lora_versions`
/// [2], that adapter's tokens); a bad body, tensors that do not fit the config or the base,
/// a rank above `--max-lora-rank`, a bad config, the base's name and a server without
/// adapters are refused naming the field, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_pushed_over_http_computes_what_its_folder_computes() {
    within(240, async {
        let f = folders(&["v1", "v2"], &[]);
        let server = serve(&f, &[], &[]);
        let base = &server.url;
        let (v1, v2) = (&f.adapters[0].1, &f.adapters[1].1);
        let (config1, tensors1) = adapter_files(v1);
        let (config2, tensors2) = adapter_files(v2);
        let load = |name: &str, path: &Path| json!({"lora_name": name, "lora_path": path});
        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("folder1", v1)).await;
        assert_eq!(status, 200, "{out}");

        let (status, out) = push_lora(base, "pol", &config1, tensors1.clone(), false).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(
            (out["lora_name"].as_str(), out["lora_version"].as_u64()),
            (Some("pol"), Some(1)),
            "{out}"
        );
        assert_eq!(out["rank"], 8, "{out}");
        let (_, models) = procs::get(&url(base, "/v1/models")).await;
        let served = models["data"][0]["id"].as_str().unwrap().to_owned();
        let p = prompt(4);
        let (ids1, lps1, out1) = complete(base, "pol", &p, 8).await;
        assert_eq!(out1["choices"][0]["lora_versions"], json!([1]), "{out1}");
        let (want, want_lps, _) = complete(base, "folder1", &p, 8).await;
        assert_eq!(
            (&ids1, &lps1),
            (&want, &want_lps),
            "pushed and folder differ"
        );
        let (plain, _, _) = complete(base, &served, &p, 8).await;
        assert_ne!(ids1, plain, "the adapter changes the tokens");

        // The same name again needs load_inplace; with it, another adapter's tensors are
        // version 2, computing what that adapter's folder computes.
        let (status, out) = push_lora(base, "pol", &config2, tensors2.clone(), false).await;
        assert_eq!(
            (status, out["error"]["param"].as_str()),
            (400, Some("lora_name")),
            "{out}"
        );
        let (status, out) = push_lora(base, "pol", &config2, tensors2.clone(), true).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["lora_version"], 2, "{out}");
        let (ids2, lps2, out2) = complete(base, "pol", &p, 8).await;
        assert_eq!(out2["choices"][0]["lora_versions"], json!([2]), "{out2}");
        assert_ne!(ids2, ids1);
        let (status, out) = post(&url(base, "/v1/load_lora_adapter"), &load("folder2", v2)).await;
        assert_eq!(status, 200, "{out}");
        let (want, want_lps, _) = complete(base, "folder2", &p, 8).await;
        assert_eq!(
            (&ids2, &lps2),
            (&want, &want_lps),
            "pushed v2 and folder v2 differ"
        );

        // Refusals, each naming its field; none changes `pol`.
        let refused = |status: u16, out: &Value, param: &str| {
            assert_eq!(
                (status, out["error"]["param"].as_str()),
                (400, Some(param)),
                "{out}"
            );
        };
        let (status, out) =
            push_lora(base, "pol", &config1, b"not safetensors".to_vec(), true).await;
        refused(status, &out, "body");
        let mut cut = tensors1.clone();
        cut.truncate(cut.len() / 2);
        let (status, out) = push_lora(base, "pol", &config1, cut, true).await;
        refused(status, &out, "body");
        // Rank 4 in the config, rank 8 in the tensors: their shapes do not fit.
        let mut r4: Value = serde_json::from_str(&config1).unwrap();
        r4["r"] = json!(4);
        let (status, out) = push_lora(base, "pol", &r4.to_string(), tensors1.clone(), true).await;
        refused(status, &out, "body");
        assert!(
            out["error"]["message"].as_str().unwrap().contains("shape"),
            "{out}"
        );
        // A target the base lacks.
        let mut odd: Value = serde_json::from_str(&config1).unwrap();
        odd["target_modules"] = json!(["lm_head"]);
        let (status, out) = push_lora(base, "pol", &odd.to_string(), tensors1.clone(), true).await;
        refused(status, &out, "config");
        let big = f._dir.path().join("big");
        make_model(&["lora", "--base", "tiny", "--rank", "32"], &big);
        let (big_config, big_tensors) = adapter_files(&big);
        let (status, out) = push_lora(base, "pol", &big_config, big_tensors, true).await;
        refused(status, &out, "config");
        assert!(
            out["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--max-lora-rank"),
            "{out}"
        );
        let (status, out) = push_lora(base, "pol", "{", tensors1.clone(), true).await;
        refused(status, &out, "config");
        let (status, out) = push_lora(base, &served, &config1, tensors1.clone(), false).await;
        refused(status, &out, "lora_name");
        let (status, out) = procs::client()
            .post(url(base, "/v1/push_lora_adapter?lora_name=pol"))
            .body(tensors1.clone())
            .send()
            .await
            .map(|r| r.status().as_u16())
            .map(|s| (s, ()))
            .unwrap();
        assert_eq!((status, out), (400, ()));
        let (again, again_lps, out) = complete(base, "pol", &p, 8).await;
        assert_eq!(
            (&again, &again_lps),
            (&ids2, &lps2),
            "a refusal changed `pol`"
        );
        assert_eq!(out["choices"][0]["lora_versions"], json!([2]), "{out}");
        let (_, models) = procs::get(&url(base, "/v1/models")).await;
        assert_eq!(models["data"].as_array().unwrap().len(), 4, "{models}");
        // An RL loop sends load_inplace every step: a first push with it loads version 1.
        let (status, out) = push_lora(base, "fresh", &config1, tensors1.clone(), true).await;
        assert_eq!(
            (status, out["lora_version"].as_u64()),
            (200, Some(1)),
            "{out}"
        );
        let (fresh, fresh_lps, _) = complete(base, "fresh", &p, 8).await;
        assert_eq!((&fresh, &fresh_lps), (&ids1, &lps1));

        // A server without --enable-lora refuses the push.
        let plain = procs::spawn(
            &[
                "serve",
                "--model",
                f.model.to_str().unwrap(),
                "--port",
                "0",
                "--enable-admin-api",
            ]
            .map(String::from),
            &[],
        )
        .ready();
        let (status, out) = push_lora(&plain.url, "pol", &config1, tensors1, false).await;
        assert_eq!(status, 400, "{out}");
        assert!(
            out["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--enable-lora"),
            "{out}"
        );
    })
    .await;
}

/// Bad flags are errors naming the flag, before the server starts.
#[test]
fn bad_lora_flags_are_errors_naming_the_flag() {
    let f = folders(&["a"], &[]);
    let run = |args: &[&str]| {
        let out = std::process::Command::new(FERRY)
            .args(["serve", "--model", "tiny", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let a = format!("a={}", f.adapters[0].1.display());
    let err = run(&["--lora-modules", &a]);
    assert!(err.contains("--enable-lora"), "{err}");
    let err = run(&["--enable-lora", "--lora-modules", "a"]);
    assert!(
        err.contains("--lora-modules") && err.contains("name=path"),
        "{err}"
    );
    let err = run(&["--enable-lora", "--lora-modules", "a=/nonexistent"]);
    assert!(err.contains("--lora-modules a=/nonexistent"), "{err}");
    let err = run(&[
        "--enable-lora",
        "--max-lora-rank",
        "2",
        "--lora-modules",
        &a,
    ]);
    assert!(
        err.contains("--lora-modules a=") && err.contains("rank"),
        "{err}"
    );
    let err = run(&["--enable-lora", "--max-loras", "0"]);
    assert!(err.contains("--max-loras"), "{err}");
}

/// P/D with an adapter: through `ferry proxy`, D loads the prompt's KV from P for a request
/// under the adapter (the export names the adapter and its version) and answers what one
/// engine answers; after an in-place load on D only, D's version differs from the export's,
/// so D computes the prompt itself (no load) and still answers its own version's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_and_d_move_an_adapters_kv_only_under_the_same_version() {
    within(240, async {
        let f = folders(&["a", "a2"], &[]);
        let module = [("a".to_owned(), f.adapters[0].1.clone())];
        let p = serve(&f, &module, &["--kv-role", "kv_producer"]);
        let d = serve(&f, &module, &["--kv-role", "kv_consumer"]);
        let single = serve(&f, &module, &[]);
        let proxy = procs::proxy(&[&p.url], &[&d.url], &[]).ready();
        let loads = |d: &Proc| {
            let d = d.url.clone();
            async move {
                procs::metric(
                    &procs::metrics_text(&d).await,
                    "ferry_kv_loads_finished_total",
                )
            }
        };
        let pr = prompt(7);
        let (want, want_lps, _) = complete(&single.url, "a", &pr, 6).await;
        let (got, got_lps, out) = complete(&proxy.url, "a", &pr, 6).await;
        assert_eq!((&got, &got_lps), (&want, &want_lps), "{out}");
        assert_eq!(out["choices"][0]["lora_versions"], json!([1]), "{out}");
        assert_eq!(loads(&d).await, 1.0, "D loaded the prompt from P");

        // D alone moves to version 2: P's export is version 1's, so D recomputes.
        let body = json!({"lora_name": "a", "lora_path": f.adapters[1].1, "load_inplace": true});
        let (status, out) = post(&url(&d.url, "/v1/load_lora_adapter"), &body).await;
        assert_eq!(status, 200, "{out}");
        let (status, out) = post(&url(&single.url, "/v1/load_lora_adapter"), &body).await;
        assert_eq!(status, 200, "{out}");
        let pr = prompt(8);
        let (want, _, _) = complete(&single.url, "a", &pr, 6).await;
        let (got, _, out) = complete(&proxy.url, "a", &pr, 6).await;
        assert_eq!(got, want, "{out}");
        assert_eq!(out["choices"][0]["lora_versions"], json!([2]), "{out}");
        assert_eq!(
            loads(&d).await,
            1.0,
            "no load of version 1's KV into version 2"
        );

        // A push through the proxy reaches P and D alike: under it, D loads P's KV (the
        // same version on both) and the tokens are adapter `a`'s own.
        let (config, tensors) = adapter_files(&f.adapters[0].1);
        let (status, out) = push_lora(&proxy.url, "pushed", &config, tensors, true).await;
        assert_eq!(status, 200, "{out}");
        let pr = prompt(9);
        let (status, out) = post(
            &url(&single.url, "/v1/load_lora_adapter"),
            &json!({"lora_name": "a1", "lora_path": f.adapters[0].1}),
        )
        .await;
        assert_eq!(status, 200, "{out}");
        let (want, want_lps, _) = complete(&single.url, "a1", &pr, 6).await;
        let (got, got_lps, out) = complete(&proxy.url, "pushed", &pr, 6).await;
        assert_eq!((&got, &got_lps), (&want, &want_lps), "{out}");
        assert_eq!(out["choices"][0]["lora_versions"], json!([1]), "{out}");
        assert_eq!(
            loads(&d).await,
            2.0,
            "D loaded the pushed adapter's prompt from P"
        );
    })
    .await;
}
