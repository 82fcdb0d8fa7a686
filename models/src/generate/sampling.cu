// Token picking on the GPU: one block per row of logits, the next token of each row
// (models/src/generate/sampling.rs states the rules; its CPU implementation is the reference).
// Compiled with NVRTC at first use, so it includes no headers.
//
// params, four floats a row: temperature (0 = argmax), top_p (1 = off), top_k (0 = off), u
// (the row's uniform draw in [0, 1)).

#define NEG_INF __int_as_float(0xff800000)

// Orders floats as unsigned integers: a < b exactly when key(a) < key(b) (NaN aside).
__device__ __forceinline__ unsigned int order_key(float x) {
    unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Block-wide sum in a fixed order (warp butterflies, then warp 0 over the warps' sums), so the
// same row gives the same bits every time. Every thread gets thread 0's result.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? scratch[lane] : T(0);
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
        if (lane == 0) scratch[32] = v;
    }
    __syncthreads();
    return scratch[32];
}

// The row's largest logit and its first index.
__device__ void block_argmax(float& best, int& best_i, float* fscratch, int* iscratch) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, best, o);
        int oi = __shfl_down_sync(0xffffffffu, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) { fscratch[warp] = best; iscratch[warp] = best_i; }
    __syncthreads();
    if (warp == 0) {
        best = lane < warps ? fscratch[lane] : NEG_INF;
        best_i = lane < warps ? iscratch[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_down_sync(0xffffffffu, best, o);
            int oi = __shfl_down_sync(0xffffffffu, best_i, o);
            if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
        }
        if (lane == 0) { fscratch[32] = best; iscratch[32] = best_i; }
    }
    __syncthreads();
    best = fscratch[32];
    best_i = iscratch[32];
}

extern "C" __global__ void tern_pick_tokens(const float* logits, const float* params, unsigned int* out, int vocab) {
    __shared__ float fscratch[33];
    __shared__ int iscratch[33];
    __shared__ unsigned int uscratch[33];
    __shared__ float chunk_sums[1024];
    const float* row = logits + (size_t)blockIdx.x * (size_t)vocab;
    const float temperature = params[blockIdx.x * 4 + 0];
    const float top_p = params[blockIdx.x * 4 + 1];
    const unsigned int top_k = (unsigned int)params[blockIdx.x * 4 + 2];
    const float u = params[blockIdx.x * 4 + 3];
    const int t = threadIdx.x, n = blockDim.x;

    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = t; i < vocab; i += n) {
        float x = row[i];
        if (x > best) { best = x; best_i = i; }
    }
    block_argmax(best, best_i, fscratch, iscratch);
    if (!(temperature > 0.0f)) {
        if (t == 0) out[blockIdx.x] = best_i == 0x7fffffff ? 0u : (unsigned int)best_i;
        return;
    }
    const float inv_t = 1.0f / temperature;

    // Kept: the tokens whose logit's key is at least `floor_key`. Top-k: the k-th largest
    // key, found bit by bit (the largest key with at least k logits at or above it).
    unsigned int floor_key = 0;
    if (top_k > 0 && top_k < (unsigned int)vocab) {
        unsigned int found = 0;
        for (int b = 31; b >= 0; --b) {
            unsigned int cand = found | (1u << b);
            unsigned int c = 0;
            for (int i = t; i < vocab; i += n) c += order_key(row[i]) >= cand ? 1u : 0u;
            if (block_sum(c, uscratch) >= top_k) found = cand;
        }
        floor_key = found;
    }
    // Top-p: the largest key whose logits at or above it (and kept) hold at least top_p of
    // the kept mass: the fewest likeliest tokens that reach top_p.
    if (top_p < 1.0f) {
        float s = 0.0f;
        for (int i = t; i < vocab; i += n) {
            float x = row[i];
            if (order_key(x) >= floor_key) s += expf((x - best) * inv_t);
        }
        const float target = top_p * block_sum(s, fscratch);
        unsigned int found = 0;
        for (int b = 31; b >= 0; --b) {
            unsigned int cand = found | (1u << b);
            unsigned int at_least = cand > floor_key ? cand : floor_key;
            float m = 0.0f;
            for (int i = t; i < vocab; i += n) {
                float x = row[i];
                if (order_key(x) >= at_least) m += expf((x - best) * inv_t);
            }
            if (block_sum(m, fscratch) >= target) found = cand;
        }
        if (found > floor_key) floor_key = found;
    }

    // The draw: the first kept token, in vocabulary order, whose running mass passes u times
    // the kept mass. Each thread sums a contiguous chunk; thread 0 walks the chunks' sums,
    // then the one chunk that holds the draw.
    const int chunk = (vocab + n - 1) / n;
    const int lo = t * chunk, hi = (lo + chunk < vocab ? lo + chunk : vocab);
    float s = 0.0f;
    for (int i = lo; i < hi; ++i) {
        float x = row[i];
        if (order_key(x) >= floor_key) s += expf((x - best) * inv_t);
    }
    chunk_sums[t] = s;
    __syncthreads();
    if (t == 0) {
        float total = 0.0f;
        for (int c = 0; c < n; ++c) total += chunk_sums[c];
        const float target = u * total;
        float acc = 0.0f;
        // Where rounding leaves the draw at the total, the row's likeliest token.
        int pick = best_i;
        for (int c = 0; c < n; ++c) {
            if (acc + chunk_sums[c] > target) {
                const int clo = c * chunk, chi = (clo + chunk < vocab ? clo + chunk : vocab);
                for (int i = clo; i < chi; ++i) {
                    float x = row[i];
                    if (order_key(x) < floor_key) continue;
                    pick = i;
                    acc += expf((x - best) * inv_t);
                    // Rounding may leave the draw past the chunk's end: its last kept token.
                    if (acc > target) break;
                }
                break;
            }
            acc += chunk_sums[c];
        }
        out[blockIdx.x] = (unsigned int)pick;
    }
}
