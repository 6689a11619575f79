//! `GET /openapi.json` against the live router and the API's documentation (the README,
//! `docs/api.md` and `docs/lifecycle-admin.md`): every documented route answers its method,
//! every documented query parameter is one its handler knows, and every route and parameter
//! the documentation lists is in the document.

use std::collections::BTreeSet;

use ferry_server::openapi::routes;
use serde_json::Value;

use crate::support::{start, Options};

/// A Markdown file of the repository (`path` from its root, two levels above this crate).
fn markdown(path: &str) -> String {
    let full = format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// `text` from `start` (a line prefix) to the next `## ` heading.
fn section<'a>(text: &'a str, start: &str) -> &'a str {
    let from = text
        .find(start)
        .unwrap_or_else(|| panic!("the documentation has no {start:?}"));
    let rest = &text[from + start.len()..];
    &rest[..rest.find("\n## ").unwrap_or(rest.len())]
}

/// Every `` `X` `` span in `text`.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// `(method, path)` of every route mentioned as `` `GET /x` ``, `` `POST /x` `` or
/// `` `GET|POST /x` ``.
fn routes_in(text: &str) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for span in code_spans(text) {
        let Some((methods, path)) = span.split_once(' ') else {
            continue;
        };
        let path = path.split(['?', ' ']).next().unwrap_or("");
        if !path.starts_with('/') {
            continue;
        }
        for m in methods.split('|') {
            if m == "GET" || m == "POST" || m == "DELETE" {
                out.insert((m.to_owned(), path.to_owned()));
            }
        }
    }
    out
}

/// Resolves a `$ref` to its component.
fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(r) => {
            let name = r.rsplit('/').next().unwrap();
            &doc["components"]["schemas"][name]
        }
        None => schema,
    }
}

/// The property names of an object schema, through `allOf`, `$ref` and nullable `oneOf`s.
fn properties(doc: &Value, schema: &Value) -> BTreeSet<String> {
    let schema = resolve(doc, schema);
    let mut out: BTreeSet<String> = schema["properties"]
        .as_object()
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default();
    for key in ["allOf", "oneOf", "anyOf"] {
        for part in schema[key].as_array().into_iter().flatten() {
            out.extend(properties(doc, part));
        }
    }
    out
}

/// The schema of property `name` of an object schema (through `allOf` and `$ref`).
fn property<'a>(doc: &'a Value, schema: &'a Value, name: &str) -> Option<&'a Value> {
    let schema = resolve(doc, schema);
    if let Some(p) = schema["properties"].get(name) {
        return Some(p);
    }
    ["allOf", "oneOf", "anyOf"].iter().find_map(|key| {
        schema[*key]
            .as_array()?
            .iter()
            .find_map(|part| property(doc, part, name))
    })
}

/// `a` or `a.b`: a property (or a nested one) of `schema`.
fn has_param(doc: &Value, schema: &Value, param: &str) -> bool {
    let mut parts = param.split('.');
    let first = parts.next().unwrap();
    let Some(mut current) = property(doc, schema, first) else {
        return false;
    };
    for part in parts {
        match property(doc, current, part) {
            Some(next) => current = next,
            None => return false,
        }
    }
    true
}

fn operation<'a>(doc: &'a Value, method: &str, path: &str) -> &'a Value {
    &doc["paths"][path][method.to_lowercase()]
}

