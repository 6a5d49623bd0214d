// Products over GGUF blocks as stored, never a float copy of the weight
// (llamatrain.ops.quantized_matmul).
//
// lt_matmul:   y  = x . W^T   x (m, k) float32 -> y (m, n)   W (n, k) as its blocks
// lt_matmul_t: dx = G . W     G (m, n)                        -> dx (m, k)
//
// lt_matmul takes lt_matmul_panels (below) past a format's direct_rows rows of x, and up to
// them lt_matmul_rows (rows_dot.h: each weight row straight from its blocks, as decoding's
// one token a row has no x rows to share a panel's repack).
//
// The forward is llama.cpp's scheme for prompt processing (ggml-cpu's repacked
// gemm_q4_0_8x8_q8_0 and llamafile's tinyBLAS): x is quantized once to int8 per 32 values
// with one float scale d (and d * sum(q), for the weight types with an offset); W is taken
// eight rows at a time (a panel) and its blocks unpacked to the one form of blocks.h
// (value = s * q + off) and repacked so that 32 bytes hold four consecutive quants of each of
// the eight rows. One integer dot product instruction (VNNI dpbusd, or AVX2 maddubs + madd)
// of such a group with four of x's quants broadcast then gives eight rows' partial sums at
// once, in eight int32 lanes, with no horizontal sums; every 32 values (16 for Q6_K's
// scales) those sums are scaled in float, per lane, and accumulated in registers. A tile of
// a few x rows shares each group loaded (kRowTile). Unsigned quants (4 and 5 bits) multiply
// x's quants as they are; Q8_0's signed ones as |w| times x with w's signs; Q6_K's (-32 .. 31)
// x's quants shifted to unsigned, 128 * sum(w) taken off the sums (add_shifted_half). The K
// types' activations are quantized per 32 values too (llama.cpp's Q8_K uses 256): a finer
// scale, one activation format.
//
// The backward decodes W a little at a time, never whole: each thread owns a tile of dx's
// columns and walks W's rows a panel at a time, decoding the panel (ggml's arithmetic,
// float32) into an L2-sized buffer, then a register-tiled float micro-kernel (gradient_tile.h:
// kGradRows rows of dx by two vectors of columns) adds G[m, o] * W[o, cols] into dx. Built with
// -ffp-contract=off, so the decoded values are ggml's, bit for bit. aarch64: the same on NEON
// (neon.h: SDOT or SMULL + SADALP; gradient_tile.h: FMLA), checked under qemu only
// (tests/kernels/), not timed.
#include <vector>

#include "gradient_tile.h"
#include "rows_dot.h"

namespace {

using blocks::Unpack;

constexpr int kPanelRows = 8;      // weight rows repacked together: one int32 lane each
constexpr int kPanelSubs = 64;     // 32-value sub-blocks repacked at a time (16 KiB of quants)
#if defined(__AVX512F__)
constexpr int kRowTile = 8;        // x rows per pass over a panel (32 vector registers)
#else
constexpr int kRowTile = 4;        // (16 vector registers)
#endif

// A panel's sub-blocks repacked: per sub-block 8 groups of 32 bytes, group g holding quants
// 4g .. 4g+3 of each row (row j at bytes 4j .. 4j+3), then per sub-block each row's scales.
struct Panel {
    AlignedVector<int8_t> q;
    std::vector<float> lo, hi, off;
    std::vector<int32_t> sums;  // split types (Q6_K) on x86: each half's sum of quants (sum_halves)
};

using Repack = void (*)(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t first,
                        int64_t count, int64_t ahead, Panel* out);
using DecodeBlocks = void (*)(const uint8_t* w, int64_t row_stride, int64_t rows,
                              int64_t blocks, int64_t ahead, float* out);

struct Format {
    int values;   // per block
    int bytes;    // per block
    bool offset;  // whether any block has a nonzero offset (the forward then adds off . xs)
    bool split;   // whether values 0-15 and 16-31 may have different scales (Q6_K)
    int run;      // repacked quants unsigned, at most 15 (8) or 31 (4): groups whose byte
                  // products AVX2 may sum in int16 before widening; 0: signed quants
    Repack repack;
    DecodeBlocks decode_blocks;
    int direct_rows;   // x rows up to which lt_matmul takes ``rows``
    RowsProduct rows;  // the forward for a few rows of x (rows_dot.h)
};

// 8 rows of 8 groups of four bytes (rows 32 bytes apart in ``src``, ``stride`` bytes) written
// group-major: out[g][j] = src[j][g], an 8 x 8 transpose of int32s. Inlined by force: GCC
// otherwise stops inlining it into repack once the file holds rows_dot.h too (the AVX2
// panels' M=8 1.2-1.4x slower).
[[gnu::always_inline]] inline void transpose_groups(const int8_t* src, int64_t stride,
                                                   int8_t* out) {
#if defined(__AVX2__)
    __m256i r[8], t[8], u[8];
    for (int j = 0; j < 8; ++j)
        r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j * stride));
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
        u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
        u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
        u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    for (int g = 0; g < 4; ++g) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * g),
                            _mm256_permute2x128_si256(u[g], u[g + 4], 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (g + 4)),
                            _mm256_permute2x128_si256(u[g], u[g + 4], 0x31));
    }
