//! Standard Webhooks signatures: `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")),
//! one per secret, space-separated, so receivers keep verifying while a secret is rotated.

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The secrets deliveries are signed with, `whsec_<base64 key>` each; the first is the current
/// one, the others are still accepted by receivers during a rotation.
#[derive(Clone)]
pub struct Signer {
    keys: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signer({} secrets)", self.keys.len())
    }
}

impl Signer {
    /// Parses comma-separated `whsec_...` secrets (at least one).
    pub fn parse(secrets: &str) -> Result<Signer, String> {
        let keys = secrets
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                let b64 = s.strip_prefix("whsec_").ok_or("webhook secrets start with whsec_")?;
                let key = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|_| "a webhook secret is whsec_ followed by base64")?;
                if key.len() < 24 {
                    return Err("webhook secrets hold at least 24 bytes of key");
                }
                Ok(key)
            })
            .collect::<Result<Vec<_>, &str>>()?;
        if keys.is_empty() {
            return Err("no webhook secret given".into());
        }
        Ok(Signer { keys })
    }

    /// The `webhook-signature` header value for a message.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        self.keys
            .iter()
            .map(|key| {
                let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any size");
                mac.update(format!("{id}.{timestamp}.").as_bytes());
                mac.update(body);
                format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::Signer;

    #[test]
    fn matches_the_specs_example() {
        // The example of the Standard Webhooks specification (and its reference libraries).
        let signer = Signer::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signer.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn rotation_signs_with_every_secret_and_bad_secrets_are_refused() {
        let two = Signer::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw,whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA").unwrap();
        assert_eq!(two.sign("id", 1, b"{}").split(' ').count(), 2);
        assert!(Signer::parse("").is_err());
        assert!(Signer::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
        assert!(Signer::parse("whsec_c2hvcnQ=").is_err());
    }
}
