//! Whisper audio encoder: the maths of candle-transformers' `AudioEncoder` (OpenAI's
//! `model.py`), with its hot spots done differently on the CPU.
//!
//! Profiled on candle's encoder, GELU (a single-threaded `tanhf` map) took 14% of the time and
//! the attention softmax's `expf` 11%; here GELU runs on every core with a polynomial `exp`
//! that the compiler vectorises ([`tern_kernels::cpu_ops`]), and attention is one fused pass per
//! (window, head) ([`self_attention`]). The attention scale is folded into the query weights at
//! load instead of scaling queries and keys on every pass. On CPUs with AVX-512 BF16, the
//! blocks' linear layers can run their products in BF16 ([`tern_kernels::bf16_gemm`]), about twice
//! as fast as gemm's F32 there. Other devices use candle's ops.

use candle_core::{Module, Result, Tensor};
use candle_nn::{layer_norm, Conv1d, Conv1dConfig, LayerNorm, VarBuilder};
use candle_transformers::models::whisper::Config;
use rayon::prelude::*;

use super::LAYER_NORM_EPS;
use tern_kernels::bf16_gemm::{self, Bf16Linear};
use tern_kernels::cpu_ops::{gelu, softmax_last_dim, Gelu};
use crate::linear::{linear, linear_no_bias, Linear, TransposedF32};
use tern_kernels::cpu_kernels;
use tern_kernels::cpu_ops::{rows_per_task, OutPtr};
use tern_kernels::f32_linear::{attend_spans_f32, Residual};
use tern_kernels::self_attention::{attend_spans_bf16, end_to_end, padded, self_attention, self_attention_spans};

fn conv1d(c_in: usize, c_out: usize, stride: usize, vb: VarBuilder) -> Result<Conv1d> {
    let cfg = Conv1dConfig { padding: 1, stride, groups: 1, dilation: 1, cudnn_fwd_algo: None };
    Ok(Conv1d::new(vb.get((c_out, c_in, 3), "weight")?, Some(vb.get(c_out, "bias")?), cfg))
}

/// One of Whisper's convolutions (kernel 3, padding 1) as a product, channels last: output
/// position `t` is the product of input positions `stride t - 1 ..= stride t + 1` side by side
/// (zeros past the ends) with the weights reordered to match. candle's F32 convolution (a
/// scalar gather into columns) was a sixth of the encoder once its linear layers took BF16
/// products.
struct RowConv {
    product: ConvProduct,
    c_in: usize,
    stride: usize,
}

enum ConvProduct {
    Bf16(Bf16Linear),
    F32(TransposedF32),
}

impl RowConv {
    /// In BF16 products where `bf16` and the CPU has AVX-512 BF16 and `c_in` is even (whole
    /// BF16 pairs per position), else F32 ones on the CPU; `None` for another device or dtype.
    fn new(conv: &Conv1d, bf16: bool) -> Result<Option<RowConv>> {
        let (c_out, c_in, k) = conv.weight().dims3()?;
        if k != 3 || conv.config().padding != 1 || conv.config().dilation != 1 || conv.config().groups != 1 {
            return Ok(None);
        }
        let weight = conv.weight().permute((0, 2, 1))?.contiguous()?.reshape((c_out, 3 * c_in))?;
        let stride = conv.config().stride;
        if bf16 && c_in % 2 == 0 {
            if let Some(product) = Bf16Linear::pack(&weight, conv.bias())? {
                return Ok(Some(RowConv { product: ConvProduct::Bf16(product), c_in, stride }));
            }
        }
        Ok(TransposedF32::new(&weight, conv.bias())?.map(|t| RowConv { product: ConvProduct::F32(t), c_in, stride }))
    }

    fn d_out(&self) -> usize {
        match &self.product {
            ConvProduct::Bf16(p) => p.d_out(),
            ConvProduct::F32(t) => t.d_out,
        }
    }

