// Attention of a few new tokens per row against a slot KV cache, in fp32 arithmetic over an fp32 or bf16 cache.
// out[b, t, h] = softmax_j(q[b, t, h] . k[b, h/g, j] * scale + bias[b, t, j]) @ v[b, h/g, j], over j < n_keys[b].
// torch's batched matmul has to run over the cache's whole capacity (a slice would cost it a copy), so every step
// of a rollout reads keys up to prompt + max_tokens; this reads each row's own keys only, and its exp is AVX2.
// bias is 0 / -inf ([B, T, cap], the tree mask of this step's speculative block); keys at or past n_keys[b] are
// never read. Query rows may be strided views (the output of the qkv projection); the last dim is contiguous.
// Built with small_gemm.c into one library by tlt/models/kernels.py (flags: kernels._CFLAGS).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

// 8 bf16 values (raw bits) -> 8 floats (exact: a bf16 is a float's upper 16 bits)
static inline __m256 load8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

#define KV_T float
#define LOAD8(p) _mm256_loadu_ps(p)
#define ONE_HEAD one_head
#define CACHED_ATTENTION tlt_cached_attention
#include "cached_attention_impl.h"
#undef KV_T
#undef LOAD8
#undef ONE_HEAD
#undef CACHED_ATTENTION

// The same with a bf16 KV cache (bf16 models): keys and values widened to fp32 as they are read.
#define KV_T uint16_t
#define LOAD8(p) load8_bf16(p)
#define ONE_HEAD one_head_bf16kv
#define CACHED_ATTENTION tlt_cached_attention_bf16kv
#include "cached_attention_impl.h"
