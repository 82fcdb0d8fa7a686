//! A diffusers folder's configs (`model_index.json`, `unet/config.json`, `vae/config.json`,
//! `text_encoder*/config.json`) read into the shapes tern builds, refusing the options it does
//! not compute (so nothing silently differs from diffusers).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use candle_transformers::models::stable_diffusion::{unet_2d, vae};
use serde::Deserialize;
use serde_json::Value;

/// Which pipeline a folder holds, from `model_index.json`'s `_class_name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineKind {
    /// `StableDiffusionPipeline`: SD 1.x, 2.x, SD-Turbo. One CLIP text encoder.
    Sd,
    /// `StableDiffusionXLPipeline`: SDXL, SDXL-Turbo. Two text encoders, the second pooled, and
    /// the size conditioning.
    Sdxl,
}

/// `model_index.json`.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub kind: PipelineKind,
    /// SDXL: an empty negative prompt is zero embeddings rather than the encoded "" (diffusers'
    /// `force_zeros_for_empty_prompt`, true by default).
    pub force_zeros_for_empty_prompt: bool,
}

impl PipelineConfig {
    pub fn read(dir: &Path) -> Result<PipelineConfig> {
        let index: Value = read_json(&dir.join("model_index.json"))?;
        let class = index.get("_class_name").and_then(Value::as_str).unwrap_or_default();
        let kind = match class {
            "StableDiffusionPipeline" => PipelineKind::Sd,
            "StableDiffusionXLPipeline" => PipelineKind::Sdxl,
            other => bail!("{}: pipeline {other:?} is not one tern runs (StableDiffusionPipeline, StableDiffusionXLPipeline)", dir.display()),
        };
        let force_zeros_for_empty_prompt = index.get("force_zeros_for_empty_prompt").and_then(Value::as_bool).unwrap_or(true);
        Ok(PipelineConfig { kind, force_zeros_for_empty_prompt })
    }
}

pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// An int for every block, or one for all.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum PerBlock {
    One(usize),
    Each(Vec<usize>),
}

