//! Reader for CTranslate2 `model.bin` files (the faster-whisper format) and the mapping of its
//! Whisper variables to the Hugging Face names candle's `whisper::model::Whisper` loads.
//!
//! Layout (little endian): u32 version, string spec name, u32 revision, u32 variable count, then
//! per variable: string name, u8 rank, rank x u32 dims, u8 dtype, u32 byte count, raw bytes;
//! then aliases, which we do not need (the only one ties the output projection to the token
//! embeddings, which candle already does). A string is a u16 length and NUL-padded bytes.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};

/// The `dtype` byte of an F16 variable.
pub(crate) const DTYPE_F16: u8 = 4;

/// One variable as stored.
pub(crate) struct RawVar {
    pub dims: Vec<usize>,
    pub dtype: u8,
    pub data: Vec<u8>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| anyhow!("model.bin truncated at byte {}", self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        let b = b.split(|&c| c == 0).next().unwrap_or(b);
        Ok(String::from_utf8(b.to_vec())?)
    }
}

/// Parses every variable of a CT2 `model.bin`.
pub(crate) fn read_model_bin(bytes: &[u8]) -> Result<HashMap<String, RawVar>> {
    let mut r = Reader { buf: bytes, pos: 0 };
    let version = r.u32()?;
    if version < 5 {
        // Older files lack the spec name/revision header; faster-whisper has written >= 5 for years.
        bail!("unsupported CTranslate2 model.bin version {version}");
    }
    let spec = r.string()?;
    if spec != "WhisperSpec" {
        bail!("model.bin holds a {spec}, not a WhisperSpec");
    }
    let _revision = r.u32()?;
    let count = r.u32()? as usize;
    let mut vars = HashMap::with_capacity(count);
    for _ in 0..count {
        let name = r.string()?;
        let rank = r.u8()? as usize;
        let dims = (0..rank)
            .map(|_| r.u32().map(|d| d as usize))
            .collect::<Result<Vec<_>>>()?;
        let dtype = r.u8()?;
        let nbytes = r.u32()? as usize;
        let data = r.take(nbytes)?.to_vec();
        vars.insert(name, RawVar { dims, dtype, data });
    }
    Ok(vars)
}

impl RawVar {
    /// Converts to an F32 tensor on the CPU (the only float types CT2 whisper files use here are
    /// F32/F16/BF16; int8-quantised files are refused because their scales need separate handling).
    fn to_f32_tensor(&self, name: &str) -> Result<Tensor> {
        let n: usize = self.dims.iter().product::<usize>().max(1);
        let shape = self.dims.clone();
        let dev = Device::Cpu;
        let t = match self.dtype {
            0 => {
                check_len(name, self.data.len(), n * 4)?;
                let v: Vec<f32> = self
                    .data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Tensor::from_vec(v, shape, &dev)?
            }
            DTYPE_F16 | 5 => {
                check_len(name, self.data.len(), n * 2)?;
                let dt = if self.dtype == DTYPE_F16 {
                    DType::F16
                } else {
                    DType::BF16
                };
                Tensor::from_raw_buffer(&self.data, dt, &shape, &dev)?.to_dtype(DType::F32)?
            }
            d => bail!(
                "variable {name} has dtype {d}; only float (F32/F16/BF16) models are supported"
            ),
        };
        Ok(t)
    }

    /// Reads an integer scalar (num_heads is stored as I16).
    fn scalar_usize(&self, name: &str) -> Result<usize> {
        let v = match (self.dtype, self.data.len()) {
            (1, 1) => self.data[0] as i8 as i64,
            (2, 2) => i16::from_le_bytes([self.data[0], self.data[1]]) as i64,
            (3, 4) => i32::from_le_bytes(self.data[..4].try_into()?) as i64,
            _ => bail!("{name} is not an integer scalar"),
        };
        usize::try_from(v).with_context(|| format!("{name} is negative"))
    }
}

fn check_len(name: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        bail!("variable {name}: {got} bytes for {want} expected");
    }
    Ok(())
}

/// The model's tensors under candle's names, plus the architecture read from their shapes.
pub(crate) struct Ct2Whisper {
    pub tensors: HashMap<String, Tensor>,
    pub config: candle_transformers::models::whisper::Config,
}

