// The log-prob of one token a row under softmax(logits / T), fp32: what the engine returns for every sampled token
// (the old policy's log-prob in RL). torch's log_softmax writes the whole [N, V] result and a gather then reads one
// value a row; at 64 rows x 49152 that pass took ~5 ms of a ~30 ms decode step (a 30M model). Here each row is read
// twice (its max, then the sum of exps; a row stays in L2 between the passes) and nothing else is written.
// Same formula as log_softmax, (x / T - max) - log(sum(exp(x / T - max))), up to the exp's and the sum's rounding
// (~1e-6). Rows are independent (one thread a row), so a row's value does not depend on the batch.
#include <math.h>
#include <stdint.h>

#include "simd.h"

// sum(exp(x / t - m)) over a row: two chains (the adds' latency, not the exp, would bound one)
static float row_sumexp(const float* x, int V, float t, float m) {
    const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int i = 0;
    for (; i + 16 <= V; i += 16) {
        s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), mv)));
        s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8), tv), mv)));
    }
    for (; i + 8 <= V; i += 8)
        s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), mv)));
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < V; i++) s += expf(x[i] / t - m);
    return s;
}

static float row_logprob(const float* x, int V, float t, int64_t id) {
    const __m256 tv = _mm256_set1_ps(t);
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_div_ps(_mm256_loadu_ps(x + i), tv));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, m8);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; i < V; i++) m = x[i] / t > m ? x[i] / t : m;
    return (x[id] / t - m) - logf(row_sumexp(x, V, t, m));
}

// logits [N, V] contiguous, temp [N] (<= 0: greedy, the raw softmax), ids [N] -> out [N].
void tlt_token_logprobs(const float* logits, int N, int V, const float* temp, const int64_t* ids, float* out,
                        int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N > 1)
    for (int n = 0; n < N; n++)
        out[n] = row_logprob(logits + (size_t)n * V, V, temp[n] > 0 ? temp[n] : 1.0f, ids[n]);
}

// Greedy rows: the index of each row's first maximum (logits.argmax(-1)) and its log-prob under the raw softmax,
// the very value tlt_token_logprobs gives for that index at T <= 0 (the same max and the same sum, in the same
// order), in one pass for max and index instead of an argmax pass and a max pass. A row holding a NaN gets a NaN
// log-prob (its caller then leaves the row to torch, whose argmax is the NaN).
void tlt_greedy_logprobs(const float* logits, int N, int V, int64_t* ids, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N > 1)
    for (int n = 0; n < N; n++) {
        const float* x = logits + (size_t)n * V;
        __m256 m8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
        __m256i i8 = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(8);
        int i = 0;
        for (; i + 8 <= V; i += 8, at = _mm256_add_epi32(at, step)) {  // per lane: its first maximum
            __m256 v = _mm256_loadu_ps(x + i);
            __m256 gt = _mm256_cmp_ps(v, m8, _CMP_GT_OQ);
            m8 = _mm256_blendv_ps(m8, v, gt);
            nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            i8 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i8), _mm256_castsi256_ps(at), gt));
        }
        float lanes[8], m = -INFINITY;
        int idx[8], best = 0;
        _mm256_storeu_ps(lanes, m8);
        _mm256_storeu_si256((__m256i*)idx, i8);
        for (int l = 0; l < 8; l++)  // across lanes: the largest value, then the smallest index holding it
            if (lanes[l] > m || (lanes[l] == m && idx[l] < best)) m = lanes[l], best = idx[l];
        int nan = _mm256_movemask_ps(nan8);
        for (; i < V; i++) {
            nan |= isnan(x[i]);
            if (x[i] > m) m = x[i], best = i;
        }
        ids[n] = best;
        out[n] = nan ? NAN : (x[best] / 1.0f - m) - logf(row_sumexp(x, V, 1.0f, m));
    }
}
