// The body of tlt/models/csrc/cached_attention.c, included once per KV-cache element type: KV_T (float or
// uint16_t bf16 bits), LOAD8 (8 keys or values -> __m256), ONE_HEAD and CACHED_ATTENTION (the names).
// A (row, KV head) pair's query rows (its g query heads times T tokens) go through its keys ATTN_GROUP at a time:
// each block of 4 keys and each value row is read (and widened from bf16) once for the group's rows, which also
// gives the out-of-order core independent FMA chains. Keys and values are prefetched ATTN_AHEAD rows ahead on their
// first reading: a forward reads each layer's cache once, from memory. On a 2-core Xeon (Emerald Rapids; a
// SmolLM2-135M layer's shapes, a cache per layer, 200 keys) this ran 1.38 / 1.60 / 1.54x faster than one query row
// at a time at 1 / 16 rows of one token and 4 rows of 4 (docs/design.md §9). Each output is the chain of operations
// its query gets alone, in the same order, whichever rows share its group: a row's attention is the same in plain
// decoding and in verification, with masked speculative keys between.
#ifndef ATTN_GROUP
#define ATTN_GROUP 4
#endif
#ifndef ATTN_AHEAD
#define ATTN_AHEAD 16
#endif

// One (row b, KV head) pair: its g * T query rows (r = t * g + head), ATTN_GROUP at a time; s: ATTN_GROUP * cap
// floats of scratch. nv = D / 8, a constant where the caller inlines it (D = 64 and 128: no vector array indexed
// at run time).
static inline __attribute__((always_inline)) void ONE_HEAD(const float* q, int64_t q_st, int64_t q_sh,
        const KV_T* k, const KV_T* v, int n, const float* bias, int64_t bias_st, float* out, int64_t out_st, int T,
        int g, int h0, int D, float scale, float* s, int cap, const int nv) {
    const int G = g * T;
    for (int r0 = 0; r0 < G; r0 += ATTN_GROUP) {
        const int R = G - r0 < ATTN_GROUP ? G - r0 : ATTN_GROUP;
        const float* qr[ATTN_GROUP];
        const float* bt[ATTN_GROUP];
        float m[ATTN_GROUP], sums[ATTN_GROUP];
        __m128 m4[ATTN_GROUP];
        for (int i = 0; i < R; i++) {
            int r = r0 + i, t = r / g, hi = r % g;
            qr[i] = q + t * q_st + (int64_t)(h0 + hi) * q_sh;
            bt[i] = bias + t * bias_st;
            m4[i] = _mm_set1_ps(-INFINITY);
        }
        int j = 0;
        for (; j + 4 <= n; j += 4) {  // four keys at once: independent FMA chains, one joint reduction
            const KV_T* kj = k + (int64_t)j * D;
            if (r0 == 0)  // the keys' first reading
                for (int u = 0; u < 4 * D * (int)sizeof(KV_T); u += 64)
                    _mm_prefetch((const char*)(kj + ATTN_AHEAD * D) + u, _MM_HINT_T0);
            for (int i = 0; i < R; i++) {
                const float* b = bt[i];
                float* si = s + (size_t)i * cap;
                if (b[j] == -INFINITY && b[j + 1] == -INFINITY && b[j + 2] == -INFINITY && b[j + 3] == -INFINITY) {
                    for (int u = 0; u < 4; u++) si[j + u] = -INFINITY;  // masked (a causal prompt's later keys):
                    continue;                                                // the score they would get anyway
                }
                const float* qq = qr[i];
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int c = 0; c < nv; c++) {
                    __m256 qc = _mm256_loadu_ps(qq + 8 * c);
                    a0 = _mm256_fmadd_ps(qc, LOAD8(kj + 8 * c), a0);
                    a1 = _mm256_fmadd_ps(qc, LOAD8(kj + D + 8 * c), a1);
                    a2 = _mm256_fmadd_ps(qc, LOAD8(kj + 2 * D + 8 * c), a2);
                    a3 = _mm256_fmadd_ps(qc, LOAD8(kj + 3 * D + 8 * c), a3);
                }
                __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                __m128 x = _mm_add_ps(_mm_mul_ps(dots, _mm_set1_ps(scale)), _mm_loadu_ps(b + j));
                _mm_storeu_ps(si + j, x);
                m4[i] = _mm_max_ps(x, m4[i]);  // x > m ? x : m lane by lane: a NaN score is skipped
            }
        }
        for (int i = 0; i < R; i++) {  // the lanes hold no NaN, and their max is the same in any order
            __m128 a = _mm_max_ps(m4[i], _mm_movehl_ps(m4[i], m4[i]));
            a = _mm_max_ss(a, _mm_movehdup_ps(a));
            m[i] = _mm_cvtss_f32(a);
        }
        for (; j < n; j++) {
            const KV_T* kj = k + (int64_t)j * D;
            for (int i = 0; i < R; i++) {
                float* si = s + (size_t)i * cap;
                if (bt[i][j] == -INFINITY) {
                    si[j] = -INFINITY;
                    continue;
                }
                __m256 a = _mm256_setzero_ps();
                for (int c = 0; c < nv; c++)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qr[i] + 8 * c), LOAD8(kj + 8 * c), a);
                float x = hsum_pairwise(a) * scale + bt[i][j];  // the four-key block's reduction order
                si[j] = x;
                m[i] = x > m[i] ? x : m[i];
            }
        }
        // Each row's sum of exps in 8 lanes, the key of visible rank r in lane r % 8 (masked keys skipped): the same
        // sum, bit for bit, whether masked speculative keys lie between (verification) or not (plain decoding).
        for (int i = 0; i < R; i++) {
            float* si = s + (size_t)i * cap;
            const float* b = bt[i];
            __m256 mv = _mm256_set1_ps(m[i]), sum8 = _mm256_setzero_ps();
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            int jj;
            for (jj = 0; jj + 8 <= n; jj += 8) {
                if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(b + jj), ninf, _CMP_EQ_OQ))) break;
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + jj), mv));
                _mm256_storeu_ps(si + jj, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, sum8);
            for (int r = jj; jj < n; jj += 8) {  // the rest through padded vectors: masked keys and the tail
                float tmp[8];
                int w = n - jj < 8 ? n - jj : 8;
                for (int u = 0; u < 8; u++) tmp[u] = u < w ? si[jj + u] - m[i] : -INFINITY;
                _mm256_storeu_ps(tmp, exp8(_mm256_loadu_ps(tmp)));
                for (int u = 0; u < w; u++) {
                    si[jj + u] = tmp[u];
                    if (b[jj + u] != -INFINITY) lanes[r++ & 7] += tmp[u];
                }
            }
            sums[i] = hsum(_mm256_loadu_ps(lanes));
        }
        // values: each widened once for the group's queries, half a head (4 vectors) at a time
        for (int c0 = 0; c0 < nv; c0 += 4) {
            const int cw = nv - c0 < 4 ? nv - c0 : 4;
            __m256 acc[ATTN_GROUP][4];
            for (int i = 0; i < R; i++)
                for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();
            for (int jj = 0; jj < n; jj++) {
                const KV_T* vj = v + (int64_t)jj * D + 8 * c0;
                if (r0 == 0 && c0 == 0)
                    for (int u = 0; u < D * (int)sizeof(KV_T); u += 64)
                        _mm_prefetch((const char*)(v + (int64_t)(jj + ATTN_AHEAD) * D) + u, _MM_HINT_T0);
                __m256 vv[4];
                for (int c = 0; c < cw; c++) vv[c] = LOAD8(vj + 8 * c);
                for (int i = 0; i < R; i++) {
                    float p = s[(size_t)i * cap + jj];
                    if (p == 0.0f) continue;  // masked (or negligible) keys add nothing
                    __m256 pb = _mm256_set1_ps(p);
                    for (int c = 0; c < cw; c++) acc[i][c] = _mm256_fmadd_ps(pb, vv[c], acc[i][c]);
                }
            }
            for (int i = 0; i < R; i++) {
                __m256 inv = _mm256_set1_ps(1.0f / sums[i]);
                int r = r0 + i;
                float* o = out + (r / g) * out_st + (int64_t)(h0 + r % g) * D + 8 * c0;
                for (int c = 0; c < cw; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[i][c], inv));
            }
        }
    }
}

