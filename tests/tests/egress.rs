//! The SSRF guard: with the allow switch off (the default), audio URLs and webhook targets that
//! point at internal addresses, literally or through a hostname, are refused with
//! `url_forbidden`; the guarded client refuses them again at connect time and on redirects.

use serde_json::json;
use tern_e2e::Cluster;

#[tokio::test]
async fn internal_targets_are_refused_at_submit_and_at_connect() {
    let cluster = Cluster::start(&[
        ("TERN_ALLOW_PRIVATE_URLS", "false"),
        ("TERN_WEBHOOK_SECRETS", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
    ])
    .await
    .unwrap();
    let targets = [
        "http://127.0.0.1:8333/tern-test/x.wav",
        "http://10.0.0.8/x.wav",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:8080/x.wav",
        "http://[::ffff:127.0.0.1]/x.wav",
        "http://localhost:8080/x.wav", // a hostname resolving to loopback
    ];
    for url in targets {
        let (status, err) =
            cluster.post("/v1/jobs", &json!({"kind": "transcribe", "input": {"audio": {"url": url}}})).await.unwrap();
        assert_eq!((status, err["error"]["code"].as_str()), (422, Some("url_forbidden")), "audio {url}: {err}");
        let (status, err) = cluster
            .post("/v1/jobs", &json!({"kind": "echo", "input": {}, "webhook": {"url": url}}))
            .await
            .unwrap();
        assert_eq!((status, err["error"]["code"].as_str()), (422, Some("url_forbidden")), "webhook {url}: {err}");
    }
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&cluster.pg).await.unwrap();
    assert_eq!(jobs, 0, "nothing was accepted");

    // At connect time: the guarded client resolves, checks, and refuses.
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    let guarded = tern_jobs::egress::client(false, std::time::Duration::from_secs(5));
    let err = guarded.get(format!("http://localhost:{port}/")).send().await.unwrap_err();
    let why = tern_jobs::egress::forbidden_cause(&err).expect("refused by the guard");
    assert!(why.contains("loopback"), "{why}");

    // A redirect to another scheme is never followed, even when internal addresses are allowed.
    // (A redirect from a public host to an internal one goes through the same resolver check as
    // the first hop; this machine has no public host to start from.)
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(|| async { (axum::http::StatusCode::FOUND, [("location", "file:///etc/passwd")]) }),
    );
    tokio::spawn(async move { axum::serve(server, app).await.unwrap() });
    let open = tern_jobs::egress::client(true, std::time::Duration::from_secs(5));
    let resp = open.get(format!("http://127.0.0.1:{port}/")).send().await.unwrap();
    assert_eq!(resp.status(), 302, "not followed");
}
