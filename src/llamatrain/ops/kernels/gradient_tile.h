// The backward's float micro-kernel (quantized.cpp's lt_matmul_t): dx += G . W over a
// decoded panel, on AVX-512, AVX2, NEON or plain C++ float vectors, and G packed into
// the tiles it reads. Kept apart from quantized.cpp so that each file holds one direction.
#pragma once
#include <cstdint>
#include <cstring>

#include "aligned.h"
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

// The backward's float vectors: AVX-512, AVX2, NEON or plain C++ (kVec floats).
#if defined(__AVX512F__)
using FloatVec = __m512;
constexpr int kVec = 16;
inline FloatVec vzero() { return _mm512_setzero_ps(); }
inline FloatVec vload(const float* p) { return _mm512_loadu_ps(p); }
inline FloatVec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline FloatVec vfma(FloatVec a, FloatVec b, FloatVec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vadd_into(float* p, FloatVec v) { _mm512_storeu_ps(p, _mm512_add_ps(vload(p), v)); }
constexpr int kGradRows = 8;
#elif defined(__AVX2__)
using FloatVec = __m256;
constexpr int kVec = 8;
inline FloatVec vzero() { return _mm256_setzero_ps(); }
inline FloatVec vload(const float* p) { return _mm256_loadu_ps(p); }
inline FloatVec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline FloatVec vfma(FloatVec a, FloatVec b, FloatVec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vadd_into(float* p, FloatVec v) { _mm256_storeu_ps(p, _mm256_add_ps(vload(p), v)); }
constexpr int kGradRows = 6;  // 12 accumulators, 2 columns, 1 broadcast: 15 of 16 registers
#elif defined(__ARM_NEON)
// NEON: 8 floats in two q-registers, so that a slice is 16 columns (decode_32 writes halves
// of 16); kGradRows 6: 24 accumulators, 4 for the columns, 1 broadcast, of its 32 registers.
using FloatVec = float32x4x2_t;
constexpr int kVec = 8;
inline FloatVec vzero() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
inline FloatVec vload(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline FloatVec vbroadcast(const float* p) { return {vld1q_dup_f32(p), vld1q_dup_f32(p)}; }
inline FloatVec vfma(FloatVec a, FloatVec b, FloatVec c) {
    return {vfmaq_f32(c.val[0], a.val[0], b.val[0]), vfmaq_f32(c.val[1], a.val[1], b.val[1])};
}
inline void vadd_into(float* p, FloatVec v) {
    vst1q_f32(p, vaddq_f32(vld1q_f32(p), v.val[0]));
    vst1q_f32(p + 4, vaddq_f32(vld1q_f32(p + 4), v.val[1]));
}
constexpr int kGradRows = 6;
#else
struct FloatVec {
    float v[8];
};
constexpr int kVec = 8;
inline FloatVec vzero() { return {}; }
inline FloatVec vload(const float* p) {
    FloatVec out;
    std::memcpy(out.v, p, sizeof(out.v));
    return out;
}
inline FloatVec vbroadcast(const float* p) {
    FloatVec out;
    for (float& value : out.v) value = *p;
    return out;
}
inline FloatVec vfma(FloatVec a, FloatVec b, FloatVec c) {
    for (int i = 0; i < kVec; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
}
inline void vadd_into(float* p, FloatVec v) {
    for (int i = 0; i < kVec; ++i) p[i] += v.v[i];
}
constexpr int kGradRows = 4;
#endif
constexpr int kSlice = 2 * kVec;  // dx columns a micro-kernel call holds (32 divides it)

// One row of G's tile against the two column vectors, if the tile has row r (R > r).
template <int R, int r>
inline void fma_row(const float* g, FloatVec w0, FloatVec w1, FloatVec& a0, FloatVec& a1) {
    if constexpr (R > r) {
        const FloatVec b = vbroadcast(g + r);
        a0 = vfma(b, w0, a0);
        a1 = vfma(b, w1, a1);
    }
}

template <int R, int r>
inline void add_row(float* dx, int64_t k, FloatVec a0, FloatVec a1) {
    if constexpr (R > r) {
        vadd_into(dx + r * k, a0);
        vadd_into(dx + r * k + kVec, a1);
    }
}

// dx[m0 .. m0+R, c .. c+kSlice] += sum over the panel's rows o of G[m0 + r, o] * W[o, c ..],
// for one slice of the decoded panel and G's rows m0 .. packed as g[o][kGradRows]: R x 2
// vector accumulators in registers for the whole panel, added into dx once. Named
// accumulators, not an array: GCC keeps an array of vectors on the stack and stores it every
// iteration (AVX2: 1.4x slower).
template <int R>
void add_panel(const float* slice, int64_t rows, const float* g, float* dx, int64_t k) {
    static_assert(R <= 8, "eight rows of accumulators at most");
    FloatVec a00 = vzero(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00;
    FloatVec a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00;
    FloatVec a70 = a00, a71 = a00;
    for (int64_t o = 0; o < rows; ++o, g += kGradRows) {
        const FloatVec w0 = vload(slice + o * kSlice), w1 = vload(slice + o * kSlice + kVec);
        fma_row<R, 0>(g, w0, w1, a00, a01);
        fma_row<R, 1>(g, w0, w1, a10, a11);
        fma_row<R, 2>(g, w0, w1, a20, a21);
        fma_row<R, 3>(g, w0, w1, a30, a31);
        fma_row<R, 4>(g, w0, w1, a40, a41);
        fma_row<R, 5>(g, w0, w1, a50, a51);
        fma_row<R, 6>(g, w0, w1, a60, a61);
        fma_row<R, 7>(g, w0, w1, a70, a71);
    }
    add_row<R, 0>(dx, k, a00, a01);
    add_row<R, 1>(dx, k, a10, a11);
    add_row<R, 2>(dx, k, a20, a21);
    add_row<R, 3>(dx, k, a30, a31);
    add_row<R, 4>(dx, k, a40, a41);
    add_row<R, 5>(dx, k, a50, a51);
    add_row<R, 6>(dx, k, a60, a61);
    add_row<R, 7>(dx, k, a70, a71);
}

template <int R = kGradRows>
void add_panel_rows(int rows_m, const float* slice, int64_t rows, const float* g, float* dx,
                    int64_t k) {
    if constexpr (R > 1) {
        if (rows_m < R) return add_panel_rows<R - 1>(rows_m, slice, rows, g, dx, k);
    }
    add_panel<R>(slice, rows, g, dx, k);
}

// G (m rows of n) packed once for every tile of kGradRows of its rows, tile by tile as
// out[tile][o][r] (zeros past G's last row): a tile's reads over a panel are contiguous. Read
// row by row, as G is laid out (not transposed first: a copy of G per call).
void pack_gradient(const float* g, int64_t n, int64_t m, AlignedVector<float>* out,
                   int threads) {
    const int64_t tiles = (m + kGradRows - 1) / kGradRows;
    out->resize(tiles * kGradRows * n);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        float* packed = out->data() + t * n * kGradRows;
        for (int r = 0; r < kGradRows; ++r) {
            const int64_t row = t * kGradRows + r;
            for (int64_t o = 0; o < n; ++o)
                packed[o * kGradRows + r] = row < m ? g[row * n + o] : 0.0f;
        }
    }
}

}  // namespace
