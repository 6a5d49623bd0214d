// Products over GGUF blocks as stored, never a float copy of the weight
// (llamatrain.ops.quantized_matmul).
//
// lt_matmul:   y  = x . W^T   x (m, k) float32 -> y (m, n)   W (n, k) as its blocks
// lt_matmul_t: dx = G . W     G given transposed, gt (n, m)  -> dx (m, k), added into
//
// The forward follows llama.cpp's scheme (ggml-cpu's ggml_vec_dot_*_q8_*): x is quantized to
// int8 per 32 values with one float scale d (and the block's d * sum(q), for the weight types
// with an offset), each weight block is unpacked to signed 8-bit quants with a float scale
// per 16 values and a float offset per 32, and every 32 values are one integer dot product
// (AVX2 maddubs + madd, or VNNI dpbusd), scaled in float. Every weight type is reduced to
// that one form, so one dot kernel serves them all:
//   value = s * q + off     q int8, s per 16 values ("lo" for values 0-15, "hi" 16-31)
//   sum over 32 values of value * x  ~  s . xd . sum(q * qx)  +  off . xd . sum(qx)
// The K types are quantized against 32-value activation blocks too (llama.cpp's Q8_K uses
// 256): a finer scale, so closer to the exact product, and one activation format for all.
//
// The backward decodes W a little at a time, never whole: each thread owns whole blocks of dx's columns and
// walks W's rows a panel at a time, decoding the panel's blocks (ggml's arithmetic, float32)
// into an L1-sized buffer and adding G[m, o] * W[o, cols] into dx, four rows of dx at a time
// held in registers. Built with -ffp-contract=off, so the decoded values are ggml's, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 4;  // activation rows per pass over a weight row

float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
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

void set_scales(Unpacked out, int sub, float lo, float hi, float off) {
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
#else
    for (int i = 0; i < N; ++i) {
        low[i] = static_cast<int8_t>((src[i] & 0x0F) - bias);
        high[i] = static_cast<int8_t>((src[i] >> 4) - bias);
    }
#endif
}

void unpack_q4_0(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b);
    split_nibbles<16>(b + 2, out.q, out.q + 16, 8);
    set_scales(out, 0, d, d, 0.0f);
}

void unpack_q4_1(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    split_nibbles<16>(b + 4, out.q, out.q + 16, 0);
    set_scales(out, 0, d, d, m);
}

void unpack_q8_0(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b);
    std::memcpy(out.q, b + 2, 32);
    set_scales(out, 0, d, d, 0.0f);
}

// Q4_K/Q5_K: sub-block j's six-bit scale and min from the block's 12 packed bytes.
void k_scale_min(int j, const uint8_t* packed, int* scale, int* min) {
    if (j < 4) {
        *scale = packed[j] & 63;
        *min = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
}

void k_scales(const uint8_t* b, Unpacked out) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    for (int j = 0; j < 8; ++j) {
        int scale, min;
        k_scale_min(j, b + 4, &scale, &min);
        const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(min);
        set_scales(out, j, d1, d1, -m1);
    }
}

void unpack_q4_k(const uint8_t* b, Unpacked out) {
    for (int j = 0; j < 4; ++j) split_nibbles<32>(b + 16 + 32 * j, out.q + 64 * j, out.q + 64 * j + 32, 0);
    k_scales(b, out);
}

void unpack_q5_k(const uint8_t* b, Unpacked out) {
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

void unpack_q6_k(const uint8_t* b, Unpacked out) {
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

struct Rows;
using UnpackRows = void (*)(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t k,
                            Rows* out);
using DecodeBlocks = void (*)(const uint8_t* w, int64_t row_stride, int64_t rows,
                              int64_t blocks, float* out);

struct Format {
    int values;   // per block
    int bytes;    // per block
    bool offset;  // whether any block has a nonzero offset (the forward then adds off . xs)
    UnpackRows unpack_rows;
    DecodeBlocks decode_blocks;
};

// A run of weight rows unpacked (quants, and per 32 values lo / hi / off), reused per thread.
struct Rows {
    std::vector<int8_t> q;
    std::vector<float> lo, hi, off;
};

// Rows of blocks unpacked into ``out``; a template over the type's unpack, so it is inlined.
template <Unpack U, int V, int B>
void unpack_rows(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t k, Rows* out) {
    const int64_t subs = k / 32, blocks = k / V;
    out->q.resize(rows * k);
    out->lo.resize(rows * subs);
    out->hi.resize(rows * subs);
    out->off.resize(rows * subs);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t sub = r * subs + b * (V / 32);
            U(w + r * row_stride + b * B,
              {&out->q[r * k + b * V], &out->lo[sub], &out->hi[sub], &out->off[sub]});
        }
    }
}