#elif defined(__ARM_NEON)
    transpose_groups_neon(src, stride, out);
#else
    for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 8; ++j) std::memcpy(out + 32 * g + 4 * j, src + j * stride + 4 * g, 4);
#endif
}

#if defined(__AVX2__)
// Each row's sum of a repacked sub-block's quants, per half (groups 0-3, 4-7): out[half][j],
// for the x86 panels of a split type, which take x shifted (add_shifted_half).
inline void sum_halves(const int8_t* groups, int32_t* out) {
    const __m256i ones = _mm256_set1_epi8(1);
    for (int half = 0; half < 2; ++half) {
        __m256i total = _mm256_setzero_si256();
        for (int g = 4 * half; g < 4 * half + 4; ++g) {
            const __m256i w =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(groups + 32 * g));
            total = _mm256_add_epi32(
                total, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, w), _mm256_set1_epi16(1)));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + half * kPanelRows), total);
    }
}
#endif

// Blocks first .. first+count of up to 8 weight rows unpacked and repacked into ``out``;
// missing rows (the last panel of W) are zeros. The same blocks of the next panel's first
// ``ahead`` rows are asked from memory meanwhile, block by block (rows_dot.h's prefetch: a
// whole panel asked at once before its repack, as before, left a 1B decoding step's matrices
// at M=8 1.14-1.32x slower, Q4_0 and Q4_K_M, both builds). A template over the type's
// unpack, so it is inlined.
template <Unpack U, int V, int B, bool Split>
void repack(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t first, int64_t count,
            int64_t ahead, Panel* out) {
    constexpr int kSubs = V / 32;
    out->q.resize(count * kSubs * 256);
    if (Split) out->sums.resize(count * kSubs * 2 * kPanelRows);
    out->lo.resize(count * kSubs * kPanelRows);
    out->hi.resize(out->lo.size());
    out->off.resize(out->lo.size());
    alignas(32) int8_t q[kPanelRows][V] = {};
    float lo[kPanelRows][kSubs] = {}, hi[kPanelRows][kSubs] = {}, off[kPanelRows][kSubs] = {};
    for (int64_t b = 0; b < count; ++b) {
        for (int j = 0; j < rows; ++j) {
            const uint8_t* block = w + j * row_stride + (first + b) * B;
            if (j < ahead) prefetch(block + kPanelRows * row_stride, B);
            U(block, {q[j], lo[j], hi[j], off[j]});
        }
        for (int s = 0; s < kSubs; ++s) {
            const int64_t sub = b * kSubs + s;
            transpose_groups(&q[0][32 * s], V, &out->q[sub * 256]);
            for (int j = 0; j < kPanelRows; ++j) {
                out->lo[sub * kPanelRows + j] = lo[j][s];
                out->hi[sub * kPanelRows + j] = hi[j][s];
                out->off[sub * kPanelRows + j] = off[j][s];
            }
#if defined(__AVX2__)  // NEON and plain C++ multiply the signed quants as they are
            if (Split) sum_halves(&out->q[sub * 256], &out->sums[2 * sub * kPanelRows]);
#endif
        }
    }
}

