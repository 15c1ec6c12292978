// The body of tlt/models/csrc/cached_attention.c, included once per KV-cache element type: KV_T (float or
// uint16_t bf16 bits), LOAD8 (8 keys or values -> __m256), ONE_HEAD and CACHED_ATTENTION (the names).

// One (row b, KV head) pair: its g * T query rows, one at a time (their keys stay in L1/L2 between rows).
static void ONE_HEAD(const float* q, int64_t q_st, int64_t q_sh, const KV_T* k, const KV_T* v, int n,
                     const float* bias, int64_t bias_st, float* out, int64_t out_st, int T, int g, int h0, int D,
                     float scale, float* s) {
    const int nv = D / 8;
    for (int t = 0; t < T; t++) {
        const float* bt = bias + t * bias_st;
        for (int hi = 0; hi < g; hi++) {
            const float* qr = q + t * q_st + (int64_t)(h0 + hi) * q_sh;
            __m256 qv[32];  // D <= 256
            for (int c = 0; c < nv; c++) qv[c] = _mm256_loadu_ps(qr + 8 * c);
            float m = -INFINITY;
            int j = 0;
            for (; j + 4 <= n; j += 4) {  // four keys at once: independent FMA chains, one joint reduction
                if (bt[j] == -INFINITY && bt[j + 1] == -INFINITY && bt[j + 2] == -INFINITY && bt[j + 3] == -INFINITY) {
                    for (int i = 0; i < 4; i++) s[j + i] = -INFINITY;  // masked (a causal prompt's later keys):
                    continue;                                          // the score they would get anyway
                }
                const KV_T* kj = k + (int64_t)j * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int c = 0; c < nv; c++) {
                    a0 = _mm256_fmadd_ps(qv[c], LOAD8(kj + 8 * c), a0);
                    a1 = _mm256_fmadd_ps(qv[c], LOAD8(kj + D + 8 * c), a1);
                    a2 = _mm256_fmadd_ps(qv[c], LOAD8(kj + 2 * D + 8 * c), a2);
                    a3 = _mm256_fmadd_ps(qv[c], LOAD8(kj + 3 * D + 8 * c), a3);
                }
                __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                __m128 x = _mm_add_ps(_mm_mul_ps(dots, _mm_set1_ps(scale)), _mm_loadu_ps(bt + j));
                _mm_storeu_ps(s + j, x);
                for (int i = 0; i < 4; i++) m = s[j + i] > m ? s[j + i] : m;
            }
            for (; j < n; j++) {
                if (bt[j] == -INFINITY) {
                    s[j] = -INFINITY;
                    continue;
                }
                const KV_T* kj = k + (int64_t)j * D;
                __m256 a = _mm256_setzero_ps();
                for (int c = 0; c < nv; c++) a = _mm256_fmadd_ps(qv[c], LOAD8(kj + 8 * c), a);
                float x = hsum_pairwise(a) * scale + bt[j];  // the four-key block's reduction order
                s[j] = x;
                m = x > m ? x : m;
            }
            // Sum of exps in 8 lanes, the key of visible rank r in lane r % 8 (masked keys skipped): the same sum,
            // bit for bit, whether masked speculative keys lie between (verification) or not (plain decoding).
            __m256 mv = _mm256_set1_ps(m), sum8 = _mm256_setzero_ps();
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            for (j = 0; j + 8 <= n; j += 8) {
                if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(bt + j), ninf, _CMP_EQ_OQ))) break;
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
                _mm256_storeu_ps(s + j, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, sum8);
            for (int r = j; j < n; j += 8) {  // the rest through padded vectors: masked keys and the tail
                float tmp[8];
                int w = n - j < 8 ? n - j : 8;
                for (int i = 0; i < 8; i++) tmp[i] = i < w ? s[j + i] - m : -INFINITY;
                _mm256_storeu_ps(tmp, exp8(_mm256_loadu_ps(tmp)));
                for (int i = 0; i < w; i++) {
                    s[j + i] = tmp[i];
                    if (bt[j + i] != -INFINITY) lanes[r++ & 7] += tmp[i];
                }
            }
            float sum = hsum(_mm256_loadu_ps(lanes));
            __m256 acc[32];
            for (int c = 0; c < nv; c++) acc[c] = _mm256_setzero_ps();
            for (j = 0; j < n; j++) {
                if (s[j] == 0.0f) continue;  // masked (or negligible) keys add nothing
                __m256 p = _mm256_set1_ps(s[j]);
                const KV_T* vj = v + (int64_t)j * D;
                for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(p, LOAD8(vj + 8 * c), acc[c]);
            }
            __m256 inv = _mm256_set1_ps(1.0f / sum);
            float* o = out + t * out_st + (int64_t)(h0 + hi) * D;
            for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], inv));
        }
    }
}

// q: [B, T, nh, D] with strides (q_sb, q_st, q_sh, 1); k, v: [slots, nkv, cap, D] contiguous, row b's at slot
// slots[b] (b where slots is NULL); n_keys: [B]; bias: [B, T, cap] contiguous; out: [B, T, nh, D] contiguous. D must
// be a multiple of 8, at most 256.
void CACHED_ATTENTION(const float* q, int64_t q_sb, int64_t q_st, int64_t q_sh, const KV_T* k, const KV_T* v,
                          int cap, const int64_t* slots, const int64_t* n_keys, const float* bias, float* out, int B,
                          int T, int nh, int nkv, int D, float scale, int threads) {
    int g = nh / nkv;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float* s = malloc(sizeof(float) * (size_t)(cap > 0 ? cap : 1));
#pragma omp for schedule(dynamic)
        for (int task = 0; task < B * nkv; task++) {
            int b = task / nkv, kh = task % nkv;
            int64_t kv_off = ((slots ? slots[b] : (int64_t)b) * nkv + kh) * cap * D;
            int n = (int)(n_keys[b] < cap ? n_keys[b] : cap);
            ONE_HEAD(q + b * q_sb, q_st, q_sh, k + kv_off, v + kv_off, n, bias + (int64_t)b * T * cap, cap,
                     out + (int64_t)b * T * nh * D, (int64_t)nh * D, T, g, kh * g, D, scale, s);
        }
        free(s);
    }
}
