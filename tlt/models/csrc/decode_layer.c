// One decoder layer for a few new tokens per row against the slot KV cache, fp32, in one call (decode and
// speculative verification): the same arithmetic as DecoderLayer.forward's torch ops with tlt's matmul and
// attention kernels, without ~20 torch ops a layer. At one row a SmolLM2 decode step spent ~40% of its time in
// per-op overhead (dispatch, allocation, ctypes) rather than in reading weights.
//   h = rms_norm(x) * ln1 (skipped when ln1 is NULL: the drafter's layer)       [M, H]
//   q, k, v = h @ Wqkv^T (+ bqkv); q, k = rms_norm per head * q_norm / k_norm (Qwen3, when given), then rotary
//   k, v -> cache slot s0 + m / T (slots[m / T] where slots is given), position cols[m];
//   a = attention(q, cache, bias, n_keys)
//   x' = x + a @ Wo^T;  x' += (silu(g) * u) @ Wd^T  where  g, u = rms_norm(x') * ln2 @ Wgu^T
// Rows m = b * T + t. Weights are packed by tlt_pack; cos / ssin are [M, D] (ssin = [-sin, sin], see _rotate).
// work holds M * ((nh + 2 nkv) D + nh D + 2 H + 3 I) floats.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

void tlt_small_gemm(const float* x, int M, int K, const float* packed, int N, const float* bias, float* y,
                    int threads);
void tlt_cached_attention(const float* q, int64_t q_sb, int64_t q_st, int64_t q_sh, const float* k, const float* v,
                          int cap, const int64_t* slots, const int64_t* n_keys, const float* bias, float* out, int B,
                          int T, int nh, int nkv, int D, float scale, int threads);

// y = w * (x * rsqrt(mean(x^2) + eps)), torch's rms_norm then the weight, over n floats (n % 8 == 0).
static void rms_norm(const float* x, const float* w, int n, float eps, float* y) {
    __m256 ss = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / (float)n + eps));
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}

// x * cos + [x2, x1] * ssin for one head of D floats, in place (two products and a sum, each rounded: torch's).
static void rotate(float* x, const float* cos, const float* ssin, int D) {
    float tmp[256];
    int half = D / 2;
    for (int d = 0; d < D; d++) {
        float a = x[d] * cos[d], b = x[d < half ? d + half : d - half] * ssin[d];
        tmp[d] = a + b;
    }
    memcpy(x, tmp, sizeof(float) * D);
}

// One row of the qkv projection [(nh + 2 nkv) D], in place: q and k heads normed per head (Qwen3, when the norm
// weights are given), then rotated at the row's position.
static void norm_rotate(float* row, int nh, int nkv, int D, const float* q_norm, const float* k_norm, float eps,
                        const float* cos, const float* ssin) {
    for (int hd = 0; hd < nh + nkv; hd++) {
        float* x = row + (size_t)hd * D;
        const float* nw = hd < nh ? q_norm : k_norm;
        if (nw) rms_norm(x, nw, D, eps, x);
        rotate(x, cos, ssin, D);
    }
}

