//! Outbound HTTP on behalf of users (audio URLs, webhook targets) that cannot be turned against
//! the network tern runs in: loopback, private, link-local (cloud metadata at 169.254.169.254
//! included), unique-local, carrier-grade NAT, multicast and reserved addresses are refused
//! unless the operator allows them (`TERN_ALLOW_PRIVATE_URLS`, for local development and tests).
//!
//! The check runs in the HTTP client's DNS resolver, so the addresses checked are the addresses
//! connected to (no gap for DNS rebinding), on the first request and on every redirect; literal
//! IP hosts, which skip DNS, are checked on the URL itself.

use std::error::Error as StdError;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Most redirects followed, each checked like the first URL.
pub const MAX_REDIRECTS: usize = 5;

/// Why a URL may not be fetched: code `url_forbidden`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct Forbidden(pub String);

/// The kind of address `ip` is when tern must not reach it, or `None` for a public address.
pub fn forbidden_kind(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_kind(v4),
        IpAddr::V6(v6) => {
            // IPv4-mapped (::ffff:a.b.c.d) and the deprecated IPv4-compatible (::a.b.c.d) forms
            // reach the IPv4 address on dual-stack hosts.
            if let Some(v4) = v6.to_ipv4() {
                return v4_kind(v4);
            }
            let s = v6.segments();
            // NAT64 (64:ff9b::/96) embeds an IPv4 address.
            if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
                return v4_kind(Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8));
            }
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if (s[0] & 0xfe00) == 0xfc00 {
                Some("unique-local")
            } else if (s[0] & 0xffc0) == 0xfe80 {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else {
                None
            }
        }
    }
}

fn v4_kind(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_private() {
        Some("private")
    } else if ip.is_link_local() {
        Some(if o == [169, 254, 169, 254] { "cloud metadata" } else { "link-local" })
    } else if o[0] == 0 {
        Some("unspecified")
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some("carrier-grade NAT")
    } else if o[0] == 192 && o[1] == 0 && o[2] == 0 {
        Some("IETF protocol assignments")
    } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
        Some("benchmarking")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if o[0] >= 240 {
        Some("reserved")
    } else {
        None
    }
}

/// Checks a URL before any request: http or https only, and a literal IP host must be public.
/// Hostnames are checked when they resolve (see [`client`]).
/// Whether `url` is printable ASCII (international names as punycode, other characters
/// percent-encoded), as the schemas' URL pattern says, and parses: file URLs and webhook URLs
/// are held to it before any address check.
pub fn well_formed(url: &str) -> bool {
    url.chars().all(|c| c.is_ascii_graphic()) && reqwest::Url::parse(url).is_ok()
}

pub fn check_url(url: &str, allow_private: bool) -> Result<(), Forbidden> {
    let parsed = reqwest::Url::parse(url).map_err(|e| Forbidden(format!("{url:?} is not a URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(Forbidden(format!("only http and https URLs are fetched, not {}", parsed.scheme())));
    }
    if allow_private {
        return Ok(());
    }
    let ip = match parsed.host() {
        Some(url::Host::Ipv4(v4)) => IpAddr::V4(v4),
        Some(url::Host::Ipv6(v6)) => IpAddr::V6(v6),
        Some(url::Host::Domain(_)) => return Ok(()),
        None => return Err(Forbidden(format!("{url:?} has no host"))),
    };
    match forbidden_kind(ip) {
        Some(kind) => Err(Forbidden(format!("{ip} is a {kind} address; tern does not fetch those"))),
        None => Ok(()),
    }
}

/// Resolves `host` and fails unless every address is allowed (one forbidden address is enough
/// to refuse: a client picking among them could land on it).
pub async fn check_host(host: &str, port: u16, allow_private: bool) -> Result<Vec<SocketAddr>, Forbidden> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| Forbidden(format!("{host} does not resolve: {e}")))?
        .collect();
    if !allow_private {
        if let Some((addr, kind)) = addrs.iter().find_map(|a| forbidden_kind(a.ip()).map(|k| (a, k))) {
            return Err(Forbidden(format!("{host} resolves to {}, a {kind} address; tern does not fetch those", addr.ip())));
        }
    }
    Ok(addrs)
}

/// Checks a URL fully, resolving its host: what the API does at submission, for an early 422.
pub async fn check_url_resolving(url: &str, allow_private: bool) -> Result<(), Forbidden> {
    check_url(url, allow_private)?;
    if allow_private {
        return Ok(());
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| Forbidden(e.to_string()))?;
    if let (Some(url::Host::Domain(host)), Some(port)) = (parsed.host(), parsed.port_or_known_default()) {
        check_host(host, port, false).await?;
    }
    Ok(())
}

struct GuardedResolver;

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let addrs = check_host(&host, 0, false).await.map_err(|e| Box::new(e) as Box<dyn StdError + Send + Sync>)?;
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A client builder whose DNS resolution refuses internal addresses (unless `allow_private`).
/// It ignores `HTTP(S)_PROXY`: through a proxy the guard would check only the proxy's address,
/// and the proxy would reach whatever the URL names.
pub fn guarded_builder(allow_private: bool) -> reqwest::ClientBuilder {
    let builder = reqwest::Client::builder().no_proxy();
    if allow_private {
        builder
    } else {
        builder.dns_resolver(Arc::new(GuardedResolver))
    }
}

