//! Bucketed weight uploads through the proxy to P and D: each bucket copied to both as it
//! arrives, a two-phase commit that installs one version everywhere, and a failed prepare on
//! one instance that commits nowhere.

use serde_json::{json, Value};

use super::bounded;
use crate::procs::*;

fn greedy_body() -> Value {
    completion("the weights arrive in buckets", 6)
}

const NORMS: [(&str, f32); 2] = [
    ("model.norm.weight", 0.5),
    ("model.layers.0.input_layernorm.weight", 2.0),
];

async fn send_bucket(base: &str, id: &str, body: Vec<u8>) -> (u16, Value) {
    let response = client()
        .post(url(base, &format!("/weight_uploads/{id}/buckets")))
        .header("content-type", "application/octet-stream")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Begins an upload on `base` and stages both norms, one bucket each; its id.
async fn staged(base: &str) -> String {
    let (status, begun) = post(&url(base, "/weight_uploads"), &json!({})).await;
    assert_eq!(status, 200, "{begun}");
    let id = begun["upload_id"].as_str().unwrap().to_owned();
    for (name, value) in NORMS {
        let (status, reply) = send_bucket(base, &id, vector_push(name, value)).await;
        assert_eq!(status, 200, "{reply}");
    }
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucketed_upload_commits_one_version_on_p_and_d_and_equals_one_engines_push() {
    bounded(async {
        let single = serve(&[]);
        let fleet = pd_fleet(&[], &[]);
        let single = single.ready();
        let proxy = &fleet.proxy.url;
        let before = post(&url(proxy, "/v1/completions"), &greedy_body()).await.1;

        let id = staged(proxy).await;
        let (_, open) = get(&url(proxy, "/weight_uploads")).await;
        assert_eq!(open["upload"]["n_buckets"], 2, "{open}");
        // Staged, not installed: P and D still run the old weights.
        let (_, info) = get(&url(&fleet.d.url, "/weight_info")).await;
        assert_eq!(info["n_weight_updates"], 0, "{info}");
        let (status, committed) = post(
            &url(proxy, &format!("/weight_uploads/{id}/commit")),
            &json!(null),
        )
        .await;
        assert_eq!(status, 200, "{committed}");
        let instances = committed["instances"].as_array().unwrap();
        assert_eq!(instances.len(), 2, "{committed}");
        let version = instances[0]["body"]["weight_version"].as_str().unwrap();
        assert!(version.starts_with("proxy-"), "{committed}");
        for i in instances {
            assert_eq!(i["body"]["weight_version"], version, "{committed}");
            assert_eq!(i["body"]["n_tensors"], 2, "{committed}");
        }

        // One engine given the same tensors in one push: the same tokens and logprobs.
        let mut both = Vec::new();
        let header = format!(
            r#"{{"{}":{{"dtype":"F32","shape":[64],"data_offsets":[0,256]}},"{}":{{"dtype":"F32","shape":[64],"data_offsets":[256,512]}}}}"#,
            NORMS[0].0, NORMS[1].0
        );
        let mut header = header.into_bytes();
        while header.len() % 8 != 0 {
            header.push(b' ');
        }
        both.extend((header.len() as u64).to_le_bytes());
        both.extend(header);
        for (_, value) in NORMS {
            for _ in 0..64 {
                both.extend(value.to_le_bytes());
            }
        }
        let (status, pushed) = push(&single.url, &format!("?weight_version={version}"), both).await;
        assert_eq!(status, 200, "{pushed}");
        let (status, after) = post(&url(proxy, "/v1/completions"), &greedy_body()).await;
        assert_eq!(status, 200, "{after}");
        let (_, one) = post(&url(&single.url, "/v1/completions"), &greedy_body()).await;
        assert_eq!(after["choices"][0]["logprobs"], one["choices"][0]["logprobs"]);
        assert_eq!(after["choices"][0]["weight_versions"], json!([version]));
        assert_ne!(
            after["choices"][0]["logprobs"], before["choices"][0]["logprobs"],
            "the upload changed nothing"
        );
        let (_, open) = get(&url(proxy, "/weight_uploads")).await;
        assert_eq!(open["upload"], Value::Null, "{open}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_that_fails_on_one_instance_commits_nowhere_and_names_it() {
    bounded(async {
        let fleet = pd_fleet(&[], &[]);
        let proxy = &fleet.proxy.url;
        // D's weights dropped: a partial upload cannot be installed there, while P could.
        let (status, slept) = post(&url(&fleet.d.url, "/sleep?level=2"), &json!(null)).await;
        assert_eq!(status, 200, "{slept}");
        let id = staged(proxy).await;
        let (status, reply) = post(
            &url(proxy, &format!("/weight_uploads/{id}/commit")),
            &json!({"weight_version": "never"}),
        )
        .await;
        assert_eq!(status, 400, "{reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.contains(&fleet.d.url), "{message}");
        assert!(message.contains("nothing was committed"), "{message}");
        // Nothing committed on P, and the upload is gone everywhere.
        let (_, info) = get(&url(&fleet.p.url, "/weight_info")).await;
        assert_eq!(info["n_weight_updates"], 0, "{info}");
        assert_ne!(info["weight_version"], "never", "{info}");
        for base in [proxy, &fleet.p.url, &fleet.d.url] {
            let (_, open) = get(&url(base, "/weight_uploads")).await;
            assert_eq!(open["upload"], Value::Null, "{base}: {open}");
        }
    })
    .await;
}

/// D dies between its prepare and its commit: P commits, and the error names D, whose old
/// version is what it comes back with (a restart loads its model again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_lost_between_prepare_and_commit_is_named_and_the_others_commit() {
    bounded(async {
        let mut fleet = pd_fleet(&[], &[]);
        let proxy = fleet.proxy.url.clone();
        let id = staged(&proxy).await;
        let (status, prepared) = post(
            &url(&proxy, &format!("/weight_uploads/{id}/prepare")),
            &json!(null),
        )
        .await;
        assert_eq!(status, 200, "{prepared}");
        for i in prepared["instances"].as_array().unwrap() {
            assert_eq!(i["body"]["prepared"], true, "{prepared}");
        }
        let d_url = fleet.d.url.clone();
        fleet.d.kill();
        let (status, reply) = post(
            &url(&proxy, &format!("/weight_uploads/{id}/commit")),
            &json!({"weight_version": "half-fleet"}),
        )
        .await;
        assert_ne!(status, 200, "{reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.contains(&d_url), "{message}");
        assert!(message.contains("old weights"), "{message}");
        let (_, info) = get(&url(&fleet.p.url, "/weight_info")).await;
        assert_eq!(info["weight_version"], "half-fleet", "{info}");
        let (_, open) = get(&url(&proxy, "/weight_uploads")).await;
        assert_eq!(open["upload"], Value::Null, "{open}");
    })
    .await;
}

/// A client gone midway never blocks the next upload: once the instances' idle timeout has
/// discarded theirs, the proxy forgets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_upload_expires_on_the_proxy_with_the_instances() {
    bounded(async {
        let short = ["--weight-upload-timeout-seconds", "1"];
        let fleet = pd_fleet(&short, &short);
        let proxy = &fleet.proxy.url;
        let first = staged(proxy).await;
        let (status, refused) = post(&url(proxy, "/weight_uploads"), &json!({})).await;
        assert_eq!(status, 409, "{refused}");
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        let (status, begun) = post(&url(proxy, "/weight_uploads"), &json!({})).await;
        assert_eq!(status, 200, "{begun}");
        assert_ne!(begun["upload_id"].as_str(), Some(first.as_str()));
        for base in [&fleet.p.url, &fleet.d.url] {
            let (_, info) = get(&url(base, "/weight_info")).await;
            assert_eq!(info["n_weight_updates"], 0, "{base}: {info}");
        }
    })
    .await;
}
