// y[M, N] = x[M, K] @ W^T (+ bias) in fp32 for a few rows M (decode, verification of a small batch): the regime
// where MKL's sgemm reads the weight at a third of the memory bandwidth. W is pre-packed into panels of PANEL output
// columns, each panel contiguous over k ([N/PANEL][K][PANEL], zero-padded), so one pass streams the whole weight
// sequentially while every weight vector loaded feeds up to 6 rows of FMAs.
// - AVX2: panels of 16 columns, 12 accumulators (2 weight vectors and a broadcast: 15 of the 16 registers).
// - AVX-512 (chosen at run time): panels of 64 columns, 24 accumulators of 16 (4 weight vectors and a broadcast: 29
//   of 32), so one broadcast feeds four FMAs instead of two. Zen 4 EPYC, two threads, the 30M model's five matmul
//   shapes: 1.3x the AVX2 kernel at 64 rows, 1.6x at 16.
// Every output is one lane's chain of FMAs over k in order, plus the bias: the same bits in either layout, and
// whatever else is in the batch (tests compare the two layouts bit for bit).
// Built at run time by tlt/models/kernels.py (flags: kernels._CFLAGS).
#include <immintrin.h>
#include <string.h>

#define PANEL 16   // AVX2 layout
#define WPANEL 64  // AVX-512 layout
#define ROWS 6  // rows per pass over a panel
// From prefetch_min_rows + 1 rows, the first pass over a panel prefetches the next one (software prefetch): the
// weight then streams from memory while the later passes compute, instead of each panel's first pass waiting on
// memory and the others on the FMA units. Whole SmolLM2 matmuls per decode step, one AVX2 EPYC core: 4 rows
// 46.6 -> 42.1 ms, 8 rows 58.8 -> 53.9, 16 rows 85.6 -> 81.0, 32 rows 135 -> 126 (two threads: 7-13% less).
// At 1-3 rows (one pass, purely memory-bound) it only got in that CPU's hardware prefetcher's way, so 3 rows is the
// default; on an Intel Xeon (Emerald Rapids, two threads, SmolLM2-135M's matmuls) it sped the AVX2 layout up
// 1.07 / 1.28 / 1.24x at 1 / 2 / 3 rows and the AVX-512 one 0.88 / 1.02 / 1.09x, so kernels.py sets 0 and 2 there
// (tlt_fp32_set_prefetch; docs/design.md §9). A prefetch changes no bit of the output.
static int prefetch_min_rows[2] = {3, 3};  // AVX2 layout, AVX-512 layout

void tlt_fp32_set_prefetch(int narrow, int wide) {
    prefetch_min_rows[0] = narrow;
    prefetch_min_rows[1] = wide;
}
#define AVX512_TARGET __attribute__((target("avx512f")))

// The layout in use: 1 = AVX-512 (panels of 64), 0 = AVX2 (panels of 16); -1 = not chosen yet (by the CPU).
static int wide_layout = -1;

static int wide(void) {
    if (wide_layout < 0) wide_layout = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return wide_layout;
}

// Columns per panel of the packed layout (kernels.py sizes the packed weight with it).
int tlt_fp32_panel_width(void) { return wide() ? WPANEL : PANEL; }

// 0 = the AVX2 layout, 1 = the AVX-512 one where the CPU has it, -1 = the CPU's choice. kernels.py sets it at load
// from torch's instruction set (ATEN_CPU_CAPABILITY=avx2 gives 0); tests switch it. Weights packed before a change
// must be packed again.
void tlt_fp32_set_layout(int w) { wide_layout = w < 0 ? -1 : (w && __builtin_cpu_supports("avx512f")); }

