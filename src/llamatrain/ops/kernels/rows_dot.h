// The forward for a few rows of x (quantized.cpp's lt_matmul up to a format's direct_rows):
// each weight row's blocks dotted straight against x's int8 blocks, as ggml's
// ggml_vec_dot_*_q8_0 does.
//
// Why not the panels: lt_matmul's GEMM repacks every 8 weight rows per call (an 8 x 8
// transpose of the quants, written and read back), which pays for itself only when several
// x rows share it; at one row (decoding) that repack is most of the time. Here a block's
// quants go from the stored bytes into a register, 32 values at a time (a K super-block's
// scales decoded once for its eight sub-blocks, as ggml_vec_dot_q4_K_q8_K does), and meet
// each x row there; without AVX2, through blocks.h's unpackers into a buffer on the stack,
// then NEON's integer dot products (neon.h) or plain C++.
//
// Numerics are the GEMM's: the same integer sums per 32 values (16 for Q6_K's scales) and the
// same per-block float scale product (w's scale times x's d); only the order in which the
// float terms are summed differs (eight lanes, then across them), so the two agree to float32
// rounding.
#pragma once
#include <utility>

#include "activations.h"
#include "blocks.h"
#include "neon.h"

namespace {

constexpr int kDirectRows = 4;  // x rows sharing each weight block loaded

// One weight row against up to kDirectRows rows of x, starting at sub-block 0.
struct RowsArgs {
    const Activations* a;
    int64_t m0;          // x's first row
    int64_t k;           // values per row
    int64_t blocks;      // weight blocks per row
    const uint8_t* end;  // W's last byte + 1: none past it is prefetched
};

// Weight bytes asked from memory kAheadBytes ahead of the dot products that read them, a few
// lines every block or two, into L2 (prefetcht1): a decoding step streams every weight from
// memory once, and the hardware prefetcher alone left it waiting. Llama-3.2-1B's every matrix
// at M=1 in file order (a decoding step's stream; thread CPU, native, load ~3-4): whole rows
// 4 ahead into L1 (the previous scheme) Q4_0 96 ms, Q8_0 161, Q4_K_M 103; into L2 84 / 136 /
// 99; spread through the dot products, 3 KiB ahead, 74-78 / 122 / 87 (AVX2 build: Q8_0 162
// -> 132, Q4_K_M 112 -> 92); 1 KiB ahead 84 (Q4_0), 8 KiB 75; into L1 83.
constexpr int64_t kAheadBytes = 3072;

inline void prefetch(const uint8_t* bytes, int64_t count) {
    for (int64_t at = 0; at < count; at += 64) __builtin_prefetch(bytes + at, 0, 2);
}

// The ``count`` bytes kAheadBytes past ``at`` asked for, those before ``end``.
inline void prefetch_ahead(const uint8_t* at, int64_t count, const uint8_t* end) {
    if (end - at > kAheadBytes) prefetch(at + kAheadBytes, std::min(count, end - at - kAheadBytes));
}

#if defined(__AVX2__)
// acc + sums over each 4 consecutive byte products of |w| (unsigned) and x signed as w.
inline __m256i dot_acc(__m256i acc, __m256i magnitude, __m256i x_signed) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, magnitude, x_signed);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, magnitude, x_signed);
#else
    const __m256i pairs = _mm256_maddubs_epi16(magnitude, x_signed);  // |w| |x| < 2^15: exact
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

inline __m256i q4_0_quants(const uint8_t* b) { return blocks::nibbles_32(b + 2); }
inline __m256i q4_1_quants(const uint8_t* b) { return blocks::nibbles_32(b + 4); }
inline __m256i q5_0_quants(const uint8_t* b) {
    return _mm256_or_si256(blocks::nibbles_32(b + 6), blocks::fifth_bits(b + 2));
}
inline __m256i q5_1_quants(const uint8_t* b) {
    return _mm256_or_si256(blocks::nibbles_32(b + 8), blocks::fifth_bits(b + 4));
}
inline __m256i q8_0_quants(const uint8_t* b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
}

// A block read from its bytes (StoredBlock, StoredKBlock, StoredQ6KBlock) offers: kSubs, its
// 32-value sub-blocks; quants<S>(), sub-block S's 32 quants in a register; scale_products(xd,
// out), for one row of x (xd its scales from the block's first sub-block on), each weight
// scale times x's scale of its sub-block, the float products the panels take (w's scale *
// x's d); lane_scale<S>(out), sub-block S's as the eight int32 lanes of its integer sums want
// them (lanes 0-3: values 0-15); and its offsets, off(S) or a vector of eight (K types).

