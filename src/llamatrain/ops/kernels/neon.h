// The kernels' aarch64 NEON pieces, used where x86's AVX2 ones are (quantized.cpp, rows_dot.h):
// the forward's integer products, the same int32 sums per 16 or 32 values as the x86 paths
// scaled in float the same way (the backward's float vectors: gradient_tile.h).
//
// Where the CPU has the dot product extension (__ARM_FEATURE_DOTPROD: armv8.2-a+dotprod, every
// Apple M, Graviton 2 and later, Ampere) one SDOT (vdotq_s32, vdotq_laneq_s32) sums four
// signed byte products into each int32 lane; else SMULL (vmull_s8) widens eight products to
// int16 and SADALP (vpadalq_s16) adds their pairs into int32. Both multiply signed by signed,
// so unlike x86's maddubs (unsigned by signed) no signs are moved between the operands: the
// unsigned 4- and 5-bit quants and the signed Q8_0/Q6_K ones take the one path.
// Verified under qemu-aarch64 only (tests/kernels/harness.cpp, both variants); no timing has
// been measured on ARM hardware.
#pragma once
#if defined(__ARM_NEON) && !defined(__AVX2__)
#include <arm_neon.h>

#include <cstdint>
#include <utility>

namespace {

// acc lane i += the four byte products of w's bytes 4i .. 4i+3 with x's bytes 4L .. 4L+3:
// the panels' group of four quants of four weight rows against four of one x row's.
template <int L>
inline int32x4_t dot_lane(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_laneq_s32(acc, w, x, L);
#else
    const int8x8_t four = vreinterpret_s8_s32(vdup_laneq_s32(vreinterpretq_s32_s8(x), L));
    const int16x8_t rows_01 = vmull_s8(vget_low_s8(w), four);
    const int16x8_t rows_23 = vmull_s8(vget_high_s8(w), four);
    // a pair of products is at most 2 * 128 * 127 in magnitude (x's quants are within
    // +-127): exact in int16
    return vpadalq_s16(acc, vpaddq_s16(rows_01, rows_23));
#endif
}

// acc + the sixteen byte products of w and x, four to an int32 lane (which four: unspecified;
// the lanes' total is the dot product).
inline int32x4_t dot_bytes(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, w, x);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w), vget_low_s8(x)));
    return vpadalq_s16(acc, vmull_high_s8(w, x));
#endif
}

// quantized.cpp's transpose_groups: 8 rows of 8 int32 groups (``stride`` bytes apart) written
// group-major, out[g][j] = src[j][g], as four 4 x 4 transposes (TRN1/TRN2 on 32, then 64 bits).
inline void transpose_groups_neon(const int8_t* src, int64_t stride, int8_t* out) {
    for (int j0 = 0; j0 < 8; j0 += 4) {
        for (int g0 = 0; g0 < 8; g0 += 4) {
            int64x2_t t[4];
            for (int i = 0; i < 2; ++i) {
                const int8_t* row = src + (j0 + 2 * i) * stride + 4 * g0;
                const int32x4_t a = vreinterpretq_s32_s8(vld1q_s8(row));
                const int32x4_t b = vreinterpretq_s32_s8(vld1q_s8(row + stride));
                t[2 * i] = vreinterpretq_s64_s32(vtrn1q_s32(a, b));      // groups 0, 2
                t[2 * i + 1] = vreinterpretq_s64_s32(vtrn2q_s32(a, b));  // groups 1, 3
            }
            const int64x2_t groups[4] = {vtrn1q_s64(t[0], t[2]), vtrn1q_s64(t[1], t[3]),
                                         vtrn2q_s64(t[0], t[2]), vtrn2q_s64(t[1], t[3])};
            for (int g = 0; g < 4; ++g)
                vst1q_s8(out + 32 * (g0 + g) + 4 * j0, vreinterpretq_s8_s64(groups[g]));
        }
    }
}

