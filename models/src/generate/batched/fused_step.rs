//! A decoding step of [`BatchedLlama`] on a GPU as a few kernels a layer (`fused_step.cu`)
//! rather than candle's ~21 ops. A step of one request is bound by its kernel launches (each
//! a few microseconds, the matrices read in far less), so the launches are what is cut:
//! - every step: a row's new key and value go straight into its cache slot with the queries'
//!   rotation (one kernel for what took seven), and attention is one kernel for all heads of
//!   all rows (for six), reading each row's slot and position from one small table;
//! - up to [`MAX_ROWS`] rows: the matrix products are tern's own matrix-vector kernels, which
//!   also apply the RMS norm before them, the rotation and cache stores, SiLU gating and the
//!   residual sum after them, so a layer is five kernels;
//! - more rows: cuBLAS products (compute-bound there) into buffers the step allocates once, the
//!   output and down products adding straight into the residual stream, with the norm as one
//!   kernel and the gating as another, so a layer is eight.
//!
//! F32 throughout, as the unfused step: the two differ only in the order of additions
//! (`tern-bench-models --only step-check` measures by how much), except the cuBLAS products of
//! steps of more than [`MAX_ROWS`] rows where [`BatchedLlama::set_tf32_products`] asks for TF32
//! tensor cores (F32 in and out, inputs rounded to 10 bits of mantissa, F32 sums; chosen with
//! `TERN_PRECISION=tf32-products`, never the default). Only for dense weights
//! ([`super::WeightLayout::Dense`]) whose widths are multiples of 4 and heads of at most 256.

use std::sync::OnceLock;

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, Device, Layout, Module, Result, Shape, Storage, Tensor};

use super::{BatchedLlama, Matrix, Projections, RowCache};
use crate::generate::architecture::Config;

/// Rows the matrix-vector kernels take; steps of more use cuBLAS.
pub(crate) const MAX_ROWS: usize = 8;
/// Threads of a matrix-vector block (8 warps, an output each) and of the other kernels.
const THREADS: u32 = 256;
/// Positions the attention kernel's shared memory holds scores for.
const MAX_POSITIONS: usize = 8192;

/// The kernels, loaded on the model's device at its first fused step.
pub(super) struct Kernels {
    stream: Arc<CudaStream>,
    /// candle's cuBLAS handle, bound to that stream.
    blas: Arc<candle_core::cuda_backend::cudarc::cublas::CudaBlas>,
    gemv: CudaFunction,
    gemv_add: CudaFunction,
    gemv_gate_up: CudaFunction,
    gemv_qkv: CudaFunction,
    rope_store: CudaFunction,
    rms_norm: CudaFunction,
    silu_mul: CudaFunction,
    attention: CudaFunction,
}

fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    crate::generate::nvrtc_once(&PTX, include_str!("fused_step.cu"), "the fused step's kernels")
}

impl Kernels {
    /// A launch of `func` on the device's stream (candle's: the step's other ops run there).
    fn builder<'a>(&'a self, func: &'a CudaFunction) -> LaunchArgs<'a> {
        self.stream.launch_builder(func)
    }

    fn load(dev: &CudaDevice) -> Result<Kernels> {
        let ptx = ptx()?;
        let f = |name: &str| dev.get_or_load_custom_func(name, "tern_fused_step", ptx).map(|f| f.into_cuda_function());
        Ok(Kernels {
            stream: dev.cuda_stream(),
            blas: dev.cublas_handle(),
            gemv: f("tern_gemv")?,
            gemv_add: f("tern_gemv_add")?,
            gemv_gate_up: f("tern_gemv_gate_up")?,
            gemv_qkv: f("tern_gemv_qkv")?,
            rope_store: f("tern_rope_store")?,
            rms_norm: f("tern_rms_norm")?,
            silu_mul: f("tern_silu_mul")?,
            attention: f("tern_decode_attention")?,
        })
    }
}

/// Whether the fused step serves this model: on a GPU, dense matrices (q, k and v stacked),
/// widths that are multiples of 4, heads of at most 256 and rotary tables of at most
/// [`MAX_POSITIONS`].
pub(super) fn supports(llama: &BatchedLlama) -> bool {
    let cfg = &llama.cfg;
    let widths = [cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim];
    llama.device.is_cuda()
        && llama.layers.first().is_some_and(|l| matches!(l.qkv, Projections::Stacked(..)))
        && matches!(llama.output, Matrix::Dense(_))
        && widths.iter().all(|w| w % 4 == 0)
        && cfg.head_dim % 2 == 0
        && cfg.head_dim <= THREADS as usize
        && llama.cos.dim(0).is_ok_and(|positions| positions <= MAX_POSITIONS)
}

