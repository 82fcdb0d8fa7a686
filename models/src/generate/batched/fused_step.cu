// One decoding step of the llama pass on a GPU in a few kernels a layer
// (models/src/generate/batched/fused_step.rs says which runs when). F32 throughout, as the
// unfused step computes. Compiled with NVRTC at first use, so it includes no headers.
//
// Layouts: activations are row-major `rows x width`; a weight matrix is `outs x n`, row-major
// (one output's weights contiguous); the key and value caches are `slots x kv_heads x
// positions x head_dim`; `meta` holds each row's cache slot and position, `2 x rows` u32.

#define MAX_ROWS 8  // rows the matrix-vector kernels take (one accumulator each)
#define WARPS 8     // warps a block of them has: one output (or pair) per warp
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum or maximum (blockDim.x a multiple of 32); every thread gets the result.
__device__ float block_reduce(float v, float* red, bool is_max) {
    v = is_max ? warp_max(v) : warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();  // red may still be read from the last call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : (is_max ? NEG_INF : 0.f);
    return is_max ? warp_max(v) : warp_sum(v);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// inv[r] = 1 / sqrt(mean(x[r]^2) + eps) for each of `rows` rows of n floats (warp r takes row
// r), as candle's rms_norm; 1 where `use_norm` is 0. Ends with a barrier.
__device__ void inverse_rms(const float* x, int rows, int n, int use_norm, float eps, float* inv) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < rows) {
        float s = 0.f;
        if (use_norm) {
            const float* xr = x + (size_t)warp * n;
            for (int i = lane; i < n; i += 32) s += xr[i] * xr[i];
            s = warp_sum(s);
        }
        if (lane == 0) inv[warp] = use_norm ? rsqrtf(s / n + eps) : 1.f;
    }
    __syncthreads();
}

// acc[r] += this lane's share of sum_i w[i] * norm[i] * x[r][i] (norm skipped where use_norm
// is 0), in 16-byte steps: n % 4 == 0 and every row 16-byte aligned.
__device__ __forceinline__ void dot_rows(const float* __restrict__ w, const float* __restrict__ x, int rows, int n,
                                         const float* __restrict__ norm, int use_norm, float acc[MAX_ROWS]) {
    int lane = threadIdx.x & 31;
    for (int i = lane * 4; i < n; i += 128) {
        float4 a = *reinterpret_cast<const float4*>(w + i);
        if (use_norm) {
            float4 g = *reinterpret_cast<const float4*>(norm + i);
            a.x *= g.x; a.y *= g.y; a.z *= g.z; a.w *= g.w;
        }
#pragma unroll
        for (int r = 0; r < MAX_ROWS; r++) {
            if (r < rows) {
                float4 b = *reinterpret_cast<const float4*>(x + (size_t)r * n + i);
                acc[r] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        }
    }
}

// Stores output pair (o, o + 1) of the stacked q, k, v projection for row r: queries rotated
// into q (`rows x heads x head_dim`), keys rotated and values as they are into the row's slot
// at its position. Rotary pairs are GGML's interleaved ones (candle's rope_i).
__device__ __forceinline__ void store_qkv_pair(int r, int o, float a, float b, const unsigned* meta, const float* cosines,
                                               const float* sines, float* q, float* kc, float* vc, int heads, int kv_heads,
                                               int d, int positions) {
    unsigned slot = meta[2 * r], pos = meta[2 * r + 1];
    int qd = heads * d, kd = kv_heads * d;
    if (o < qd + kd) {
        int i = (o % d) / 2, half = d / 2;
        float c = cosines[(size_t)pos * half + i], s = sines[(size_t)pos * half + i];
        float ra = a * c - b * s, rb = a * s + b * c;
        if (o < qd) {
            q[(size_t)r * qd + o] = ra;
            q[(size_t)r * qd + o + 1] = rb;
        } else {
            int k = o - qd;
            size_t at = (((size_t)slot * kv_heads + k / d) * positions + pos) * d + k % d;
            kc[at] = ra;
            kc[at + 1] = rb;
        }
    } else {
        int k = o - qd - kd;
        size_t at = (((size_t)slot * kv_heads + k / d) * positions + pos) * d + k % d;
        vc[at] = a;
        vc[at + 1] = b;
    }
}

// out[r][o] = sum_i w[o][i] * xn[r][i], xn the rows rms-normed by `norm` when use_norm is 1.
// Up to MAX_ROWS rows; grid ceil(outs / WARPS), WARPS x 32 threads.
extern "C" __global__ void tern_gemv(const float* w, int outs, const float* x, int rows, int n, const float* norm,
                                     int use_norm, float eps, float* out) {
    __shared__ float inv[MAX_ROWS];
    inverse_rms(x, rows, n, use_norm, eps, inv);
    int o = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= outs) return;
    float acc[MAX_ROWS] = {0.f};
    dot_rows(w + (size_t)o * n, x, rows, n, norm, use_norm, acc);
#pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) {
        if (r < rows) {
            float s = warp_sum(acc[r]);
            if (lane == 0) out[(size_t)r * outs + o] = s * inv[r];
        }
    }
}