// A 32-value block read straight from its bytes into a register: its quants by Read
// (unsigned for Q4/Q5, as the forward's unpackers leave them), the float16 d at byte 0, and
// the offset the float16 m at byte 2 (Min: Q4_1, Q5_1) or -Bias * d (Q4_0: 8, Q5_0: 16).
template <__m256i (*Read)(const uint8_t*), int Bias, bool Min>
struct StoredBlock {
    static constexpr int kSubs = 1;
    __m256i q;
    float d, offset;
    explicit StoredBlock(const uint8_t* b)
        : q(Read(b)),
          d(blocks::half_to_float(b)),
          offset(Min ? blocks::half_to_float(b + 2) : -static_cast<float>(Bias) * d) {}
    template <int>
    __m256i quants() const {
        return q;
    }
    void scale_products(const float* xd, float* out) const { out[0] = d * xd[0]; }
    template <int>
    static __m256 lane_scale(const float* products) {
        return _mm256_set1_ps(products[0]);
    }
    float off(int) const { return offset; }
};

// 32 bytes from p, each byte's bits shifted by Shift (left if positive) within its 16-bit
// lane and masked by Mask: with a mask inside the byte no bit crosses from one to the next.
template <int Shift, int Mask>
inline __m256i shifted_bits(const uint8_t* p) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    __m256i moved = bytes;
    if constexpr (Shift > 0) moved = _mm256_slli_epi16(bytes, Shift);
    if constexpr (Shift < 0) moved = _mm256_srli_epi16(bytes, -Shift);
    return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(Mask)));
}

// 8 bytes as 8 floats times ``scale``: d * float(q), as blocks.h's unpackers round it.
inline __m256 scaled_bytes(__m128i bytes, float scale) {
    const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    return _mm256_mul_ps(values, _mm256_set1_ps(scale));
}