    /// `x` `(batch, len, c_in)` F32 on the CPU; returns `(batch, (len - 1) / stride + 1, c_out)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, len, c) = x.dims3()?;
        let out = self.forward_rows(&x.reshape((b * len, c))?, &vec![len; b])?;
        out.reshape((b, (len - 1) / self.stride + 1, self.d_out()))
    }

    /// Sequences laid end to end: `x` `(rows, c_in)` holds sequence `i`'s `lens[i]` positions
    /// after those of the sequences before it, and each sequence is convolved alone (zeros past
    /// its own ends). Returns `(rows out, c_out)`, sequence `i` taking `(lens[i] - 1) / stride +
    /// 1` rows.
    fn forward_rows(&self, x: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let (rows, c) = x.dims2()?;
        if c != self.c_in || lens.contains(&0) || lens.iter().sum::<usize>() != rows {
            candle_core::bail!("convolution over {c} channels of {lens:?} positions in {rows} rows; it takes {}", self.c_in);
        }
        let x = x.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("row convolutions run on the CPU");
        };
        let values = tern_kernels::cpu_ops::contiguous_f32(cpu, layout)?;
        // Each output row's sequence: its first input row, its length and its position in it.
        let mut sources = Vec::new();
        let mut first = 0;
        for &len in lens {
            sources.extend((0..(len - 1) / self.stride + 1).map(|t| (first, len, t)));
            first += len;
        }
        let out = match &self.product {
            ConvProduct::Bf16(product) => {
                let pairs = bf16_gemm::to_bf16_pairs(values, rows, c);
                let gathered = self.gather(&pairs, c / 2, &sources);
                product.pair_rows_times(&gathered, sources.len(), true)
            }
            ConvProduct::F32(product) => {
                let gathered = self.gather(values, c, &sources);
                let mut out = vec![0f32; sources.len() * product.d_out];
                product.rows_into(&gathered, true, Residual::None, &mut out);
                out
            }
        };
        Tensor::from_vec(out, (sources.len(), self.d_out()), x.device())
    }

    /// The three input positions of each output row (`sources`: first row of its sequence, the
    /// sequence's length, the output position), `per_position` values each, side by side.
    fn gather<T: Copy + Default + Send + Sync>(&self, src: &[T], per_position: usize, sources: &[(usize, usize, usize)]) -> Vec<T> {
        let mut gathered = vec![T::default(); sources.len() * 3 * per_position];
        gathered.par_chunks_mut(3 * per_position).zip(sources.par_iter()).for_each(|(row, &(first, len, t))| {
            for (k, dst) in row.chunks_exact_mut(per_position).enumerate() {
                // Input position `stride t + k - 1`; outside the sequence it stays zero.
                if let Some(p) = (t * self.stride + k).checked_sub(1).filter(|&p| p < len) {
                    let from = (first + p) * per_position;
                    dst.copy_from_slice(&src[from..from + per_position]);
                }
            }
        });
        gathered
    }
}

struct Block {
    attn_ln: LayerNorm,
    /// Scaled by `head_dim^-0.5` at load (the scale OpenAI splits between queries and keys).
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    mlp_ln: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn products(&self) -> [&Linear; 6] {
        [&self.q, &self.k, &self.v, &self.out, &self.fc1, &self.fc2]
    }
}

/// The encoder of one Whisper model.
pub(crate) struct Encoder {
    conv1: Conv1d,
    conv2: Conv1d,
    /// Both convolutions as products over rows (BF16 where the blocks take BF16 products), on
    /// the CPU in F32.
    row_convs: Option<(RowConv, RowConv)>,
    /// Sinusoids `(1500, d_model)`.
    positions: Tensor,
    blocks: Vec<Block>,
    ln_post: LayerNorm,
    n_head: usize,
}

/// OpenAI's `sinusoids(length, channels)`.
fn sinusoids(length: usize, channels: usize, device: &candle_core::Device) -> Result<Tensor> {
    let increment = 10000f32.ln() / (channels / 2 - 1) as f32;
    let mut v = vec![0f32; length * channels];
    for t in 0..length {
        for i in 0..channels / 2 {
            let x = t as f32 * (-(i as f32) * increment).exp();
            v[t * channels + i] = x.sin();
            v[t * channels + channels / 2 + i] = x.cos();
        }
    }
    Tensor::from_vec(v, (length, channels), device)
}

