//! The API's OpenAPI 3.1 document, served at `GET /openapi.json` without a key.
//!
//! Its operations are the handlers' `#[utoipa::path]` attributes, taken by the same `routes!`
//! calls that build the router ([`crate::routes::openapi`]): a route cannot be served without
//! being described, nor described without being served. [`document`] then adds what the
//! attributes cannot say: the job kinds' own JSON Schemas (`schemas/`), one job request variant
//! per kind, and the answers every authenticated route shares (401, 403, 429, 503).

pub mod schemas;

pub use schemas::*;

use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::LazyLock;
use tern_jobs::JobKind as Kind;
use utoipa::openapi::security::{ApiKey as ApiKeyScheme, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// Info, tags and security schemes; the routes add the paths and the schemas they use.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "tern",
        description = "Async AI inference jobs: submit a job, and tern records it in Postgres, queues it in Redis by priority, runs it on a worker and writes its output to S3-compatible storage. Every `/v1` request carries an API key (`Authorization: Bearer tern_...` or `x-api-key`); errors are always `{\"error\": {\"code\", \"message\", \"request_id\"}}` with a stable code."
    ),
    // What webhooks receive is no route's body: named here to be a component.
    components(schemas(WebhookMessage)),
    modifiers(&SecuritySchemes),
    tags(
        (name = "jobs", description = "Submit, inspect, list and cancel jobs (scopes jobs:write, jobs:read)"),
        (name = "uploads", description = "Presigned uploads for files too large to send as base64"),
        (name = "webhooks", description = "Webhook endpoints of a tenant, and the deliveries of a job's events"),
        (name = "admin", description = "Operators (admin scope): API keys, queues, jobs of every tenant, tenants' shares, workers"),
        (name = "health", description = "Liveness, readiness, Prometheus metrics and this document; no key needed"),
    )
)]
pub struct ApiDoc;

/// The two ways to send an API key. Operations name the scope they need as the requirement's
/// role (OpenAPI 3.1 allows roles for non-OAuth schemes).
struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(utoipa::openapi::Components::new);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("tern_<prefix>_<secret>")
                    .description(Some(
                        "An API key, `tern-api keys create --tenant T --scope ...` or `POST /v1/admin/keys`. \
                         It acts for one tenant, with its scopes; each key has its own rate limit.",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "api_key",
            SecurityScheme::ApiKey(ApiKeyScheme::Header(ApiKeyValue::with_description(
                "x-api-key",
                "The same API key, for clients that cannot set `Authorization`.",
            ))),
        );
    }
}

/// The document as `/openapi.json` serves it, built once.
static DOCUMENT: LazyLock<Value> = LazyLock::new(document);

/// This document.
///
/// The OpenAPI 3.1 description of every route of the API.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "openapi",
    tag = "health",
    responses(
        (status = 200, description = "The OpenAPI 3.1 document", body = serde_json::Value, content_type = "application/json"),
    ),
)]
pub async fn serve() -> Json<&'static Value> {
    Json(&*DOCUMENT)
}

/// Component name of a kind: `echo` -> `Echo`.
fn pascal(kind: Kind) -> String {
    capitalised(kind.as_str())
}

/// The complete document: utoipa's, with the kinds' schemas, a request variant per kind, the
/// answers every authenticated route shares, and optional parameters that are not nullable.
pub fn document() -> Value {
    let mut doc = serde_json::to_value(crate::routes::openapi()).expect("the OpenAPI document serialises");
    let schemas = doc
        .pointer_mut("/components/schemas")
        .and_then(Value::as_object_mut)
        .expect("the routes' bodies give the document component schemas");
    add_kind_schemas(schemas);
    split_job_request(schemas);
    add_cross_field_rules(schemas);
    add_shared_responses(&mut doc);
    optional_parameters_not_null(&mut doc);
    doc["webhooks"] = webhooks();
    doc
}