// Q4_K/Q5_K's 12 bytes of six-bit scales and mins (at b + 4) as 16 bytes, the eight scales
// then the eight mins (blocks.h's k_scale_min): sub-blocks 0-3 take bytes 0-3 (scales) and
// 4-7 (mins) less their top two bits; 4-7 the low (scales) or high (mins) nibbles of bytes
// 8-11, and as bits 4-5 the top two bits of bytes 0-3 (scales) or 4-7 (mins).
inline __m128i k_scales_and_mins(const uint8_t* b) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low = _mm_shuffle_epi8(
        packed, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(
        packed, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low_six_or_four = _mm_and_si128(
        low, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i high_four = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(0x0f));
    const __m128i bits = _mm_blend_epi32(low_six_or_four, high_four, 0b1000);
    return _mm_or_si128(bits, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
}

// A Q4_K or Q5_K super-block read straight from its bytes: sub-block S's quants (unsigned)
// made in a register when asked (S a constant: add_block's sub-blocks are a pack expansion):
// 32 bytes of qs at b + 48 (Q5_K) or b + 16 (Q4_K), their low nibbles for even S and high
// for odd, and Q5_K's fifth bit S of each of qh's 32 bytes (b + 16) moved to bit 4. The eight
// scales d * sc and offsets -(dmin * m) decoded once.
template <bool Fifth>
struct StoredKBlock {
    static constexpr int kSubs = 8;
    const uint8_t* b;
    __m256 scales, offsets;
    explicit StoredKBlock(const uint8_t* block) : b(block) {
        const __m128i scales_and_mins = k_scales_and_mins(b);
        scales = scaled_bytes(scales_and_mins, blocks::half_to_float(b));
        const __m256 mins =
            scaled_bytes(_mm_srli_si128(scales_and_mins, 8), blocks::half_to_float(b + 2));
        offsets = _mm256_xor_ps(mins, _mm256_set1_ps(-0.0f));  // negated exactly
    }
    template <int S>
    __m256i quants() const {
        const uint8_t* qs = b + (Fifth ? 48 : 16) + 32 * (S / 2);
        const __m256i low = shifted_bits<S % 2 ? -4 : 0, 0x0F>(qs);
        if constexpr (!Fifth) return low;
        return _mm256_or_si256(low, shifted_bits<4 - S, 0x10>(b + 16));
    }
    void scale_products(const float* xd, float* out) const {
        _mm256_store_ps(out, _mm256_mul_ps(scales, _mm256_loadu_ps(xd)));
    }
    template <int S>
    static __m256 lane_scale(const float* products) {
        return _mm256_broadcast_ss(products + S);
    }
};

// A Q6_K super-block read straight from its bytes: sub-block S = 4h + j (h the half of 128
// values) takes the low (j < 2) or high nibbles of ql's 32 bytes at 64h + 32(j % 2), bits
// 2j, 2j+1 of qh's 32 bytes at 128 + 32h as bits 4-5, less 32 (signed quants); values 0-15
// scaled by d * scales[2S], 16-31 by d * scales[2S + 1], the sixteen decoded once.
struct StoredQ6KBlock {
    static constexpr int kSubs = 8;
    const uint8_t* b;
    __m256 scales[2];  // sub-blocks 0-3, then 4-7: each one's lo and hi
    explicit StoredQ6KBlock(const uint8_t* block) : b(block) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
        const __m256 d = _mm256_set1_ps(blocks::half_to_float(b + 208));
        const __m256i low = _mm256_cvtepi8_epi32(bytes);
        const __m256i high = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes));
        scales[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(low), d);
        scales[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(high), d);
    }
    template <int S>
    __m256i quants() const {
        constexpr int kHalf = S / 4, kJ = S % 4;
        const __m256i low = shifted_bits<kJ < 2 ? 0 : -4, 0x0F>(b + 64 * kHalf + 32 * (kJ % 2));
        const __m256i high = shifted_bits<4 - 2 * kJ, 0x30>(b + 128 + 32 * kHalf);
        return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
    }
    // out[2s + h] = scale (lo h = 0, hi h = 1) of sub-block s * xd[s]
    void scale_products(const float* xd, float* out) const {
        const __m256 x = _mm256_loadu_ps(xd);
        const __m256 first = _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        const __m256 last = _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
        _mm256_store_ps(out, _mm256_mul_ps(scales[0], first));
        _mm256_store_ps(out + 8, _mm256_mul_ps(scales[1], last));
    }
    template <int S>
    static __m256 lane_scale(const float* products) {
        const auto* lo_hi = reinterpret_cast<const double*>(products + 2 * S);
        const __m128 pair = _mm_castpd_ps(_mm_load_sd(lo_hi));
        return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair),
                                        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    }
};

inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// acc[r] += sub-block S's terms for R rows of x (x's sub-block at[r] + S; ``products[r]`` its
// scale products): the integer dot product in eight int32 lanes (lanes 0-3 values 0-15, 4-7
// values 16-31), scaled per lane; a 32-value type's offset term off * (d * sum(qx)) into the
// float sums beside them.
// Inlined by force, as add_block: else GCC left Q6_K's add_block a call with its
// accumulators in memory (M=1 1.24 -> 1.06 ms at 2048 x 8192, native).
template <typename Block, bool Offset, bool Signed, int R, int S>
[[gnu::always_inline]] inline void add_sub(const Block& block, const Activations& a,
                                           const int64_t* at, const float (*products)[16],
                                           __m256* acc, float* offsets) {
    const __m256i w = block.template quants<S>();
    const __m256i magnitude = Signed ? _mm256_sign_epi8(w, w) : w;
    for (int r = 0; r < R; ++r) {
        const int64_t i = at[r] + S;
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[i * 32]));
        if (Signed) x = _mm256_sign_epi8(x, w);
        const __m256i sums = dot_acc(_mm256_setzero_si256(), magnitude, x);
        const __m256 scale = Block::template lane_scale<S>(products[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        if constexpr (Offset && Block::kSubs == 1) offsets[r] += block.off(S) * a.s[i];
    }
}

