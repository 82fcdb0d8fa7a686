//! API keys, tenants and limits: every request is authenticated, a tenant sees only its own
//! jobs (404, never 403, for another's), scopes are enforced, and each key is rate limited.

use serde_json::{json, Value};
use std::time::Duration;
use tern_e2e::Cluster;

#[tokio::test]
async fn keys_scopes_and_tenants_keep_each_tenant_to_its_own_jobs() {
    let cluster = Cluster::start(&[]).await.unwrap();
    let a = cluster.client_for(&cluster.create_key("tenant-a", "jobs:write,jobs:read").unwrap()).unwrap();
    let b_key = cluster.create_key("tenant-b", "jobs:write,jobs:read").unwrap();
    let b = cluster.client_for(&b_key).unwrap();
    let read_only = cluster.client_for(&cluster.create_key("tenant-a", "jobs:read").unwrap()).unwrap();
    let anonymous = cluster.client_for("").unwrap();
    let url = |p: &str| cluster.url(p);
    let status = |r: &reqwest::Response| r.status().as_u16();
    let code = |v: &Value| v["error"]["code"].as_str().unwrap_or_default().to_string();

    let resp = a.post(url("/v1/jobs")).json(&json!({"kind": "echo", "input": {"message": 1}})).send().await.unwrap();
    assert_eq!(status(&resp), 201);
    let job: Value = resp.json().await.unwrap();
    let id = job["id"].as_str().unwrap().to_string();
    assert_eq!(job["tenant"], "tenant-a");

    // Tenant B cannot read, list, cancel or see the deliveries of A's job: 404 as if absent.
    for path in [format!("/v1/jobs/{id}"), format!("/v1/jobs/{id}/events"), format!("/v1/jobs/{id}/deliveries")] {
        let r = b.get(url(&path)).send().await.unwrap();
        assert_eq!(status(&r), 404, "{path}");
    }
    let r = b.post(url(&format!("/v1/jobs/{id}/cancel"))).send().await.unwrap();
    assert_eq!(status(&r), 404);
    let listed: Value = b.get(url("/v1/jobs")).send().await.unwrap().json().await.unwrap();
    assert_eq!(listed["jobs"].as_array().unwrap().len(), 0, "B lists none of A's jobs");
    let listed: Value = a.get(url("/v1/jobs")).send().await.unwrap().json().await.unwrap();
    assert_eq!(listed["jobs"].as_array().unwrap().len(), 1);
    // Nor use A's uploads.
    let upload: Value = a.post(url("/v1/uploads")).send().await.unwrap().json().await.unwrap();
    let r = b
        .post(url("/v1/jobs"))
        .json(&json!({"kind": "echo", "input": {"file": {"upload_key": upload["upload_key"]}}}))
        .send()
        .await
        .unwrap();
    assert_eq!(status(&r), 404, "as if the upload did not exist");
    assert_eq!(code(&r.json().await.unwrap()), "upload_not_found");

    // No key, a bad key, a key without the scope.
    let r = anonymous.get(url("/v1/jobs")).send().await.unwrap();
    assert_eq!(status(&r), 401);
    assert_eq!(code(&r.json().await.unwrap()), "unauthenticated");
    let bogus = cluster.client_for("tern_AAAAAAAA_BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB").unwrap();
    let r = bogus.get(url("/v1/jobs")).send().await.unwrap();
    assert_eq!(status(&r), 401);
    assert_eq!(code(&r.json().await.unwrap()), "invalid_api_key");
    let r = read_only.post(url("/v1/jobs")).json(&json!({"kind": "echo", "input": {}})).send().await.unwrap();
    assert_eq!(status(&r), 403);
    assert_eq!(code(&r.json().await.unwrap()), "insufficient_scope");
    let r = read_only.get(url(&format!("/v1/jobs/{id}"))).send().await.unwrap();
    assert_eq!(status(&r), 200, "the same tenant reads with jobs:read");
    let r = a.get(url("/v1/admin/keys")).send().await.unwrap();
    assert_eq!(status(&r), 403, "admin endpoints need the admin scope");
    // Health needs no key.
    assert_eq!(status(&anonymous.get(url("/healthz")).send().await.unwrap()), 200);

    // Revoked through the admin API: refused at once.
    let prefix = b_key.rsplit_once('_').unwrap().0.to_string();
    let r = cluster.http.post(url(&format!("/v1/admin/keys/{prefix}/revoke"))).send().await.unwrap();
    assert_eq!(status(&r), 200);
    let r = b.get(url("/v1/jobs")).send().await.unwrap();
    assert_eq!(status(&r), 401);
    assert_eq!(code(&r.json().await.unwrap()), "api_key_revoked");
    // Keys made through the API work; their secrets are never listed.
    let made: Value = cluster
        .http
        .post(url("/v1/admin/keys"))
        .json(&json!({"tenant": "tenant-c", "scopes": ["jobs:read"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let c = cluster.client_for(made["key"].as_str().unwrap()).unwrap();
    assert_eq!(status(&c.get(url("/v1/jobs")).send().await.unwrap()), 200);
    let all = cluster.http.get(url("/v1/admin/keys")).send().await.unwrap().text().await.unwrap();
    assert!(!all.contains(made["key"].as_str().unwrap()), "secrets are not listed");
}

#[tokio::test]
async fn over_the_rate_limit_a_key_gets_429_with_retry_after_and_tenants_have_a_queue_cap() {
    let cluster = Cluster::start(&[
        ("TERN_RATE_LIMIT_PER_SEC", "2"),
        ("TERN_RATE_LIMIT_BURST", "5"),
        ("TERN_MAX_QUEUED_PER_TENANT", "3"),
    ])
    .await
    .unwrap();
    let key = cluster.create_key("tenant-r", "jobs:write,jobs:read").unwrap();
    let client = cluster.client_for(&key).unwrap();
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for _ in 0..12 {
        let r = client.get(cluster.url("/v1/jobs")).send().await.unwrap();
        if r.status() == 429 {
            retry_after = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["code"], "rate_limited");
            statuses.push(429);
        } else {
            statuses.push(r.status().as_u16());
        }
    }
    assert!(statuses[..5].iter().all(|s| *s == 200), "the burst passes: {statuses:?}");
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(retry_after.is_some_and(|s| s.parse::<u64>().unwrap() >= 1));
    // Another key has its own bucket.
    let other = cluster.client_for(&cluster.create_key("tenant-q", "jobs:write,jobs:read").unwrap()).unwrap();
    assert_eq!(other.get(cluster.url("/v1/jobs")).send().await.unwrap().status(), 200);
    // The bucket refills.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(client.get(cluster.url("/v1/jobs")).send().await.unwrap().status(), 200);

    // Tenant cap: three waiting jobs, the fourth refused (no worker runs them).
    for i in 0..3 {
        let r = other.post(cluster.url("/v1/jobs")).json(&json!({"kind": "echo", "input": {"message": i}})).send().await.unwrap();
        assert_eq!(r.status(), 201);
    }
    let r = other.post(cluster.url("/v1/jobs")).json(&json!({"kind": "echo", "input": {}})).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "tenant_queue_full");
}