// The first ``blocks`` blocks of a run of weight rows as floats, in slices of kSlice columns:
// value v of row r at out[(v / kSlice) * rows + r][v % kSlice], so that the micro-kernel
// walks one slice's rows contiguously (rows a power-of-two apart would share cache sets);
// ggml's float arithmetic. Block by block, each down the run's rows: consecutive stores land
// side by side in a slice (a row at a time scattered them a slice apart, every store a line
// of its own set), and the next ``ahead`` rows' same block is asked from memory meanwhile.
// 2048 x 8192 Q4_0 at one row of G, AVX2 build: 3.8 -> 2.8 ms, the backward at 64 rows ~8%.
template <Unpack U, int V, int B>
void decode_blocks(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t blocks,
                   int64_t ahead, float* out) {
    int8_t q[V];
    float lo[V / 32], hi[V / 32], off[V / 32];
    auto at = [&](int64_t r, int64_t v) {  // where value v of row r goes
        return out + ((v / kSlice) * rows + r) * kSlice + v % kSlice;
    };
    for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t r = 0; r < rows; ++r) {
            if (r < ahead) prefetch(w + (rows + r) * row_stride + b * B, B);
            U(w + r * row_stride + b * B, {q, lo, hi, off});
            for (int s = 0; s < V / 32; ++s) {
                const int64_t first = b * V + 32 * s;
                float* const halves[2] = {at(r, first), at(r, first + 16)};
                blocks::decode_32(q + 32 * s, lo[s], hi[s], off[s], halves);
            }
        }
    }
}

// A type's format: U decodes (the backward), Forward unpacks for the forward's repacking.
template <Unpack U, Unpack Forward, int V, int B, bool Offset, bool Split, int Run,
          int DirectRows, typename Rows>
constexpr Format format() {
    return {V,          B, Offset, Split, Run, repack<Forward, V, B, Split>, decode_blocks<U, V, B>,
            DirectRows, rows_product<Rows, V, B, Offset, Run == 0>};
}

// Indexed by the type ids of quantized_matmul.KERNEL_TYPES. Unsigned quants where the type's
// are (or, Q4_0, are made so with an offset): they multiply x's signed quants directly, where
// Q8_0's -128..127 need x's signs flipped per weight first (Q6_K's are split: add_shifted_half).
// Direct rows: the most M at which the direct path took no longer than the panels (within
// 2%) in both builds, native AVX-512 VNNI and -march=haswell (`bench/kernel_rows.py
// --direct`, bench/README.md). Past kDirectRows it passes over each weight row again.
const Format kFormats[] = {
    format<blocks::unpack_q4_0, blocks::unpack_q4_0_unsigned, 32, 18, true, false, 8, 4,
           Q4_0Rows>(),
    format<blocks::unpack_q4_1, blocks::unpack_q4_1, 32, 20, true, false, 8, 3, Q4_1Rows>(),
    format<blocks::unpack_q8_0, blocks::unpack_q8_0, 32, 34, false, false, 0, 4, Q8_0Rows>(),
    format<blocks::unpack_q4_k, blocks::unpack_q4_k, 256, 144, true, false, 8, 5, Q4_KRows>(),
    format<blocks::unpack_q5_k, blocks::unpack_q5_k, 256, 176, true, false, 4, 5, Q5_KRows>(),
    format<blocks::unpack_q6_k, blocks::unpack_q6_k, 256, 210, false, true, 0, 4, Q6_KRows>(),
    format<blocks::unpack_q5_0, blocks::unpack_q5_0_unsigned, 32, 22, true, false, 4, 2,
           Q5_0Rows>(),
    format<blocks::unpack_q5_1, blocks::unpack_q5_1, 32, 24, true, false, 4, 2, Q5_1Rows>(),
};
constexpr int kFormatCount = sizeof(kFormats) / sizeof(kFormats[0]);

