//! Picking each request's next token from a step's logits, where the logits are: on a GPU, one
//! kernel for every row of the step ([`pick_tokens`] on a CUDA tensor), so only the chosen
//! tokens come back to the host rather than `rows x vocabulary` floats; on the CPU the same
//! rules in Rust, which the tests hold the GPU's to.
//!
//! The rules, per row:
//! - temperature 0: the largest logit (the first of equal ones);
//! - else the probabilities `softmax(logits / temperature)`, cut to the `top_k` likeliest
//!   tokens (ties at the k-th value are kept too), then to the fewest likeliest whose
//!   probabilities reach `top_p` of what is left (again with ties);
//! - the token is drawn by inverting the kept tokens' cumulative mass, in vocabulary order, at
//!   `u` times their total, where `u` in [0, 1) is the request's next draw from a generator
//!   seeded with its `seed` ([`Sampler`]). One draw a step, on the host, so a seed gives the
//!   same draws on every device, and the same text wherever the logits agree.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::GenerateOptions;

/// Threads a row gets on a GPU (one block), and the number of chunks the draw's running sum
/// is cut into on both devices, so their sums are added in the same order.
const THREADS: usize = 1024;

/// One request's sampling settings and its random draws.
#[derive(Debug, Clone)]
pub(crate) struct Sampler {
    temperature: f32,
    top_p: f32,
    top_k: u32,
    /// SplitMix64: a small, well-mixed generator whose sequence is fixed by the seed alone.
    state: u64,
}

impl Sampler {
    pub(crate) fn new(opts: &GenerateOptions) -> Sampler {
        let greedy = opts.temperature <= 0.0;
        Sampler {
            temperature: if greedy { 0.0 } else { opts.temperature as f32 },
            top_p: opts.top_p.map_or(1.0, |p| p as f32),
            top_k: opts.top_k.map_or(0, |k| u32::try_from(k).unwrap_or(u32::MAX)),
            state: opts.seed,
        }
    }

    pub(crate) fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// This step's settings for [`pick_tokens`], drawing the step's number where it samples.
    pub(crate) fn next_row(&mut self) -> RowSettings {
        let u = if self.is_greedy() { 0.0 } else { self.draw() };
        RowSettings { temperature: self.temperature, top_p: self.top_p, top_k: self.top_k, u }
    }

