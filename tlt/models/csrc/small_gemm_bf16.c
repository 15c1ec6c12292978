// y[M, N] = x[M, K] @ W^T (+ bias) for a few rows M with bf16 x and W and fp32 accumulation, on CPUs with
// AVX512-BF16 (vdpbf16ps: 16 lanes, each adding the products of one pair of k). The bf16 twin of small_gemm.c:
// W is pre-packed into panels of 64 output columns, each contiguous over pairs of k ([N/64][K/2][64][2],
// zero-padded), so one pass streams the weight and every four weight vectors loaded feed up to 6 rows (24
// accumulators of 16, 4 weight vectors and a broadcast: 29 of AVX-512's 32 registers). Panels of 64 columns and
// passes of 6 rows ran the matmuls of the 30M model's decode step (its five shapes) 1.11-1.23x faster than panels
// of 32 and passes of 8 at 1-16 rows and 1.14x at 64 (Zen 4 EPYC, two threads): one broadcast a row feeds four
// products instead of two. Each output is one lane's chain of vdpbf16ps over the pairs of k in order, so the panel
// width and the rows of a pass do not change a bit of it. The output is fp32 (y32) or rounded to bf16 (y16, round
// to nearest even, as torch's bf16 matmul rounds its fp32 accumulators). Only called where the CPU has
// avx512_bf16 (kernels.py checks); built with the others.
//
// On a CPU with AMX (tlt_bf16_amx turned it on), every call whose K is a multiple of 32 runs on the tile unit
// instead, over the same packed panels: blocks of up to 16 rows, four 16-column tiles of fp32 sums a panel, and
// TDPBF16PS over 32 k at a time in order. Its sums differ from vdpbf16ps's in the last bits (the tile unit keeps more
// of each product pair), so the choice holds for the whole process, at every row count; its rows are as
// batch-independent (each output one element's chain of TDPBF16PS over k in order, whatever the block holds).
// SmolLM2-135M decoding on a 2-core Xeon with AMX: about as fast at bs 1-4, 1.5x at 16, 2.8x at 64 (docs/design.md §9).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define BPANEL 64
#define BROWS 6
#define BVECS (BPANEL / 16)  // accumulators a row
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// w [N, K] bf16 bits -> out [ceil(N/64)][ceil(K/2)][64][2]
void tlt_pack_bf16(const uint16_t* w, int N, int K, uint16_t* out) {
    int panels = (N + BPANEL - 1) / BPANEL, K2 = (K + 1) / 2;
    memset(out, 0, sizeof(uint16_t) * (size_t)panels * K2 * BPANEL * 2);
    for (int n = 0; n < N; n++) {
        uint16_t* p = out + (size_t)(n / BPANEL) * K2 * BPANEL * 2 + (n % BPANEL) * 2;
        const uint16_t* row = w + (size_t)n * K;
        for (int k = 0; k < K; k++) p[(size_t)(k / 2) * BPANEL * 2 + (k & 1)] = row[k];
    }
}