// Where one tile of the forward reads and writes: x rows m0 .. (quants, scales, sums), the
// panel's sub-blocks, and y's block of rows m0 .., columns o0 .. o0+cols.
struct TileArgs {
    const Panel* panel;
    int64_t subs;        // sub-blocks in the panel
    const int8_t* xq;    // x row m0's quants at the panel's first sub-block
    const float* xd;     // its scales
    const float* xs;     // its d * sum(q)
    int64_t k;           // x's row length (quants from one row to the next)
    int64_t x_subs;      // k / 32 (scales from one row to the next)
    float* y;            // y[m0, o0]
    int64_t n;           // y's row length
    int cols;            // valid columns of the panel (8, or fewer in W's last panel)
    bool accumulate;     // add into y (a later chunk of the panel) or set it
};

#if defined(__AVX2__)
// x row r's quants 4g .. 4g+3 of sub-block s, in every int32 lane.
inline __m256i broadcast_four(const TileArgs& t, int r, int64_t s, int g) {
    int32_t four;
    std::memcpy(&four, t.xq + r * t.k + 32 * s + 4 * g, 4);
    return _mm256_set1_epi32(four);
}

// sums[r] += the byte products of groups First .. First+Count-1 with x row r's quants, the
// unsigned operand first as dpbusd / maddubs take it: w (the unsigned quants of 4 and 5 bits)
// or, XShifted, x's quants shifted to unsigned (add_shifted_half). VNNI's dpbusd takes them as
// they are; AVX2's maddubs sums Run groups' products in int16 (no saturation: |w| <= 15 or 31
// against x, or |w| <= 32 against x + 128 with Run 2) before widening them once.
template <int R, int Run, bool XShifted, int First, int Count>
inline void add_groups(const int8_t* wq, const TileArgs& t, int64_t s, __m256i* sums) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#pragma GCC unroll 8
    for (int g = First; g < First + Count; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * g));
        for (int r = 0; r < R; ++r) {
            const __m256i x = broadcast_four(t, r, s, g);
            sums[r] = XShifted ? dot_acc(sums[r], x, w) : dot_acc(sums[r], w, x);
        }
    }
#else
    for (int g0 = First; g0 < First + Count; g0 += Run) {
        __m256i pairs[R];
        for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = g0; g < g0 + Run; ++g) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * g));
            for (int r = 0; r < R; ++r) {
                const __m256i x = broadcast_four(t, r, s, g);
                pairs[r] = _mm256_add_epi16(pairs[r], XShifted ? _mm256_maddubs_epi16(x, w)
                                                               : _mm256_maddubs_epi16(w, x));
                // each sum kept in its register here: GCC otherwise reorders the unrolled
                // groups into all 32 products first, then a tree of adds, spilling most of
                // them to the stack (2048 x 8192 Q4_0 at 64 rows, AVX2 build: 16.2 -> 11.5 ms)
                asm("" : "+x"(pairs[r]));
            }
        }
        for (int r = 0; r < R; ++r)
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1)));
    }
#endif
}

// One half of a split type's sub-block (Q6_K: groups 0-3 or 4-7, 16 values a scale): its
// signed quants (-32 .. 31) times x's quants shifted to unsigned (x + 128, which
// lt_matmul_panels passes in t.xq), then 128 * sum(w) taken off each lane: no signs moved per
// group. The signed path's sign instructions made Q6_K's panels ~1.8x Q4_K's time on AVX2.
template <int R, int Half>
inline void add_shifted_half(const int8_t* wq, const TileArgs& t, int64_t s,
                             const int32_t* sums_of_w, __m256i* sums) {
    add_groups<R, 2, true, 4 * Half, 4>(wq, t, s, sums);
    const __m256i offset = _mm256_slli_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums_of_w + Half * kPanelRows)), 7);
    for (int r = 0; r < R; ++r) sums[r] = _mm256_sub_epi32(sums[r], offset);
}