// A tile's sums: R rows of x against a panel's 8 weight rows (quantized.cpp's panel_tile).
// Four rows of x (quantized.cpp's kRowTile 4, its #else, suits NEON): each holds two int32
// sums (weight rows 0-3, 4-7), two float sums and its sub-block's 32 quants (two registers),
// 24 of NEON's 32 q-registers, the rest for the two registers of a weight group and the
// scales; eight rows would spill. One register of x holds four groups, taken by lane: no
// broadcasts.
template <int R>
struct NeonTileSums {
    int32x4_t sums[R][2];
    float32x4_t acc[R][2];
    int8x16_t x[R][2];
};

// Group G (quants 4G .. 4G+3 of the 8 weight rows) into every row's integer sums.
template <int R, int G>
inline void add_group(const int8_t* wq, NeonTileSums<R>& s) {
    const int8x16_t w0 = vld1q_s8(wq + 32 * G), w1 = vld1q_s8(wq + 32 * G + 16);
    for (int r = 0; r < R; ++r) {
        s.sums[r][0] = dot_lane<G % 4>(s.sums[r][0], w0, s.x[r][G / 4]);
        s.sums[r][1] = dot_lane<G % 4>(s.sums[r][1], w1, s.x[r][G / 4]);
    }
}

template <int R, int... G>
inline void add_groups(const int8_t* wq, NeonTileSums<R>& s, std::integer_sequence<int, G...>) {
    (add_group<R, G>(wq, s), ...);
}

// y[m0 + r, o0 + j] as the AVX2 panel_tile computes it, lane for lane: per sub-block the
// integer sums scaled by w's scale times x's d (lo for values 0-15, hi for 16-31 where Split),
// then the offset times x's d * sum(q).
template <int R, bool Offset, bool Split, int PanelRows, typename Tile>
void panel_tile_neon(const Tile& t) {
    static_assert(PanelRows == 8, "two registers of four int32 lanes a panel");
    const auto& p = *t.panel;
    NeonTileSums<R> s;
    for (int r = 0; r < R; ++r) s.acc[r][0] = s.acc[r][1] = vdupq_n_f32(0.0f);
    for (int64_t sub = 0; sub < t.subs; ++sub) {
        const int8_t* wq = &p.q[sub * 256];
        for (int r = 0; r < R; ++r) {
            const int8_t* xq = t.xq + r * t.k + 32 * sub;
            s.x[r][0] = vld1q_s8(xq);
            s.x[r][1] = vld1q_s8(xq + 16);
            s.sums[r][0] = s.sums[r][1] = vdupq_n_s32(0);
        }
        auto scale_into_acc = [&](const float* scales) {
            for (int h = 0; h < 2; ++h) {
                const float32x4_t w = vld1q_f32(scales + sub * 8 + 4 * h);
                for (int r = 0; r < R; ++r) {
                    const float32x4_t scale = vmulq_n_f32(w, t.xd[r * t.x_subs + sub]);
                    s.acc[r][h] = vfmaq_f32(s.acc[r][h], vcvtq_f32_s32(s.sums[r][h]), scale);
                    s.sums[r][h] = vdupq_n_s32(0);
                }
            }
        };
        add_groups<R>(wq, s, std::integer_sequence<int, 0, 1, 2, 3>{});
        if (Split) scale_into_acc(p.lo.data());
        add_groups<R>(wq, s, std::integer_sequence<int, 4, 5, 6, 7>{});
        scale_into_acc(Split ? p.hi.data() : p.lo.data());
        for (int h = 0; h < 2 && Offset; ++h) {
            const float32x4_t off = vld1q_f32(&p.off[sub * 8 + 4 * h]);
            for (int r = 0; r < R; ++r)
                s.acc[r][h] = vfmaq_f32(s.acc[r][h], off, vdupq_n_f32(t.xs[r * t.x_subs + sub]));
        }
    }
    for (int r = 0; r < R; ++r) {
        float row[8];
        vst1q_f32(row, s.acc[r][0]);
        vst1q_f32(row + 4, s.acc[r][1]);
        float* out = t.y + r * t.n;
        for (int j = 0; j < t.cols; ++j) out[j] = t.accumulate ? out[j] + row[j] : row[j];
    }
}

}  // namespace
#endif
