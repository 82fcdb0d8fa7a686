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
        self.save_to(&path)?;
        Ok(path)
    }

    /// Writes the file at `path` atomically and never readable by others: the text goes to a
    /// file beside it created owner-only (0600), which then replaces it. Written in place and
    /// chmod-ed after, the keys were world-readable for a moment, and a crash mid-write left
    /// half a file.
    fn save_to(&self, path: &std::path::Path) -> Result<()> {
        use std::io::Write;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let partial = path.with_extension("toml.partial");
        let _ = std::fs::remove_file(&partial);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&partial).with_context(|| format!("creating {}", partial.display()))?;
        file.write_all(toml::to_string_pretty(self)?.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&partial, path).with_context(|| format!("replacing {}", path.display()))?;
        Ok(())
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

    /// A profile file is written whole and owner-only into a new file that replaces a
    /// world-readable one (a new inode: never the old file rewritten in place).
    #[cfg(unix)]
    #[test]
    fn profiles_are_saved_owner_only_and_whole() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = std::env::temp_dir().join(format!("tern-cli-profile-{}", std::process::id()));
        let path = dir.join("config.toml");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let before = std::fs::metadata(&path).unwrap().ino();
        let mut config = Config::default();
        config.profiles.insert("prod".into(), Profile { url: Some("https://p".into()), api_key: Some("tern_secret".into()) });
        config.save_to(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "mode {:o}", meta.permissions().mode());
        assert_ne!(meta.ino(), before, "the file was rewritten in place, not replaced");
        let saved: Config = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(saved.profiles["prod"].api_key.as_deref(), Some("tern_secret"));
        assert!(!path.with_extension("toml.partial").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