// x[r][o] += sum_i w[o][i] * y[r][i]: a projection added to the residual stream in place.
extern "C" __global__ void tern_gemv_add(const float* w, int outs, const float* y, int rows, int n, float* x) {
    int o = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= outs) return;
    float acc[MAX_ROWS] = {0.f};
    dot_rows(w + (size_t)o * n, y, rows, n, y, 0, acc);
#pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) {
        if (r < rows) {
            float s = warp_sum(acc[r]);
            if (lane == 0) x[(size_t)r * outs + o] += s;
        }
    }
}

// out[r][o] = silu(gate) * up, gate and up outputs o and ffn + o of the stacked gate and up
// matrix over the rows rms-normed by `norm`.
extern "C" __global__ void tern_gemv_gate_up(const float* w, int ffn, const float* x, int rows, int n, const float* norm,
                                             float eps, float* out) {
    __shared__ float inv[MAX_ROWS];
    inverse_rms(x, rows, n, 1, eps, inv);
    int o = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= ffn) return;
    float gate[MAX_ROWS] = {0.f}, up[MAX_ROWS] = {0.f};
    dot_rows(w + (size_t)o * n, x, rows, n, norm, 1, gate);
    dot_rows(w + (size_t)(ffn + o) * n, x, rows, n, norm, 1, up);
#pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) {
        if (r < rows) {
            float g = warp_sum(gate[r]), u = warp_sum(up[r]);
            if (lane == 0) out[(size_t)r * ffn + o] = silu(g * inv[r]) * (u * inv[r]);
        }
    }
}

// The stacked q, k, v projection of the rows rms-normed by `norm`, one output pair a warp,
// stored as store_qkv_pair does. Grid ceil(pairs / WARPS).
extern "C" __global__ void tern_gemv_qkv(const float* w, const float* x, int rows, int n, const float* norm, float eps,
                                         const unsigned* meta, const float* cosines, const float* sines, float* q, float* kc,
                                         float* vc, int heads, int kv_heads, int d, int positions) {
    __shared__ float inv[MAX_ROWS];
    inverse_rms(x, rows, n, 1, eps, inv);
    int pairs = (heads + 2 * kv_heads) * d / 2;
    int p = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (p >= pairs) return;
    float a[MAX_ROWS] = {0.f}, b[MAX_ROWS] = {0.f};
    dot_rows(w + (size_t)(2 * p) * n, x, rows, n, norm, 1, a);
    dot_rows(w + (size_t)(2 * p + 1) * n, x, rows, n, norm, 1, b);
#pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) {
        if (r < rows) {
            float sa = warp_sum(a[r]), sb = warp_sum(b[r]);
            if (lane == 0) store_qkv_pair(r, 2 * p, sa * inv[r], sb * inv[r], meta, cosines, sines, q, kc, vc, heads, kv_heads, d, positions);
        }
    }
}

