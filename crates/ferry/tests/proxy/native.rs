//! The RL frameworks' native routes through `ferry proxy`: SGLang's `/generate` and vLLM's
//! `/inference/v1/generate` go through P and D as completions do (D loads the prompt's KV
//! from P, and the answer is one engine's: the same tokens and logprobs, streamed or not),
//! a batch goes to D alone, and the discovery routes are answered by one instance.

use serde_json::{json, Value};

use super::procs::*;
use super::{bounded, url, PROMPT};

/// D's finished KV loads.
async fn loads(d: &str) -> f64 {
    metric(&metrics_text(d).await, "ferry_kv_loads_finished_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_generate_routes_go_through_p_and_d_as_one_engine() {
    bounded(async {
        let single = serve(&[]);
        let fleet = pd_fleet(&[], &[]);
        let single = single.ready();
        let proxy = &fleet.proxy.url;
        let (status, tokens) =
            post(&url(&single.url, "/tokenize"), &json!({"prompt": PROMPT})).await;
        assert_eq!(status, 200, "{tokens}");
        let prompt = tokens["tokens"].clone();

        // SGLang's /generate: P computes the prompt, D loads it and decodes.
        let sglang = json!({"input_ids": prompt, "return_logprob": true, "top_logprobs_num": 2,
                            "sampling_params": {"max_new_tokens": 10, "temperature": 0,
                                                "ignore_eos": true}});
        let (status, one) = post(&url(&single.url, "/generate"), &sglang).await;
        assert_eq!(status, 200, "{one}");
        let (status, pd) = post(&url(proxy, "/generate"), &sglang).await;
        assert_eq!(status, 200, "{pd}");
        assert_eq!(pd["output_ids"], one["output_ids"]);
        assert_eq!(pd["text"], one["text"]);
        for key in [
            "output_token_logprobs",
            "output_top_logprobs",
            "finish_reason",
        ] {
            assert_eq!(pd["meta_info"][key], one["meta_info"][key], "{key}");
        }
        assert_eq!(pd.get("kv_transfer_params"), None, "{pd}");
        assert_eq!(loads(&fleet.d.url).await, 1.0);

        // Streamed: D's cumulative events pass through; the last is one engine's answer.
        let other = "Another prompt for the native routes, loaded from P as well.";
        let body = json!({"text": other, "stream": true, "return_logprob": true,
                          "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                              "ignore_eos": true}});
        let (status, events, done) = stream(&url(proxy, "/generate"), &body).await;
        assert!(status == 200 && done, "{events:?}");
        let mut plain = body.clone();
        plain["stream"] = json!(false);
        let (_, one) = post(&url(&single.url, "/generate"), &plain).await;
        let last = events.last().unwrap();
        assert_eq!(last["output_ids"], one["output_ids"]);
        assert_eq!(
            last["meta_info"]["output_token_logprobs"],
            one["meta_info"]["output_token_logprobs"]
        );
        assert_eq!(loads(&fleet.d.url).await, 2.0);

        // A batch goes to D alone, as one engine computes it.
        let batch = json!({"text": [PROMPT, other], "sampling_params": {"max_new_tokens": 8,
                           "temperature": 0, "ignore_eos": true}});
        let (status, out) = post(&url(proxy, "/generate"), &batch).await;
        assert_eq!(status, 200, "{out}");
        let out = out.as_array().unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[1]["output_ids"], one["output_ids"]);
        assert_eq!(loads(&fleet.d.url).await, 2.0);

        // vLLM's /inference/v1/generate.
        let third = "A third prompt, for the token-in token-out route.";
        let (_, t) = post(&url(&single.url, "/tokenize"), &json!({"prompt": third})).await;
        let vllm = json!({"model": "tiny", "token_ids": t["tokens"],
                          "sampling_params": {"max_tokens": 9, "temperature": 0,
                                              "ignore_eos": true, "logprobs": 1}});
        let (status, one) = post(&url(&single.url, "/inference/v1/generate"), &vllm).await;
        assert_eq!(status, 200, "{one}");
        let (status, pd, _) = call(
            reqwest::Method::POST,
            &url(proxy, "/inference/v1/generate"),
            Some(&vllm),
            &[("X-Session-ID", "s-1")],
        )
        .await;
        assert_eq!(status, 200, "{pd}");
        assert_eq!(pd["choices"], one["choices"]);
        assert_eq!(pd["usage"]["completion_tokens"], 9);
        assert_eq!(pd["kv_transfer_params"], Value::Null, "{pd}");
        assert_eq!(loads(&fleet.d.url).await, 3.0);
        let mut streamed = vllm.clone();
        streamed["stream"] = json!(true);
        let (status, events, done) = stream(&url(proxy, "/inference/v1/generate"), &streamed).await;
        assert!(status == 200 && done, "{events:?}");
        let ids: Vec<Value> = events
            .iter()
            .flat_map(|e| e["choices"][0]["token_ids"].as_array().unwrap().clone())
            .collect();
        assert_eq!(Value::Array(ids), one["choices"][0]["token_ids"]);

        // A refusal is P's 400, naming the field as the client sent it.
        let bad = json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}});
        let (status, err) = post(&url(proxy, "/generate"), &bad).await;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], "sampling_params.max_new_tokens");

        // The discovery routes: one instance answers.
        let (status, info) = get(&url(proxy, "/server_info")).await;
        assert_eq!(status, 200, "{info}");
        assert_eq!(
            (info["tp_size"].clone(), info["model_path"].clone()),
            (json!(1), json!("tiny"))
        );
        let (status, info) = get(&url(proxy, "/get_model_info")).await;
        assert_eq!(status, 200, "{info}");
        assert_eq!(info["is_generation"], true);
        let (status, _) = get(&url(proxy, "/health_generate")).await;
        assert_eq!(status, 200);
        let (status, ws) = get(&url(proxy, "/get_world_size")).await;
        assert_eq!((status, ws), (200, json!({"world_size": 1})));
    })
    .await;
}