/// An HTTP client for user-given URLs: addresses checked at resolution, redirects (at most
/// [`MAX_REDIRECTS`]) checked the same way, `timeout` for the whole request.
pub fn client(allow_private: bool, timeout: Duration) -> reqwest::Client {
    let redirects = reqwest::redirect::Policy::custom(move |attempt| {
        // `previous()` holds the first URL too: the redirects so far are one fewer.
        match check_redirect(
            attempt.url().as_str(),
            attempt.previous().len().saturating_sub(1),
            allow_private,
        ) {
            Ok(()) => attempt.follow(),
            Err(e) => attempt.error(e),
        }
    });
    guarded_builder(allow_private).timeout(timeout).redirect(redirects).build().expect("the HTTP client builds")
}

/// Whether a redirect to `url`, after `hops` earlier ones, may be followed: the scheme and a
/// literal address are checked here, a hostname by the resolver when it is connected to.
pub fn check_redirect(url: &str, hops: usize, allow_private: bool) -> Result<(), Forbidden> {
    if hops >= MAX_REDIRECTS {
        return Err(Forbidden(format!("more than {MAX_REDIRECTS} redirects")));
    }
    check_url(url, allow_private)
}

/// The refusal inside a request error, if the guard caused it.
pub fn forbidden_cause(e: &reqwest::Error) -> Option<String> {
    let mut source: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(f) = s.downcast_ref::<Forbidden>() {
            return Some(f.0.clone());
        }
        source = s.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses_are_forbidden_and_public_ones_not() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fd00:ec2::254",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::127.0.0.1",
            "::a00:1",
            "::",
            "64:ff9b::a00:1",
        ] {
            assert!(forbidden_kind(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "172.32.0.1"] {
            assert!(forbidden_kind(ip.parse().unwrap()).is_none(), "{ip}");
        }
    }

    #[test]
    fn urls_are_checked_for_scheme_and_literal_addresses() {
        assert!(check_url("http://127.0.0.1:8080/x", false).is_err());
        assert!(check_url("http://[::1]/x", false).is_err());
        assert!(check_url("http://169.254.169.254/latest/meta-data", false).is_err());
        assert!(check_url("file:///etc/passwd", true).is_err());
        assert!(check_url("https://example.com/a.wav", false).is_ok());
        assert!(check_url("http://127.0.0.1:8080/x", true).is_ok());
    }

    #[test]
    fn redirects_to_internal_addresses_or_too_many_are_refused() {
        assert!(check_redirect("http://169.254.169.254/latest/meta-data/", 1, false).is_err());
        assert!(check_redirect("http://[::1]/", 1, false).is_err());
        assert!(check_redirect("http://10.0.0.1/", 1, false).is_err());
        assert!(check_redirect("https://example.com/next", 1, false).is_ok());
        assert!(check_redirect("https://example.com/next", MAX_REDIRECTS, false).is_err());
    }

    /// A plain HTTP server on 127.0.0.1: `/hop/N` redirects to `/hop/N-1`, `/hop/0` answers 200.
    async fn redirect_chain() -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = conn.read(&mut buf).await.unwrap_or(0);
                    let request = String::from_utf8_lossy(&buf[..n]);
                    let path = request.split_whitespace().nth(1).unwrap_or("/");
                    let hops: u32 = path.trim_start_matches("/hop/").parse().unwrap_or(0);
                    let response = if hops == 0 {
                        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                            .to_string()
                    } else {
                        format!("HTTP/1.1 302 Found\r\nlocation: /hop/{}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n", hops - 1)
                    };
                    let _ = conn.write_all(response.as_bytes()).await;
                });
            }
        });
        base
    }

    #[tokio::test]
    async fn the_client_follows_five_redirects_and_refuses_a_sixth() {
        let base = redirect_chain().await;
        let http = client(true, Duration::from_secs(10));
        let ok = http
            .get(format!("{base}/hop/{MAX_REDIRECTS}"))
            .send()
            .await
            .unwrap();
        assert_eq!(ok.status(), 200);
        let err = http
            .get(format!("{base}/hop/{}", MAX_REDIRECTS + 1))
            .send()
            .await
            .unwrap_err();
        assert!(
            forbidden_cause(&err).is_some_and(|why| why.contains("redirects")),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn the_client_ignores_proxies_from_the_environment() {
        let base = redirect_chain().await;
        // A proxy that refuses every connection: going through it would fail the request.
        // (nextest runs each test in a process of its own, so the variables stay here.)
        for var in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"] {
            std::env::set_var(var, "http://127.0.0.1:9");
        }
        std::env::remove_var("NO_PROXY");
        std::env::remove_var("no_proxy");
        let http = client(true, Duration::from_secs(10));
        let ok = http.get(format!("{base}/hop/0")).send().await.unwrap();
        assert_eq!(ok.status(), 200, "fetched directly, not through the proxy");
    }
}