/// The device memory of a contiguous tensor on a GPU.
fn view<'a, T: CudaDType + DeviceRepr>(storage: &'a Storage, layout: &Layout) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(s) = storage else { bail!("fused step: a tensor is not on the GPU") };
    let Some((a, b)) = layout.contiguous_offsets() else { bail!("fused step: a tensor is not contiguous") };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by the kernel the buffer is made for before it is read.
    unsafe { dev.alloc::<T>(len) }
}

fn tensor<T: CudaDType + DeviceRepr>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())), shape, BackpropOp::none(), false)
}

fn dense(m: &Matrix) -> Result<&Tensor> {
    match m {
        Matrix::Dense(w) => Ok(w),
        Matrix::Quantized(_) => bail!("fused step: a quantized matrix"),
    }
}

fn stacked(p: &Projections) -> Result<&Tensor> {
    match p {
        Projections::Stacked(w, _) => Ok(w),
        Projections::Apart(_) => bail!("fused step: projections kept apart"),
    }
}

fn blocks(n: usize, per_block: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(per_block) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

impl BatchedLlama {
    /// [`BatchedLlama::step`] as the module's doc says: the logits of each row, `(rows,
    /// vocabulary)` on the device.
    pub(super) fn step_fused(&self, rows: &mut [(u32, &mut RowCache)]) -> anyhow::Result<Tensor> {
        let Device::Cuda(dev) = &self.device else { anyhow::bail!("fused step: not on a GPU") };
        let kernels = match self.kernels.get() {
            Some(k) => k,
            None => {
                let k = Kernels::load(dev)?;
                self.kernels.get_or_init(|| k)
            }
        };
        let n = rows.len();
        let Config { hidden, heads, kv_heads, head_dim: d, ffn, rms_eps: eps, .. } = self.cfg;
        let (q_dim, width) = (heads * d, (heads + 2 * kv_heads) * d);
        // The rows' tokens, then each row's slot and position: one copy to the device.
        let mut table: Vec<u32> = rows.iter().map(|r| r.0).collect();
        table.extend(rows.iter().flat_map(|r| [r.1.slot as u32, r.1.len as u32]));
        let table = Tensor::from_vec(table, 3 * n, &self.device)?;
        let x = self.embeddings.forward(&table.narrow(0, 0, n)?)?.contiguous()?;
        let meta = table.narrow(0, n, 2 * n)?;
        let span = rows.iter().map(|r| r.1.len + 1).max().unwrap_or(1);

        let caches = self.lock_caches();
        let positions = caches.dims().1;
        anyhow::ensure!(span < positions, "fused step: position {span} is past the caches' {positions}");
        let (heads_i, kv_i, d_i, pos_i) = (heads as i32, kv_heads as i32, d as i32, positions as i32);
        let (rows_i, hidden_i, ffn_i, one) = (n as i32, hidden as i32, ffn as i32, 1i32);
        let small = n <= MAX_ROWS;
        let q = tensor(alloc::<f32>(dev, n * q_dim)?, dev, (n, q_dim));
        let attended = tensor(alloc::<f32>(dev, n * q_dim)?, dev, (n, q_dim));
        let gated = tensor(alloc::<f32>(dev, n * ffn)?, dev, (n, ffn));
        let normed = tensor(alloc::<f32>(dev, n * hidden)?, dev, (n, hidden));
        // The cuBLAS products' outputs, reused by every layer (more rows only).
        let (qkv_out, gu_out) = if small { (None, None) } else { (Some(alloc::<f32>(dev, n * width)?), Some(alloc::<f32>(dev, n * 2 * ffn)?)) };
        let (sx, lx) = x.storage_and_layout();
        let xv = view::<f32>(&sx, lx)?;
        let (smeta, lmeta) = meta.storage_and_layout();
        let metav = view::<u32>(&smeta, lmeta)?;
        let (scos, lcos) = self.cos.storage_and_layout();
        let cosv = view::<f32>(&scos, lcos)?;
        let (ssin, lsin) = self.sin.storage_and_layout();
        let sinv = view::<f32>(&ssin, lsin)?;
        let (sq, lq) = q.storage_and_layout();
        let qv = view::<f32>(&sq, lq)?;
        let (sa, la) = attended.storage_and_layout();
        let av = view::<f32>(&sa, la)?;
        let (sg, lg) = gated.storage_and_layout();
        let gv = view::<f32>(&sg, lg)?;
        let (sn, ln) = normed.storage_and_layout();
        let nv = view::<f32>(&sn, ln)?;
        // normed = rms_norm(x) * norm (more rows; the residual sums are in x already: the
        // products add into it).
        let norm_x = |norm: &Tensor| -> anyhow::Result<()> {
            let (sw, lw) = norm.storage_and_layout();
            let wv = view::<f32>(&sw, lw)?;
            let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut b = kernels.builder(&kernels.rms_norm);
            b.arg(&xv).arg(&hidden_i).arg(&wv).arg(&eps).arg(&nv);
            // SAFETY: rows x hidden floats in x and normed; hidden in the norm.
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        };

        for (l, layer) in self.layers.iter().enumerate() {
            let (ck, cv) = &caches.layers[l];
            let (sk, lk) = ck.storage_and_layout();
            let kv = view::<f32>(&sk, lk)?;
            let (svc, lvc) = cv.storage_and_layout();
            let vv = view::<f32>(&svc, lvc)?;
            let wqkv = stacked(&layer.qkv)?;
            if small {
                let (sw, lw) = wqkv.storage_and_layout();
                let wv = view::<f32>(&sw, lw)?;
                let (snorm, lnorm) = layer.attn_norm.weight.storage_and_layout();
                let normv = view::<f32>(&snorm, lnorm)?;
                let mut b = kernels.builder(&kernels.gemv_qkv);
                b.arg(&wv).arg(&xv).arg(&rows_i).arg(&hidden_i).arg(&normv).arg(&eps).arg(&metav).arg(&cosv).arg(&sinv);
                b.arg(&qv).arg(&kv).arg(&vv).arg(&heads_i).arg(&kv_i).arg(&d_i).arg(&pos_i);
                // SAFETY: the weights are width x hidden, x rows x hidden, q rows x q_dim; rows'
                // slots and positions are inside the caches (checked above).
                unsafe { b.launch(blocks(width / 2, 8)) }.w()?;
            } else {
                norm_x(&layer.attn_norm.weight)?;
                let qkv = qkv_out.as_ref().expect("more rows");
                self.product(kernels, &nv, wqkv, qkv.device_ptr(&kernels.stream).0, n, false)?;
                let mut b = kernels.builder(&kernels.rope_store);
                b.arg(qkv).arg(&rows_i).arg(&metav).arg(&cosv).arg(&sinv).arg(&qv).arg(&kv).arg(&vv);
                b.arg(&heads_i).arg(&kv_i).arg(&d_i).arg(&pos_i);
                let cfg = LaunchConfig { grid_dim: ((n * width / 2).div_ceil(THREADS as usize) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: as above, from a product of rows x width.
                unsafe { b.launch(cfg) }.w()?;
            }
            {
                let shared = ((d + 32 + span + THREADS as usize) * 4) as u32;
                let cfg = LaunchConfig { grid_dim: (heads as u32, n as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: shared };
                let scale = 1.0 / (d as f32).sqrt();
                let mut b = kernels.builder(&kernels.attention);
                b.arg(&qv).arg(&kv).arg(&vv).arg(&metav).arg(&av).arg(&heads_i).arg(&kv_i).arg(&d_i).arg(&pos_i).arg(&scale);
                // SAFETY: every row's positions up to its own are inside its slot; the shared
                // memory holds the longest row's scores.
                unsafe { b.launch(cfg) }.w()?;
            }
            let wo = dense(&layer.attn_output)?;
            let wgu = stacked(&layer.gate_up)?;
            let wdown = dense(&layer.down)?;
            if small {
                self.gemv_add(kernels, wo, &av, n, q_dim, &xv, hidden)?;
                let (sw, lw) = wgu.storage_and_layout();
                let wv = view::<f32>(&sw, lw)?;
                let (snorm, lnorm) = layer.ffn_norm.weight.storage_and_layout();
                let normv = view::<f32>(&snorm, lnorm)?;
                let mut b = kernels.builder(&kernels.gemv_gate_up);
                b.arg(&wv).arg(&ffn_i).arg(&xv).arg(&rows_i).arg(&hidden_i).arg(&normv).arg(&eps).arg(&gv);
                // SAFETY: the weights are 2 ffn x hidden, x rows x hidden, gated rows x ffn.
                unsafe { b.launch(blocks(ffn, 8)) }.w()?;
                self.gemv_add(kernels, wdown, &gv, n, ffn, &xv, hidden)?;
            } else {
                let x_ptr = xv.device_ptr(&kernels.stream).0;
                self.product(kernels, &av, wo, x_ptr, n, true)?;
                norm_x(&layer.ffn_norm.weight)?;
                let gu = gu_out.as_ref().expect("more rows");
                self.product(kernels, &nv, wgu, gu.device_ptr(&kernels.stream).0, n, false)?;
                let mut b = kernels.builder(&kernels.silu_mul);
                b.arg(gu).arg(&rows_i).arg(&ffn_i).arg(&gv);
                // SAFETY: rows x 2 ffn in, rows x ffn out.
                unsafe { b.launch(blocks(n * ffn, THREADS as usize)) }.w()?;
                self.product(kernels, &gv, wdown, x_ptr, n, true)?;
            }
        }
        let output = dense(&self.output)?;
        let vocab = output.dim(0)?;
        let logits = if small {
            let (sw, lw) = output.storage_and_layout();
            let wv = view::<f32>(&sw, lw)?;
            let (snorm, lnorm) = self.norm.weight.storage_and_layout();
            let normv = view::<f32>(&snorm, lnorm)?;
            let out = alloc::<f32>(dev, n * vocab)?;
            let vocab_i = vocab as i32;
            let mut b = kernels.builder(&kernels.gemv);
            b.arg(&wv).arg(&vocab_i).arg(&xv).arg(&rows_i).arg(&hidden_i).arg(&normv).arg(&one).arg(&eps).arg(&out);
            // SAFETY: the output matrix is vocab x hidden, x rows x hidden, out rows x vocab.
            unsafe { b.launch(blocks(vocab, 8)) }.w()?;
            tensor(out, dev, (n, vocab))
        } else {
            norm_x(&self.norm.weight)?;
            let out = alloc::<f32>(dev, n * vocab)?;
            self.product(kernels, &nv, output, out.device_ptr(&kernels.stream).0, n, false)?;
            tensor(out, dev, (n, vocab))
        };
        drop(caches);
        for row in rows.iter_mut() {
            row.1.len += 1;
        }
        Ok(logits)
    }

    /// `out = a · wᵀ` (or `out += a · wᵀ` with `accumulate`) for `a` rows x k and `w` outs x k,
    /// F32 and contiguous, `out` rows x outs on the device, by cuBLAS on the step's stream: F32
    /// products, or TF32 tensor-core ones where [`BatchedLlama::set_tf32_products`] is on. The
    /// output is the caller's buffer (reused by every layer, or the residual stream itself), so
    /// a step allocates no tensor per product.
    fn product(&self, kernels: &Kernels, a: &CudaView<'_, f32>, w: &Tensor, out: CUdeviceptr, rows: usize, accumulate: bool) -> anyhow::Result<()> {
        use candle_core::cuda_backend::cudarc::cublas::{result::gemm_ex, sys};
        let (outs, k) = w.dims2()?;
        anyhow::ensure!(a.len() == rows * k, "fused step: a product of {} values by {outs}x{k}", a.len());
        let compute = if self.tf32_products.load(std::sync::atomic::Ordering::Relaxed) {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let (sw, lw) = w.storage_and_layout();
        let wv = view::<f32>(&sw, lw)?;
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let (ap, _ga) = a.device_ptr(&kernels.stream);
        let (wp, _gw) = wv.device_ptr(&kernels.stream);
        // Row-major out (rows x outs) is column-major outs x rows = wᵀ(col-major k x outs)ᵀ · a.
        // SAFETY: w holds outs x k floats, a rows x k, out rows x outs (the caller's), all used
        // on this one stream in order.
        unsafe {
            gemm_ex(
                *kernels.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                outs as i32,
                rows as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                wp as *const _,
                sys::cudaDataType_t::CUDA_R_32F,
                k as i32,
                ap as *const _,
                sys::cudaDataType_t::CUDA_R_32F,
                k as i32,
                &beta as *const f32 as *const _,
                out as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                outs as i32,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| anyhow::anyhow!("fused step: cuBLAS product: {e:?}"))
    }

    /// x += y · wᵀ for up to [`MAX_ROWS`] rows.
    #[allow(clippy::too_many_arguments)]
    fn gemv_add(&self, kernels: &Kernels, w: &Tensor, y: &CudaView<'_, f32>, rows: usize, n: usize, x: &CudaView<'_, f32>, outs: usize) -> anyhow::Result<()> {
        let (sw, lw) = w.storage_and_layout();
        let wv = view::<f32>(&sw, lw)?;
        let (outs_i, rows_i, n_i) = (outs as i32, rows as i32, n as i32);
        let mut b = kernels.builder(&kernels.gemv_add);
        b.arg(&wv).arg(&outs_i).arg(y).arg(&rows_i).arg(&n_i).arg(x);
        // SAFETY: w is outs x n, y rows x n, x rows x outs.
        unsafe { b.launch(blocks(outs, 8)) }.w()?;
        Ok(())
    }
}
