// The forward's activations (quantized.cpp, rows_dot.h): x quantized per 32 values to int8
// with one float scale, ggml's quantize_row_q8_0 arithmetic but for the rounding of ties (to
// even here), the integer dot products' other operand.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "aligned.h"
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

// x quantized per 32 values: int8 quants, the scale d and d * sum(q) of each block.
struct Activations {
    AlignedVector<int8_t> q;
    std::vector<float> d, s;
};

// 32 values of x as int8 quants q = round-half-even(v * 127 / amax); returns sum(q) and sets
// d = amax / 127.
inline int quantize_32(const float* v, int8_t* q, float* d) {
#if defined(__AVX2__)
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    __m256 values[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        values[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, values[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float top = _mm_cvtss_f32(m);
    *d = top / 127.0f;
    const __m256 scale = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i ints[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // the current rounding mode: to nearest, ties to even
        ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(values[i], scale));
        total = _mm256_add_epi32(total, ints[i]);
    }
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                             _mm256_packs_epi32(ints[2], ints[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the lane interleave
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(words, order));
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 1));
    return _mm_cvtsi128_si32(sum);
#elif defined(__ARM_NEON)
    float32x4_t values[8], amax = vdupq_n_f32(0.0f);
    for (int i = 0; i < 8; ++i) {
        values[i] = vld1q_f32(v + 4 * i);
        amax = vmaxq_f32(amax, vabsq_f32(values[i]));
    }
    const float top = vmaxvq_f32(amax);
    *d = top / 127.0f;
    const float scale = top > 0.0f ? 127.0f / top : 0.0f;
    int32x4_t ints[8], total = vdupq_n_s32(0);
    for (int i = 0; i < 8; ++i) {  // FCVTNS: to nearest, ties to even
        ints[i] = vcvtnq_s32_f32(vmulq_n_f32(values[i], scale));
        total = vaddq_s32(total, ints[i]);
    }
    int16x8_t words[4];
    for (int i = 0; i < 4; ++i)
        words[i] = vcombine_s16(vqmovn_s32(ints[2 * i]), vqmovn_s32(ints[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        vst1q_s8(q + 16 * i, vcombine_s8(vqmovn_s16(words[2 * i]), vqmovn_s16(words[2 * i + 1])));
    return vaddvq_s32(total);
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    *d = amax / 127.0f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
        q[j] = static_cast<int8_t>(static_cast<int>(std::nearbyint(v[j] * id)));
        sum += q[j];
    }
    return sum;
#endif
}

// Sub-blocks below which quantizing x stays on the calling thread: a decoding step's few
// thousand values take less than starting the team would.
constexpr int64_t kParallelSubs = 1024;

void quantize_rows(const float* x, int64_t m, int64_t k, Activations* a, int threads) {
    const int64_t subs = k / 32;
    a->q.resize(m * k);
    a->d.resize(m * subs);
    a->s.resize(m * subs);
#pragma omp parallel for num_threads(threads) schedule(static) if (m * subs >= kParallelSubs)
    for (int64_t i = 0; i < m * subs; ++i) {
        const int sum = quantize_32(x + i * 32, &a->q[i * 32], &a->d[i]);
        a->s[i] = a->d[i] * static_cast<float>(sum);
    }
}

// x's rows quantized into the calling thread's buffers, kept across calls: a buffer freed and
// allocated again every product would be fresh pages to fault in each time (glibc maps large
// blocks anew). The threads of a product's team read the caller's.
inline Activations& quantized_rows(const float* x, int64_t m, int64_t k, int threads) {
    static thread_local Activations buffers;
    quantize_rows(x, m, k, &buffers, threads);
    return buffers;
}

}  // namespace
