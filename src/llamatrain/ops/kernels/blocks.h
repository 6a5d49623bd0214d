// GGUF blocks unpacked to one form (llamatrain.ops.quantized_matmul's kernels, quantized.cpp):
// every type's block becomes signed 8-bit quants q, and per 32 values a scale for values 0-15
// ("lo"), one for values 16-31 ("hi") and an offset, so that value i = scale * q[i] + off,
// each operation rounded as ggml's dequantize_row_* rounds it.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace blocks {

inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__ARM_NEON)  // FCVT: every aarch64 CPU converts halves
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
#else
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
        const float value = std::ldexp(static_cast<float>(mantissa), -24);
        return sign ? -value : value;
    }
    if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
#endif
}

// One block unpacked: its quants as int8 and, per 32 values, the scale of values 0-15 (lo)
// and 16-31 (hi) and the offset (off), so that value i = scale * q[i] + off.
struct Unpacked {
    int8_t* __restrict q;
    float* __restrict lo;
    float* __restrict hi;
    float* __restrict off;
};

using Unpack = void (*)(const uint8_t* block, Unpacked out);

inline void set_scales(Unpacked out, int sub, float lo, float hi, float off) {
    out.lo[sub] = lo;
    out.hi[sub] = hi;
    out.off[sub] = off;
}

// The low and the high nibbles of ``n`` bytes (16 or 32) as int8 values minus ``bias``.
template <int N>
inline void split_nibbles(const uint8_t* __restrict src, int8_t* __restrict low,
                          int8_t* __restrict high, int8_t bias) {
#if defined(__AVX2__)
    const __m128i mask = _mm_set1_epi8(0x0F), offset = _mm_set1_epi8(bias);
    for (int i = 0; i < N; i += 16) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        const __m128i l = _mm_sub_epi8(_mm_and_si128(v, mask), offset);
        const __m128i h = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), offset);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(low + i), l);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(high + i), h);
    }
#elif defined(__ARM_NEON)
    const int8x16_t offset = vdupq_n_s8(bias);
    for (int i = 0; i < N; i += 16) {
        const uint8x16_t v = vld1q_u8(src + i);
        vst1q_s8(low + i, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), offset));
        vst1q_s8(high + i, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), offset));
    }
#else
    for (int i = 0; i < N; ++i) {
        low[i] = static_cast<int8_t>((src[i] & 0x0F) - bias);
        high[i] = static_cast<int8_t>((src[i] >> 4) - bias);
    }
#endif
}

inline void unpack_q4_0(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b);
    split_nibbles<16>(b + 2, out.q, out.q + 16, 8);
    set_scales(out, 0, d, d, 0.0f);
}

// Q4_0 for the forward's integer sums: its quants left unsigned (0-15) and the 8 taken off
// as an offset, value = d * u - 8d (the offset's product goes with the activations' sums).
// Not for decoding: d * u - 8d may round differently from ggml's d * (u - 8).
inline void unpack_q4_0_unsigned(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b);
    split_nibbles<16>(b + 2, out.q, out.q + 16, 0);
    set_scales(out, 0, d, d, -8.0f * d);
}

inline void unpack_q4_1(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    split_nibbles<16>(b + 4, out.q, out.q + 16, 0);
    set_scales(out, 0, d, d, m);
}

#if defined(__AVX2__)
// 16 bytes' low nibbles then their high nibbles: a Q4 block's 32 quants in value order.
inline __m256i nibbles_32(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// A Q5 block's fifth bits (32-bit qh, bit j for value j) as bytes 16 or 0 in value order:
// byte j picks qh's byte j / 8, keeps bit j % 8, and that bit set becomes 0x10.
inline __m256i fifth_bits(const uint8_t* qh_bytes) {
    uint32_t qh;
    std::memcpy(&qh, qh_bytes, 4);
    const __m256i which = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                             0x0303030303030303);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), which);
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}
#endif

// Q5_0/Q5_1: the low nibbles as Q4's, the fifth bits from the 32-bit qh (bit j for value j),
// values 0-31 unsigned.
inline void five_bit_quants(const uint8_t* qh_bytes, const uint8_t* qs, int8_t* q) {
#if defined(__AVX2__)
    const __m256i quants = _mm256_or_si256(nibbles_32(qs), fifth_bits(qh_bytes));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), quants);
#else
    split_nibbles<16>(qs, q, q + 16, 0);
    uint32_t qh;
    std::memcpy(&qh, qh_bytes, 4);
    for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(q[j] | (((qh >> j) & 1) << 4));
#endif
}

inline void unpack_q5_0(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b);
    five_bit_quants(b + 2, b + 6, out.q);
    for (int j = 0; j < 32; ++j) out.q[j] = static_cast<int8_t>(out.q[j] - 16);
    set_scales(out, 0, d, d, 0.0f);
}