    /// A uniform number in [0, 1) with 24 random bits (every f32 of that form is exact).
    fn draw(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

/// How one row of a step picks its token ([`Sampler::next_row`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSettings {
    /// 0: argmax.
    pub temperature: f32,
    /// 1: no nucleus cut.
    pub top_p: f32,
    /// 0: no top-k cut.
    pub top_k: u32,
    /// The draw, in [0, 1).
    pub u: f32,
}

/// The next token of each row of `logits` `(rows, vocabulary)`, F32 (or another float type,
/// converted), on the logits' device; `rows` gives each row's settings.
pub fn pick_tokens(logits: &Tensor, rows: &[RowSettings]) -> candle_core::Result<Vec<u32>> {
    let (n, _) = logits.dims2()?;
    if n != rows.len() {
        candle_core::bail!("pick_tokens: {n} rows of logits for {} settings", rows.len());
    }
    let settings: Vec<f32> = rows.iter().flat_map(|r| [r.temperature, r.top_p, r.top_k as f32, r.u]).collect();
    let settings = Tensor::from_vec(settings, (n, 4), logits.device())?;
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    logits.apply_op2_no_bwd(&settings, &PickTokens)?.to_vec1()
}

/// Orders floats as unsigned integers (NaN aside), as the kernel does.
fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// One row by the rules of the module's doc, in the kernel's order of work.
fn pick_row(row: &[f32], s: RowSettings) -> u32 {
    let vocab = row.len();
    let (mut best, mut best_i) = (f32::NEG_INFINITY, 0usize);
    for (i, &x) in row.iter().enumerate() {
        if x > best {
            best = x;
            best_i = i;
        }
    }
    if !(s.temperature > 0.0) {
        return best_i as u32;
    }
    let inv_t = 1.0 / s.temperature;
    let keys: Vec<u32> = row.iter().map(|&x| order_key(x)).collect();
    let weights: Vec<f32> = row.iter().map(|&x| ((x - best) * inv_t).exp()).collect();
    let mut floor_key = 0u32;
    if s.top_k > 0 && (s.top_k as usize) < vocab {
        // The k-th largest key, which the kernel's bit-by-bit search finds too.
        let mut sorted = keys.clone();
        let k = s.top_k as usize;
        let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        floor_key = *kth;
    }
    if s.top_p < 1.0 {
        let mass = |at_least: u32| -> f32 { keys.iter().zip(&weights).filter(|(&k, _)| k >= at_least).map(|(_, &w)| w).sum() };
        let target = s.top_p * mass(floor_key);
        let mut found = 0u32;
        for b in (0..32).rev() {
            let cand = found | (1 << b);
            if mass(cand.max(floor_key)) >= target {
                found = cand;
            }
        }
        floor_key = floor_key.max(found);
    }
    let chunk = vocab.div_ceil(THREADS);
    let span = |c: usize| (c * chunk).min(vocab)..((c + 1) * chunk).min(vocab);
    let kept = |i: &usize| keys[*i] >= floor_key;
    let chunk_sums: Vec<f32> = (0..THREADS).map(|c| span(c).filter(kept).map(|i| weights[i]).sum()).collect();
    let total: f32 = chunk_sums.iter().sum();
    let target = s.u * total;
    let mut acc = 0.0f32;
    // Where rounding leaves the draw at the total, the row's likeliest token.
    let mut pick = best_i;
    for (c, &sum) in chunk_sums.iter().enumerate() {
        if acc + sum > target {
            for i in span(c).filter(kept) {
                pick = i;
                acc += weights[i];
                // Rounding may leave the draw past the chunk's end: its last kept token.
                if acc > target {
                    break;
                }
            }
            break;
        }
        acc += sum;
    }
    pick as u32
}

/// `(logits (rows, vocabulary) F32, settings (rows, 4) F32) -> tokens (rows,) U32`.
struct PickTokens;

impl CustomOp2 for PickTokens {
    fn name(&self) -> &'static str {
        "tern-pick-tokens"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (Some((a1, b1)), Some((a2, b2))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("pick_tokens: contiguous inputs only");
        };
        let (logits, settings) = (&s1.as_slice::<f32>()?[a1..b1], &s2.as_slice::<f32>()?[a2..b2]);
        let (rows, vocab) = l1.shape().dims2()?;
        let settings: Vec<RowSettings> = settings
            .chunks_exact(4)
            .map(|s| RowSettings { temperature: s[0], top_p: s[1], top_k: s[2] as u32, u: s[3] })
            .collect();
        let pick = |(row, s): (&[f32], &RowSettings)| pick_row(row, *s);
        // Rows that sample read the whole vocabulary several times: side by side from a few.
        let tokens: Vec<u32> = if rows >= 4 {
            logits.par_chunks_exact(vocab).zip(settings.par_iter()).map(pick).collect()
        } else {
            logits.chunks_exact(vocab).zip(settings.iter()).map(pick).collect()
        };
        Ok((CpuStorage::U32(tokens), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;
        use std::sync::OnceLock;

        static PTX: OnceLock<Result<String, String>> = OnceLock::new();
        let ptx = super::nvrtc_once(&PTX, include_str!("sampling.cu"), "the sampling kernel")?;
        let (Some((a1, b1)), Some((a2, b2))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("pick_tokens: contiguous inputs only");
        };
        let (rows, vocab) = l1.shape().dims2()?;
        let dev = s1.device();
        let logits = s1.as_cuda_slice::<f32>()?.slice(a1..b1);
        let settings = s2.as_cuda_slice::<f32>()?.slice(a2..b2);
        let func = dev.get_or_load_custom_func("tern_pick_tokens", "tern_sampling", ptx)?;
        // SAFETY: every row's token is written by the kernel.
        let out = unsafe { dev.alloc::<u32>(rows)? };
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
        let vocab = vocab as i32;
        let mut builder = func.builder();
        builder.arg(&logits).arg(&settings).arg(&out).arg(&vocab);
        // SAFETY: the kernel reads rows x vocab logits and rows x 4 settings, writes rows tokens.
        unsafe { builder.launch(cfg) }.w()?;
        Ok((candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(rows)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn settings(temperature: f32, top_p: f32, top_k: u32, u: f32) -> RowSettings {
        RowSettings { temperature, top_p, top_k, u }
    }

    #[test]
    fn greedy_takes_the_first_largest() {
        assert_eq!(pick_row(&[0.5, 2.0, 2.0, -1.0], settings(0.0, 1.0, 0, 0.9)), 1);
    }

    #[test]
    fn draws_invert_the_cumulative_mass() {
        // Equal logits: each of four tokens holds a quarter of the mass.
        let row = [1.0f32; 4];
        for (u, want) in [(0.0, 0), (0.24, 0), (0.26, 1), (0.6, 2), (0.99, 3)] {
            assert_eq!(pick_row(&row, settings(1.0, 1.0, 0, u)), want, "u = {u}");
        }
    }

    #[test]
    fn top_k_and_top_p_keep_the_likeliest() {
        // Probabilities about 0.64, 0.24, 0.09, 0.03 (logits 3, 2, 1, 0 at temperature 1).
        let row = [0.0f32, 3.0, 1.0, 2.0];
        // Top-2 keeps tokens 1 and 3: a draw near 1 lands on 3, never on 2 or 0.
        assert_eq!(pick_row(&row, settings(1.0, 1.0, 2, 0.999)), 3);
        // Top-1 is greedy whatever the draw.
        assert_eq!(pick_row(&row, settings(1.0, 1.0, 1, 0.999)), 1);
        // top_p 0.5 keeps token 1 alone (0.64 >= 0.5); 0.8 keeps 1 and 3 (0.88).
        assert_eq!(pick_row(&row, settings(1.0, 0.5, 0, 0.999)), 1);
        assert_eq!(pick_row(&row, settings(1.0, 0.8, 0, 0.999)), 3);
        assert_eq!(pick_row(&row, settings(1.0, 0.8, 0, 0.1)), 1);
    }

    #[test]
    fn draws_follow_the_distribution() {
        // 20,000 draws from a 5-token distribution land within 1.5% of each probability.
        let row = [0.1f32, 1.3, -0.7, 0.9, 0.0];
        let z: f32 = row.iter().map(|x| x.exp()).sum();
        let mut sampler = Sampler::new(&GenerateOptions { temperature: 1.0, seed: 3, ..Default::default() });
        let mut counts = [0usize; 5];
        for _ in 0..20_000 {
            counts[pick_row(&row, sampler.next_row()) as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let want = row[i].exp() / z;
            assert!((c as f32 / 20_000.0 - want).abs() < 0.015, "token {i}: {c} draws, p {want}");
        }
    }

    #[test]
    fn the_op_picks_each_row_as_alone() {
        // A vocabulary the size of SmolLM2's, rows with every kind of setting, through the
        // op (rows side by side) and one by one.
        let vocab = 49_152;
        let logits: Vec<f32> = (0..6 * vocab).map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 12.0).collect();
        let rows = [
            settings(0.0, 1.0, 0, 0.0),
            settings(0.7, 1.0, 0, 0.3),
            settings(0.7, 0.9, 0, 0.7),
            settings(1.0, 1.0, 40, 0.5),
            settings(0.5, 0.95, 50, 0.99),
            settings(1.3, 1.0, 0, 0.0),
        ];
        let t = Tensor::from_vec(logits.clone(), (6, vocab), &Device::Cpu).unwrap();
        let together = pick_tokens(&t, &rows).unwrap();
        let alone: Vec<u32> = logits.chunks(vocab).zip(rows).map(|(row, s)| pick_row(row, s)).collect();
        assert_eq!(together, alone);
    }

    #[test]
    fn a_seed_fixes_the_draws() {
        let opts = GenerateOptions { temperature: 0.8, seed: 42, ..Default::default() };
        let (mut a, mut b) = (Sampler::new(&opts), Sampler::new(&opts));
        let draws: Vec<f32> = (0..8).map(|_| a.next_row().u).collect();
        assert_eq!(draws, (0..8).map(|_| b.next_row().u).collect::<Vec<_>>());
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        let mut other = Sampler::new(&GenerateOptions { seed: 43, ..opts });
        assert_ne!(draws, (0..8).map(|_| other.next_row().u).collect::<Vec<_>>());
    }
}