/// Maps a CT2 Whisper to candle. Suppress tokens are left empty: they come from config.json.
pub(crate) fn to_candle(vars: &HashMap<String, RawVar>) -> Result<Ct2Whisper> {
    let get = |name: &str| -> Result<Tensor> {
        vars.get(name)
            .ok_or_else(|| anyhow!("model.bin lacks {name}"))?
            .to_f32_tensor(name)
    };
    let count_layers = |prefix: &str| {
        (0..)
            .take_while(|i| {
                vars.keys()
                    .any(|k| k.starts_with(&format!("{prefix}/layer_{i}/")))
            })
            .count()
    };
    let heads = |name: &str| -> Result<usize> {
        vars.get(name)
            .ok_or_else(|| anyhow!("model.bin lacks {name}"))?
            .scalar_usize(name)
    };

    let mut t: HashMap<String, Tensor> = HashMap::new();
    // Plain renames: (CT2 prefix, HF prefix); each has weight (+ bias) or gamma/beta.
    let linear =
        |t: &mut HashMap<String, Tensor>, src: &str, dst: &str, bias: bool| -> Result<()> {
            t.insert(format!("{dst}.weight"), get(&format!("{src}/weight"))?);
            if bias {
                t.insert(format!("{dst}.bias"), get(&format!("{src}/bias"))?);
            }
            Ok(())
        };
    let norm = |t: &mut HashMap<String, Tensor>, src: &str, dst: &str| -> Result<()> {
        t.insert(format!("{dst}.weight"), get(&format!("{src}/gamma"))?);
        t.insert(format!("{dst}.bias"), get(&format!("{src}/beta"))?);
        Ok(())
    };
    // Stacked projections: rows [0, d) are the first, [d, 2d) the second, ...
    let split = |t: &mut HashMap<String, Tensor>, src: &str, dsts: &[&str]| -> Result<()> {
        let w = get(&format!("{src}/weight"))?;
        let b = get(&format!("{src}/bias"))?;
        let d = w.dim(0)? / dsts.len();
        for (i, dst) in dsts.iter().enumerate() {
            t.insert(
                format!("{dst}.weight"),
                w.narrow(0, i * d, d)?.contiguous()?,
            );
            // candle's k_proj has no bias (Whisper trains without it; CT2 stores zeros).
            if !dst.ends_with("k_proj") {
                t.insert(format!("{dst}.bias"), b.narrow(0, i * d, d)?.contiguous()?);
            }
        }
        Ok(())
    };

    // The parts every encoder and decoder layer has; `s` is the CT2 layer, `d` the HF one.
    let self_attention = |t: &mut HashMap<String, Tensor>, s: &str, d: &str| -> Result<()> {
        split(
            t,
            &format!("{s}/self_attention/linear_0"),
            &[
                &format!("{d}.self_attn.q_proj"),
                &format!("{d}.self_attn.k_proj"),
                &format!("{d}.self_attn.v_proj"),
            ],
        )?;
        linear(
            t,
            &format!("{s}/self_attention/linear_1"),
            &format!("{d}.self_attn.out_proj"),
            true,
        )?;
        norm(
            t,
            &format!("{s}/self_attention/layer_norm"),
            &format!("{d}.self_attn_layer_norm"),
        )
    };
    let feed_forward = |t: &mut HashMap<String, Tensor>, s: &str, d: &str| -> Result<()> {
        linear(t, &format!("{s}/ffn/linear_0"), &format!("{d}.fc1"), true)?;
        linear(t, &format!("{s}/ffn/linear_1"), &format!("{d}.fc2"), true)?;
        norm(
            t,
            &format!("{s}/ffn/layer_norm"),
            &format!("{d}.final_layer_norm"),
        )
    };

    linear(&mut t, "encoder/conv1", "model.encoder.conv1", true)?;
    linear(&mut t, "encoder/conv2", "model.encoder.conv2", true)?;
    t.insert(
        "model.encoder.embed_positions.weight".into(),
        get("encoder/position_encodings/encodings")?,
    );
    norm(&mut t, "encoder/layer_norm", "model.encoder.layer_norm")?;
    let enc_layers = count_layers("encoder");
    for i in 0..enc_layers {
        let s = format!("encoder/layer_{i}");
        let d = format!("model.encoder.layers.{i}");
        self_attention(&mut t, &s, &d)?;
        feed_forward(&mut t, &s, &d)?;
    }

    t.insert(
        "model.decoder.embed_tokens.weight".into(),
        get("decoder/embeddings/weight")?,
    );
    t.insert(
        "model.decoder.embed_positions.weight".into(),
        get("decoder/position_encodings/encodings")?,
    );
    norm(&mut t, "decoder/layer_norm", "model.decoder.layer_norm")?;
    let dec_layers = count_layers("decoder");
    for i in 0..dec_layers {
        let s = format!("decoder/layer_{i}");
        let d = format!("model.decoder.layers.{i}");
        self_attention(&mut t, &s, &d)?;
        linear(
            &mut t,
            &format!("{s}/attention/linear_0"),
            &format!("{d}.encoder_attn.q_proj"),
            true,
        )?;
        split(
            &mut t,
            &format!("{s}/attention/linear_1"),
            &[
                &format!("{d}.encoder_attn.k_proj"),
                &format!("{d}.encoder_attn.v_proj"),
            ],
        )?;
        linear(
            &mut t,
            &format!("{s}/attention/linear_2"),
            &format!("{d}.encoder_attn.out_proj"),
            true,
        )?;
        norm(
            &mut t,
            &format!("{s}/attention/layer_norm"),
            &format!("{d}.encoder_attn_layer_norm"),
        )?;
        feed_forward(&mut t, &s, &d)?;
    }

    let emb = &t["model.decoder.embed_tokens.weight"];
    let (vocab_size, d_model) = emb.dims2()?;
    let conv1 = &t["model.encoder.conv1.weight"];
    let num_mel_bins = conv1.dim(1)?;
    let max_source_positions = t["model.encoder.embed_positions.weight"].dim(0)?;
    let max_target_positions = t["model.decoder.embed_positions.weight"].dim(0)?;
    // The encoder computes OpenAI's sinusoids for a CTranslate2 model rather than read the
    // file's, as it always has (transcripts equal to faster-whisper's).
    t.remove("model.encoder.embed_positions.weight");
    if enc_layers == 0 || dec_layers == 0 {
        bail!("model.bin has no encoder or decoder layers");
    }
    let config = candle_transformers::models::whisper::Config {
        num_mel_bins,
        max_source_positions,
        d_model,
        encoder_attention_heads: heads("encoder/num_heads")?,
        encoder_layers: enc_layers,
        vocab_size,
        max_target_positions,
        decoder_attention_heads: heads("decoder/num_heads")?,
        decoder_layers: dec_layers,
        suppress_tokens: Vec::new(),
    };
    Ok(Ct2Whisper { tensors: t, config })
}
