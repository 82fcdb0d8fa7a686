//! `tern`: tern from the shell. Transcribe a directory of recordings, embed, generate, make
//! images, submit and watch jobs, run batches, steer queues and keys.
//!
//! Output is for people on a terminal (progress bars, tables, text) and JSON when stdout is
//! not one (`--json` forces it), so scripts can pipe it. Exit codes: 0 all went well, 1 a job
//! (or batch) failed or was canceled, 2 bad usage, 3 the API refused a request or could not
//! be reached.

mod admin;
mod api;
mod batch;
mod image;
mod jobs;
mod output;
mod profile;
mod transcribe;
mod watch;

use anyhow::Result;
use api::{Api, ApiFailure};
use clap::{Parser, Subcommand};
use output::Output;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "tern", version, about = "tern from the shell: transcribe, embed, generate, make images, submit and watch jobs, run batches, steer queues")]
struct Cli {
    /// The profile to use (see `tern profile`); default: the config's `default_profile`, else `default`.
    #[arg(long, global = true, env = "TERN_PROFILE")]
    profile: Option<String>,
    /// The API's base URL; overrides the profile's. Default http://127.0.0.1:8080.
    #[arg(long, global = true, env = "TERN_URL")]
    url: Option<String>,
    /// The API key; overrides the profile's.
    #[arg(long, global = true, env = "TERN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// JSON output even on a terminal (it is the default when stdout is not one).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Transcribe audio files, URLs and directories (searched for audio files). With
    /// --output-dir, each transcript is written beside the others, and a run again skips what
    /// is done and picks up the jobs it started: a directory of any size, resumable.
    Transcribe(transcribe::Args),
    /// Embed texts: the arguments, or one text a line from --file (`-` for stdin).
    Embed {
        texts: Vec<String>,
        #[arg(long)]
        file: Option<PathBuf>,
        /// urgent, high, normal or low.
        #[arg(long)]
        priority: Option<String>,
    },
    /// Generate text from a prompt; on a terminal the text shows as it comes.
    Generate {
        prompt: String,
        /// A system message before the prompt (then the prompt is the user's message).
        #[arg(long)]
        system: Option<String>,
        #[arg(long, default_value_t = 256)]
        max_tokens: u32,
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long)]
        priority: Option<String>,
    },
    /// Make images from a prompt (Stable Diffusion) with a bar of the denoising steps, and
    /// download them as PNGs into --output-dir, named `<job id>-<i>.png`; prints their paths.
    Image(image::Args),
    /// Submit a job of any kind: `--input` is its input as JSON, or @FILE.
    Submit {
        kind: String,
        #[arg(long)]
        input: String,
        #[arg(long)]
        priority: Option<String>,
        /// Makes a retried submit return the first one's job.
        #[arg(long)]
        idempotency_key: Option<String>,
        /// Wait for the job to finish, with its progress; exit 1 unless it succeeded.
        #[arg(long)]
        wait: bool,
    },
    /// List, inspect, watch, cancel and retry jobs.
    #[command(subcommand)]
    Jobs(jobs::Command),
    /// OpenAI-style batches: a JSONL file of requests, run as jobs, answered in files.
    #[command(subcommand)]
    Batch(batch::Command),
    /// Queue depths per kind and priority (admin).
    Queues,
    /// API keys (admin).
    #[command(subcommand)]
    Keys(admin::KeysCommand),
    /// Named profiles: deployments and their keys.
    #[command(subcommand)]
    Profile(ProfileCommand),
}

#[derive(Subcommand)]
enum ProfileCommand {
    /// Adds or changes a profile.
    Set {
        name: String,
        #[arg(long)]
        url: Option<String>,
        #[arg(long)]
        api_key: Option<String>,
        /// Make it the profile used when none is named.
        #[arg(long)]
        default: bool,
    },
    /// The profiles (keys hidden).
    List,
}

/// How the command ended, for the exit code.
pub enum Outcome {
    Ok,
    /// A job or batch failed or was canceled.
    JobFailed,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let out = Output::new(cli.json);
    let code = match run(cli, &out).await {
        Ok(Outcome::Ok) => 0,
        Ok(Outcome::JobFailed) => 1,
        Err(e) => {
            out.error(&e);
            if e.downcast_ref::<ApiFailure>().is_some() {
                3
            } else {
                2
            }
        }
    };
    std::process::exit(code);
}

async fn run(cli: Cli, out: &Output) -> Result<Outcome> {
    let config = profile::Config::load()?;
    if let Command::Profile(command) = &cli.command {
        return profile_command(config, command, out);
    }
    let (url, key) = config.resolve(cli.profile.as_deref(), cli.url.clone(), cli.api_key.clone())?;
    let api = Api::new(&url, key)?;
    match cli.command {
        Command::Transcribe(args) => transcribe::run(&api, out, args).await,
        Command::Embed { texts, file, priority } => jobs::embed(&api, out, texts, file, priority).await,
        Command::Generate { prompt, system, max_tokens, temperature, priority } => {
            jobs::generate(&api, out, jobs::GenerateArgs { prompt, system, max_tokens, temperature, priority }).await
        }
        Command::Image(args) => image::run(&api, out, args).await,
        Command::Submit { kind, input, priority, idempotency_key, wait } => {
            jobs::submit(&api, out, &kind, &input, priority, idempotency_key, wait).await
        }
        Command::Jobs(command) => jobs::run(&api, out, command).await,
        Command::Batch(command) => batch::run(&api, out, command).await,
        Command::Queues => admin::queues(&api, out).await,
        Command::Keys(command) => admin::keys(&api, out, command).await,
        Command::Profile(_) => unreachable!("handled above"),
    }
}

fn profile_command(mut config: profile::Config, command: &ProfileCommand, out: &Output) -> Result<Outcome> {
    match command {
        ProfileCommand::Set { name, url, api_key, default } => {
            let profile = config.profiles.entry(name.clone()).or_default();
            if url.is_some() {
                profile.url = url.clone();
            }
            if api_key.is_some() {
                profile.api_key = api_key.clone();
            }
            if *default {
                config.default_profile = Some(name.clone());
            }
            let path = config.save()?;
            out.note(&format!("profile {name} saved in {}", path.display()));
        }
        ProfileCommand::List => {
            let current = config.profile_name(None);
            let rows: Vec<serde_json::Value> = config
                .profiles
                .iter()
                .map(|(name, p)| {
                    serde_json::json!({
                        "name": name, "url": p.url.as_deref().unwrap_or(profile::DEFAULT_URL),
                        "api_key": p.api_key.as_ref().map(|k| format!("{}…", &k[..k.len().min(13)])),
                        "default": *name == current,
                    })
                })
                .collect();
            out.table(&rows, &["name", "url", "api_key", "default"]);
        }
    }
    Ok(Outcome::Ok)
}
