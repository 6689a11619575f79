//! Bucketed weight uploads through the proxy to P and D: each bucket copied to both as it
//! arrives, a two-phase commit that installs one version everywhere, and a failed prepare on
//! one instance that commits nowhere. Buckets go from the caller's socket to the instances'
//! with splice (their answers say `spliced`), one request at a time on a connection that
//! also carries other requests; a bucket cut off by its caller, or refused by the instances,
//! leaves nothing staged anywhere.

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
        // Through the proxy the body never passed through its memory.
        if reply.get("instances").is_some() {
            assert_eq!(reply["spliced"], true, "{reply}");
        }
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

/// A minimal HTTP/1.1 client on one connection, to send requests back to back and pipelined
/// as the proxy's own front door sees them.
struct Raw {
    stream: std::io::BufReader<std::net::TcpStream>,
}

impl Raw {
    fn connect(base: &str) -> Self {
        let addr = base.trim_start_matches("http://");
        let stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        Self {
            stream: std::io::BufReader::new(stream),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.stream.get_mut().write_all(bytes).unwrap();
    }

    fn request(method: &str, path: &str, extra: &str, body: &[u8]) -> Vec<u8> {
        let mut out = format!(
            "{method} {path} HTTP/1.1\r\nhost: proxy\r\ncontent-length: {}\r\n{extra}\r\n",
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(body);
        out
    }

    /// The next answer's status and JSON body (`Content-Length` or chunked).
    fn answer(&mut self) -> (u16, Value) {
        use std::io::{BufRead, Read};
        let mut line = String::new();
        self.stream.read_line(&mut line).unwrap();
        let status: u16 = line.split(' ').nth(1).unwrap().parse().unwrap();
        let (mut length, mut chunked) = (None, false);
        loop {
            line.clear();
            self.stream.read_line(&mut line).unwrap();
            let l = line.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.strip_prefix("content-length:") {
                length = Some(v.trim().parse::<usize>().unwrap());
            }
            chunked |= l == "transfer-encoding: chunked";
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                line.clear();
                self.stream.read_line(&mut line).unwrap();
                let n = usize::from_str_radix(line.trim(), 16).unwrap();
                let mut piece = vec![0; n + 2];
                self.stream.read_exact(&mut piece).unwrap();
                if n == 0 {
                    break;
                }
                body.extend_from_slice(&piece[..n]);
            }
        } else {
            body.resize(length.expect("an answer with no length"), 0);
            self.stream.read_exact(&mut body).unwrap();
        }
        (status, serde_json::from_slice(&body).unwrap())
    }
}

/// The norms' bucket as a chunked body (a framing the proxy's front door leaves to hyper).
fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for piece in body.chunks(100) {
        out.extend(format!("{:x}\r\n", piece.len()).into_bytes());
        out.extend_from_slice(piece);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// One keep-alive connection carries a health check, a begin, two pipelined buckets (spliced),
/// a chunked one (copied), the commit and a generation, each answered in turn; the commit
/// installs what the three buckets held on P and D alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_carries_plain_requests_and_spliced_buckets_in_turn() {
    bounded(async {
        let fleet = pd_fleet(&[], &[]);
        let proxy = fleet.proxy.url.clone();
        let d_url = fleet.d.url.clone();
        tokio::task::spawn_blocking(move || {
            let mut raw = Raw::connect(&proxy);
            raw.send(&Raw::request("GET", "/health", "", b""));
            let (status, health) = raw.answer();
            assert_eq!(status, 200, "{health}");
            raw.send(&Raw::request(
                "POST",
                "/weight_uploads",
                "content-type: application/json\r\n",
                br#"{"weight_version": "one-connection"}"#,
            ));
            let (status, begun) = raw.answer();
            assert_eq!(status, 200, "{begun}");
            let id = begun["upload_id"].as_str().unwrap().to_owned();
            let path = format!("/weight_uploads/{id}/buckets");
            // Two buckets in one write: the second's head arrives with the first's body.
            let mut both = Raw::request("POST", &path, "", &vector_push(NORMS[0].0, NORMS[0].1));
            both.extend(Raw::request(
                "POST",
                &path,
                "",
                &vector_push(NORMS[1].0, NORMS[1].1),
            ));
            raw.send(&both);
            for _ in 0..2 {
                let (status, reply) = raw.answer();
                assert_eq!(status, 200, "{reply}");
                assert_eq!(reply["spliced"], true, "{reply}");
            }
            let third = vector_push("model.layers.1.input_layernorm.weight", 3.0);
            let mut request = format!(
                "POST {path} HTTP/1.1\r\nhost: proxy\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            .into_bytes();
            request.extend(chunked(&third));
            raw.send(&request);
            let (status, reply) = raw.answer();
            assert_eq!(status, 200, "{reply}");
            assert_eq!(reply["spliced"], false, "{reply}");
            raw.send(&Raw::request(
                "POST",
                &format!("/weight_uploads/{id}/commit"),
                "content-type: application/json\r\n",
                b"{}",
            ));
            let (status, committed) = raw.answer();
            assert_eq!(status, 200, "{committed}");
            for i in committed["instances"].as_array().unwrap() {
                assert_eq!(i["body"]["weight_version"], "one-connection", "{committed}");
                assert_eq!(i["body"]["n_tensors"], 3, "{committed}");
            }
            let generation = serde_json::to_vec(&greedy_body()).unwrap();
            raw.send(&Raw::request(
                "POST",
                "/v1/completions",
                "content-type: application/json\r\n",
                &generation,
            ));
            let (status, answer) = raw.answer();
            assert_eq!(status, 200, "{answer}");
            assert_eq!(
                answer["choices"][0]["weight_versions"],
                json!(["one-connection"])
            );
        })
        .await
        .unwrap();
        let (_, info) = get(&url(&d_url, "/weight_info")).await;
        assert_eq!(info["weight_version"], "one-connection", "{info}");
    })
    .await;
}

/// A bucket whose caller goes away mid-body, and one naming a tensor the model lacks (refused
/// by the instances while its body is still arriving): each discards the upload on P and D,
/// the refusal is a 400 naming the tensor, and the old weights go on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_cut_off_or_refused_mid_body_stages_nothing_anywhere() {
    bounded(async {
        let fleet = pd_fleet(&[], &[]);
        let proxy = fleet.proxy.url.clone();
        let before = post(&url(&proxy, "/v1/completions"), &greedy_body())
            .await
            .1;

        // 1. Cut off: 4 MiB promised, 1 MiB sent, then the connection closes.
        let (status, begun) = post(&url(&proxy, "/weight_uploads"), &json!({})).await;
        assert_eq!(status, 200, "{begun}");
        let id = begun["upload_id"].as_str().unwrap().to_owned();
        let base = proxy.clone();
        let path = format!("/weight_uploads/{id}/buckets");
        tokio::task::spawn_blocking(move || {
            let mut raw = Raw::connect(&base);
            let mut request = format!(
                "POST {path} HTTP/1.1\r\nhost: proxy\r\ncontent-length: {}\r\n\r\n",
                4 << 20
            )
            .into_bytes();
            request.extend(vec![0u8; 1 << 20]);
            raw.send(&request);
        })
        .await
        .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let (_, open) = get(&url(&proxy, "/weight_uploads")).await;
            if open["upload"].is_null() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "still open: {open}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        for base in [&fleet.p.url, &fleet.d.url] {
            let (_, open) = get(&url(base, "/weight_uploads")).await;
            assert_eq!(open["upload"], Value::Null, "{base}: {open}");
        }

        // 2. Refused: a tensor the model lacks, 16 MiB of it.
        let (status, begun) = post(&url(&proxy, "/weight_uploads"), &json!({})).await;
        assert_eq!(status, 200, "{begun}");
        let id = begun["upload_id"].as_str().unwrap().to_owned();
        let body = f32_vector_body("model.layers.0.nope.weight", 4 << 20, 0.0);
        let (status, refused) = send_bucket(&proxy, &id, body).await;
        assert_eq!(status, 400, "{refused}");
        let message = refused["error"]["message"].as_str().unwrap();
        assert!(message.contains("model.layers.0.nope.weight"), "{message}");
        for base in [&proxy, &fleet.p.url, &fleet.d.url] {
            let (_, open) = get(&url(base, "/weight_uploads")).await;
            assert_eq!(open["upload"], Value::Null, "{base}: {open}");
        }
        let (status, after) = post(&url(&proxy, "/v1/completions"), &greedy_body()).await;
        assert_eq!(status, 200, "{after}");
        assert_eq!(
            after["choices"][0]["logprobs"],
            before["choices"][0]["logprobs"]
        );
    })
    .await;
}