// The same stores from a projection already made (`rows x (heads + 2 kv_heads) head_dim`), one
// pair a thread.
extern "C" __global__ void tern_rope_store(const float* qkv, int rows, const unsigned* meta, const float* cosines,
                                           const float* sines, float* q, float* kc, float* vc, int heads, int kv_heads, int d,
                                           int positions) {
    int width = (heads + 2 * kv_heads) * d, pairs = width / 2;
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows * pairs) return;
    int r = t / pairs, o = 2 * (t % pairs);
    const float* row = qkv + (size_t)r * width;
    store_qkv_pair(r, o, row[o], row[o + 1], meta, cosines, sines, q, kc, vc, heads, kv_heads, d, positions);
}

// h[r] = x[r] rms-normed by `norm` (the residual sums are in x already: the products add into
// it). One block a row.
extern "C" __global__ void tern_rms_norm(const float* x, int n, const float* norm, float eps, float* h) {
    __shared__ float red[32];
    const float* xr = x + (size_t)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    float inv = rsqrtf(block_reduce(s, red, false) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) h[(size_t)blockIdx.x * n + i] = xr[i] * inv * norm[i];
}

// out[r][o] = silu(gu[r][o]) * gu[r][ffn + o].
extern "C" __global__ void tern_silu_mul(const float* gu, int rows, int ffn, float* out) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows * ffn) return;
    int r = t / ffn, o = t % ffn;
    out[t] = silu(gu[(size_t)r * 2 * ffn + o]) * gu[(size_t)r * 2 * ffn + ffn + o];
}

// Attention of one query head of one row over its slot's keys and values at positions 0..=its
// own: grid (heads, rows), 256 threads. Dynamic shared memory: head_dim + 32 + span + 256
// floats, span the longest row's positions. head_dim <= 256.
extern "C" __global__ void tern_decode_attention(const float* q, const float* kc, const float* vc, const unsigned* meta,
                                                 float* out, int heads, int kv_heads, int d, int positions, float scale) {
    extern __shared__ float sm[];
    int h = blockIdx.x, r = blockIdx.y;
    unsigned slot = meta[2 * r], len = meta[2 * r + 1] + 1;
    int kh = h / (heads / kv_heads);
    float* qs = sm;
    float* red = qs + d;
    float* scores = red + 32;
    float* part = scores + len;
    size_t base = ((size_t)slot * kv_heads + kh) * positions * d;
    const float* K = kc + base;
    const float* V = vc + base;
    for (int i = threadIdx.x; i < d; i += blockDim.x) qs[i] = q[((size_t)r * heads + h) * d + i];
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (unsigned j = warp; j < len; j += warps) {
        float s = 0.f;
        for (int i = lane; i < d; i += 32) s += qs[i] * K[(size_t)j * d + i];
        s = warp_sum(s);
        if (lane == 0) scores[j] = s * scale;
    }
    __syncthreads();
    float m = NEG_INF;
    for (unsigned j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_reduce(m, red, true);
    float z = 0.f;
    for (unsigned j = threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(scores[j] - m);
        scores[j] = e;
        z += e;
    }
    z = block_reduce(z, red, false);  // its barriers make every score visible
    int groups = blockDim.x / d, i = threadIdx.x % d, g = threadIdx.x / d;
    float acc = 0.f;
    if (g < groups)
        for (unsigned j = g; j < len; j += groups) acc += scores[j] * V[(size_t)j * d + i];
    part[threadIdx.x] = acc;
    __syncthreads();
    if (g == 0) {
        for (int k = 1; k < groups; k++) acc += part[k * d + i];
        out[((size_t)r * heads + h) * d + i] = acc / z;
    }
}