// fp32 -> bf16 bits, n values, round to nearest even (vcvtneps2bf16)
BF16_TARGET void tlt_f32_to_bf16(const float* x, int64_t n, uint16_t* y) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i*)(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(y + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

// R rows of x (bf16, row stride xs elements, pairs of k read as one 32-bit word) against one panel. When pf is not
// NULL, the panel at pf (the next one) is prefetched on the way, one 64-byte line per vector.
#define BPANEL_ROWS(R)                                                                                         \
    BF16_TARGET static inline void bpanel_##R(const uint16_t* x, int64_t xs, int K2, const uint16_t* p,          \
                                              const uint16_t* pf, float* acc) {                                 \
        __m512 a[R][BVECS];                                                                                    \
        for (int r = 0; r < R; r++)                                                                            \
            for (int v = 0; v < BVECS; v++) a[r][v] = _mm512_setzero_ps();                                      \
        for (int kp = 0; kp < K2; kp++) {                                                                      \
            const uint16_t* pk = p + (size_t)kp * BPANEL * 2;                                                  \
            __m512bh w[BVECS];                                                                                 \
            for (int v = 0; v < BVECS; v++) {                                                                  \
                if (pf) _mm_prefetch((const char*)(pf + (size_t)kp * BPANEL * 2 + 32 * v), _MM_HINT_T0);      \
                w[v] = (__m512bh)_mm512_loadu_si512(pk + 32 * v);                                              \
            }                                                                                                  \
            for (int r = 0; r < R; r++) {                                                                      \
                int32_t pair;                                                                                  \
                memcpy(&pair, x + (size_t)r * xs + 2 * kp, 4);                                                 \
                __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                               \
                for (int v = 0; v < BVECS; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], xb, w[v]);                \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < R; r++)                                                                            \
            for (int v = 0; v < BVECS; v++) _mm512_storeu_ps(acc + r * BPANEL + 16 * v, a[r][v]);             \
    }
BPANEL_ROWS(1)
BPANEL_ROWS(2)
BPANEL_ROWS(3)
BPANEL_ROWS(4)
BPANEL_ROWS(5)
BPANEL_ROWS(6)

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define TLT_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f")))
#define AMX_ROWS 16
static int use_amx = 0;
static __thread int amx_rows = 0;  // the rows this thread's tile configuration holds; 0 = none loaded

// Turn the tile path on (1) or off (0); returns whether it is on. Turning it on asks Linux for the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; Linux 5.16+), once: where that is refused it stays off.
// The caller checks the CPU has AMX-BF16.
int tlt_bf16_amx(int on) {
    static int granted = -1;
    if (on && granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    use_amx = on && granted > 0;
    return use_amx;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// tiles 0-3: R x 16 fp32 sums; 4: R rows x 32 bf16 of x; 5-7: 16 pairs of k x 16 columns x 2 of the panel
AMX_TARGET static void amx_configure(int R) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 5 ? R : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
    amx_rows = R;
}

// R <= 16 rows of x (row stride xs elements) against one panel ([K/2][64][2]: a tile's 16 pairs of k are rows 256
// bytes apart), K % 32 == 0 -> acc [R][64]
AMX_TARGET static void amx_panel(const uint16_t* x, int64_t xs, int R, int K, const uint16_t* p, float* acc) {
    if (R != amx_rows) amx_configure(R);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        const uint16_t* pk = p + (size_t)(k / 2) * BPANEL * 2;
        _tile_loadd(4, x + k, xs * 2);
        _tile_loadd(5, pk, BPANEL * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, pk + 32, BPANEL * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, pk + 64, BPANEL * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, pk + 96, BPANEL * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, acc, BPANEL * 4);
    _tile_stored(1, acc + 16, BPANEL * 4);
    _tile_stored(2, acc + 32, BPANEL * 4);
    _tile_stored(3, acc + 48, BPANEL * 4);
}

AMX_TARGET static void amx_release(void) {
    if (amx_rows) _tile_release();
    amx_rows = 0;
}
#else
#define AMX_ROWS BROWS
static const int use_amx = 0;
int tlt_bf16_amx(int on) { (void)on; return 0; }
static void amx_panel(const uint16_t* x, int64_t xs, int R, int K, const uint16_t* p, float* acc) {}
static void amx_release(void) {}
#endif

// Logits-sized fp32 outputs (at least this many bytes, larger than L2) are written with non-temporal stores: a
// normal store first reads each line it fills (read for ownership), which cost ~15% of a 64 x 384 x 49152 LM head
// (the 30M model's, bs 64) on the Zen 4 EPYC. The sampler reads the logits once afterwards, from memory either way.
#define STREAM_MIN_BYTES (4 << 20)

// From prefetch_min_rows + 1 rows, the pass over a panel prefetches the next one, as in small_gemm.c; 3 unless
// kernels.py sets it (tlt_bf16_set_prefetch). On an Intel Xeon (Emerald Rapids, two threads, SmolLM2-135M's matmuls
// and LM head) prefetching at every row count ran 1.14-1.17 / 1.24-1.29 / 1.26-1.34x faster at 1 / 2 / 3 rows and
// the same from 4: the hardware prefetcher alone read the weight at 10-15 GB/s there, so a verification of 2-3
// tokens cost 1.25x a plain step's matmuls (docs/design.md §9). It changes no bit of the output.
static int prefetch_min_rows = 3;

void tlt_bf16_set_prefetch(int rows) { prefetch_min_rows = rows; }

// x [M, xs] bf16 bits with xs >= 2 * ceil(K/2) (an odd K needs x[m, K] == 0: the pad pairs with W's zero pad)
BF16_TARGET void tlt_small_gemm_bf16(const uint16_t* x, int M, int K, int64_t xs, const uint16_t* packed, int N,
                                     const float* bias, float* y32, uint16_t* y16, int threads) {
    int panels = (N + BPANEL - 1) / BPANEL, K2 = (K + 1) / 2;
    int stream = y32 && (size_t)M * N * sizeof(float) >= STREAM_MIN_BYTES && N % 16 == 0 && (uintptr_t)y32 % 64 == 0;
    int amx = use_amx && K % 32 == 0, rows = amx ? AMX_ROWS : BROWS;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static) nowait
    for (int j = 0; j < panels; j++) {
        const uint16_t* p = packed + (size_t)j * K2 * BPANEL * 2;
        int n0 = j * BPANEL, width = N - n0 < BPANEL ? N - n0 : BPANEL;
        float acc[AMX_ROWS * BPANEL];
        const uint16_t* pf = M > prefetch_min_rows && j + 1 < panels ? p + (size_t)K2 * BPANEL * 2 : NULL;
        for (int m = 0; m < M; m += rows) {
            int R = M - m < rows ? M - m : rows;
            const uint16_t* xr = x + (size_t)m * xs;
            const uint16_t* f = m == 0 ? pf : NULL;
            if (amx) amx_panel(xr, xs, R, K, p, acc);
            else switch (R) {
                case 1: bpanel_1(xr, xs, K2, p, f, acc); break;
                case 2: bpanel_2(xr, xs, K2, p, f, acc); break;
                case 3: bpanel_3(xr, xs, K2, p, f, acc); break;
                case 4: bpanel_4(xr, xs, K2, p, f, acc); break;
                case 5: bpanel_5(xr, xs, K2, p, f, acc); break;
                default: bpanel_6(xr, xs, K2, p, f, acc); break;
            }
            for (int r = 0; r < R; r++) {
                float* a = acc + r * BPANEL;
                if (bias)
                    for (int c = 0; c < width; c++) a[c] += bias[n0 + c];
                if (y32) {
                    float* out = y32 + (size_t)(m + r) * N + n0;
                    if (stream && width == BPANEL) {
                        for (int v = 0; v < BVECS; v++) _mm512_stream_ps(out + 16 * v, _mm512_loadu_ps(a + 16 * v));
                    } else {
                        memcpy(out, a, sizeof(float) * width);
                    }
                } else {
                    for (int c = 0; c < width; c += 32) {  // 32 columns a store, the last one masked
                        int w = width - c < 32 ? width - c : 32;
                        __mmask32 mk = w == 32 ? 0xffffffffu : (__mmask32)((1u << w) - 1);
                        __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + c + 16), _mm512_loadu_ps(a + c));
                        _mm512_mask_storeu_epi16(y16 + (size_t)(m + r) * N + n0 + c, mk, (__m512i)h);
                    }
                }
            }
        }
    }
    if (stream) _mm_sfence();  // this thread's streamed lines are visible before the region's closing barrier
    if (amx) amx_release();    // a thread holding no tile state saves and restores none on a context switch
    }
}
