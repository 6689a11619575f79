//! `GET /openapi.json`: the API as an OpenAPI 3.1 document.
//!
//! The schemas come from the wire types themselves (`utoipa`'s `ToSchema` derives on the
//! request and response structs), so a field added to a request is in the document by
//! construction. The routes are the table below ([`ROUTES`]) and, for the admin API, the
//! admin calls' own table (`ferry_admin::AdminCall::decl`), both in [`routes`];
//! `tests/server/openapi.rs` checks them against
//! the live router (every documented route answers its method, every documented query
//! parameter is one its handler knows) and against the API's documentation (every route and
//! parameter the README, `docs/api.md` and `docs/lifecycle-admin.md` list is here).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use utoipa::openapi::path::{
    HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn, PathsBuilder,
};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::schema::{AllOfBuilder, ComponentsBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::{
    ContentBuilder, InfoBuilder, OpenApi, OpenApiBuilder, Ref, RefOr, Required, ResponseBuilder,
};
use utoipa::ToSchema;

use crate::error::ErrorBody;
use crate::kv_transfer::KvTransferParamsJson;
use crate::native::sglang::SglangGenerateRequest;
use crate::native::vllm::VllmGenerateRequest;
use crate::request::{ChatFields, CommonParams, CompletionFields, StructuredFields, ToolFields};
use crate::response::{ChatChunk, ChatResponse, CompletionResponse, ModelList};
use crate::routes::{DetokenizeRequest, TokenizeRequest};
use crate::state::AppState;
use ferry_admin::bodies::{
    AbortRequest, AbortRequests, BeginUpload, CommitUpload, LoadLoraAdapter, MemoryTags,
    PauseGeneration, ResetPrefixCache, SleepBody, UnloadLoraAdapter, UpdateFromDisk,
    UpdateWeightVersion, UpdateWeightsJson, WakeUpBody,
};
pub use ferry_admin::{Method, Param};

/// `GET /openapi.json`: the API's OpenAPI document (with the admin routes when they are on).
pub async fn openapi_json(State(app): State<Arc<AppState>>) -> Json<OpenApi> {
    Json(document(app.config.enable_admin_api))
}

fn http_method(m: Method) -> HttpMethod {
    match m {
        Method::Get => HttpMethod::Get,
        Method::Post => HttpMethod::Post,
        Method::Delete => HttpMethod::Delete,
    }
}

/// One documented route.
#[derive(Debug, Clone, Copy)]
pub struct RouteDoc {
    pub methods: &'static [Method],
    pub path: &'static str,
    pub summary: &'static str,
    pub query: &'static [Param],
    /// The JSON body's schema (a component name), if the route takes one.
    pub body: Option<&'static str>,
    /// The 200 reply's schema (a component name), if it has a fixed one.
    pub reply: Option<&'static str>,
    /// Only with `--enable-admin-api`.
    pub admin: bool,
}

const POST: &[Method] = &[Method::Post];
const GET: &[Method] = &[Method::Get];

const fn route(methods: &'static [Method], path: &'static str, summary: &'static str) -> RouteDoc {
    RouteDoc {
        methods,
        path,
        summary,
        query: &[],
        body: None,
        reply: None,
        admin: false,
    }
}

/// Every route the server serves but the admin calls ([`routes`] adds those).
pub const ROUTES: &[RouteDoc] = &[
    RouteDoc {
        body: Some("CompletionRequest"),
        reply: Some("CompletionResponse"),
        ..route(
            POST,
            "/v1/completions",
            "Completions (streamed as server-sent events with `stream: true`)",
        )
    },
    RouteDoc {
        body: Some("ChatRequest"),
        reply: Some("ChatResponse"),
        ..route(
            POST,
            "/v1/chat/completions",
            "Chat completions (streamed as `ChatChunk` events with `stream: true`)",
        )
    },
    RouteDoc {
        reply: Some("ModelList"),
        ..route(GET, "/v1/models", "The served model")
    },
    route(
        GET,
        "/health",
        "200 while the engine runs; 503 once it was shut down; 500 naming the failure once it failed",
    ),
    route(GET, "/version", "The server's version"),
    route(
        GET,
        "/kv_events_info",
        "Where the engine publishes its KV events (ZMQ endpoints, topic, block size)",
    ),
    route(GET, "/metrics", "Prometheus metrics"),
    route(GET, "/openapi.json", "This document"),
    RouteDoc {
        body: Some("TokenizeRequest"),
        ..route(
            POST,
            "/tokenize",
            "Text or chat messages to token ids (vLLM's shape)",
        )
    },
    RouteDoc {
        body: Some("DetokenizeRequest"),
        ..route(POST, "/detokenize", "Token ids to text (vLLM's shape)")
    },
    RouteDoc {
        body: Some("SglangGenerateRequest"),
        ..route(
            POST,
            "/generate",
            "SGLang's native generate (`input_ids` or `text`, `sampling_params`; a list for a batch; SGLang's stream with `stream: true`)",
        )
    },
    RouteDoc {
        body: Some("VllmGenerateRequest"),
        ..route(
            POST,
            "/inference/v1/generate",
            "vLLM's token-in/token-out generate (`token_ids`, `sampling_params`)",
        )
    },
    route(
        GET,
        "/server_info",
        "SGLang's server arguments (model path, parallel sizes, weight version)",
    ),
    route(GET, "/get_server_info", "SGLang's older name of `/server_info`"),
    route(
        GET,
        "/model_info",
        "SGLang's model info (model and tokenizer path, weight version)",
    ),
    route(GET, "/get_model_info", "SGLang's older name of `/model_info`"),
    route(
        GET,
        "/health_generate",
        "200 once a one-token generation works, else 503",
    ),
    route(GET, "/get_world_size", "vLLM's world size (always 1)"),
];

/// Every route the server serves, with the admin API's: each admin call as the table
/// declares it.
pub fn routes() -> Vec<RouteDoc> {
    let admin = ferry_admin::AdminCall::all().map(|call| {
        let d = call.decl();
        let body = match d.body {
            ferry_admin::Body::Json(schema) | ferry_admin::Body::JsonOrSafetensors(schema) => {
                Some(schema)
            }
            ferry_admin::Body::None | ferry_admin::Body::Safetensors => None,
        };
        RouteDoc {
            methods: d.methods,
            path: d.path,
            summary: d.summary,
            query: d.query,
            body,
            reply: None,
            admin: true,
        }
    });
    ROUTES.iter().copied().chain(admin).collect()
}

/// The `{name}` parameters of a path, in order.
pub fn path_params(path: &str) -> impl Iterator<Item = &str> {
    path.split('/')
        .filter_map(|part| part.strip_prefix('{').and_then(|p| p.strip_suffix('}')))
}

/// The document, with the admin routes when the server mounts them.
pub fn document(with_admin: bool) -> OpenApi {
    let mut paths = PathsBuilder::new().build();
    for r in routes().into_iter().filter(|r| with_admin || !r.admin) {
        let mut op = OperationBuilder::new().summary(Some(r.summary));
        for name in path_params(r.path) {
            op = op.parameter(
                ParameterBuilder::new()
                    .name(name)
                    .parameter_in(ParameterIn::Path)
                    .required(Required::True)
                    .schema(Some(ObjectBuilder::new().schema_type(Type::String))),
            );
        }
        for param in r.query {
            op = op.parameter(
                ParameterBuilder::new()
                    .name(param.name)
                    .parameter_in(ParameterIn::Query)
                    .required(Required::False)
                    .description(Some(param.about))
                    .schema(Some(ObjectBuilder::new().schema_type(Type::String))),
            );
        }
        if let Some(body) = r.body {
            op = op.request_body(Some(
                RequestBodyBuilder::new()
                    .content("application/json", json_of(body))
                    .build(),
            ));
        }
        let mut ok = ResponseBuilder::new().description("success");
        if let Some(reply) = r.reply {
            ok = ok.content("application/json", json_of(reply));
        }
        let error = ResponseBuilder::new()
            .description("an OpenAI-style error naming the field at fault")
            .content("application/json", json_of("ErrorBody"));
        let op = op
            .response("200", ok.build())
            .response("4XX", error.build());
        let methods = r.methods.iter().map(|&m| http_method(m)).collect();
        paths.add_path_operation(r.path, methods, op.build());
    }
    let mut schemas: Vec<(String, RefOr<Schema>)> = Vec::new();
    add::<CommonParams>(&mut schemas);
    add::<CompletionFields>(&mut schemas);
    add::<ChatFields>(&mut schemas);
    add::<StructuredFields>(&mut schemas);
    add::<ToolFields>(&mut schemas);
    add::<KvTransferParamsJson>(&mut schemas);
    add::<ModelList>(&mut schemas);
    add::<TokenizeRequest>(&mut schemas);
    add::<DetokenizeRequest>(&mut schemas);
    add::<ErrorBody>(&mut schemas);
    add::<SglangGenerateRequest>(&mut schemas);
    add::<VllmGenerateRequest>(&mut schemas);
    if with_admin {
        add::<UpdateWeightsJson>(&mut schemas);
        add::<ResetPrefixCache>(&mut schemas);
        add::<SleepBody>(&mut schemas);
        add::<WakeUpBody>(&mut schemas);
        add::<AbortRequests>(&mut schemas);
        add::<UpdateFromDisk>(&mut schemas);
        add::<LoadLoraAdapter>(&mut schemas);
        add::<UnloadLoraAdapter>(&mut schemas);
        add::<UpdateWeightVersion>(&mut schemas);
        add::<PauseGeneration>(&mut schemas);
        add::<MemoryTags>(&mut schemas);
        add::<AbortRequest>(&mut schemas);
        add::<BeginUpload>(&mut schemas);
        add::<CommitUpload>(&mut schemas);
    }
    // The two generation requests: each route's own fields, the shared sampling fields and
    // the structured-output fields (and chat's tool fields), as read by
    // `CompletionRequest::from_json` and `ChatRequest::from_json`.
    for (name, own) in [
        ("CompletionRequest", &["CompletionFields"][..]),
        ("ChatRequest", &["ChatFields", "ToolFields"][..]),
    ] {
        let mut all = AllOfBuilder::new();
        for part in own.iter().chain(&["CommonParams", "StructuredFields"]) {
            all = all.item(Ref::from_schema_name(*part));
        }
        schemas.push((name.to_owned(), Schema::AllOf(all.build()).into()));
    }
    let completion = generic::<CompletionResponse>(&mut schemas);
    schemas.push(("CompletionResponse".into(), completion));
    let chat = generic::<ChatResponse>(&mut schemas);
    schemas.push(("ChatResponse".into(), chat));
    let chunk = generic::<ChatChunk>(&mut schemas);
    schemas.push(("ChatChunk".into(), chunk));
    let components = ComponentsBuilder::new().schemas_from_iter(schemas).build();
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("ferry")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "An OpenAI-compatible LLM server for RL training loops, with vLLM's and SGLang's admin routes.",
                ))
                .build(),
        )
        .paths(paths)
        .components(Some(components))
        .build()
}

/// `application/json` content of the component `name`.
fn json_of(name: &str) -> utoipa::openapi::Content {
    ContentBuilder::new()
        .schema(Some(Ref::from_schema_name(name)))
        .build()
}

/// `T`'s schema and those it refers to.
fn add<T: ToSchema>(schemas: &mut Vec<(String, RefOr<Schema>)>) {
    schemas.push((T::name().into_owned(), T::schema()));
    T::schemas(schemas);
}

/// A generic instance's schema (inlined by `utoipa`, so it has no name of its own).
fn generic<T: ToSchema>(schemas_out: &mut Vec<(String, RefOr<Schema>)>) -> RefOr<Schema> {
    T::schemas(schemas_out);
    T::schema()
}
