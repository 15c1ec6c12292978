// y[M, N] = x[M, K] @ W^T (+ bias) in fp32 for a few rows M (decode, verification of a small batch): the regime
// where MKL's sgemm reads the weight at a third of the memory bandwidth. W is pre-packed into panels of 16 output
// columns, each panel contiguous over k ([N/16][K][16], zero-padded), so one pass streams the whole weight
// sequentially while every weight vector loaded feeds up to 6 rows of FMAs (12 accumulators, 2 weight vectors and a
// broadcast: 15 of AVX2's 16 registers), so a chain-4 verification (5 rows a sequence) costs one pass.
// Built at run time by tlt/models/kernels.py (flags: kernels._CFLAGS).
#include <immintrin.h>
#include <string.h>

#define PANEL 16
#define ROWS 6  // rows per pass over a panel
// From PREFETCH_MIN_ROWS + 1 rows, the first pass over a panel prefetches the next one (software prefetch): the
// weight then streams from memory while the later passes compute, instead of each panel's first pass waiting on
// memory and the others on the FMA units. Whole SmolLM2 matmuls per decode step, one AVX2 EPYC core: 4 rows
// 46.6 -> 42.1 ms, 8 rows 58.8 -> 53.9, 16 rows 85.6 -> 81.0, 32 rows 135 -> 126 (two threads: 7-13% less).
// At 1-3 rows (one pass, purely memory-bound) it only got in the hardware prefetcher's way.
#define PREFETCH_MIN_ROWS 3

void tlt_pack(const float* w, int N, int K, float* out) {
    int panels = (N + PANEL - 1) / PANEL;
    memset(out, 0, sizeof(float) * (size_t)panels * K * PANEL);
    for (int n = 0; n < N; n++) {
        float* p = out + (size_t)(n / PANEL) * K * PANEL + n % PANEL;
        const float* row = w + (size_t)n * K;
        for (int k = 0; k < K; k++) p[(size_t)k * PANEL] = row[k];
    }
}

// R rows of x (row stride K) against one panel: 2R accumulators of 8 lanes, written to acc[R][16]. When pf is
// not NULL, the K cache lines of the panel at pf (one 64-byte line per k) are prefetched on the way.
#define PANEL_ROWS(R)                                                                                   \
    static inline void panel_##R(const float* x, int K, const float* p, const float* pf, float* acc) { \
        __m256 a0[R], a1[R];                                                                            \
        for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }      \
        for (int k = 0; k < K; k++) {                                                                   \
            if (pf) _mm_prefetch((const char*)(pf + (size_t)k * PANEL), _MM_HINT_T0);                  \
            __m256 w0 = _mm256_load_ps(p + (size_t)k * PANEL), w1 = _mm256_load_ps(p + (size_t)k * PANEL + 8); \
            for (int r = 0; r < R; r++) {                                                               \
                __m256 xb = _mm256_broadcast_ss(x + (size_t)r * K + k);                                 \
                a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);                                                 \
                a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);                                                 \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < R; r++) {                                                                   \
            _mm256_storeu_ps(acc + r * PANEL, a0[r]);                                                   \
            _mm256_storeu_ps(acc + r * PANEL + 8, a1[r]);                                               \
        }                                                                                               \
    }
PANEL_ROWS(1)
PANEL_ROWS(2)
PANEL_ROWS(3)
PANEL_ROWS(4)
PANEL_ROWS(5)
PANEL_ROWS(6)

void tlt_small_gemm(const float* x, int M, int K, const float* packed, int N, const float* bias, float* y,
                    int threads) {
    int panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int j = 0; j < panels; j++) {
        const float* p = packed + (size_t)j * K * PANEL;
        int n0 = j * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        float acc[ROWS * PANEL];
        const float* pf = M > PREFETCH_MIN_ROWS && j + 1 < panels ? p + (size_t)K * PANEL : NULL;  // next panel
        for (int m = 0; m < M; m += ROWS) {  // the panel stays in L1/L2 for the next rows
            int R = M - m < ROWS ? M - m : ROWS;
            const float* xr = x + (size_t)m * K;
            const float* f = m == 0 ? pf : NULL;
            switch (R) {
                case 1: panel_1(xr, K, p, f, acc); break;
                case 2: panel_2(xr, K, p, f, acc); break;
                case 3: panel_3(xr, K, p, f, acc); break;
                case 4: panel_4(xr, K, p, f, acc); break;
                case 5: panel_5(xr, K, p, f, acc); break;
                default: panel_6(xr, K, p, f, acc); break;
            }
            for (int r = 0; r < R; r++) {
                float* out = y + (size_t)(m + r) * N + n0;
                for (int c = 0; c < width; c++) out[c] = acc[r * PANEL + c] + (bias ? bias[n0 + c] : 0.0f);
            }
        }
    }
}