void tlt_pack(const float* w, int N, int K, float* out) {
    int P = tlt_fp32_panel_width(), panels = (N + P - 1) / P;
    memset(out, 0, sizeof(float) * (size_t)panels * K * P);
    for (int n = 0; n < N; n++) {
        float* p = out + (size_t)(n / P) * K * P + n % P;
        const float* row = w + (size_t)n * K;
        for (int k = 0; k < K; k++) p[(size_t)k * P] = row[k];
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

// The AVX-512 layout: R rows against one panel of 64 columns, 4R accumulators of 16, written to acc[R][64].
#define WPANEL_ROWS(R)                                                                                            \
    AVX512_TARGET static inline void wpanel_##R(const float* x, int K, const float* p, const float* pf,          \
                                                float* acc) {                                                    \
        __m512 a[R][4];                                                                                          \
        for (int r = 0; r < R; r++)                                                                              \
            for (int v = 0; v < 4; v++) a[r][v] = _mm512_setzero_ps();                                          \
        for (int k = 0; k < K; k++) {                                                                            \
            __m512 w[4];                                                                                         \
            for (int v = 0; v < 4; v++) {                                                                        \
                if (pf) _mm_prefetch((const char*)(pf + (size_t)k * WPANEL + 16 * v), _MM_HINT_T0);             \
                w[v] = _mm512_load_ps(p + (size_t)k * WPANEL + 16 * v);                                          \
            }                                                                                                    \
            for (int r = 0; r < R; r++) {                                                                        \
                __m512 xb = _mm512_set1_ps(x[(size_t)r * K + k]);                                                \
                for (int v = 0; v < 4; v++) a[r][v] = _mm512_fmadd_ps(xb, w[v], a[r][v]);                       \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < R; r++)                                                                              \
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + r * WPANEL + 16 * v, a[r][v]);                   \
    }
WPANEL_ROWS(1)
WPANEL_ROWS(2)
WPANEL_ROWS(3)
WPANEL_ROWS(4)
WPANEL_ROWS(5)
WPANEL_ROWS(6)

// acc [R][P] (+ bias) -> y rows m.., columns n0 .. n0 + width
static inline void store_rows(const float* acc, int P, int R, const float* bias, int n0, int width, float* y,
                              int m, int N) {
    for (int r = 0; r < R; r++) {
        float* out = y + (size_t)(m + r) * N + n0;
        for (int c = 0; c < width; c++) out[c] = acc[r * P + c] + (bias ? bias[n0 + c] : 0.0f);
    }
}

// One driver per layout (P columns a panel, PFX##_R the R-row pass), with the passes' calls inlined: a call through
// a table of pass functions instead cost 1-4% (the five 30M-model shapes, in-process A/B).
#define SMALL_GEMM_LAYOUT(NAME, P, PFX, ATTR, PF)                                                                  \
    ATTR static void NAME(const float* x, int M, int K, const float* packed, int N, const float* bias, float* y, \
                          int threads) {                                                                         \
        int panels = (N + P - 1) / P;                                                                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                       \
        for (int j = 0; j < panels; j++) {                                                                       \
            const float* p = packed + (size_t)j * K * P;                                                         \
            int n0 = j * P, width = N - n0 < P ? N - n0 : P;                                                     \
            float acc[ROWS * P];                                                                                 \
            const float* pf = M > (PF) && j + 1 < panels ? p + (size_t)K * P : NULL;                          \
            for (int m = 0; m < M; m += ROWS) { /* the panel stays in L1/L2 for the next rows */                \
                int R = M - m < ROWS ? M - m : ROWS;                                                             \
                const float* xr = x + (size_t)m * K;                                                             \
                const float* f = m == 0 ? pf : NULL;                                                             \
                switch (R) {                                                                                     \
                    case 1: PFX##_1(xr, K, p, f, acc); break;                                                    \
                    case 2: PFX##_2(xr, K, p, f, acc); break;                                                    \
                    case 3: PFX##_3(xr, K, p, f, acc); break;                                                    \
                    case 4: PFX##_4(xr, K, p, f, acc); break;                                                    \
                    case 5: PFX##_5(xr, K, p, f, acc); break;                                                    \
                    default: PFX##_6(xr, K, p, f, acc); break;                                                   \
                }                                                                                                \
                store_rows(acc, P, R, bias, n0, width, y, m, N);                                                 \
            }                                                                                                    \
        }                                                                                                        \
    }
SMALL_GEMM_LAYOUT(small_gemm_narrow, PANEL, panel, , prefetch_min_rows[0])
SMALL_GEMM_LAYOUT(small_gemm_wide, WPANEL, wpanel, AVX512_TARGET, prefetch_min_rows[1])

void tlt_small_gemm(const float* x, int M, int K, const float* packed, int N, const float* bias, float* y,
                    int threads) {
    if (wide())
        small_gemm_wide(x, M, K, packed, N, bias, y, threads);
    else
        small_gemm_narrow(x, M, K, packed, N, bias, y, threads);
}