// 32 values scale * q + off (scale lo for the first 16, hi for the rest), each operation
// rounded to float32 as ggml's dequantize_row_* rounds it.
inline void decode_32(const int8_t* q, float lo, float hi, float off, float* out) {
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
        _mm256_storeu_ps(out + 16 * half, _mm256_add_ps(a, offset));
        _mm256_storeu_ps(out + 16 * half + 8, _mm256_add_ps(b, offset));
    }
#else
    for (int i = 0; i < 32; ++i) out[i] = (i < 16 ? lo : hi) * static_cast<float>(q[i]) + off;
#endif
}

// The first ``blocks`` blocks of a run of weight rows as floats, ``out[row][value]`` (a row's
// blocks are contiguous: read in order, where one block of many rows would be a strided walk
// over pages); ggml's float arithmetic.
template <Unpack U, int V, int B>
void decode_blocks(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t blocks,
                   float* out) {
    int8_t q[V];
    float lo[V / 32], hi[V / 32], off[V / 32];
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            U(w + r * row_stride + b * B, {q, lo, hi, off});
            float* values = out + (r * blocks + b) * V;
            for (int s = 0; s < V / 32; ++s) {
                decode_32(q + 32 * s, lo[s], hi[s], off[s], values + 32 * s);
            }
        }
    }
}

template <Unpack U, int V, int B, bool Offset>
constexpr Format format() {
    return {V, B, Offset, unpack_rows<U, V, B>, decode_blocks<U, V, B>};
}

// Indexed by the type ids of quantized_matmul.KERNEL_TYPES.
const Format kFormats[] = {
    format<unpack_q4_0, 32, 18, false>(),  format<unpack_q4_1, 32, 20, true>(),
    format<unpack_q8_0, 32, 34, false>(),  format<unpack_q4_k, 256, 144, true>(),
    format<unpack_q5_k, 256, 176, true>(), format<unpack_q6_k, 256, 210, false>(),
};
constexpr int kFormatCount = sizeof(kFormats) / sizeof(kFormats[0]);

// x quantized per 32 values: int8 quants, the scale d and d * sum(q) of each block.
struct Activations {
    std::vector<int8_t> q;
    std::vector<float> d, s;
};

void quantize_rows(const float* x, int64_t m, int64_t k, Activations* a, int threads) {
    const int64_t subs = k / 32;
    a->q.resize(m * k);
    a->d.resize(m * subs);
    a->s.resize(m * subs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < m * subs; ++i) {
        const float* v = x + i * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
            const int q = static_cast<int>(std::nearbyint(v[j] * id));
            a->q[i * 32 + j] = static_cast<int8_t>(q);
            sum += q;
        }
        a->d[i] = d;
        a->s[i] = d * static_cast<float>(sum);
    }
}

#if defined(__AVX2__)
// sum over each 4 consecutive byte products of unsigned a and signed b: 8 int32 lanes.
inline __m256i dot_u8_i8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// y[r] = sum over the row of s * xd * sum(q * qx) for R activation rows against one weight
// row (its quants wq, scales lo / hi per 32 values); offsets are added by the caller.
template <int R>
void dot_rows(const int8_t* wq, const float* lo, const float* hi, int64_t subs, const int8_t* xq,
              const float* xd, int64_t k, float* y) {
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < subs; ++s) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * s));
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        const __m256 scale = _mm256_set_m128(_mm_set1_ps(hi[s]), _mm_set1_ps(lo[s]));
        for (int r = 0; r < R; ++r) {
            const __m256i x =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + 32 * s));
            const __m256i sums = dot_u8_i8(magnitude, _mm256_sign_epi8(x, w));
            const __m256 factor = _mm256_mul_ps(scale, _mm256_set1_ps(xd[r * subs + s]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), factor, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[r] = horizontal_sum(acc[r]);
#else
    for (int r = 0; r < R; ++r) {
        float total = 0.0f;
        for (int64_t s = 0; s < subs; ++s) {
            const int8_t* w = wq + 32 * s;
            const int8_t* x = xq + r * k + 32 * s;
            int low = 0, high = 0;
            for (int i = 0; i < 16; ++i) low += w[i] * x[i];
            for (int i = 16; i < 32; ++i) high += w[i] * x[i];
            total += (lo[s] * static_cast<float>(low) + hi[s] * static_cast<float>(high)) *
                     xd[r * subs + s];
        }
        y[r] = total;
    }
#endif
}

float offset_dot(const float* off, const float* xs, int64_t subs) {
    float total = 0.0f;
    for (int64_t s = 0; s < subs; ++s) total += off[s] * xs[s];
    return total;
}