// y[m0 + r, o0 + j] for R rows and the panel's 8 columns: per sub-block, the integer sums of
// 8 groups in registers, then scaled (lo for groups 0-3, hi for 4-7) and added in float.
template <int R, bool Offset, bool Split, int Run>
void panel_tile(const TileArgs& t) {
    static_assert(!(Split && Run), "split scales come with signed quants (Q6_K)");
    const Panel& p = *t.panel;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < t.subs; ++s) {
        const int8_t* wq = &p.q[s * 256];
        __m256i sums[R];
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        auto scale_into_acc = [&](const float* scales) {
            const __m256 w_scale = _mm256_loadu_ps(scales + s * kPanelRows);
            for (int r = 0; r < R; ++r) {
                const __m256 scale = _mm256_mul_ps(w_scale, _mm256_set1_ps(t.xd[r * t.x_subs + s]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r]);
                sums[r] = _mm256_setzero_si256();
            }
        };
        if constexpr (Split) {
            add_shifted_half<R, 0>(wq, t, s, &p.sums[2 * s * kPanelRows], sums);
            scale_into_acc(p.lo.data());
            add_shifted_half<R, 1>(wq, t, s, &p.sums[2 * s * kPanelRows], sums);
        } else if constexpr (Run > 0) {
            add_groups<R, Run, false, 0, 8>(wq, t, s, sums);
        } else {  // Q8_0: |w| times x with w's signs
            // unrolled by two only: by eight, GCC spilled the products to the stack as in
            // add_groups (2048 x 8192 Q8_0 at 64 rows, AVX2 build: 21.6 -> 18.2 ms)
#pragma GCC unroll 2
            for (int g = 0; g < 8; ++g) {
                const __m256i w =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * g));
                const __m256i magnitude = _mm256_sign_epi8(w, w);
                for (int r = 0; r < R; ++r) {
                    const __m256i x = _mm256_sign_epi8(broadcast_four(t, r, s, g), w);
                    sums[r] = dot_acc(sums[r], magnitude, x);
                }
            }
        }
        scale_into_acc(Split ? p.hi.data() : p.lo.data());
        if (Offset) {
            const __m256 off = _mm256_loadu_ps(&p.off[s * kPanelRows]);
            for (int r = 0; r < R; ++r)
                acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(t.xs[r * t.x_subs + s]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        alignas(32) float row[kPanelRows];
        _mm256_store_ps(row, acc[r]);
        float* out = t.y + r * t.n;
        for (int j = 0; j < t.cols; ++j) out[j] = t.accumulate ? out[j] + row[j] : row[j];
    }
}
#elif defined(__ARM_NEON)
template <int R, bool Offset, bool Split, int Run>  // signed or not, one path (neon.h)
void panel_tile(const TileArgs& t) { panel_tile_neon<R, Offset, Split, kPanelRows>(t); }
#else
template <int R, bool Offset, bool Split, int Run>
void panel_tile(const TileArgs& t) {
    const Panel& p = *t.panel;
    for (int r = 0; r < R; ++r) {
        float* out = t.y + r * t.n;
        for (int j = 0; j < t.cols; ++j) {
            float total = 0.0f;
            for (int64_t s = 0; s < t.subs; ++s) {
                int low = 0, high = 0;
                for (int i = 0; i < 32; ++i) {
                    const int w = p.q[s * 256 + (i / 4) * 32 + 4 * j + i % 4];
                    (i < 16 ? low : high) += w * t.xq[r * t.k + 32 * s + i];
                }
                const int64_t at = s * kPanelRows + j;
                const float xd = t.xd[r * t.x_subs + s];
                total += static_cast<float>(low) * (p.lo[at] * xd);
                total += static_cast<float>(high) * (p.hi[at] * xd);
                if (Offset) total += p.off[at] * t.xs[r * t.x_subs + s];
            }
            out[j] = t.accumulate ? out[j] + total : total;
        }
    }
}
#endif