// act [M, I] = silu(g) * u = g / (1 + exp(-g)) * u, with g, u the halves of each row of gu [M, 2 I]
static void silu_mul(const float* gu, int M, int I, float* act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) {
        const float *g = gu + (size_t)m * 2 * I, *u = g + I;
        float* a = act + (size_t)m * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

void tlt_decode_layer(float* x_out, const float* x_in, int M, int T, int H, int I, int nh, int nkv, int D,
                      const float* ln1, const float* ln2, const float* q_norm, const float* k_norm, float eps,
                      const float* wqkv, const float* bqkv, const float* wo, const float* wgu, const float* wd,
                      const float* cos, const float* ssin, float* k_cache, float* v_cache, int cap, int s0,
                      const int64_t* slots, const int64_t* cols, const int64_t* n_keys, const float* bias, float* work,
                      int threads) {
    const int W = (nh + 2 * nkv) * D, B = M / T;
    float *qkv = work, *attn = qkv + (size_t)M * W, *h = attn + (size_t)M * nh * D, *tmp = h + (size_t)M * H;
    float *gu = tmp + (size_t)M * H, *act = gu + (size_t)M * 2 * I;

    const float* hin = x_in;
    if (ln1) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
        for (int m = 0; m < M; m++) rms_norm(x_in + (size_t)m * H, ln1, H, eps, h + (size_t)m * H);
        hin = h;
    }
    tlt_small_gemm(hin, M, H, wqkv, W, bqkv, qkv, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) {
        float* row = qkv + (size_t)m * W;
        norm_rotate(row, nh, nkv, D, q_norm, k_norm, eps, cos + (size_t)m * D, ssin + (size_t)m * D);
        int64_t slot = slots ? slots[m / T] : s0 + m / T, col = cols[m];
        for (int kh = 0; kh < nkv; kh++) {
            size_t at = (((size_t)slot * nkv + kh) * cap + (size_t)col) * D;
            memcpy(k_cache + at, row + (size_t)(nh + kh) * D, sizeof(float) * D);
            memcpy(v_cache + at, row + (size_t)(nh + nkv + kh) * D, sizeof(float) * D);
        }
    }
    size_t slot0 = slots ? 0 : (size_t)s0 * nkv * cap * D;
    tlt_cached_attention(qkv, (int64_t)T * W, W, D, k_cache + slot0, v_cache + slot0, cap, slots, n_keys, bias, attn,
                         B, T, nh, nkv, D, 1.0f / sqrtf((float)D), threads);

    tlt_small_gemm(attn, M, nh * D, wo, H, NULL, tmp, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) {
        for (size_t i = (size_t)m * H; i < (size_t)(m + 1) * H; i++) x_out[i] = x_in[i] + tmp[i];
        rms_norm(x_out + (size_t)m * H, ln2, H, eps, h + (size_t)m * H);
    }
    tlt_small_gemm(h, M, H, wgu, 2 * I, NULL, gu, threads);
    silu_mul(gu, M, I, act, threads);
    tlt_small_gemm(act, M, I, wd, H, NULL, tmp, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++)
        for (size_t i = (size_t)m * H; i < (size_t)(m + 1) * H; i++) x_out[i] += tmp[i];
}

// ---- bf16 models (CPUs with AVX512-BF16): the same layer over bf16 weights, activations and KV cache ----------
// The layer computes in fp32 between its matmuls; each matmul rounds its input to bf16 and accumulates in fp32
// (tlt_small_gemm_bf16), the K/V written to the cache and the layer's output are rounded to bf16. torch's bf16 ops
// round after every op instead, so the two differ by bf16 rounding (the fused layer is the closer to fp32).
void tlt_small_gemm_bf16(const uint16_t* x, int M, int K, int64_t xs, const uint16_t* packed, int N,
                         const float* bias, float* y32, uint16_t* y16, int threads);
void tlt_f32_to_bf16(const float* x, int64_t n, uint16_t* y);
void tlt_cached_attention_bf16kv(const float* q, int64_t q_sb, int64_t q_st, int64_t q_sh, const uint16_t* k,
                                 const uint16_t* v, int cap, const int64_t* slots, const int64_t* n_keys,
                                 const float* bias, float* out, int B, int T, int nh, int nkv, int D, float scale,
                                 int threads);

static void bf16_to_f32(const uint16_t* x, size_t n, float* y) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + i))), 16)));
    for (; i < n; i++) {
        uint32_t u = (uint32_t)x[i] << 16;
        memcpy(y + i, &u, 4);
    }
}

// y [M, N] fp32 = bf16(x [M, K] fp32) @ W^T (+ bias); xb: M * K bf16 of scratch (K even)
static void gemm_bf16(const float* x, int M, int K, uint16_t* xb, const uint16_t* packed, int N, const float* bias,
                      float* y, int threads) {
    tlt_f32_to_bf16(x, (int64_t)M * K, xb);
    tlt_small_gemm_bf16(xb, M, K, K, packed, N, bias, y, NULL, threads);
}