impl PerBlock {
    fn get(&self, i: usize) -> usize {
        match self {
            PerBlock::One(n) => *n,
            PerBlock::Each(v) => v[i.min(v.len() - 1)],
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
struct UNetJson {
    #[serde(default = "four")]
    in_channels: usize,
    #[serde(default = "four")]
    out_channels: usize,
    sample_size: Option<usize>,
    block_out_channels: Vec<usize>,
    down_block_types: Vec<String>,
    #[serde(default = "two")]
    layers_per_block: usize,
    attention_head_dim: Option<PerBlock>,
    num_attention_heads: Option<PerBlock>,
    cross_attention_dim: PerBlock,
    transformer_layers_per_block: Option<PerBlock>,
    #[serde(default)]
    use_linear_projection: bool,
    #[serde(default = "thirty_two")]
    norm_num_groups: usize,
    #[serde(default = "norm_eps")]
    norm_eps: f64,
    #[serde(default = "yes")]
    flip_sin_to_cos: bool,
    #[serde(default)]
    freq_shift: f64,
    #[serde(default = "one")]
    downsample_padding: usize,
    #[serde(default = "one_f")]
    mid_block_scale_factor: f64,
    #[serde(default)]
    center_input_sample: bool,
    addition_embed_type: Option<String>,
    addition_time_embed_dim: Option<usize>,
    projection_class_embeddings_input_dim: Option<usize>,
    time_cond_proj_dim: Option<usize>,
    class_embed_type: Option<String>,
    mid_block_type: Option<String>,
    #[serde(default = "silu")]
    act_fn: String,
    #[serde(default = "three")]
    conv_in_kernel: usize,
    #[serde(default = "three")]
    conv_out_kernel: usize,
    #[serde(default)]
    only_cross_attention: Value,
    #[serde(default = "default_shift")]
    resnet_time_scale_shift: String,
    #[serde(default = "positional")]
    time_embedding_type: String,
}

fn four() -> usize {
    4
}
fn two() -> usize {
    2
}
fn three() -> usize {
    3
}
fn one() -> usize {
    1
}
fn one_f() -> f64 {
    1.0
}
fn thirty_two() -> usize {
    32
}
fn norm_eps() -> f64 {
    1e-5
}
fn yes() -> bool {
    true
}
fn silu() -> String {
    "silu".into()
}
fn default_shift() -> String {
    "default".into()
}
fn positional() -> String {
    "positional".into()
}

/// The UNet: candle's block config and what tern's own top level adds (SDXL's size and pooled
/// text conditioning).
#[derive(Debug, Clone)]
pub struct UNetConfig {
    pub blocks: unet_2d::UNet2DConditionModelConfig,
    pub in_channels: usize,
    pub out_channels: usize,
    /// Latent size the model was trained at (pixels / 8): the default image size.
    pub sample_size: usize,
    /// SDXL's `text_time` conditioning: (time embedding width per size number, input width of
    /// the added embedding).
    pub text_time: Option<(usize, usize)>,
}

impl UNetConfig {
    pub fn read(path: &Path) -> Result<UNetConfig> {
        let j: UNetJson = read_json(path)?;
        let where_ = path.display();
        let n = j.block_out_channels.len();
        ensure!(j.down_block_types.len() == n, "{where_}: {} down blocks for {n} block widths", j.down_block_types.len());
        ensure!(j.time_cond_proj_dim.is_none(), "{where_}: time_cond_proj_dim (LCM) is not supported");
        ensure!(j.class_embed_type.is_none(), "{where_}: class_embed_type is not supported");
        ensure!(j.act_fn == "silu", "{where_}: act_fn {:?} is not supported (silu)", j.act_fn);
        ensure!(j.conv_in_kernel == 3 && j.conv_out_kernel == 3, "{where_}: conv kernels other than 3 are not supported");
        ensure!(j.resnet_time_scale_shift == "default", "{where_}: resnet_time_scale_shift {:?} is not supported", j.resnet_time_scale_shift);
        ensure!(j.time_embedding_type == "positional", "{where_}: time_embedding_type {:?} is not supported", j.time_embedding_type);
        ensure!(matches!(j.only_cross_attention, Value::Null | Value::Bool(false)), "{where_}: only_cross_attention is not supported");
        if let Some(mid) = &j.mid_block_type {
            ensure!(mid == "UNetMidBlock2DCrossAttn", "{where_}: mid block {mid:?} is not supported");
        }
        let cross_attention_dim = j.cross_attention_dim.get(0);
        ensure!((0..n).all(|i| j.cross_attention_dim.get(i) == cross_attention_dim), "{where_}: per-block cross_attention_dim is not supported");
        // diffusers reads `attention_head_dim` as the number of heads when `num_attention_heads`
        // is unset (a naming slip it keeps for compatibility); tern's blocks take heads too.
        let heads = j.num_attention_heads.clone().or(j.attention_head_dim.clone()).unwrap_or(PerBlock::One(8));
        let layers = j.transformer_layers_per_block.clone().unwrap_or(PerBlock::One(1));
        let mut blocks = Vec::with_capacity(n);
        for (i, kind) in j.down_block_types.iter().enumerate() {
            let use_cross_attn = match kind.as_str() {
                "CrossAttnDownBlock2D" => Some(layers.get(i)),
                "DownBlock2D" => None,
                other => bail!("{where_}: down block {other:?} is not supported"),
            };
            blocks.push(unet_2d::BlockConfig { out_channels: j.block_out_channels[i], use_cross_attn, attention_head_dim: heads.get(i) });
        }
        let text_time = match j.addition_embed_type.as_deref() {
            None => None,
            Some("text_time") => Some((
                j.addition_time_embed_dim.context("addition_time_embed_dim is missing")?,
                j.projection_class_embeddings_input_dim.context("projection_class_embeddings_input_dim is missing")?,
            )),
            Some(other) => bail!("{where_}: addition_embed_type {other:?} is not supported"),
        };
        let blocks = unet_2d::UNet2DConditionModelConfig {
            center_input_sample: j.center_input_sample,
            flip_sin_to_cos: j.flip_sin_to_cos,
            freq_shift: j.freq_shift,
            blocks,
            layers_per_block: j.layers_per_block,
            downsample_padding: j.downsample_padding,
            mid_block_scale_factor: j.mid_block_scale_factor,
            norm_num_groups: j.norm_num_groups,
            norm_eps: j.norm_eps,
            cross_attention_dim,
            sliced_attention_size: None,
            use_linear_projection: j.use_linear_projection,
        };
        Ok(UNetConfig { blocks, in_channels: j.in_channels, out_channels: j.out_channels, sample_size: j.sample_size.unwrap_or(64), text_time })
    }
}

#[derive(Debug, Clone, Deserialize)]
struct VaeJson {
    #[serde(default = "three")]
    out_channels: usize,
    block_out_channels: Vec<usize>,
    #[serde(default = "one")]
    layers_per_block: usize,
    #[serde(default = "four")]
    latent_channels: usize,
    #[serde(default = "thirty_two")]
    norm_num_groups: usize,
    #[serde(default = "scaling_factor")]
    scaling_factor: f64,
    shift_factor: Option<f64>,
    latents_mean: Option<Value>,
    #[serde(default = "yes")]
    use_quant_conv: bool,
    #[serde(default = "yes")]
    use_post_quant_conv: bool,
    #[serde(default = "yes")]
    mid_block_add_attention: bool,
    #[serde(default = "silu")]
    act_fn: String,
    sample_size: Option<usize>,
}

fn scaling_factor() -> f64 {
    0.18215
}

/// The VAE (`AutoencoderKL`).
#[derive(Debug, Clone)]
pub struct VaeConfig {
    pub candle: vae::AutoEncoderKLConfig,
    pub out_channels: usize,
    /// Latents are divided by this before decoding (0.18215 for SD 1.x/2.x, 0.13025 for SDXL).
    pub scaling_factor: f64,
    /// Pixels per latent, 2^(blocks - 1): 8 for every Stable Diffusion VAE.
    pub scale: usize,
    /// The image size the VAE was trained at (pixels): the tile size of a tiled decode.
    pub sample_size: usize,
}

impl VaeConfig {
    pub fn read(path: &Path) -> Result<VaeConfig> {
        let j: VaeJson = read_json(path)?;
        let where_ = path.display();
        ensure!(j.shift_factor.unwrap_or(0.0) == 0.0, "{where_}: shift_factor is not supported");
        ensure!(matches!(j.latents_mean, None | Some(Value::Null)), "{where_}: latents_mean is not supported");
        ensure!(j.mid_block_add_attention, "{where_}: a mid block without attention is not supported");
        ensure!(j.act_fn == "silu", "{where_}: act_fn {:?} is not supported (silu)", j.act_fn);
        let candle = vae::AutoEncoderKLConfig {
            block_out_channels: j.block_out_channels.clone(),
            layers_per_block: j.layers_per_block,
            latent_channels: j.latent_channels,
            norm_num_groups: j.norm_num_groups,
            use_quant_conv: j.use_quant_conv,
            use_post_quant_conv: j.use_post_quant_conv,
        };
        let scale = 1 << (j.block_out_channels.len() - 1);
        Ok(VaeConfig {
            candle,
            out_channels: j.out_channels,
            scaling_factor: j.scaling_factor,
            scale,
            sample_size: j.sample_size.unwrap_or(512),
        })
    }
}

/// A CLIP text encoder's `config.json` (`CLIPTextModel` or `CLIPTextModelWithProjection`).
#[derive(Debug, Clone, Deserialize)]
pub struct ClipConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default = "seventy_seven")]
    pub max_position_embeddings: usize,
    #[serde(default = "quick_gelu")]
    pub hidden_act: String,
    #[serde(default = "norm_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub projection_dim: Option<usize>,
    #[serde(default = "eos")]
    pub eos_token_id: u32,
}

fn seventy_seven() -> usize {
    77
}
fn quick_gelu() -> String {
    "quick_gelu".into()
}
fn eos() -> u32 {
    2
}

impl ClipConfig {
    pub fn read(path: &Path) -> Result<ClipConfig> {
        let c: ClipConfig = read_json(path)?;
        ensure!(
            matches!(c.hidden_act.as_str(), "quick_gelu" | "gelu"),
            "{}: hidden_act {:?} is not supported (quick_gelu, gelu)",
            path.display(),
            c.hidden_act
        );
        Ok(c)
    }
}
