//! The engine through its requests: swaps under load, memory splits, image memory states.
use super::health::tests::models_dir;
use super::*;
use crate::kinds::embed::embed;
use crate::kinds::image::generate_images;
use crate::kinds::transcribe::transcribe;
use std::sync::atomic::AtomicUsize;
use tern_models::diffusion::ImageRequest;
use tern_models::whisper::TranscribeOptions;

fn whisper() -> Family {
    Family::named("whisper").unwrap()
}

fn embedder() -> Family {
    Family::named("embedder").unwrap()
}

/// An engine serving the diffusion family's tiny fixture (random weights) as its image model,
/// `probe` telling its memory.
fn sd_tiny_engine(probe: MemoryProbe) -> Engine {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/diffusion");
    let names = ModelNames::defaults().with("diffusion", "sd-tiny");
    Engine::start(fixtures, candle_core::Device::Cpu, Default::default(), names, 4 << 30, BatchLimits::defaults(1), probe)
}

/// Six clips always in flight (each answered one is sent again) keep a continuous
/// transcription batch running for as long as the loop goes on. A model swap must still
/// apply once its batch drains, not wait for the load to stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_applies_while_a_closed_loop_keeps_a_transcription_batch_running() {
    let dir = models_dir();
    let names = ModelNames::defaults();
    let limits = BatchLimits::defaults(1).with("whisper", 4);
    let engine = Arc::new(Engine::start(dir.clone(), candle_core::Device::Cpu, Default::default(), names, 4 << 30, limits, MemoryProbe::Host));
    let clip = std::fs::read(dir.join("testdata/librivox/sense_and_sensibility_01_austen_64kb-0880.wav")).expect("test speech: run scripts/models.sh");
    let pcm = tern_models::audio::decode_mono_16k(&clip).unwrap();
    let source = engine.source().clone();
    let folder = dir.join("whisper-tiny.en");
    let loaded = tokio::task::spawn_blocking(move || source.load(whisper(), "tiny-v2", &folder)).await.unwrap().unwrap();

    let (running, served) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicUsize::new(0)));
    let models = Arc::new(Mutex::new(Vec::new()));
    let loops: Vec<_> = (0..6)
        .map(|_| {
            let (engine, pcm, running, served, models) = (engine.clone(), pcm.clone(), running.clone(), served.clone(), models.clone());
            tokio::spawn(async move {
                while running.load(Ordering::Relaxed) {
                    let (progress, _) = tokio_mpsc::unbounded_channel();
                    let out = transcribe(&engine, pcm.clone(), TranscribeOptions::default(), progress, Arc::default()).await;
                    let text = out.as_ref().map(|o| o.value.text.to_lowercase()).unwrap_or_default();
                    if !text.contains("young man") {
                        running.store(false, Ordering::Relaxed);
                        panic!("{out:?}");
                    }
                    models.lock().unwrap().push(out.unwrap().model);
                    served.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Until `n` clips are answered; a loop that fails ends the wait (its panic shows below).
    let wait_served = |n: usize| {
        let (served, loops_alive) = (served.clone(), running.clone());
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while served.load(Ordering::Relaxed) < n && loops_alive.load(Ordering::Relaxed) {
                assert!(Instant::now() < deadline, "{n} clips not answered within 60 s");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_served(12).await;
    let installed = tokio::time::timeout(Duration::from_secs(30), engine.install(whisper(), "tiny-v2".into(), loaded)).await;
    let at_install = served.load(Ordering::Relaxed);
    wait_served(at_install + 6).await;
    running.store(false, Ordering::Relaxed);
    for l in loops {
        l.await.unwrap();
    }
    assert_eq!(installed.expect("the swap waited for the load to stop").unwrap(), "whisper-tiny.en");
    let models = models.lock().unwrap();
    assert_eq!(models.last().map(String::as_str), Some("tiny-v2"), "clips after the swap run the new model");
    assert!(models[..12].iter().all(|m| m == "whisper-tiny.en"));
}

/// An image request on the diffusion family's tiny fixture (random weights) reports each
/// denoising step, ending at steps/steps; with its stop raised it ends after its first step,
/// `canceled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_request_reports_each_step_and_stops_when_asked() {
    let engine = sd_tiny_engine(MemoryProbe::Host);
    let request = ImageRequest {
        prompt: "a lighthouse at dusk".into(),
        width: Some(64),
        height: Some(64),
        steps: Some(3),
        seed: Some(5),
        n: Some(2),
        scheduler: Some(tern_models::diffusion::SchedulerKind::Euler),
        ..Default::default()
    };
    // A request of several images may hear a step once per image.
    let steps_seen = |mut rx: tokio_mpsc::UnboundedReceiver<(usize, usize)>| {
        let mut seen = Vec::new();
        while let Ok(step) = rx.try_recv() {
            seen.push(step);
        }
        seen.dedup();
        seen
    };

    let (progress, rx) = tokio_mpsc::unbounded_channel();
    let served = generate_images(&engine, request.clone(), progress, Arc::default()).await.unwrap();
    assert_eq!(served.model, "sd-tiny");
    let out = served.value;
    assert_eq!(out.steps, 3);
    assert_eq!(out.images.iter().map(|i| (i.width, i.height, i.seed, i.rgb.len())).collect::<Vec<_>>(), [(64, 64, 5, 64 * 64 * 3), (64, 64, 6, 64 * 64 * 3)]);
    assert_eq!(steps_seen(rx), [(1, 3), (2, 3), (3, 3)]);

    let (progress, rx) = tokio_mpsc::unbounded_channel();
    let stopped = generate_images(&engine, request, progress, Arc::new(AtomicBool::new(true))).await.unwrap_err();
    assert_eq!(stopped.code(), "canceled", "{stopped}");
    assert_eq!(steps_seen(rx), [(1, 3)]);
}

/// With the memory free too small for a whole VAE decode (a test's figure: the CPU's probe
/// cannot tell), images decode in tiles, and with room enough whole; both finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_decode_in_tiles_when_a_whole_decode_would_not_fit() {
    // 1 KiB a UNet row, so the rows always fit; a 128x128 whole decode of sd-tiny's VAE
    // needs about 5 MiB.
    let (probe, figures) = MemoryProbe::fixed(1 << 20, 1 << 10);
    let engine = sd_tiny_engine(probe);
    let request = ImageRequest {
        prompt: "a lighthouse at dusk".into(),
        width: Some(128),
        height: Some(128),
        steps: Some(2),
        seed: Some(5),
        scheduler: Some(tern_models::diffusion::SchedulerKind::Euler),
        ..Default::default()
    };
    let (progress, _rx) = tokio_mpsc::unbounded_channel();
    let tight = generate_images(&engine, request.clone(), progress, Arc::default()).await.unwrap().value;
    assert!(tight.tiled_decode, "1 MiB free: tiles");
    figures.free_bytes.store(1 << 30, Ordering::Relaxed);
    let (progress, _rx) = tokio_mpsc::unbounded_channel();
    let roomy = generate_images(&engine, request, progress, Arc::default()).await.unwrap().value;
    assert!(!roomy.tiled_decode, "1 GiB free: whole");
    assert_eq!(tight.images[0].rgb.len(), roomy.images[0].rgb.len());
    assert_ne!(tight.images[0].rgb, roomy.images[0].rgb, "tiles blend at their seams");
}

/// Memory states: with the memory free too small for a batch's UNet rows (a test's figure:
/// the CPU's probe cannot tell), the text encoders and the VAE wait in host memory and move
/// to the device for their step, their bytes making the room the batch needs; with room
/// for both they are resident again. The images are the same in both states.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_encoders_and_vae_wait_in_host_memory_when_the_unet_rows_need_their_room() {
    use tern_models::diffusion::MemoryState;
    // A UNet row takes 512 KiB (the warmup measures what the probe says); sd-tiny's text
    // encoder and VAE decoder weigh 0.93 MiB in F32, a whole 64x64 decode takes 1.3 MiB.
    // 64 MiB free hold everything.
    let (probe, figures) = MemoryProbe::fixed(64 << 20, 512 << 10);
    let engine = sd_tiny_engine(probe);
    let request = ImageRequest { prompt: "a lighthouse at dusk".into(), steps: Some(2), seed: Some(3), n: Some(2), scheduler: Some(tern_models::diffusion::SchedulerKind::Euler), ..Default::default() };
    let run = |request: ImageRequest| {
        let (progress, _rx) = tokio_mpsc::unbounded_channel();
        generate_images(&engine, request, progress, Arc::default())
    };
    let roomy = run(request.clone()).await.unwrap().value;
    assert_eq!(roomy.memory_state, MemoryState::Resident);
    // Two guided images are four rows, 2 MiB: 1.5 MiB free do not hold them, but do with
    // the encoder's and the VAE's bytes moved out (and a whole decode still fits).
    figures.free_bytes.store(3 << 19, Ordering::Relaxed);
    let tight = run(request.clone()).await.unwrap().value;
    assert_eq!(tight.memory_state, MemoryState::Offloaded, "1.5 MiB free: offloaded");
    assert!(!tight.tiled_decode && !roomy.tiled_decode);
    assert_eq!(tight.images.len(), 2);
    for (a, b) in tight.images.iter().zip(&roomy.images) {
        assert_eq!(a.rgb, b.rgb, "the same images in either state");
    }
    // Still short of the batch and the components together: they stay in host memory.
    let still = run(request.clone()).await.unwrap().value;
    assert_eq!(still.memory_state, MemoryState::Offloaded);
    figures.free_bytes.store(64 << 20, Ordering::Relaxed);
    let back = run(request).await.unwrap().value;
    assert_eq!(back.memory_state, MemoryState::Resident, "room again: resident");
    assert_eq!(back.images[0].rgb, roomy.images[0].rgb);
}

/// A batch that runs out of memory (here the probe's free memory cannot hold its windows,
/// as a GPU's allocator would refuse them) is run again at half size until it fits: every
/// recording is transcribed as it is alone, none fails, and the budget shrinks to what ran.
/// The same for an embedding pass, whose tokens per forward pass halve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_runs_out_of_memory_is_split_and_no_job_fails() {
    let dir = models_dir();
    let names = ModelNames::defaults();
    let limits = BatchLimits::defaults(1);
    // The warmup measures 100 MiB per window; 4 GiB are free until the test says otherwise.
    let (probe, figures) = MemoryProbe::fixed(4 << 30, 100 << 20);
    let engine = Engine::start(dir.clone(), candle_core::Device::Cpu, Default::default(), names.clone(), 8 << 30, limits.clone(), probe);
    let clips: Vec<Vec<f32>> = ["sense_and_sensibility_01_austen_64kb-0880.wav", "sense_and_sensibility_01_austen_64kb-0870.wav"]
        .iter()
        .map(|f| tern_models::audio::decode_mono_16k(&std::fs::read(dir.join("testdata/librivox").join(f)).expect("test speech: run scripts/models.sh")).unwrap())
        .collect();
    let transcribe = |pcm: Vec<f32>| {
        let (progress, _) = tokio_mpsc::unbounded_channel();
        transcribe(&engine, pcm, TranscribeOptions::default(), progress, Arc::default())
    };
    let alone: Vec<String> = futures::future::join_all(clips.iter().map(|c| transcribe(c.clone()))).await.into_iter().map(|t| t.unwrap().value.text).collect();
    // The budget is set once the batch ends, which can be just after its last reply.
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine.batch_budget(whisper()) != 16 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(engine.batch_budget(whisper()), 16, "4 GiB free hold 40 windows of 100 MiB: the CPU's ceiling");

    // 250 MiB free: 16 windows do not fit, nor 8 or 4; 2 do.
    figures.free_bytes.store(250 << 20, Ordering::Relaxed);
    let batch: Vec<Vec<f32>> = (0..6).map(|i| clips[i % 2].clone()).collect();
    let texts = futures::future::join_all(batch.into_iter().map(transcribe)).await;
    for (i, t) in texts.into_iter().enumerate() {
        assert_eq!(t.expect("no recording fails for want of memory").value.text, alone[i % 2]);
    }
    assert_eq!(engine.stats.oom_splits.load(Ordering::Relaxed), 3, "16 -> 8 -> 4 -> 2 windows");
    assert_eq!(engine.batch_budget(whisper()), 2, "later pulls take what fitted");
    assert_eq!(engine.batching().budgets["transcribe_windows"], 2);

    // Embeddings: 1 MiB per token; 3,000 MiB free hold 2,048 of the CPU's 8,192 tokens per pass.
    let (probe, figures) = MemoryProbe::fixed(4 << 30, 1 << 20);
    let engine = Engine::start(dir, candle_core::Device::Cpu, Default::default(), names, 8 << 30, limits, probe);
    let texts: Vec<String> = (0..300).map(|i| format!("sentence number {i} about the weather in a town by the sea")).collect();
    let before = embed(&engine, texts.clone()).await.unwrap().value;
    figures.free_bytes.store(3000 << 20, Ordering::Relaxed);
    let after = embed(&engine, texts).await.expect("no embedding fails for want of memory").value;
    assert_eq!(engine.stats.oom_splits.load(Ordering::Relaxed), 2, "8,192 -> 4,096 -> 2,048 tokens per pass");
    assert_eq!(engine.batch_budget(embedder()), 2048);
    for (a, b) in before.iter().zip(&after) {
        let cosine: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        assert!(cosine > 0.9999, "smaller passes give the same vectors: {cosine}");
    }
}