fn query_params(op: &Value) -> BTreeSet<String> {
    op["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["in"] == "query")
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_matches_the_router_and_the_docs() {
    let s = start(Options {
        admin_api: true,
        ..Options::default()
    })
    .await;
    let doc = s.get_json("/openapi.json").await;
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
    let paths = doc["paths"].as_object().unwrap();
    assert_eq!(
        paths.len(),
        routes()
            .iter()
            .map(|r| r.path)
            .collect::<BTreeSet<_>>()
            .len()
    );

    // The router: each documented route answers its method (not the fallback's 404, not a
    // 405), and knows each documented query parameter (a bad value is refused for its value,
    // never as an unknown parameter). The first probe shows an unknown one would be caught.
    let (status, body) = s.admin("/pause?no_such_parameter=1").await;
    assert_eq!(status, 400);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("unknown query parameter"));
    for r in routes() {
        for m in r.methods {
            let query: Vec<String> = r.query.iter().map(|p| format!("{}=zz", p.name)).collect();
            // A path parameter gets a value no resource has: its handler answers a 404 that
            // names the parameter, where the fallback's names none.
            let params: Vec<&str> = ferry_server::openapi::path_params(r.path).collect();
            let path = params.iter().fold(r.path.to_owned(), |p, name| {
                p.replace(&format!("{{{name}}}"), "zz")
            });
            let url = s.url(&format!("{path}?{}", query.join("&")));
            let req = match m.as_str() {
                "GET" => s.http.get(url),
                "DELETE" => s.http.delete(url),
                _ => s.http.post(url),
            };
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            // Not every reply is JSON (`/metrics`); an error is.
            let body: Value =
                serde_json::from_str(&resp.text().await.unwrap()).unwrap_or(Value::Null);
            let what = format!("{} {} -> {status} {body}", m.as_str(), r.path);
            let names_a_param = params
                .iter()
                .any(|p| body["error"]["param"].as_str() == Some(*p));
            assert!((status != 404 || names_a_param) && status != 405, "{what}");
            let message = body["error"]["message"].as_str().unwrap_or("");
            assert!(!message.contains("unknown query parameter"), "{what}");
            assert!(
                operation(&doc, m.as_str(), r.path).is_object(),
                "{what}: not in the document"
            );
            let documented = query_params(operation(&doc, m.as_str(), r.path));
            assert_eq!(documented.len(), r.query.len(), "{what}");
        }
    }
    // Without the admin API, its routes are not in the document.
    let plain = start(Options::default()).await;
    let plain_doc = plain.get_json("/openapi.json").await;
    assert!(plain_doc["paths"].get("/pause").is_none());
    assert!(plain_doc["paths"].get("/v1/completions").is_some());

    // The documentation: every route the README, the API reference and the admin API's page
    // list is in the document, with its method.
    let readme = markdown("README.md");
    let api = markdown("docs/api.md");
    let admin = markdown("docs/lifecycle-admin.md");
    let listed: BTreeSet<_> = routes_in(&readme)
        .into_iter()
        .chain(routes_in(&api))
        .chain(routes_in(&admin))
        .collect();
    assert!(listed.len() >= 25, "{listed:?}");
    for (method, path) in &listed {
        assert!(
            operation(&doc, method, path).is_object(),
            "the documentation's {method} {path} is not in /openapi.json"
        );
    }

    // Every generation parameter it lists is a field of both generation requests (chat's
    // and completions' own fields count for their route).
    let completion = &doc["components"]["schemas"]["CompletionRequest"];
    let chat = &doc["components"]["schemas"]["ChatRequest"];
    let params = section(&api, "## Parameters");
    let params = &params[..params.find("are accepted and ignored").unwrap()];
    let mut names: Vec<&str> = code_spans(params)
        .into_iter()
        .filter(|t| {
            t.chars()
                .all(|c| c.is_ascii_lowercase() || c == '_' || c == '.')
        })
        .collect();
    let structured = section(&api, "## Structured outputs");
    let structured = &structured[..structured.find("```").unwrap()];
    for line in structured.lines().filter(|l| l.starts_with("| `")) {
        let first = line.split('|').nth(1).unwrap();
        // `field: {...}` or `field`; the spans after `/` are other forms of the same field.
        for span in code_spans(first)
            .into_iter()
            .filter(|t| t.starts_with(|c: char| c.is_ascii_lowercase()))
        {
            names.push(span.split([':', ' ']).next().unwrap());
        }
    }
    names.push("kv_transfer_params");
    assert!(names.len() >= 25, "{names:?}");
    for name in names {
        let route_own = ["max_completion_tokens", "top_logprobs", "messages"];
        let in_completion = has_param(&doc, completion, name);
        let in_chat = has_param(&doc, chat, name);
        assert!(
            (in_completion && in_chat)
                || ((in_completion || in_chat)
                    && (route_own.contains(&name)
                        || ["prompt", "logprobs", "echo"].contains(&name))),
            "docs/api.md's parameter `{name}` is not in the request schemas"
        );
    }

    // The tool fields docs/api.md's "Tool calls" names are chat's.
    let tools = section(&api, "## Tool calls");
    for name in ["tools", "tool_choice", "parallel_tool_calls"] {
        assert!(tools.contains(&format!("`{name}")), "{name}");
        assert!(
            has_param(&doc, chat, name),
            "`{name}` is not in ChatRequest"
        );
        assert!(
            !has_param(&doc, completion, name),
            "`{name}` on completions"
        );
    }

    // Every admin parameter the table of docs/lifecycle-admin.md lists: `name=` in the query,
    // `"name"` in the JSON body.
    for row in admin.lines().filter(|l| l.starts_with("| `")) {
        // Cells split on `|`, but not on the `\|` inside them.
        let row = row.replace("\\|", "/");
        let cells: Vec<&str> = row.split('|').skip(1).collect();
        let route = routes_in(cells[0]);
        let (method, path) = route.iter().next().unwrap();
        let op = operation(&doc, method, path);
        let query = query_params(op);
        let body = &op["requestBody"]["content"]["application/json"]["schema"];
        let body_props = properties(&doc, body);
        for span in code_spans(cells[1]) {
            if let Some((name, _)) = span.split_once('=') {
                assert!(
                    query.contains(name),
                    "{method} {path}: docs/lifecycle-admin.md's `{name}=` is not documented"
                );
            }
            for key in span
                .split('"')
                .skip(1)
                .step_by(2)
                .filter(|k| span.contains(&format!("\"{k}\":")))
            {
                assert!(
                    body_props.contains(key),
                    "{method} {path}: docs/lifecycle-admin.md's body key `{key}` is not documented"
                );
            }
        }
    }
}
