// The log-prob of one token a row under softmax(logits / T), fp32: what the engine returns for every sampled token
// (the old policy's log-prob in RL). torch's log_softmax writes the whole [N, V] result and a gather then reads one
// value a row; at 64 rows x 49152 that pass took ~5 ms of a ~30 ms decode step (a 30M model). Here each row is read
// twice (its max, then the sum of exps; a row stays in L2 between the passes) and nothing else is written.
// Same formula as log_softmax, (x / T - max) - log(sum(exp(x / T - max))), up to the exp's and the sum's rounding
// (~1e-6). Rows are independent (one thread a row), so a row's value does not depend on the batch.
#include <math.h>
#include <stdint.h>

#include "simd.h"

static float row_logprob(const float* x, int V, float t, int64_t id) {
    const __m256 tv = _mm256_set1_ps(t);
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_div_ps(_mm256_loadu_ps(x + i), tv));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, m8);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; i < V; i++) m = x[i] / t > m ? x[i] / t : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (i = 0; i + 16 <= V; i += 16) {  // two chains: the adds' latency, not the exp, would bound one
        s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), mv)));
        s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8), tv), mv)));
    }
    for (; i + 8 <= V; i += 8)
        s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), mv)));
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < V; i++) s += expf(x[i] / t - m);
    return (x[id] / t - m) - logf(s);
}

// logits [N, V] contiguous, temp [N] (<= 0: greedy, the raw softmax), ids [N] -> out [N].
void tlt_token_logprobs(const float* logits, int N, int V, const float* temp, const int64_t* ids, float* out,
                        int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N > 1)
    for (int n = 0; n < N; n++)
        out[n] = row_logprob(logits + (size_t)n * V, V, temp[n] > 0 ? temp[n] : 1.0f, ids[n]);
}