// Q5_0 for the forward's integer sums, as unpack_q4_0_unsigned: value = d * u - 16d.
inline void unpack_q5_0_unsigned(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b);
    five_bit_quants(b + 2, b + 6, out.q);
    set_scales(out, 0, d, d, -16.0f * d);
}

inline void unpack_q5_1(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    five_bit_quants(b + 4, b + 8, out.q);
    set_scales(out, 0, d, d, m);
}

inline void unpack_q8_0(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b);
    std::memcpy(out.q, b + 2, 32);
    set_scales(out, 0, d, d, 0.0f);
}

// Q4_K/Q5_K: sub-block j's six-bit scale and min from the block's 12 packed bytes.
inline void k_scale_min(int j, const uint8_t* packed, int* scale, int* min) {
    if (j < 4) {
        *scale = packed[j] & 63;
        *min = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
}

inline void k_scales(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    for (int j = 0; j < 8; ++j) {
        int scale, min;
        k_scale_min(j, b + 4, &scale, &min);
        const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(min);
        set_scales(out, j, d1, d1, -m1);
    }
}

inline void unpack_q4_k(const uint8_t* b, Unpacked out) {
    for (int j = 0; j < 4; ++j) {
        split_nibbles<32>(b + 16 + 32 * j, out.q + 64 * j, out.q + 64 * j + 32, 0);
    }
    k_scales(b, out);
}

inline void unpack_q5_k(const uint8_t* b, Unpacked out) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int j = 0; j < 4; ++j, qs += 32) {
        for (int l = 0; l < 32; ++l) {
            const int high_low = ((qh[l] >> (2 * j)) & 1) << 4;
            const int high_high = ((qh[l] >> (2 * j + 1)) & 1) << 4;
            out.q[64 * j + l] = static_cast<int8_t>((qs[l] & 0x0F) | high_low);
            out.q[64 * j + 32 + l] = static_cast<int8_t>((qs[l] >> 4) | high_high);
        }
    }
    k_scales(b, out);
}

inline void unpack_q6_k(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = b + 64 * half;
        const uint8_t* qh = b + 128 + 32 * half;
        int8_t* q = out.q + 128 * half;
        for (int l = 0; l < 32; ++l) {
            q[l] = static_cast<int8_t>(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
            q[32 + l] = static_cast<int8_t>(((ql[32 + l] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
            q[64 + l] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            q[96 + l] = static_cast<int8_t>(((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
        for (int quarter = 0; quarter < 4; ++quarter) {
            const int8_t* sc = scales + 8 * half + 2 * quarter;
            set_scales(out, 4 * half + quarter, d * static_cast<float>(sc[0]),
                       d * static_cast<float>(sc[1]), 0.0f);
        }
    }
}

// 32 values scale * q + off (scale lo for the first 16, hi for the rest), each operation
// rounded to float32 as ggml's dequantize_row_* rounds it; values 0-15 to out[0], 16-31 to
// out[1] (the two may be apart: slices of 16 columns).
inline void decode_32(const int8_t* q, float lo, float hi, float off, float* const out[2]) {
#if defined(__AVX2__)
    const __m128i bytes[2] = {_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))};
    const __m256 scales[2] = {_mm256_set1_ps(lo), _mm256_set1_ps(hi)};
    const __m256 offset = _mm256_set1_ps(off);
    for (int half = 0; half < 2; ++half) {
        const __m256i low = _mm256_cvtepi8_epi32(bytes[half]);
        const __m256i high = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes[half], bytes[half]));
        const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(low), scales[half]);
        const __m256 b = _mm256_mul_ps(_mm256_cvtepi32_ps(high), scales[half]);
        _mm256_storeu_ps(out[half], _mm256_add_ps(a, offset));
        _mm256_storeu_ps(out[half] + 8, _mm256_add_ps(b, offset));
    }
#elif defined(__ARM_NEON)  // a multiply then an add, each rounded, as above
    const float scales[2] = {lo, hi};
    for (int half = 0; half < 2; ++half) {
        const int8x16_t bytes = vld1q_s8(q + 16 * half);
        const int16x8_t words[2] = {vmovl_s8(vget_low_s8(bytes)), vmovl_high_s8(bytes)};
        for (int i = 0; i < 4; ++i) {
            const int16x8_t w = words[i / 2];
            const int32x4_t ints = i % 2 ? vmovl_high_s16(w) : vmovl_s16(vget_low_s16(w));
            const float32x4_t scaled = vmulq_n_f32(vcvtq_f32_s32(ints), scales[half]);
            vst1q_f32(out[half] + 4 * i, vaddq_f32(scaled, vdupq_n_f32(off)));
        }
    }
#else
    for (int i = 0; i < 32; ++i) {
        out[i / 16][i % 16] = (i < 16 ? lo : hi) * static_cast<float>(q[i]) + off;
    }
#endif
}

}  // namespace blocks