// work: floats M * ((nh + 2 nkv) D + nh D + 4 H + 3 I) + 2 H + 2 D, then M * max(H, nh D, I) bf16 of scratch.
void tlt_decode_layer_bf16(uint16_t* x_out, const uint16_t* x_in, int M, int T, int H, int I, int nh, int nkv,
                           int D, const uint16_t* ln1, const uint16_t* ln2, const uint16_t* q_norm,
                           const uint16_t* k_norm, float eps, const uint16_t* wqkv, const float* bqkv,
                           const uint16_t* wo, const uint16_t* wgu, const uint16_t* wd, const float* cos,
                           const float* ssin, uint16_t* k_cache, uint16_t* v_cache, int cap, int s0,
                           const int64_t* slots, const int64_t* cols, const int64_t* n_keys, const float* bias,
                           float* work, int threads) {
    const int W = (nh + 2 * nkv) * D, B = M / T;
    float *qkv = work, *attn = qkv + (size_t)M * W, *h = attn + (size_t)M * nh * D, *tmp = h + (size_t)M * H;
    float *gu = tmp + (size_t)M * H, *act = gu + (size_t)M * 2 * I, *x = act + (size_t)M * I;
    float *xo = x + (size_t)M * H, *w1 = xo + (size_t)M * H, *w2 = w1 + H, *wq = w2 + H, *wk = wq + D;
    uint16_t* xb = (uint16_t*)(wk + D);

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) bf16_to_f32(x_in + (size_t)m * H, H, x + (size_t)m * H);
    bf16_to_f32(ln2, H, w2);
    if (q_norm) bf16_to_f32(q_norm, D, wq);
    if (k_norm) bf16_to_f32(k_norm, D, wk);
    const float* hin = x;
    if (ln1) {
        bf16_to_f32(ln1, H, w1);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
        for (int m = 0; m < M; m++) rms_norm(x + (size_t)m * H, w1, H, eps, h + (size_t)m * H);
        hin = h;
    }
    gemm_bf16(hin, M, H, xb, wqkv, W, bqkv, qkv, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) {
        float* row = qkv + (size_t)m * W;
        norm_rotate(row, nh, nkv, D, q_norm ? wq : NULL, k_norm ? wk : NULL, eps, cos + (size_t)m * D,
                    ssin + (size_t)m * D);
        int64_t slot = slots ? slots[m / T] : s0 + m / T, col = cols[m];
        for (int kh = 0; kh < nkv; kh++) {
            size_t at = (((size_t)slot * nkv + kh) * cap + (size_t)col) * D;
            tlt_f32_to_bf16(row + (size_t)(nh + kh) * D, D, k_cache + at);
            tlt_f32_to_bf16(row + (size_t)(nh + nkv + kh) * D, D, v_cache + at);
        }
    }
    size_t slot0 = slots ? 0 : (size_t)s0 * nkv * cap * D;
    tlt_cached_attention_bf16kv(qkv, (int64_t)T * W, W, D, k_cache + slot0, v_cache + slot0, cap, slots, n_keys,
                                bias, attn, B, T, nh, nkv, D, 1.0f / sqrtf((float)D), threads);

    gemm_bf16(attn, M, nh * D, xb, wo, H, NULL, tmp, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) {
        for (size_t i = (size_t)m * H; i < (size_t)(m + 1) * H; i++) xo[i] = x[i] + tmp[i];
        rms_norm(xo + (size_t)m * H, w2, H, eps, h + (size_t)m * H);
    }
    gemm_bf16(h, M, H, xb, wgu, 2 * I, NULL, gu, threads);
    silu_mul(gu, M, I, act, threads);
    gemm_bf16(act, M, I, xb, wd, H, NULL, tmp, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) {
        for (size_t i = (size_t)m * H; i < (size_t)(m + 1) * H; i++) xo[i] += tmp[i];
        tlt_f32_to_bf16(xo + (size_t)m * H, H, x_out + (size_t)m * H);
    }
}