// Block b's terms for R rows of x, its even sub-blocks into ``first`` and odd ones into
// ``second`` (two chains of dependent adds); a super-block's eight offset terms
// off * (d * sum(qx)) in one vector product per row, into ``first``'s lanes.
template <typename Block, int B, bool Offset, bool Signed, int R, int... S>
[[gnu::always_inline]] inline void add_block(const uint8_t* row, int64_t b, const RowsArgs& t,
                                             __m256* first, __m256* second, float* offsets,
                                             std::integer_sequence<int, S...>) {
    const Activations& a = *t.a;
    const Block block(row + b * B);
    int64_t at[R];
    alignas(32) float products[R][16];
    for (int r = 0; r < R; ++r) {
        at[r] = (t.m0 + r) * (t.k / 32) + b * Block::kSubs;
        block.scale_products(&a.d[at[r]], products[r]);
    }
    (add_sub<Block, Offset, Signed, R, S>(block, a, at, products, S % 2 ? second : first,
                                           offsets),
     ...);
    if constexpr (Offset && Block::kSubs == 8) {
        const __m256 off = block.offsets;
        for (int r = 0; r < R; ++r)
            first[r] = _mm256_fmadd_ps(off, _mm256_loadu_ps(&a.s[at[r]]), first[r]);
    }
}

// y_r = row . x_r for R rows of x: even and odd blocks (and sub-blocks) into two sets of
// sums, added at the end.
template <typename Block, int B, bool Offset, bool Signed, int R>
void row_dot(const uint8_t* row, const RowsArgs& t, float* out, int64_t out_stride) {
    constexpr auto kSubs = std::make_integer_sequence<int, Block::kSubs>{};
    __m256 even[R], odd[R];
    float even_offsets[R] = {}, odd_offsets[R] = {};
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < t.blocks; b += 2) {
        prefetch_ahead(row + b * B, 2 * B, t.end);
        add_block<Block, B, Offset, Signed, R>(row, b, t, even, odd, even_offsets, kSubs);
        add_block<Block, B, Offset, Signed, R>(row, b + 1, t, odd, even, odd_offsets, kSubs);
    }
    if (b < t.blocks)
        add_block<Block, B, Offset, Signed, R>(row, b, t, even, odd, even_offsets, kSubs);
    for (int r = 0; r < R; ++r) {
        const float offsets = even_offsets[r] + odd_offsets[r];
        out[r * out_stride] = sum_lanes(_mm256_add_ps(even[r], odd[r])) + offsets;
    }
}
#else
// Without AVX2 every type's block is unpacked (blocks.h) into a buffer on the stack.
// (NEON could read each block straight into registers as the AVX2 readers do: not done yet.)
template <blocks::Unpack U, int V>
struct Unpacker {
    static constexpr int kSubs = V / 32;
    int8_t q[V];
    float lo_[kSubs], hi_[kSubs], off_[kSubs];
    explicit Unpacker(const uint8_t* b) { U(b, {q, lo_, hi_, off_}); }
    const int8_t* bytes(int s) const { return q + 32 * s; }
    float lo(int s) const { return lo_[s]; }
    float hi(int s) const { return hi_[s]; }
    float off(int s) const { return off_[s]; }
};