// q: [B, T, nh, D] with strides (q_sb, q_st, q_sh, 1); k, v: [slots, nkv, cap, D] contiguous, row b's at slot
// slots[b] (b where slots is NULL); n_keys: [B]; bias: [B, T, cap] contiguous; out: [B, T, nh, D] contiguous. D must
// be a multiple of 8.
void CACHED_ATTENTION(const float* q, int64_t q_sb, int64_t q_st, int64_t q_sh, const KV_T* k, const KV_T* v,
                      int cap, const int64_t* slots, const int64_t* n_keys, const float* bias, float* out, int B,
                      int T, int nh, int nkv, int D, float scale, int threads) {
    int g = nh / nkv;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float* s = malloc(sizeof(float) * ATTN_GROUP * (size_t)(cap > 0 ? cap : 1));
#pragma omp for schedule(dynamic)
        for (int task = 0; task < B * nkv; task++) {
            int b = task / nkv, kh = task % nkv;
            int64_t kv_off = ((slots ? slots[b] : (int64_t)b) * nkv + kh) * cap * D;
            int n = (int)(n_keys[b] < cap ? n_keys[b] : cap);
            const float* qb = q + b * q_sb;
            const float* bb = bias + (int64_t)b * T * cap;
            float* ob = out + (int64_t)b * T * nh * D;
            if (D == 64)  // the common head sizes with their vector counts as constants
                ONE_HEAD(qb, q_st, q_sh, k + kv_off, v + kv_off, n, bb, cap, ob, (int64_t)nh * D, T, g, kh * g, D,
                         scale, s, cap, 8);
            else if (D == 128)
                ONE_HEAD(qb, q_st, q_sh, k + kv_off, v + kv_off, n, bb, cap, ob, (int64_t)nh * D, T, g, kh * g, D,
                         scale, s, cap, 16);
            else
                ONE_HEAD(qb, q_st, q_sh, k + kv_off, v + kv_off, n, bb, cap, ob, (int64_t)nh * D, T, g, kh * g, D,
                         scale, s, cap, D / 8);
        }
        free(s);
    }
}