// y[m0 .. m0+R, o] for every row o of the unpacked run (rows o0 ..).
template <int R>
void tile_rows(const Format& f, const Rows& w, int64_t rows, int64_t o0, const Activations& a,
               int64_t m0, int64_t k, int64_t n, float* y) {
    const int64_t subs = k / 32;
    float part[R];
    for (int64_t o = 0; o < rows; ++o) {
        dot_rows<R>(&w.q[o * k], &w.lo[o * subs], &w.hi[o * subs], subs, &a.q[m0 * k],
                    &a.d[m0 * subs], k, part);
        for (int r = 0; r < R; ++r) {
            const float extra =
                f.offset ? offset_dot(&w.off[o * subs], &a.s[(m0 + r) * subs], subs) : 0.0f;
            y[(m0 + r) * n + o0 + o] = part[r] + extra;
        }
    }
}

// dx[m0 .. m0+R, c .. c+32] += sum over the panel's rows o of gt[o, m] * panel[o][c ..].
#if defined(__AVX2__)
// One row of dx's 32 columns in registers, or (R = 4) four: named accumulators, not an array,
// which GCC would keep on the stack and store every iteration.
inline void add_32(float* out, __m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), a0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_loadu_ps(out + 8), a1));
    _mm256_storeu_ps(out + 16, _mm256_add_ps(_mm256_loadu_ps(out + 16), a2));
    _mm256_storeu_ps(out + 24, _mm256_add_ps(_mm256_loadu_ps(out + 24), a3));
}

template <int R>
void add_panel(const float* panel, int64_t width, int64_t rows, const float* gt, int64_t m,
               int64_t m0, float* dx, int64_t k) {
    if constexpr (R != 4) {
        for (int r = 0; r < R; ++r) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t o = 0; o < rows; ++o) {
                const float* w = panel + o * width;
                const __m256 g = _mm256_broadcast_ss(gt + o * m + m0 + r);
                a0 = _mm256_fmadd_ps(g, _mm256_loadu_ps(w), a0);
                a1 = _mm256_fmadd_ps(g, _mm256_loadu_ps(w + 8), a1);
                a2 = _mm256_fmadd_ps(g, _mm256_loadu_ps(w + 16), a2);
                a3 = _mm256_fmadd_ps(g, _mm256_loadu_ps(w + 24), a3);
            }
            add_32(dx + (m0 + r) * k, a0, a1, a2, a3);
        }
    } else {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
        __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
        __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
        __m256 a30 = a00, a31 = a00, a32 = a00, a33 = a00;
        for (int64_t o = 0; o < rows; ++o) {
            const float* w = panel + o * width;
            const float* g = gt + o * m + m0;
            const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
            const __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);
            __m256 b = _mm256_broadcast_ss(g);
            a00 = _mm256_fmadd_ps(b, w0, a00), a01 = _mm256_fmadd_ps(b, w1, a01);
            a02 = _mm256_fmadd_ps(b, w2, a02), a03 = _mm256_fmadd_ps(b, w3, a03);
            b = _mm256_broadcast_ss(g + 1);
            a10 = _mm256_fmadd_ps(b, w0, a10), a11 = _mm256_fmadd_ps(b, w1, a11);
            a12 = _mm256_fmadd_ps(b, w2, a12), a13 = _mm256_fmadd_ps(b, w3, a13);
            b = _mm256_broadcast_ss(g + 2);
            a20 = _mm256_fmadd_ps(b, w0, a20), a21 = _mm256_fmadd_ps(b, w1, a21);
            a22 = _mm256_fmadd_ps(b, w2, a22), a23 = _mm256_fmadd_ps(b, w3, a23);
            b = _mm256_broadcast_ss(g + 3);
            a30 = _mm256_fmadd_ps(b, w0, a30), a31 = _mm256_fmadd_ps(b, w1, a31);
            a32 = _mm256_fmadd_ps(b, w2, a32), a33 = _mm256_fmadd_ps(b, w3, a33);
        }
        add_32(dx + m0 * k, a00, a01, a02, a03);
        add_32(dx + (m0 + 1) * k, a10, a11, a12, a13);
        add_32(dx + (m0 + 2) * k, a20, a21, a22, a23);
        add_32(dx + (m0 + 3) * k, a30, a31, a32, a33);
    }
}
#else
template <int R>
void add_panel(const float* panel, int64_t width, int64_t rows, const float* gt, int64_t m,
               int64_t m0, float* dx, int64_t k) {
    float acc[R][32] = {};
    for (int64_t o = 0; o < rows; ++o) {
        const float* w = panel + o * width;
        for (int r = 0; r < R; ++r) {
            const float g = gt[o * m + m0 + r];
            for (int i = 0; i < 32; ++i) acc[r][i] += g * w[i];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < 32; ++i) dx[(m0 + r) * k + i] += acc[r][i];
}
#endif

template <typename Step>
void over_tiles(int64_t m, Step step) {
    int64_t m0 = 0;
    for (; m0 + kTile <= m; m0 += kTile) step(m0, kTile);
    if (m0 < m) step(m0, static_cast<int>(m - m0));
}

}  // namespace