#if defined(__ARM_NEON)
// y_r = row . x_r for R rows of x, NEON: per 32 values the integer sums of values 0-15 and
// 16-31, four int32 lanes each, scaled (w's scale times x's d) into four float lanes; the
// offset term off * (d * sum(qx)) summed beside them.
template <typename Block, int B, bool Offset, bool Signed, int R>
void row_dot(const uint8_t* row, const RowsArgs& t, float* out, int64_t out_stride) {
    const Activations& a = *t.a;
    const int64_t x_subs = t.k / 32;
    float32x4_t total[R];
    float offsets[R] = {};
    for (int r = 0; r < R; ++r) total[r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < t.blocks; ++b) {
        prefetch_ahead(row + b * B, B, t.end);
        const Block block(row + b * B);
        for (int s = 0; s < Block::kSubs; ++s) {
            const int8x16_t w_lo = vld1q_s8(block.bytes(s)), w_hi = vld1q_s8(block.bytes(s) + 16);
            for (int r = 0; r < R; ++r) {
                const int64_t at = (t.m0 + r) * x_subs + b * Block::kSubs + s;
                const int8_t* x = &a.q[at * 32];
                const int32x4_t lo = dot_bytes(vdupq_n_s32(0), w_lo, vld1q_s8(x));
                const int32x4_t hi = dot_bytes(vdupq_n_s32(0), w_hi, vld1q_s8(x + 16));
                total[r] = vfmaq_n_f32(total[r], vcvtq_f32_s32(lo), block.lo(s) * a.d[at]);
                total[r] = vfmaq_n_f32(total[r], vcvtq_f32_s32(hi), block.hi(s) * a.d[at]);
                if (Offset) offsets[r] += block.off(s) * a.s[at];
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = vaddvq_f32(total[r]) + offsets[r];
}
#else
// y_r = row . x_r for R rows of x, plain C++: the GEMM fallback's order, per 32 values the
// integer sums of values 0-15 and 16-31 scaled and added in float.
template <typename Block, int B, bool Offset, bool Signed, int R>
void row_dot(const uint8_t* row, const RowsArgs& t, float* out, int64_t out_stride) {
    const Activations& a = *t.a;
    const int64_t x_subs = t.k / 32;
    float total[R] = {};
    for (int64_t b = 0; b < t.blocks; ++b) {
        prefetch_ahead(row + b * B, B, t.end);
        const Block block(row + b * B);
        for (int s = 0; s < Block::kSubs; ++s) {
            const int8_t* w = block.bytes(s);
            for (int r = 0; r < R; ++r) {
                const int64_t at = (t.m0 + r) * x_subs + b * Block::kSubs + s;
                int low = 0, high = 0;
                for (int i = 0; i < 32; ++i) (i < 16 ? low : high) += w[i] * a.q[at * 32 + i];
                total[r] += static_cast<float>(low) * (block.lo(s) * a.d[at]);
                total[r] += static_cast<float>(high) * (block.hi(s) * a.d[at]);
                if (Offset) total[r] += block.off(s) * a.s[at];
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = total[r];
}
#endif
#endif

// One of the row_dot kernels by its row count (1 .. kDirectRows).
template <typename Block, int B, bool Offset, bool Signed, int R = kDirectRows>
void rows_for(int rows, const uint8_t* row, const RowsArgs& t, float* out, int64_t stride) {
    if constexpr (R > 1) {
        if (rows < R) return rows_for<Block, B, Offset, Signed, R - 1>(rows, row, t, out, stride);
    }
    row_dot<Block, B, Offset, Signed, R>(row, t, out, stride);
}

// y (m, n) = x . W^T over x's quantized rows ``a``, W's rows one at a time (threads split
// them; one thread, no OpenMP region at all), each against up to kDirectRows rows of x.
template <typename Block, int V, int B, bool Offset, bool Signed>
void rows_product(const uint8_t* w, int64_t n, int64_t row_stride, const Activations& a,
                  int64_t m, int64_t k, float* y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t o = 0; o < n; ++o) {
        for (int64_t m0 = 0; m0 < m; m0 += kDirectRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kDirectRows, m - m0));
            const RowsArgs t{&a, m0, k, k / V, w + n * row_stride};
            rows_for<Block, B, Offset, Signed>(rows, w + o * row_stride, t, y + m0 * n + o, n);
        }
    }
}

// Each type's blocks read straight from their bytes (AVX2), else unpacked.
#if defined(__AVX2__)
using Q4_0Rows = StoredBlock<q4_0_quants, 8, false>;
using Q4_1Rows = StoredBlock<q4_1_quants, 0, true>;
using Q5_0Rows = StoredBlock<q5_0_quants, 16, false>;
using Q5_1Rows = StoredBlock<q5_1_quants, 0, true>;
using Q8_0Rows = StoredBlock<q8_0_quants, 0, false>;
using Q4_KRows = StoredKBlock<false>;
using Q5_KRows = StoredKBlock<true>;
using Q6_KRows = StoredQ6KBlock;
#else
using Q4_0Rows = Unpacker<blocks::unpack_q4_0_unsigned, 32>;
using Q4_1Rows = Unpacker<blocks::unpack_q4_1, 32>;
using Q5_0Rows = Unpacker<blocks::unpack_q5_0_unsigned, 32>;
using Q5_1Rows = Unpacker<blocks::unpack_q5_1, 32>;
using Q8_0Rows = Unpacker<blocks::unpack_q8_0, 32>;
using Q4_KRows = Unpacker<blocks::unpack_q4_k, 256>;
using Q5_KRows = Unpacker<blocks::unpack_q5_k, 256>;
using Q6_KRows = Unpacker<blocks::unpack_q6_k, 256>;
#endif

using RowsProduct = void (*)(const uint8_t* w, int64_t n, int64_t row_stride,
                             const Activations& a, int64_t m, int64_t k, float* y, int threads);

}  // namespace
