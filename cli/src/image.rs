//! `tern image`: images from a prompt, as an `image` job; its PNGs are downloaded into a folder
//! as `<job id>-<i>.png`.

use crate::api::Api;
use crate::jobs::{failure_note, outcome, output_of, wait_one};
use crate::output::Output;
use crate::Outcome;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// What to draw.
    prompt: String,
    /// What to steer away from.
    #[arg(long)]
    negative: Option<String>,
    /// WIDTHxHEIGHT in pixels, each a multiple of 8 from 64 to 2048 (e.g. 512x512). Default:
    /// the model's native size.
    #[arg(long, conflicts_with_all = ["width", "height"], value_parser = parse_size)]
    size: Option<(u32, u32)>,
    /// Pixels, a multiple of 8 from 64 to 2048; default: the model's native width.
    #[arg(long)]
    width: Option<u32>,
    /// Pixels, a multiple of 8 from 64 to 2048; default: the model's native height.
    #[arg(long)]
    height: Option<u32>,
    /// Denoising steps, 1 to 150; default 50 (Turbo models take 1 to 4).
    #[arg(long)]
    steps: Option<u32>,
    /// Classifier-free guidance scale, 0 to 30; default 7.5 (Turbo models take 0).
    #[arg(long)]
    guidance: Option<f64>,
    /// Seed of the first image (image i takes seed + i); default: random, and printed.
    #[arg(long)]
    seed: Option<u64>,
    /// Images to make, 1 to 8.
    #[arg(short = 'n', long = "images", default_value_t = 1)]
    n: u32,
    /// ddim, euler, euler_a or pndm; default: the one the model names.
    #[arg(long, value_parser = ["ddim", "euler", "euler_a", "pndm"])]
    scheduler: Option<String>,
    /// The folder the PNGs are written to (made if missing).
    #[arg(long, short = 'o', default_value = ".")]
    output_dir: PathBuf,
    /// urgent, high, normal or low.
    #[arg(long)]
    priority: Option<String>,
}

/// `WIDTHxHEIGHT`; the API checks the limits.
fn parse_size(size: &str) -> Result<(u32, u32), String> {
    let (width, height) = size.split_once('x').ok_or_else(|| format!("{size:?}: expected WIDTHxHEIGHT, e.g. 512x512"))?;
    let side = |s: &str| s.parse::<u32>().map_err(|_| format!("{size:?}: expected WIDTHxHEIGHT, e.g. 512x512"));
    Ok((side(width)?, side(height)?))
}

/// The `image` job's input for `args`.
fn input(args: &Args) -> Value {
    let mut input = json!({ "prompt": args.prompt, "n": args.n });
    let (width, height) = args.size.map_or((args.width, args.height), |(w, h)| (Some(w), Some(h)));
    let fields = [
        ("negative_prompt", args.negative.as_ref().map(|n| json!(n))),
        ("width", width.map(|w| json!(w))),
        ("height", height.map(|h| json!(h))),
        ("steps", args.steps.map(|s| json!(s))),
        ("guidance", args.guidance.map(|g| json!(g))),
        ("seed", args.seed.map(|s| json!(s))),
        ("scheduler", args.scheduler.as_ref().map(|s| json!(s))),
    ];
    for (field, value) in fields {
        if let Some(value) = value {
            input[field] = value;
        }
    }
    input
}

pub async fn run(api: &Api, out: &Output, args: Args) -> Result<Outcome> {
    let mut request = json!({ "kind": "image", "input": input(&args) });
    if let Some(p) = &args.priority {
        request["priority"] = json!(p);
    }
    let job = api.post("/v1/jobs", &request).await?;
    let id = job["id"].as_str().context("a job id")?.to_string();
    // A bar of the denoising steps while it runs.
    let job = wait_one(api, out, &id, "image").await?;
    failure_note(out, &job);
    if job["state"] != "succeeded" {
        return Ok(outcome(&job));
    }
    let output = output_of(api, &job).await?;
    std::fs::create_dir_all(&args.output_dir).with_context(|| format!("making {}", args.output_dir.display()))?;
    let mut written = Vec::new();
    for (i, image) in output["images"].as_array().map_or(&[][..], Vec::as_slice).iter().enumerate() {
        // The inline output carries each image's URL; the stored one names its rendering.
        let url = image["url"].as_str().or_else(|| job["output"]["formats"][format!("{i}.png")]["url"].as_str());
        let Some(url) = url else { bail!("image {i} of job {id} has no download URL") };
        let path = args.output_dir.join(format!("{id}-{i}.png"));
        std::fs::write(&path, api.download(url).await?).with_context(|| format!("writing {}", path.display()))?;
        written.push(json!({ "path": path.display().to_string(), "width": image["width"], "height": image["height"], "seed": image["seed"] }));
    }
    let paths: Vec<String> = written.iter().filter_map(|w| w["path"].as_str().map(str::to_string)).collect();
    out.text_or(
        &paths.join("\n"),
        &json!({ "id": id, "model": output["model"], "steps": output["steps"], "guidance": output["guidance"], "scheduler": output["scheduler"], "images": written }),
    );
    Ok(Outcome::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn args(argv: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("tern-image").chain(argv.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn options_become_the_jobs_input() {
        let a = args(&["a lighthouse", "--size", "768x512", "--steps", "20", "--guidance", "6.5", "--seed", "7", "-n", "2", "--scheduler", "euler_a", "--negative", "fog", "-o", "out"]).unwrap();
        assert_eq!(
            input(&a),
            json!({ "prompt": "a lighthouse", "n": 2, "width": 768, "height": 512, "steps": 20, "guidance": 6.5, "seed": 7, "scheduler": "euler_a", "negative_prompt": "fog" })
        );
        assert_eq!(a.output_dir, PathBuf::from("out"));
        let a = args(&["a lighthouse", "--width", "640"]).unwrap();
        assert_eq!(input(&a), json!({ "prompt": "a lighthouse", "n": 1, "width": 640 }));
    }

    #[test]
    fn sizes_are_width_by_height_and_not_given_twice() {
        assert_eq!(parse_size("512x256"), Ok((512, 256)));
        for bad in ["512", "512x", "ax512", "512*512"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(args(&["p", "--size", "512x512", "--width", "512"]).is_err());
        assert!(args(&["p", "--scheduler", "lms"]).is_err());
    }
}
