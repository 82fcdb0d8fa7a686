//! Named profiles: which deployment to talk to and with which key, kept in
//! `$XDG_CONFIG_HOME/tern/config.toml` (default `~/.config/tern/config.toml`; `TERN_CONFIG`
//! names another file):
//!
//! ```toml
//! default_profile = "prod"
//!
//! [profiles.prod]
//! url = "https://tern.example.com"
//! api_key = "tern_..."
//! ```
//!
//! `--url`/`TERN_URL` and `--api-key`/`TERN_API_KEY` override the profile's.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where the API listens when nothing says otherwise: `tern-api`'s own default.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Config {
    /// The profile used when none is named; default `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_profile: Option<String>,
    #[serde(default)]
    pub profiles: BTreeMap<String, Profile>,
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Profile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
}

/// The config file's path.
pub fn path() -> PathBuf {
    if let Some(path) = std::env::var_os("TERN_CONFIG") {
        return path.into();
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("tern/config.toml")
}

impl Config {
    /// The config file's profiles; none if there is no file.
    pub fn load() -> Result<Config> {
        let path = path();
        match std::fs::read_to_string(&path) {
            Ok(text) => toml::from_str(&text).with_context(|| format!("reading {}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Config::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// Writes the file, readable by its owner only (it holds keys).
    pub fn save(&self) -> Result<PathBuf> {
        let path = path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&path, toml::to_string_pretty(self)?)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        }
        Ok(path)
    }

    /// The name of the profile in use: `name`, else `default_profile`, else `default`.
    pub fn profile_name(&self, name: Option<&str>) -> String {
        name.map(str::to_string).or_else(|| self.default_profile.clone()).unwrap_or_else(|| "default".into())
    }

    /// The URL and key to use: the flags', else the profile's, else the defaults. A profile
    /// named explicitly must exist.
    pub fn resolve(&self, name: Option<&str>, url: Option<String>, key: Option<String>) -> Result<(String, Option<String>)> {
        let profile_name = self.profile_name(name);
        let profile = match self.profiles.get(&profile_name) {
            Some(p) => p.clone(),
            None if name.is_some() => anyhow::bail!("no profile {profile_name:?} in {}: add it with `tern profile set {profile_name} --url ... --api-key ...`", path().display()),
            None => Profile::default(),
        };
        Ok((url.or(profile.url).unwrap_or_else(|| DEFAULT_URL.into()), key.or(profile.api_key)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_profiles_beat_defaults() {
        let mut config = Config::default();
        config.profiles.insert("prod".into(), Profile { url: Some("https://p".into()), api_key: Some("k".into()) });
        assert_eq!(config.resolve(None, None, None).unwrap(), (DEFAULT_URL.to_string(), None));
        assert_eq!(config.resolve(Some("prod"), None, None).unwrap(), ("https://p".to_string(), Some("k".to_string())));
        assert_eq!(config.resolve(Some("prod"), Some("http://u".into()), None).unwrap().0, "http://u");
        config.default_profile = Some("prod".into());
        assert_eq!(config.resolve(None, None, None).unwrap().0, "https://p");
        assert!(config.resolve(Some("nope"), None, None).is_err());
        let text = toml::to_string_pretty(&config).unwrap();
        let back: Config = toml::from_str(&text).unwrap();
        assert_eq!(back.profiles["prod"].api_key.as_deref(), Some("k"));
    }
}