extern "C" {

// y (m, n) = x (m, k) . W^T, W's n rows of blocks row_stride bytes apart. 0, or -1 for a
// type id without a format or a k that is not whole blocks.
int lt_matmul(int type, const uint8_t* w, int64_t n, int64_t row_stride, const float* x,
              int64_t m, int64_t k, float* y, int threads) {
    if (type < 0 || type >= kFormatCount || k % kFormats[type].values) return -1;
    const Format& f = kFormats[type];
    // kept per thread across calls: a buffer freed and allocated again every product would be
    // fresh pages to fault in each time (glibc maps large blocks anew)
    static thread_local Activations buffers;
    Activations& a = buffers;  // the calling thread's, shared with the team below
    quantize_rows(x, m, k, &a, threads);
    // rows a task: a small run unpacked once and used for every tile of x's rows
    const int64_t chunk =
        m <= kTile ? 1 : std::max<int64_t>(1, std::min<int64_t>(16, n / (4 * threads)));
#pragma omp parallel num_threads(threads)
    {
        static thread_local Rows rows;
#pragma omp for schedule(dynamic, 1)
        for (int64_t o0 = 0; o0 < n; o0 += chunk) {
            const int64_t count = std::min(chunk, n - o0);
            f.unpack_rows(w + o0 * row_stride, row_stride, count, k, &rows);
            over_tiles(m, [&](int64_t m0, int tile) {
                switch (tile) {
                    case 4: tile_rows<4>(f, rows, count, o0, a, m0, k, n, y); break;
                    case 3: tile_rows<3>(f, rows, count, o0, a, m0, k, n, y); break;
                    case 2: tile_rows<2>(f, rows, count, o0, a, m0, k, n, y); break;
                    default: tile_rows<1>(f, rows, count, o0, a, m0, k, n, y); break;
                }
            });
        }
    }
    return 0;
}

// dx (m, k) += G . W with G given as gt (n, m); W as lt_matmul's. 0, or -1 as lt_matmul.
// Each task owns a tile of dx's columns (whole blocks, up to kTileValues) and walks W's rows
// a panel at a time: the panel decoded once, then added into every row of dx.
int lt_matmul_t(int type, const uint8_t* w, int64_t n, int64_t row_stride, const float* gt,
                int64_t m, int64_t k, float* dx, int threads) {
    if (type < 0 || type >= kFormatCount || k % kFormats[type].values) return -1;
    const Format& f = kFormats[type];
    // a panel of 32 KiB of floats, as deep as it can be: each panel adds its sums into dx once,
    // and dx's rows (k floats apart) contend for the same cache sets
    constexpr int64_t kPanelValues = 8192, kTileValues = 128;
    const int64_t tile_blocks = std::max<int64_t>(1, kTileValues / f.values);
    const int64_t panel_rows = kPanelValues / (tile_blocks * f.values);
    const int64_t tiles = (k / f.values + tile_blocks - 1) / tile_blocks;
#pragma omp parallel num_threads(threads)
    {
        static thread_local std::vector<float> panel(kPanelValues);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t first = t * tile_blocks;
            const int64_t blocks = std::min(tile_blocks, k / f.values - first);
            const int64_t width = blocks * f.values;
            for (int64_t o0 = 0; o0 < n; o0 += panel_rows) {
                const int64_t rows = std::min(panel_rows, n - o0);
                f.decode_blocks(w + o0 * row_stride + first * f.bytes, row_stride, rows, blocks,
                                panel.data());
                const float* g = gt + o0 * m;
                for (int64_t c = 0; c < width; c += 32) {
                    float* out = dx + first * f.values + c;
                    const float* cols = panel.data() + c;
                    over_tiles(m, [&](int64_t m0, int tile) {
                        switch (tile) {
                            case 4: add_panel<4>(cols, width, rows, g, m, m0, out, k); break;
                            case 3: add_panel<3>(cols, width, rows, g, m, m0, out, k); break;
                            case 2: add_panel<2>(cols, width, rows, g, m, m0, out, k); break;
                            default: add_panel<1>(cols, width, rows, g, m, m0, out, k); break;
                        }
                    });
                }
            }
        }
    }
    return 0;
}

}  // extern "C"
