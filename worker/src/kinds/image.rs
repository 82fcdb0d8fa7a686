//! `image`: images from a text prompt with a Stable Diffusion pipeline. See
//! `schemas/image.input.json`.
//!
//! Runs on the model thread, batched with other image jobs; the denoising steps done are
//! published as the job's progress (at most every 200 ms, and always the last step). A cancel
//! or a release stops the job at the next step. Each image is encoded as a PNG off the async
//! runtime and stored beside the JSON output as the rendering `{i}.png` (key
//! [`super::output_key`]), which the output names by key.

use super::{engine_failure, permanent, Context, Execution, ExtraOutput, PROGRESS_EVERY};
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;
use crate::engine::{Engine, EngineError, ProgressUntilReply, Served};
use tern_jobs::{Failure, Job, JobKind};
use tern_models::diffusion::family::ImageWork;
use tern_models::diffusion::{GeneratedImage, ImageOutput, ImageRequest};

/// Generates `request.n` images (default 1) of one prompt on the engine's Stable Diffusion
/// pipeline; (steps done, steps in all) arrives on `progress` after each denoising step of the
/// batch it runs in; raising `stop` ends it at the next step (the reply is then an error, code
/// `canceled`). Unset fields of `request` take the pipeline's defaults (the model's native
/// size, 50 steps, guidance 7.5, a random seed), which the output states.
pub async fn generate_images(
    engine: &Engine,
    request: ImageRequest,
    progress: tokio::sync::mpsc::UnboundedSender<(usize, usize)>,
    stop: Arc<AtomicBool>,
) -> Result<Served<ImageOutput>, EngineError> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let progress = ProgressUntilReply::new(progress);
    let report = progress.report_until(stop);
    let on_step = Box::new(move |done: usize, total: usize| report((done, total)));
    engine.run(JobKind::Image, Box::new(ImageWork { request, on_step, reply: progress.reply(reply) }), answer).await
}

/// Whether step `done` of `total` is published, the last one having been at `last`: at most
/// every [`PROGRESS_EVERY`], but the last step always, so the progress ends at total/total.
fn progress_due(last: Instant, done: usize, total: usize) -> bool {
    done >= total || last.elapsed() >= PROGRESS_EVERY
}

/// `image` as 8-bit RGB PNG.
fn png(image: &GeneratedImage) -> Result<Vec<u8>, String> {
    if image.rgb.len() != image.width * image.height * 3 {
        return Err(format!("an image of {}x{} came with {} bytes of RGB", image.width, image.height, image.rgb.len()));
    }
    let mut out = Vec::with_capacity(image.rgb.len() / 2);
    let mut encoder = png::Encoder::new(&mut out, image.width as u32, image.height as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(&image.rgb).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())?;
    Ok(out)
}

pub async fn run(job: &Job, ctx: &Context<'_>) -> Execution {
    let Some(engine) = ctx.engine else {
        return permanent("model_unavailable", "this worker has no model engine");
    };
    let request: ImageRequest = match serde_json::from_value(job.input.clone()) {
        Ok(r) => r,
        Err(e) => return permanent("invalid_input", format!("input: {e}")),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (progress_tx, progress_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, usize)>();
    let report = super::record_progress(job, ctx, progress_rx, |last, &(done, total)| progress_due(last, done, total), |(done, total)| {
        ctx.queue.set_progress(job.kind, job.id, done as u64, total as u64)
    });
    let work = async { tokio::join!(generate_images(engine, request, progress_tx, stop.clone()), report) };
    let Some((generated, ())) = super::until_stopped(ctx.stop, &stop, work).await else {
        return Execution::Stopped;
    };
    let (generated, model) = match generated {
        Ok(served) => (served.value, served.model),
        Err(e) => return engine_failure(&e),
    };
    metrics::counter!("tern_images_total").increment(generated.images.len() as u64);
    // A 2048 x 2048 image takes tens of milliseconds to compress: not on the runtime's threads.
    let images = generated.images;
    let encoded = tokio::task::spawn_blocking(move || {
        let pngs = images.iter().map(png).collect::<Result<Vec<_>, _>>();
        (images, pngs)
    })
    .await;
    let (images, pngs) = match encoded {
        Ok((images, Ok(pngs))) => (images, pngs),
        Ok((_, Err(e))) => return Execution::Failed { failure: Failure::new("inference_failed", e), permanent: false },
        Err(e) => return Execution::Failed { failure: Failure::new("inference_failed", e.to_string()), permanent: false },
    };
    let mut described = Vec::with_capacity(images.len());
    let mut extras = Vec::with_capacity(images.len());
    for (i, (image, png)) in images.iter().zip(pngs).enumerate() {
        let format = format!("{i}.png");
        described.push(json!({
            "key": super::output_key(job, &format),
            "width": image.width,
            "height": image.height,
            "seed": image.seed,
        }));
        extras.push(ExtraOutput { format, body: Bytes::from(png), content_type: "image/png" });
    }
    let body: Value = json!({
        "model": model,
        "images": described,
        "scheduler": generated.scheduler,
        "steps": generated.steps,
        "guidance": generated.guidance,
        "memory": { "state": generated.memory_state, "tiled_decode": generated.tiled_decode },
        "timings": { "encode_ms": generated.encode_ms, "denoise_ms": generated.denoise_ms, "decode_ms": generated.decode_ms },
    });
    Execution::Output {
        body: serde_json::to_vec(&body).expect("JSON values serialise").into(),
        content_type: "application/json",
        extension: "json",
        extras,
        inline: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_throttled_but_the_last_step_is_always_published() {
        let just_now = Instant::now();
        assert!(!progress_due(just_now, 3, 20));
        assert!(progress_due(just_now, 20, 20), "the last step is never skipped");
        assert!(progress_due(just_now - PROGRESS_EVERY, 3, 20));
    }

    #[test]
    fn images_become_pngs_of_their_size_and_pixels() {
        let (width, height) = (24, 16);
        let rgb: Vec<u8> = (0..width * height * 3).map(|i| (i * 37 % 251) as u8).collect();
        let bytes = png(&GeneratedImage { width, height, seed: 7, rgb: rgb.clone() }).unwrap();
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        assert_eq!((info.width, info.height, info.color_type, info.bit_depth), (24, 16, png::ColorType::Rgb, png::BitDepth::Eight));
        assert_eq!(&pixels[..info.buffer_size()], &rgb[..]);

        let short = png(&GeneratedImage { width, height, seed: 7, rgb: vec![0; 10] }).unwrap_err();
        assert!(short.contains("24x16"), "{short}");
    }
}