/// What tern sends: a job's events, POSTed to its own webhook and to its tenant's endpoints
/// (an OpenAPI 3.1 `webhooks` entry: tern is the client here).
fn webhooks() -> Value {
    let header = |name: &str, description: &str| {
        json!({ "name": name, "in": "header", "required": true, "description": description, "schema": { "type": "string" } })
    };
    json!({
        "jobEvent": {
            "post": {
                "operationId": "job_event",
                "summary": "A job's event, delivered to a webhook",
                "description": "Sent for `job.started`, `job.succeeded`, `job.failed` and `job.canceled` (and `job.progress`, at most once a second, when asked for by name), at least once: until a 2XX, attempts follow each other after 0 s, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 14 h, 20 h and 24 h (jittered; `TERN_WEBHOOK_SCHEDULE_MS`), honouring `Retry-After` on 429 and 503. Signed per the Standard Webhooks spec; receivers dedupe on `webhook-id`.",
                "tags": ["webhooks"],
                "parameters": [
                    header("webhook-id", "`msg_` and 32 hex digits: the delivery, the same on every retry."),
                    header("webhook-timestamp", "Unix seconds when this attempt was signed."),
                    header("webhook-signature", "`v1,` and the base64 HMAC-SHA256 of `{webhook-id}.{webhook-timestamp}.{body}` with each current secret, space-separated during a rotation."),
                ],
                "requestBody": {
                    "required": true,
                    "content": { "application/json": { "schema": { "$ref": "#/components/schemas/WebhookMessage" } } },
                },
                "responses": {
                    "2XX": { "description": "Delivered." },
                    "410": { "description": "Gone: the webhook (or endpoint) is disabled and gets no more events." },
                    "default": { "description": "Anything else, or no answer within 15 s: tried again on the schedule until it runs out." },
                },
            }
        }
    })
}

/// Adds each kind's input and output schema (`EchoInput`, ..., `GenerateOutput`) as the worker
/// and the API validate with them. Their `$defs` become components of their own
/// (`EchoInputFile`): inside an OpenAPI document `#/$defs/...` would point at the document's
/// root, not at the schema.
fn add_kind_schemas(schemas: &mut Map<String, Value>) {
    for &kind in Kind::ALL {
        let (input, output) = tern_jobs::schemas::documents(kind);
        for (text, part) in [(input, "Input"), (output, "Output")] {
            let name = format!("{}{part}", pascal(kind));
            let mut schema: Value = serde_json::from_str(text).expect("the kinds' schemas are JSON");
            let object = schema.as_object_mut().expect("the kinds' schemas are objects");
            object.remove("$schema");
            object.remove("$id");
            let defs = object.remove("$defs").and_then(|d| d.as_object().cloned()).unwrap_or_default();
            let renamed: Vec<(String, String)> = defs
                .keys()
                .map(|def| (format!("#/$defs/{def}"), format!("#/components/schemas/{name}{}", capitalised(def))))
                .collect();
            for (def, mut def_schema) in defs {
                retarget_refs(&mut def_schema, &renamed);
                state_base64(&mut def_schema);
                schemas.insert(format!("{name}{}", capitalised(&def)), def_schema);
            }
            retarget_refs(&mut schema, &renamed);
            schemas.insert(name, schema);
        }
    }
}

/// Canonical padded base64 (RFC 4648, no line breaks), as the API decodes it: the last quantum's
/// unused bits are zero. Leading and trailing whitespace is trimmed first.
const BASE64_PATTERN: &str =
    r"^\s*(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/][AQgw]==|[A-Za-z0-9+/]{2}[AEIMQUYcgkosw048]=)?\s*$";

/// A file's `base64` alternative, which the kinds' schemas leave any string (the API decodes it
/// and answers `invalid_base64` or `file_too_large` itself), states what the API accepts.
fn state_base64(def: &mut Value) {
    if let Some(base64) = def.pointer_mut("/properties/base64").and_then(Value::as_object_mut) {
        base64.insert("pattern".into(), json!(BASE64_PATTERN));
        base64.insert("maxLength".into(), json!(tern_jobs::file_ref::BASE64_MAX_BYTES / 3 * 4));
        base64.insert("contentEncoding".into(), json!("base64"));
    }
}

fn capitalised(s: &str) -> String {
    let mut chars = s.chars();
    chars.next().map_or_else(String::new, |c| c.to_ascii_uppercase().to_string() + chars.as_str())
}