template <int R>
void tile_for(const Format& f, const TileArgs& t) {
    if (f.split) return panel_tile<R, false, true, 0>(t);  // Q6_K
    if (f.run == 8) return panel_tile<R, true, false, 8>(t);   // Q4_0, Q4_1, Q4_K
    if (f.run == 4) return panel_tile<R, true, false, 4>(t);   // Q5_K, Q5_0, Q5_1
    return panel_tile<R, false, false, 0>(t);                 // Q8_0
}

// step(m0, rows) over [0, m) in tiles of Tile rows, the last one shorter.
template <int Tile, typename Step>
void over_tiles(int64_t m, Step step) {
    int64_t m0 = 0;
    for (; m0 + Tile <= m; m0 += Tile) step(m0, Tile);
    if (m0 < m) step(m0, static_cast<int>(m - m0));
}

// One of the tile kernels by its row count (1 .. kRowTile), a compile-time constant inside.
template <int R = kRowTile>
void tile_rows(int rows, const Format& f, const TileArgs& t) {
    if constexpr (R > 1) {
        if (rows < R) return tile_rows<R - 1>(rows, f, t);
    }
    tile_for<R>(f, t);
}



// x's quants as a split type's AVX2/VNNI panels take them, shifted to unsigned (x + 128, as
// bytes: add_shifted_half); elsewhere (NEON's signed dots, plain C++) the quants themselves.
inline const int8_t* shifted_for_split(const Activations& a, int64_t count) {
#if defined(__AVX2__)
    static thread_local AlignedVector<int8_t> shifted;
    shifted.resize(count);
    for (int64_t i = 0; i < count; ++i) shifted[i] = static_cast<int8_t>(a.q[i] ^ 0x80);
    return shifted.data();
#else
    (void)count;
    return a.q.data();
#endif
}

}  // namespace