impl Encoder {
    /// Loads `conv1`, `conv2`, `layers.N.*` and `layer_norm` from `vb` (the `model.encoder`
    /// prefix of a Hugging Face-named Whisper). With `bf16_products` (F32 on the CPU), the
    /// blocks' linear layers run in BF16 where the CPU has AVX-512 BF16.
    pub fn load(vb: VarBuilder, cfg: &Config, bf16_products: bool) -> Result<Encoder> {
        let d = cfg.d_model;
        let n_head = cfg.encoder_attention_heads;
        let scale = ((d / n_head) as f64).powf(-0.5);
        let blocks = (0..cfg.encoder_layers)
            .map(|i| {
                let vb = vb.pp(format!("layers.{i}"));
                let a = vb.pp("self_attn");
                let q = Linear::new(
                    (a.get((d, d), "q_proj.weight")? * scale)?,
                    Some((a.get(d, "q_proj.bias")? * scale)?),
                );
                // BF16 where asked and the CPU has it, else F32 kept transposed on the CPU.
                let product = |l: Linear| if bf16_products { l.in_bf16()?.in_f32_transposed() } else { l.in_f32_transposed() };
                Ok(Block {
                    attn_ln: layer_norm(d, LAYER_NORM_EPS, vb.pp("self_attn_layer_norm"))?,
                    q: product(q)?,
                    k: product(linear_no_bias(d, d, a.pp("k_proj"))?)?,
                    v: product(linear(d, d, a.pp("v_proj"))?)?,
                    out: product(linear(d, d, a.pp("out_proj"))?)?,
                    mlp_ln: layer_norm(d, LAYER_NORM_EPS, vb.pp("final_layer_norm"))?,
                    fc1: product(linear(d, 4 * d, vb.pp("fc1"))?)?,
                    fc2: product(linear(4 * d, d, vb.pp("fc2"))?)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // The stored positions where the weights hold them (a Hugging Face folder, whose
        // reference, transformers, adds them as stored: sinusoids rounded to the file's dtype);
        // else OpenAI's sinusoids, computed.
        let positions = if vb.contains_tensor("embed_positions.weight") {
            vb.get((cfg.max_source_positions, d), "embed_positions.weight")?
        } else {
            sinusoids(cfg.max_source_positions, d, vb.device())?.to_dtype(vb.dtype())?
        };
        let conv1 = conv1d(cfg.num_mel_bins, d, 1, vb.pp("conv1"))?;
        let conv2 = conv1d(d, d, 2, vb.pp("conv2"))?;
        // In BF16 where the blocks take BF16 products (the CPU has AVX-512 BF16).
        let bf16 = bf16_products && tern_kernels::bf16_gemm::available();
        let row_convs = RowConv::new(&conv1, bf16)?.zip(RowConv::new(&conv2, bf16)?);
        Ok(Encoder {
            conv1,
            conv2,
            row_convs,
            positions,
            blocks,
            ln_post: layer_norm(d, LAYER_NORM_EPS, vb.pp("layer_norm"))?,
            n_head,
        })
    }

    /// Bytes the weights take below what F32 would (the BF16-packed layers').
    pub fn bytes_saved(&self) -> usize {
        self.blocks.iter().flat_map(Block::products).map(|l| l.bytes_saved()).sum()
    }

    /// Whether the blocks' products run in BF16.
    pub fn bf16_products(&self) -> bool {
        self.blocks.iter().flat_map(Block::products).any(|l| l.bytes_saved() > 0)
    }

    /// Whether [`Encoder::forward`] takes windows of different lengths in one batch (the CPU in
    /// F32, where attention is [`self_attention`]).
    pub fn takes_lengths(&self) -> bool {
        self.positions.device().is_cpu() && self.positions.dtype() == candle_core::DType::F32
    }

    /// Whether [`Encoder::forward_ragged`] runs here: the convolutions are products over rows
    /// (on the CPU in F32).
    pub fn takes_ragged(&self) -> bool {
        self.row_convs.is_some()
    }

    /// Encodes a log-mel `(batch, n_mels, frames)` (`frames` even, at most 3000) into
    /// `(batch, frames / 2, d_model)`. With `lens` (only where [`Encoder::takes_lengths`]),
    /// window `b` is its first `lens[b]` positions (`2 * lens[b]` mel frames, the rest zeros),
    /// and its positions up to there come out as they would alone; the rest is padding.
    pub fn forward(&self, mel: &Tensor, lens: Option<&[usize]>) -> Result<Tensor> {
        // candle's CUDA kernels (softmax among them) index a tensor with 32-bit signed
        // integers: attention scores of 256 full windows of tiny.en are 3.5e9 elements, an
        // illegal address on an H100. Larger batches go through in parts of under 2^30 scores.
        let (batch, _, frames) = mel.dims3()?;
        let most = ((1usize << 30) / (self.n_head * (frames / 2).pow(2)).max(1)).max(1);
        if batch > most {
            let parts = (0..batch)
                .step_by(most)
                .map(|start| {
                    let n = most.min(batch - start);
                    self.forward(&mel.narrow(0, start, n)?, lens.map(|l| &l[start..start + n]))
                })
                .collect::<Result<Vec<_>>>()?;
            return Tensor::cat(&parts, 0);
        }
        let mel = mel.to_dtype(self.positions.dtype())?;
        let x = match &self.row_convs {
            Some((conv1, conv2)) => {
                let x = gelu(&conv1.forward(&mel.transpose(1, 2)?)?, Gelu::Erf)?;
                gelu(&conv2.forward(&x)?, Gelu::Erf)?
            }
            None => {
                let x = gelu(&self.conv1.forward(&mel)?, Gelu::Erf)?;
                gelu(&self.conv2.forward(&x)?, Gelu::Erf)?.transpose(1, 2)?
            }
        };
        let (b, len, d) = x.dims3()?;
        let x = x.broadcast_add(&self.positions.narrow(0, 0, len)?)?;
        let (h, hd) = (self.n_head, d / self.n_head);
        let heads = |t: Tensor| t.reshape((b, len, h, hd))?.transpose(1, 2);
        let spans = padded(b, len, lens)?;
        self.blocks_and_norm(x, &spans, |q, k, v| {
            if self.takes_lengths() {
                return self_attention(q, k, v, h, lens, self.bf16_products());
            }
            if lens.is_some() {
                candle_core::bail!("this encoder takes windows of one length per batch");
            }
            let (q, k_t, v) = (heads(q.clone())?.contiguous()?, heads(k.clone())?.transpose(2, 3)?.contiguous()?, heads(v.clone())?.contiguous()?);
            let w = softmax_last_dim(&q.matmul(&k_t)?)?;
            w.matmul(&v)?.transpose(1, 2)?.flatten_from(2)
        })
    }

    /// Encodes windows of different lengths without padding any of them (only where
    /// [`Encoder::takes_ragged`]): `mels[i]` is `(1, n_mels, frames)` (`frames` even, at most
    /// 3000). Returns the windows' positions end to end, `(Σ frames / 2, d_model)`, and each
    /// window's positions (`frames / 2`); each window's rows are those it gives alone.
    ///
    /// Padding a group of windows to its longest spent up to a fifth of the encoder's products
    /// on padding, and grouping only windows of similar lengths split a batch into several
    /// smaller groups.
    pub fn forward_ragged(&self, mels: &[Tensor]) -> Result<(Tensor, Vec<usize>)> {
        let Some((conv1, conv2)) = &self.row_convs else {
            candle_core::bail!("this encoder pads windows to one length");
        };
        let mut frames = Vec::with_capacity(mels.len());
        let mut columns = Vec::with_capacity(mels.len());
        for mel in mels {
            let (one, _, n) = mel.dims3()?;
            if one != 1 || n == 0 || n % 2 != 0 || n / 2 > self.positions.dim(0)? {
                candle_core::bail!("ragged encoding takes one window of an even count of at most 3000 frames per mel, not {:?}", mel.shape());
            }
            frames.push(n);
            columns.push(mel.squeeze(0)?.t()?.to_dtype(self.positions.dtype())?);
        }
        let x = gelu(&conv1.forward_rows(&Tensor::cat(&columns, 0)?, &frames)?, Gelu::Erf)?;
        drop(columns);
        let x = gelu(&conv2.forward_rows(&x, &frames)?, Gelu::Erf)?;
        let lens: Vec<usize> = frames.iter().map(|&n| n / 2).collect();
        let index: Vec<u32> = lens.iter().flat_map(|&n| 0..n as u32).collect();
        let x = (x + self.positions.index_select(&Tensor::new(index.as_slice(), self.positions.device())?, 0)?)?;
        let spans = end_to_end(&lens);
        let h = self.n_head;
        let encoded = self.blocks_and_norm(x, &spans, |q, k, v| self_attention_spans(q, k, v, h, &spans, self.bf16_products()))?;
        Ok((encoded, lens))
    }

    /// The blocks and the final layer norm over `x` (positions added), with `attend(q, k, v)`
    /// the blocks' self-attention; on the CPU in F32, [`Encoder::bf16_blocks`] or
    /// [`Encoder::f32_blocks`] over the windows' rows `spans` instead.
    fn blocks_and_norm(&self, x: Tensor, spans: &[(usize, usize)], attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let transposed = self.blocks.iter().all(|b| b.products().iter().all(|l| l.transposed().is_some()));
        if self.takes_lengths() && (self.bf16_products() || transposed) {
            let shape = x.shape().clone();
            let mut rows = x.flatten_all()?.to_vec1::<f32>()?;
            drop(x);
            if self.bf16_products() {
                self.bf16_blocks(&mut rows, spans)?;
            } else {
                self.f32_blocks(&mut rows, spans)?;
            }
            return self.ln_post.forward(&Tensor::from_vec(rows, shape, self.positions.device())?);
        }
        self.blocks_with_ops(x, attend)
    }

    /// The blocks over `x`, rows of `d_model` (F32 on the CPU, weights kept transposed), in
    /// place; window `i` is the `spans[i].1` rows from row `spans[i].0`.
    ///
    /// The same maths as the tensor ops in reused buffers: layer norms and GELU on every core,
    /// biases and residuals written in the products' passes
    /// ([`tern_kernels::f32_linear::rows_times_transposed`]), attention per (window, head,
    /// block of queries). Through candle's ops the products re-packed their transposed weights
    /// on every call and the layer norms ran on one core.
    fn f32_blocks(&self, x: &mut [f32], spans: &[(usize, usize)]) -> Result<()> {
        let d = self.positions.dim(1)?;
        let rows = x.len() / d;
        fn weights(l: &Linear) -> Result<&TransposedF32> {
            l.transposed().ok_or_else(|| candle_core::Error::Msg("transposed F32 weights expected".into()))
        }
        let Some(first) = self.blocks.first() else { return Ok(()) };
        let hidden = weights(&first.fc1)?.d_out;
        let mut normed = vec![0f32; rows * d];
        let mut activated = vec![0f32; rows * hidden];
        let (mut q, mut k, mut v, mut attended) = (vec![0f32; rows * d], vec![0f32; rows * d], vec![0f32; rows * d], vec![0f32; rows * d]);
        let eps = LAYER_NORM_EPS as f32;
        let task = rows_per_task(d) * d;
        let layer_norm = |ln: &LayerNorm, x: &[f32], out: &mut [f32]| -> Result<()> {
            let (gamma, beta) = norm_params(ln, d)?;
            out.par_chunks_mut(task).zip(x.par_chunks(task)).for_each(|(dst, src)| {
                for (dst, row) in dst.chunks_exact_mut(d).zip(src.chunks_exact(d)) {
                    cpu_kernels::layer_norm(dst, row, &gamma, &beta, eps);
                }
            });
            Ok(())
        };
        for block in &self.blocks {
            layer_norm(&block.attn_ln, x, &mut normed)?;
            for (product, out) in [(&block.q, &mut q), (&block.k, &mut k), (&block.v, &mut v)] {
                weights(product)?.rows_into(&normed, true, Residual::None, out);
            }
            attend_spans_f32(&q, &k, &v, d, self.n_head, spans, &mut attended);
            weights(&block.out)?.rows_into(&attended, true, Residual::InOut, x);
            layer_norm(&block.mlp_ln, x, &mut normed)?;
            weights(&block.fc1)?.rows_into(&normed, true, Residual::None, &mut activated);
            activated.par_chunks_mut(rows_per_task(hidden) * hidden).for_each(cpu_kernels::gelu_erf_in_place);
            weights(&block.fc2)?.rows_into(&activated, true, Residual::InOut, x);
        }
        Ok(())
    }

    /// [`Encoder::blocks_and_norm`] with candle's ops (and the linear layers' own products).
    fn blocks_with_ops(&self, mut x: Tensor, attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
        for block in &self.blocks {
            let y = block.attn_ln.forward(&x)?;
            let (q, k, v) = (block.q.forward(&y)?, block.k.forward(&y)?, block.v.forward(&y)?);
            let o = attend(&q, &k, &v)?;
            x = (x + block.out.forward(&o)?)?;
            let y = block.mlp_ln.forward(&x)?;
            x = (&x + block.fc2.forward(&gelu(&block.fc1.forward(&y)?, Gelu::Erf)?)?)?;
        }
        self.ln_post.forward(&x)
    }

    /// The blocks over `x`, rows of `d_model` (F32 on the CPU, BF16 products), in place; window
    /// `i` is the `spans[i].1` rows from row `spans[i].0` (the attention's sequences).
    ///
    /// The same maths as the tensor ops, in reused buffers and fewer passes: a layer norm
    /// writes the BF16 pairs its products read; a product's values are added to the residual,
    /// or go through GELU to the next product's pairs, while they are still in cache
    /// ([`Bf16Linear::pair_rows_each`]). Through candle's ops each of those steps was a pass
    /// over a fresh buffer of the whole batch, and the layer norm was scalar.
    fn bf16_blocks(&self, x: &mut [f32], spans: &[(usize, usize)]) -> Result<()> {
        let d = self.positions.dim(1)?;
        let rows = x.len() / d;
        fn packed(l: &Linear) -> Result<&Bf16Linear> {
            l.packed().ok_or_else(|| candle_core::Error::Msg("BF16 products expected".into()))
        }
        let norm = |ln: &LayerNorm| norm_params(ln, d);
        let Some(first) = self.blocks.first() else { return Ok(()) };
        let hidden = packed(&first.fc1)?.d_out();
        let (pairs, hidden_pairs) = (d.div_ceil(2), hidden.div_ceil(2));
        let mut normed = vec![0u32; rows * pairs];
        let mut activated = vec![0u32; rows * hidden_pairs];
        let (mut q, mut k, mut v, mut attended) = (vec![0f32; rows * d], vec![0f32; rows * d], vec![0f32; rows * d], vec![0f32; rows * d]);
        let eps = LAYER_NORM_EPS as f32;
        for block in &self.blocks {
            let (gamma, beta) = norm(&block.attn_ln)?;
            layer_norm_to_pairs(x, d, &gamma, &beta, eps, &mut normed);
            for (product, out) in [(&block.q, &mut q), (&block.k, &mut k), (&block.v, &mut v)] {
                let out = OutPtr(out.as_mut_ptr());
                packed(product)?.pair_rows_each(&normed, rows, |r, c0, values| {
                    // SAFETY: each (row, column) is handed over once; `out` holds rows x d.
                    unsafe { out.slice(r * d + c0, values.len()) }.copy_from_slice(values);
                });
            }
            attend_spans_bf16(&q, &k, &v, d, self.n_head, spans, &mut attended);
            bf16_gemm::to_bf16_pairs_into(&attended, d, &mut normed);
            let residual = OutPtr(x.as_mut_ptr());
            let add = |r: usize, c0: usize, values: &mut [f32]| {
                // SAFETY: as above, for `x`.
                for (x, v) in unsafe { residual.slice(r * d + c0, values.len()) }.iter_mut().zip(values.iter()) {
                    *x += *v;
                }
            };
            packed(&block.out)?.pair_rows_each(&normed, rows, add);
            let (gamma, beta) = norm(&block.mlp_ln)?;
            layer_norm_to_pairs(x, d, &gamma, &beta, eps, &mut normed);
            let next = OutPtr(activated.as_mut_ptr());
            packed(&block.fc1)?.pair_rows_each(&normed, rows, |r, c0, values| {
                cpu_kernels::gelu_erf_in_place(values);
                // SAFETY: as above; `c0` is even, so this piece's pairs are its own.
                bf16_gemm::row_to_bf16(values, unsafe { next.slice(r * hidden_pairs + c0 / 2, values.len().div_ceil(2)) });
            });
            packed(&block.fc2)?.pair_rows_each(&activated, rows, add);
        }
        Ok(())
    }
}

/// A layer norm's scale and shift over `d` values (a shift of zeros where it has none).
fn norm_params(ln: &LayerNorm, d: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let beta = match ln.bias() {
        Some(b) => b.to_vec1::<f32>()?,
        None => vec![0.0; d],
    };
    Ok((ln.weight().to_vec1::<f32>()?, beta))
}

/// Layer norm of each row of `x` (`d` values) into BF16 pairs, on every core.
fn layer_norm_to_pairs(x: &[f32], d: usize, gamma: &[f32], beta: &[f32], eps: f32, out: &mut [u32]) {
    let pairs = d.div_ceil(2);
    out.par_chunks_mut(pairs * 32).zip(x.par_chunks(d * 32)).for_each_init(
        || vec![0f32; d],
        |normed, (dst, src)| {
            for (dst, row) in dst.chunks_exact_mut(pairs).zip(src.chunks_exact(d)) {
                cpu_kernels::layer_norm(normed, row, gamma, beta, eps);
                bf16_gemm::row_to_bf16(normed, dst);
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_kernels::bf16_gemm::test_values as values;
    use candle_core::Device;

    /// A small encoder with made-up weights (BF16 products where the CPU has them).
    fn small_encoder() -> (Encoder, Config) {
        small_encoder_in(candle_core::DType::F32, true)
    }

    /// [`small_encoder`] in `dtype`, with BF16 products or without.
    fn small_encoder_in(dtype: candle_core::DType, bf16_products: bool) -> (Encoder, Config) {
        let cfg = Config {
            num_mel_bins: 8,
            max_source_positions: 64,
            d_model: 64,
            encoder_attention_heads: 2,
            encoder_layers: 2,
            vocab_size: 16,
            max_target_positions: 8,
            decoder_attention_heads: 2,
            decoder_layers: 1,
            suppress_tokens: vec![],
        };
        let (d, mels) = (cfg.d_model, cfg.num_mel_bins);
        let mut shapes: Vec<(String, Vec<usize>)> =
            vec![("conv1.weight".into(), vec![d, mels, 3]), ("conv1.bias".into(), vec![d]), ("conv2.weight".into(), vec![d, d, 3]), ("conv2.bias".into(), vec![d])];
        for i in 0..cfg.encoder_layers {
            for (name, shape) in [
                ("self_attn.q_proj.weight", vec![d, d]),
                ("self_attn.q_proj.bias", vec![d]),
                ("self_attn.k_proj.weight", vec![d, d]),
                ("self_attn.v_proj.weight", vec![d, d]),
                ("self_attn.v_proj.bias", vec![d]),
                ("self_attn.out_proj.weight", vec![d, d]),
                ("self_attn.out_proj.bias", vec![d]),
                ("self_attn_layer_norm.weight", vec![d]),
                ("self_attn_layer_norm.bias", vec![d]),
                ("final_layer_norm.weight", vec![d]),
                ("final_layer_norm.bias", vec![d]),
                ("fc1.weight", vec![4 * d, d]),
                ("fc1.bias", vec![4 * d]),
                ("fc2.weight", vec![d, 4 * d]),
                ("fc2.bias", vec![d]),
            ] {
                shapes.push((format!("layers.{i}.{name}"), shape));
            }
        }
        shapes.push(("layer_norm.weight".into(), vec![d]));
        shapes.push(("layer_norm.bias".into(), vec![d]));
        let tensors = shapes
            .into_iter()
            .enumerate()
            .map(|(seed, (name, shape))| {
                let n = shape.iter().product();
                let t = Tensor::from_vec(values(n, seed), shape, &Device::Cpu).unwrap();
                (name, (t * 0.2).unwrap())
            })
            .collect();
        let vb = VarBuilder::from_tensors(tensors, dtype, &Device::Cpu);
        (Encoder::load(vb, &cfg, bf16_products).unwrap(), cfg)
    }

    /// The F32 encoder on tern's kernels (convolutions and linear layers over transposed
    /// weights, layer norms and GELU in the blocks' buffers) equals the same encoder through
    /// candle's ops, for a batch of two windows, one of them padded.
    #[test]
    fn f32_kernels_match_candles_ops() {
        let (fast, cfg) = small_encoder_in(candle_core::DType::F32, false);
        let (mut reference, _) = small_encoder_in(candle_core::DType::F32, false);
        reference.row_convs = None;
        for block in &mut reference.blocks {
            for l in [&mut block.q, &mut block.k, &mut block.v, &mut block.out, &mut block.fc1, &mut block.fc2] {
                *l = std::mem::replace(l, Linear::new(Tensor::zeros((1, 1), candle_core::DType::F32, &Device::Cpu).unwrap(), None)).untransposed().unwrap();
            }
        }
        assert!(fast.takes_lengths() && fast.takes_ragged() && !fast.bf16_products());
        assert!(!reference.takes_ragged() && reference.blocks[0].q.transposed().is_none());
        let frames = 2 * 40;
        let mel = Tensor::from_vec(values(2 * cfg.num_mel_bins * frames, 9), (2, cfg.num_mel_bins, frames), &Device::Cpu).unwrap();
        let got = fast.forward(&mel, None).unwrap().to_vec3::<f32>().unwrap();
        let want = reference.forward(&mel, None).unwrap().to_vec3::<f32>().unwrap();
        let mut worst = 0f32;
        for (g, w) in got.iter().flatten().flatten().zip(want.iter().flatten().flatten()) {
            worst = worst.max((g - w).abs());
        }
        assert!(worst < 1e-4, "largest difference {worst}");
        // The second window's first 13 positions alone, and as part of the padded batch.
        let short = mel.narrow(0, 1, 1).unwrap().narrow(2, 0, 26).unwrap();
        let alone = fast.forward(&short, None).unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        let padded = fast.forward(&Tensor::cat(&[mel.narrow(0, 0, 1).unwrap(), short.pad_with_zeros(2, 0, frames - 26).unwrap()], 0).unwrap(), Some(&[40, 13])).unwrap();
        let padded = padded.get(1).unwrap().to_vec2::<f32>().unwrap();
        for p in 0..13 {
            for (a, b) in alone[p].iter().zip(&padded[p]) {
                assert!((a - b).abs() < 1e-5, "position {p}: {a} alone, {b} padded");
            }
        }
    }

    /// Windows of three lengths end to end give, row for row and to the bit, what each gives
    /// alone and what the padded batch gives for its real positions.
    #[test]
    fn ragged_windows_encode_as_alone_and_as_padded() {
        if bf16_gemm::skip_without_bf16() {
            return;
        }
        let (encoder, cfg) = small_encoder();
        assert!(encoder.takes_ragged());
        let lens = [13usize, 40, 7];
        let mels: Vec<Tensor> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| Tensor::from_vec(values(cfg.num_mel_bins * 2 * n, 100 + i), (1, cfg.num_mel_bins, 2 * n), &Device::Cpu).unwrap())
            .collect();
        let (ragged, got_lens) = encoder.forward_ragged(&mels).unwrap();
        assert_eq!(got_lens, lens);
        let ragged = ragged.to_vec2::<f32>().unwrap();
        assert_eq!(ragged.len(), lens.iter().sum::<usize>());
        let longest = 40;
        let padded: Vec<Tensor> = mels.iter().zip(&lens).map(|(m, &n)| m.pad_with_zeros(2, 0, 2 * (longest - n)).unwrap()).collect();
        let padded = encoder.forward(&Tensor::cat(&padded, 0).unwrap(), Some(&lens)).unwrap().to_vec3::<f32>().unwrap();
        let mut first = 0;
        for (i, (mel, &n)) in mels.iter().zip(&lens).enumerate() {
            let alone = encoder.forward(mel, None).unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap();
            for p in 0..n {
                let row = &ragged[first + p];
                assert!(row.iter().all(|v| v.is_finite()));
                assert_eq!(row, &alone[p], "window {i}, position {p}: end to end vs alone");
                assert_eq!(row, &padded[i][p], "window {i}, position {p}: end to end vs padded");
            }
            first += n;
        }
        // A window of an odd frame count is refused, not mis-encoded.
        assert!(encoder.forward_ragged(&[mels[0].narrow(2, 0, 25).unwrap()]).is_err());
    }

    /// The fused BF16 blocks give what candle's ops give over the same BF16 products, within
    /// the rounding of a layer norm summed in another order.
    #[test]
    fn fused_bf16_blocks_match_the_blocks_through_candles_ops() {
        if bf16_gemm::skip_without_bf16() {
            return;
        }
        let (encoder, cfg) = small_encoder();
        let d = cfg.d_model;
        let spans = [(0usize, 13usize), (13, 20), (40, 5)];
        let rows = 45;
        let x = Tensor::from_vec(values(rows * d, 7), (rows, d), &Device::Cpu).unwrap();
        let h = encoder.n_head;
        let want = encoder.blocks_with_ops(x.clone(), |q, k, v| self_attention_spans(q, k, v, h, &spans, true)).unwrap();
        let mut fused = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        encoder.bf16_blocks(&mut fused, &spans).unwrap();
        let want_rows = want.to_vec2::<f32>().unwrap();
        let got = encoder.ln_post.forward(&Tensor::from_vec(fused.clone(), (rows, d), &Device::Cpu).unwrap()).unwrap().to_vec2::<f32>().unwrap();
        let mut worst = 0f32;
        for &(from, n) in &spans {
            for r in from..from + n {
                for (g, w) in got[r].iter().zip(&want_rows[r]) {
                    worst = worst.max((g - w).abs());
                }
            }
        }
        assert!(worst < 0.05, "largest difference {worst}");
    }

    /// Channel counts that cross a 32-column block and lengths odd and even, at both strides.
    #[test]
    fn bf16_convolutions_match_candles_f32_ones() {
        if bf16_gemm::skip_without_bf16() {
            return;
        }
        let (b, c_in, c_out) = (2usize, 6usize, 40usize);
        for (stride, len) in [(1usize, 9usize), (1, 10), (2, 10), (2, 4)] {
            let cfg = Conv1dConfig { padding: 1, stride, groups: 1, dilation: 1, cudnn_fwd_algo: None };
            let weight = Tensor::from_vec(values(c_out * c_in * 3, 1), (c_out, c_in, 3), &Device::Cpu).unwrap();
            let bias = Tensor::from_vec(values(c_out, 2), c_out, &Device::Cpu).unwrap();
            let conv = Conv1d::new(weight, Some(bias), cfg);
            let x = Tensor::from_vec(values(b * c_in * len, 3), (b, c_in, len), &Device::Cpu).unwrap();
            let want = conv.forward(&x).unwrap().transpose(1, 2).unwrap().to_vec3::<f32>().unwrap();
            let bf16 = RowConv::new(&conv, true).unwrap().expect("an even channel count");
            let got = bf16.forward(&x.transpose(1, 2).unwrap()).unwrap().to_vec3::<f32>().unwrap();
            assert_eq!((got.len(), got[0].len(), got[0][0].len()), (b, (len - 1) / stride + 1, c_out));
            for (w, g) in want.iter().flatten().flatten().zip(got.iter().flatten().flatten()) {
                // 18 products of values within 1, each operand rounded to 8 significant bits.
                assert!((w - g).abs() < 0.05, "stride {stride}, length {len}: {g} vs {w}");
            }
        }
    }
}