/// Rewrites every `$ref` in `schema` found in `renamed` (from, to).
fn retarget_refs(schema: &mut Value, renamed: &[(String, String)]) {
    match schema {
        Value::Object(object) => {
            for (key, value) in object.iter_mut() {
                if key != "$ref" {
                    retarget_refs(value, renamed);
                    continue;
                }
                let to = value.as_str().and_then(|target| renamed.iter().find(|(from, _)| from == target));
                if let Some((_, to)) = to {
                    *value = Value::String(to.clone());
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| retarget_refs(item, renamed)),
        _ => {}
    }
}

/// Replaces the generated `JobRequest` (any `input`) by one variant per kind, each naming its
/// kind and its kind's input schema, told apart by `kind`; unknown fields are refused, as the
/// API does.
fn split_job_request(schemas: &mut Map<String, Value>) {
    let base = schemas.remove("JobRequest").expect("the submit bodies give a JobRequest schema");
    let mut variants = Vec::new();
    let mut mapping = Map::new();
    for &kind in Kind::ALL {
        let name = format!("{}JobRequest", pascal(kind));
        let target = format!("#/components/schemas/{name}");
        let mut variant = base.clone();
        variant["title"] = json!(format!("{kind} job"));
        variant["properties"]["kind"] = json!({ "type": "string", "enum": [kind.as_str()] });
        variant["properties"]["input"] = json!({ "$ref": format!("#/components/schemas/{}Input", pascal(kind)) });
        variant["required"] = json!(["kind", "input"]);
        variant["additionalProperties"] = json!(false);
        schemas.insert(name, variant);
        variants.push(json!({ "$ref": target }));
        mapping.insert(kind.as_str().to_string(), json!(target));
    }
    schemas.insert(
        "JobRequest".into(),
        json!({
            "description": base.get("description").cloned().unwrap_or_else(|| json!("A job to run.")),
            "oneOf": variants,
            "discriminator": { "propertyName": "kind", "mapping": mapping },
        }),
    );
}

/// What the API checks across fields, which utoipa's attributes cannot say: a job names
/// `run_at` or `delay_ms`, not both (null counts as absent); a retry names ids or a kind.
fn add_cross_field_rules(schemas: &mut Map<String, Value>) {
    let not_null = json!({ "not": { "type": "null" } });
    for &kind in Kind::ALL {
        let variant = schemas.get_mut(&format!("{}JobRequest", pascal(kind))).expect("split_job_request made it");
        variant["not"] = json!({
            "description": "`run_at` and `delay_ms` together (400 `invalid_request`)",
            "required": ["run_at", "delay_ms"],
            "properties": { "run_at": not_null, "delay_ms": not_null },
        });
    }
    let retry = schemas.get_mut("RetryRequest").expect("the retry route gives a RetryRequest schema");
    retry["anyOf"] = json!([
        { "required": ["ids"], "properties": { "ids": { "minItems": 1 } } },
        { "required": ["kind"], "properties": { "kind": not_null } },
    ]);
}

/// The answers of every route that takes an API key (those with `security`), unless the
/// route describes its own: the key is checked, then its rate limit (in Redis), then the
/// handler checks the scope; Postgres and Redis are asked on every request.
fn add_shared_responses(doc: &mut Value) {
    let error = json!({ "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } });
    let retry_after = json!({
        "Retry-After": { "description": "Seconds to wait before trying again.", "schema": { "type": "integer", "minimum": 1 } }
    });
    let shared = [
        (
            "401",
            "Unauthorized",
            json!({
                "description": "No API key (`unauthenticated`), an unknown or malformed one (`invalid_api_key`), or a revoked one (`api_key_revoked`).",
                "content": error,
            }),
        ),
        (
            "403",
            "Forbidden",
            json!({
                "description": "The key lacks the scope this operation needs (`insufficient_scope`); its security requirement names the scope.",
                "content": error,
            }),
        ),
        (
            "429",
            "RateLimited",
            json!({
                "description": "Over the key's request rate (`rate_limited`; `TERN_RATE_LIMIT_PER_SEC`, burst `TERN_RATE_LIMIT_BURST`).",
                "headers": retry_after,
                "content": error,
            }),
        ),
        (
            "503",
            "Unavailable",
            json!({
                "description": "A backing service did not answer: `database_unavailable`, `queue_unavailable` or `storage_unavailable`.",
                "headers": retry_after,
                "content": error,
            }),
        ),
    ];
    let components = doc["components"].as_object_mut().expect("the document has components");
    let responses = components.entry("responses").or_insert_with(|| json!({}));
    for (_, name, response) in &shared {
        responses[*name] = response.clone();
    }
    let Some(paths) = doc["paths"].as_object_mut() else { return };
    for operation in paths.values_mut().filter_map(Value::as_object_mut).flat_map(|item| item.values_mut()) {
        if operation.get("security").is_none() {
            continue;
        }
        let Some(answers) = operation.get_mut("responses").and_then(Value::as_object_mut) else { continue };
        for (status, name, _) in &shared {
            answers
                .entry(status.to_string())
                .or_insert_with(|| json!({ "$ref": format!("#/components/responses/{name}") }));
        }
    }
}

/// utoipa renders an `Option` parameter as nullable; for a query or header parameter it only
/// means "may be left out" (there is no null to send), so the null goes.
fn optional_parameters_not_null(doc: &mut Value) {
    let Some(paths) = doc["paths"].as_object_mut() else { return };
    for operation in paths.values_mut().filter_map(Value::as_object_mut).flat_map(|item| item.values_mut()) {
        let Some(parameters) = operation.get_mut("parameters").and_then(Value::as_array_mut) else { continue };
        for parameter in parameters.iter_mut().filter(|p| p["required"] != json!(true)) {
            if let Some(schema) = parameter.get_mut("schema") {
                drop_null(schema);
            }
        }
    }
}

/// `{"type": [T, "null"]}` -> `{"type": T}`; `{"oneOf": [{"type": "null"}, S]}` -> `S` (with
/// the outer keywords kept).
fn drop_null(schema: &mut Value) {
    let Some(object) = schema.as_object_mut() else { return };
    if let Some(Value::Array(types)) = object.get_mut("type") {
        types.retain(|t| t != "null");
        if types.len() == 1 {
            let only = types[0].clone();
            object.insert("type".into(), only);
        }
    }
    if let Some(Value::Array(alternatives)) = object.get("oneOf") {
        let rest: Vec<Value> = alternatives.iter().filter(|s| s.get("type") != Some(&json!("null"))).cloned().collect();
        if let [only] = rest.as_slice() {
            let only = only.clone();
            object.remove("oneOf");
            if let Value::Object(inner) = only {
                for (key, value) in inner {
                    object.entry(key).or_insert(value);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The routes of the README's endpoint table, with the abbreviated ones (`.../resume`)
    /// written out.
    const README_ROUTES: &[(&str, &str)] = &[
        ("post", "/v1/jobs"),
        ("post", "/v1/jobs/batch"),
        ("get", "/v1/jobs/{id}"),
        ("get", "/outputs/{id}"),
        ("get", "/v1/jobs/{id}/events"),
        ("get", "/v1/jobs/{id}/stream"),
        ("get", "/v1/jobs"),
        ("post", "/v1/jobs/{id}/cancel"),
        ("post", "/v1/uploads"),
        ("get", "/v1/jobs/{id}/deliveries"),
        ("post", "/v1/deliveries/{id}/replay"),
        ("post", "/v1/webhooks/endpoints"),
        ("get", "/v1/webhooks/endpoints"),
        ("post", "/v1/webhooks/endpoints/{id}/rotate"),
        ("delete", "/v1/webhooks/endpoints/{id}"),
        ("post", "/v1/admin/keys"),
        ("get", "/v1/admin/keys"),
        ("post", "/v1/admin/keys/{id}/revoke"),
        ("get", "/v1/admin/queues"),
        ("post", "/v1/admin/queues/{kind}/pause"),
        ("post", "/v1/admin/queues/{kind}/resume"),
        ("post", "/v1/admin/queues/{kind}/purge"),
        ("get", "/v1/admin/jobs"),
        ("get", "/v1/admin/jobs/{id}"),
        ("post", "/v1/admin/jobs/retry"),
        ("post", "/v1/admin/jobs/{id}/cancel"),
        ("delete", "/v1/admin/jobs/{id}"),
        ("get", "/v1/admin/workers"),
        ("post", "/v1/admin/workers/{id}/drain"),
        ("post", "/v1/admin/workers/{id}/undrain"),
        ("get", "/v1/admin/tenants"),
        ("put", "/v1/admin/tenants/{tenant}"),
        ("delete", "/v1/admin/tenants/{tenant}"),
        ("get", "/v1/admin/system"),
        ("post", "/v1/admin/jobs/{id}/run-now"),
        ("get", "/v1/admin/history"),
        ("post", "/v1/admin/models"),
        ("get", "/v1/admin/models"),
        ("post", "/v1/admin/models/{kind}/rollback"),
        ("get", "/metrics"),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/openapi.json"),
    ];

    /// A path with its parameter names blanked (`/v1/jobs/{}`), so the README's
    /// `{delivery_id}` or `{id or prefix}` match the route's `{id}`; a query string ends it.
    fn shape(path: &str) -> String {
        let mut out = String::new();
        let mut in_param = false;
        for c in path.chars() {
            match c {
                '{' => {
                    in_param = true;
                    out.push_str("{}");
                }
                '}' => in_param = false,
                _ if in_param => {}
                '?' | ' ' => break,
                c => out.push(c),
            }
        }
        out
    }

    /// (method, shaped path) of every operation in the document.
    fn operations(doc: &Value) -> BTreeSet<(String, String)> {
        doc["paths"]
            .as_object()
            .expect("paths")
            .iter()
            .flat_map(|(path, item)| {
                item.as_object().expect("path item").keys().map(move |method| (method.clone(), shape(path)))
            })
            .collect()
    }

    #[test]
    fn the_document_is_json_and_openapi_3_1() {
        let text = serde_json::to_string(&document()).expect("serialises");
        let doc: Value = serde_json::from_str(&text).expect("parses back");
        assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.1")), "{}", doc["openapi"]);
        assert_eq!(doc["info"]["title"], "tern");
    }

    #[test]
    fn every_route_of_the_readme_is_described() {
        let described = operations(&document());
        for (method, path) in README_ROUTES {
            assert!(described.contains(&(method.to_string(), shape(path))), "{method} {path} is not in the document");
        }
        // And the other way round: a new route goes into the README's table too.
        assert_eq!(described.len(), README_ROUTES.len(), "the document has routes the README does not list: {described:?}");
        // The table itself: each route written out in full there must be described too.
        let readme = include_str!("../../README.md");
        let table = readme.split("| request | answer |").nth(1).expect("the README has the endpoint table");
        let mut found = 0;
        for line in table.lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')) {
            for code in line.split('`').skip(1).step_by(2) {
                let Some((method, path)) = code.split_once(' ') else { continue };
                if !["GET", "POST", "DELETE"].contains(&method) || !path.starts_with('/') {
                    continue;
                }
                found += 1;
                let route = (method.to_ascii_lowercase(), shape(path));
                assert!(described.contains(&route), "the README's {method} {path} is not in the document");
            }
        }
        assert!(found >= 20, "only {found} routes read from the README's table");
    }

    #[test]
    fn every_v1_operation_needs_a_key_and_says_what_a_refused_key_gets() {
        let doc = document();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, operation) in item.as_object().expect("path item") {
                let security = operation.get("security").and_then(Value::as_array);
                if path.starts_with("/v1/") {
                    assert!(security.is_some_and(|s| !s.is_empty()), "{method} {path} has no security");
                    for status in ["401", "403", "429", "503"] {
                        assert!(operation["responses"].get(status).is_some(), "{method} {path} lacks {status}");
                    }
                } else {
                    assert!(security.is_none(), "{method} {path} needs no key");
                }
                assert!(operation["operationId"].is_string(), "{method} {path} has no operationId");
                assert!(operation["summary"].is_string(), "{method} {path} has no summary");
            }
        }
        let schemes = &doc["components"]["securitySchemes"];
        assert_eq!(schemes["bearer"]["scheme"], "bearer");
        assert_eq!(schemes["api_key"]["name"], "x-api-key");
    }

    #[test]
    fn operation_ids_are_unique() {
        let doc = document();
        let mut seen = BTreeSet::new();
        for item in doc["paths"].as_object().expect("paths").values() {
            for operation in item.as_object().expect("path item").values() {
                let id = operation["operationId"].as_str().expect("operationId");
                assert!(seen.insert(id.to_string()), "operationId {id} is used twice");
            }
        }
    }

    #[test]
    fn the_kinds_schemas_are_components() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        for &kind in Kind::ALL {
            for part in ["Input", "Output"] {
                let schema = &schemas[format!("{}{part}", pascal(kind))];
                assert!(schema.is_object(), "no {kind} {part} schema");
                assert!(schema.get("$schema").is_none() && schema.get("$defs").is_none());
            }
            let variant = &schemas[format!("{}JobRequest", pascal(kind))];
            assert_eq!(variant["properties"]["kind"]["enum"], json!([kind.as_str()]));
            assert_eq!(variant["properties"]["input"]["$ref"], format!("#/components/schemas/{}Input", pascal(kind)));
        }
        assert_eq!(schemas["JobRequest"]["oneOf"].as_array().map(Vec::len), Some(Kind::ALL.len()));
    }

    /// Every `$ref` in the document, with where it is.
    fn refs<'a>(value: &'a Value, at: String, out: &mut Vec<(String, &'a str)>) {
        match value {
            Value::Object(object) => {
                for (key, value) in object {
                    match (key.as_str(), value) {
                        ("$ref", Value::String(target)) => out.push((at.clone(), target.as_str())),
                        _ => refs(value, format!("{at}/{key}"), out),
                    }
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    refs(item, format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
    }

    #[test]
    fn every_reference_resolves() {
        let doc = document();
        let mut found = Vec::new();
        refs(&doc, String::new(), &mut found);
        assert!(!found.is_empty());
        for (at, target) in found {
            let pointer = target.strip_prefix('#').unwrap_or_else(|| panic!("{at}: external reference {target}"));
            assert!(doc.pointer(pointer).is_some(), "{at}: {target} does not resolve");
        }
    }

    #[test]
    fn optional_parameters_are_not_nullable() {
        let doc = document();
        let list = &doc["paths"]["/v1/jobs"]["get"]["parameters"];
        let limit = list.as_array().expect("parameters").iter().find(|p| p["name"] == "limit").expect("limit");
        assert_eq!(limit["required"], json!(false));
        assert_eq!(limit["schema"]["type"], "integer");
    }

    #[test]
    fn the_documented_limits_are_the_servers() {
        use tern_jobs::job::{MAX_ATTEMPTS_LIMIT, TIMEOUT_MS_LIMIT};
        let doc = document();
        let job = &doc["components"]["schemas"]["EchoJobRequest"]["properties"];
        assert_eq!(job["max_attempts"]["maximum"], json!(MAX_ATTEMPTS_LIMIT));
        assert_eq!(job["timeout_ms"]["maximum"], json!(TIMEOUT_MS_LIMIT));
        // `submission::parse_run_at`: a year of 366 days.
        assert_eq!(job["delay_ms"]["maximum"], json!(366 * 24 * 3600 * 1000_i64));
        for (path, method) in [("/v1/jobs", "get"), ("/v1/admin/jobs", "get")] {
            let list = doc["paths"][path][method]["parameters"].as_array().expect("parameters");
            let limit = list.iter().find(|p| p["name"] == "limit").expect("limit");
            assert_eq!(limit["schema"]["minimum"], json!(1));
            assert_eq!(limit["schema"]["maximum"], json!(crate::routes::jobs::LIST_LIMIT_MAX), "{path}");
        }
        let batch = &doc["components"]["schemas"]["BatchRequest"]["properties"]["jobs"];
        assert_eq!(batch["maxItems"], json!(crate::routes::jobs::BATCH_MAX));
    }

    /// The values of a string enumeration schema.
    fn enumeration(doc: &Value, name: &str) -> Vec<String> {
        doc["components"]["schemas"][name]["enum"]
            .as_array()
            .unwrap_or_else(|| panic!("{name} is not an enumeration"))
            .iter()
            .map(|v| v.as_str().expect("string").to_string())
            .collect()
    }

    #[test]
    fn the_documented_enumerations_are_the_domains() {
        let doc = document();
        let strings = |all: &[&str]| all.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(enumeration(&doc, "JobKind"), Kind::ALL.iter().map(|k| k.as_str().to_string()).collect::<Vec<_>>());
        assert_eq!(
            enumeration(&doc, "JobState"),
            tern_jobs::JobState::ALL.iter().map(|s| s.as_str().to_string()).collect::<Vec<_>>()
        );
        assert_eq!(
            enumeration(&doc, "Priority"),
            tern_jobs::Priority::ALL.iter().map(|p| p.as_str().to_string()).collect::<Vec<_>>()
        );
        assert_eq!(enumeration(&doc, "WebhookEvent"), strings(tern_jobs::job::WEBHOOK_EVENTS));
        let endpoint_events: Vec<&str> =
            tern_jobs::job::WEBHOOK_EVENTS.iter().copied().filter(|e| *e != "job.progress").collect();
        assert_eq!(enumeration(&doc, "EndpointEvent"), strings(endpoint_events.as_slice()));
        assert_eq!(enumeration(&doc, "Scope"), strings(tern_jobs::api_keys::SCOPES));
        use tern_jobs::model_versions::{has_model, SwapState, VersionState};
        let serialised = |v: serde_json::Value| v.as_str().unwrap().to_string();
        assert_eq!(
            enumeration(&doc, "ModelVersionState"),
            VersionState::ALL.iter().map(|s| serialised(json!(s))).collect::<Vec<_>>()
        );
        assert_eq!(enumeration(&doc, "WorkerSwapState"), SwapState::ALL.iter().map(|s| s.as_str().to_string()).collect::<Vec<_>>());
        assert_eq!(
            enumeration(&doc, "ModelKind"),
            Kind::ALL.iter().filter(|k| has_model(**k)).map(|k| k.as_str().to_string()).collect::<Vec<_>>()
        );
    }
}