extern "C" {

// y (m, n) = x (m, k) . W^T, W's n rows of blocks row_stride bytes apart, over repacked
// panels (any m; lt_matmul's path past its format's direct_rows). 0, or -1 for a type id
// without a format or a k that is not whole blocks.
int lt_matmul_panels(int type, const uint8_t* w, int64_t n, int64_t row_stride, const float* x,
                     int64_t m, int64_t k, float* y, int threads) {
    if (type < 0 || type >= kFormatCount || k % kFormats[type].values) return -1;
    const Format& f = kFormats[type];
    Activations& a = quantized_rows(x, m, k, threads);
    const int8_t* xq = f.split ? shifted_for_split(a, m * k) : a.q.data();
    const int64_t x_subs = k / 32, chunk_blocks = kPanelSubs * 32 / f.values;
    const int64_t blocks_in_row = k / f.values;
#pragma omp parallel num_threads(threads)
    {
        static thread_local Panel panel;
#pragma omp for schedule(dynamic, 1)
        for (int64_t o0 = 0; o0 < n; o0 += kPanelRows) {
            const int cols = static_cast<int>(std::min<int64_t>(kPanelRows, n - o0));
            // the next panel's rows asked from memory meanwhile (a decoding step at batch 8,
            // SmolLM2-135M Q4_0, 52-54 -> 42 ms with whole panels; now through the repack)
            const int64_t next = std::clamp<int64_t>(n - o0 - kPanelRows, 0, kPanelRows);
            for (int64_t first = 0; first < blocks_in_row; first += chunk_blocks) {
                const int64_t count = std::min(chunk_blocks, blocks_in_row - first);
                f.repack(w + o0 * row_stride, row_stride, cols, first, count, next, &panel);
                const int64_t s0 = first * f.values / 32;
                over_tiles<kRowTile>(m, [&](int64_t m0, int tile) {
                    const TileArgs t{&panel,          count * f.values / 32,
                                     &xq[m0 * k + s0 * 32],  &a.d[m0 * x_subs + s0],
                                     &a.s[m0 * x_subs + s0], k,
                                     x_subs,          y + m0 * n + o0,
                                     n,               cols,
                                     first > 0};
                    tile_rows(tile, f, t);
                });
            }
        }
    }
    return 0;
}

// lt_matmul_panels' product one weight row at a time (rows_dot.h; any m, lt_matmul's path
// up to its format's direct_rows): the same values but for the order of float sums.
int lt_matmul_rows(int type, const uint8_t* w, int64_t n, int64_t row_stride, const float* x,
                   int64_t m, int64_t k, float* y, int threads) {
    if (type < 0 || type >= kFormatCount || k % kFormats[type].values) return -1;
    kFormats[type].rows(w, n, row_stride, quantized_rows(x, m, k, threads), m, k, y, threads);
    return 0;
}

// y (m, n) = x (m, k) . W^T as lt_matmul_panels, by the faster path for m and the type.
int lt_matmul(int type, const uint8_t* w, int64_t n, int64_t row_stride, const float* x,
              int64_t m, int64_t k, float* y, int threads) {
    const bool direct = type >= 0 && type < kFormatCount && m <= kFormats[type].direct_rows;
    const auto product = direct ? lt_matmul_rows : lt_matmul_panels;
    return product(type, w, n, row_stride, x, m, k, y, threads);
}

// dx (m, k) = G . W for G (m, n); W as lt_matmul's. 0, or -1 as lt_matmul. Each task owns a
// tile of dx's columns (whole blocks, up to kTileValues), sets it to zero and walks W's rows a
// panel at a time: the panel decoded once, then added into every row of dx.
int lt_matmul_t(int type, const uint8_t* w, int64_t n, int64_t row_stride, const float* g,
                int64_t m, int64_t k, float* dx, int threads) {
    if (type < 0 || type >= kFormatCount || k % kFormats[type].values) return -1;
    const Format& f = kFormats[type];
    // a panel of 256 KiB of floats (L2): each panel adds its sums into dx once, and each slice
    // of it (kSlice columns, contiguous) stays in L1 while every tile of dx's rows passes over
    // it; 512 columns a task: G, packed once, is read k / 512 times
    constexpr int64_t kPanelValues = 65536, kTileValues = 512;
    const int64_t tile_blocks = std::max<int64_t>(1, kTileValues / f.values);
    const int64_t panel_rows = kPanelValues / (tile_blocks * f.values);
    const int64_t tiles = (k / f.values + tile_blocks - 1) / tile_blocks;
    static thread_local AlignedVector<float> packed;  // kept, as lt_matmul's activations
    pack_gradient(g, n, m, &packed, threads);
    const float* g_packed = packed.data();
#pragma omp parallel num_threads(threads)
    {
        static thread_local AlignedVector<float> panel(kPanelValues);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t first = t * tile_blocks;
            const int64_t blocks = std::min(tile_blocks, k / f.values - first);
            const int64_t width = blocks * f.values;
            for (int64_t r = 0; r < m; ++r)
                std::fill_n(dx + r * k + first * f.values, width, 0.0f);
            for (int64_t o0 = 0; o0 < n; o0 += panel_rows) {
                const int64_t rows = std::min(panel_rows, n - o0);
                const int64_t next = std::clamp<int64_t>(n - o0 - rows, 0, panel_rows);
                f.decode_blocks(w + o0 * row_stride + first * f.bytes, row_stride, rows, blocks,
                                next, panel.data());
                for (int64_t c = 0; c < width; c += kSlice) {
                    over_tiles<kGradRows>(m, [&](int64_t m0, int tile) {
                        const float* g_tile = g_packed + m0 * n + o0 * kGradRows;
                        add_panel_rows(tile, panel.data() + c * rows, rows, g_tile,
                                       dx + m0 * k + first * f.values + c, k);
                    });
                }
            }
        }
    }
    return 0;
}

}  // extern "C"
