// The quantized kernels (src/llamatrain/ops/kernels/quantized.cpp) against a scalar reference
// computed here, built for any target: tests/integration/test_kernels_arm.py builds it for
// aarch64 (with and without the dot product extension, run under qemu) and for the host.
//
// Why a C++ harness and not the Python tests: those need the host to run the library, so on
// an x86 machine the NEON paths would never execute; this binary runs wherever it is built
// for, under an emulator too, and needs nothing but the kernels' sources.
//
// For every kernel type, two shapes (13 weight rows x 256: a partial panel and a padded row
// stride; 136 x 2304: several panels, the forward's chunked panels and the backward's partial
// column tile, two threads) and M = 1, 3, 8, 17, 65 rows it fills random blocks and x from a
// fixed seed, then checks lt_matmul, lt_matmul_rows, lt_matmul_panels and lt_matmul_t against
// double-precision sums over the blocks decoded by the per-type formulas (GGUF's, written
// out here independently of blocks.h): the forward with x quantized per 32 values as the
// kernels do (so the integer sums are the reference's exactly), the backward over exact
// float G. Each output's error must be within kTolerance of the sum of its terms' magnitudes
// (float32 rounding of scales and of the float sums: at most 4e-7 of it seen, on every build).
//
// Build: c++ -O2 -fopenmp -ffp-contract=off -std=c++17 -march=... (one target)
//        src/llamatrain/ops/kernels/quantized.cpp tests/kernels/harness.cpp -o harness
// Prints one line per type, shape and function with the worst error ratio; exit status 1 if
// any output is out of tolerance.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

extern "C" {
int lt_matmul(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int);
int lt_matmul_rows(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*,
                   int);
int lt_matmul_panels(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t,
                     float*, int);
int lt_matmul_t(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*,
                int);
}

namespace {

constexpr double kTolerance = 2e-6;  // of the sum of |terms|, per output (seen: <= 4e-7)

// splitmix64: the same values on every target and compiler.
struct Random {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    uint8_t byte() { return static_cast<uint8_t>(next() >> 56); }
    double uniform() { return static_cast<double>(next() >> 11) / 9007199254740992.0; }  // [0, 1)
};

// A normal float16 of random sign and mantissa, magnitude 2^-9 .. 2^-5: GGUF's scales.
void random_half(Random& random, uint8_t* out) {
    const uint16_t exponent = static_cast<uint16_t>(6 + random.next() % 5);
    const uint16_t bits = static_cast<uint16_t>(((random.next() & 1) << 15) | (exponent << 10) |
                                                (random.next() & 0x3ff));
    std::memcpy(out, &bits, 2);
}

double half(const uint8_t* p) {  // normal halves only (random_half's)
    uint16_t h;
    std::memcpy(&h, p, 2);
    const double value = std::ldexp(1.0 + (h & 0x3ff) / 1024.0, ((h >> 10) & 0x1f) - 15);
    return h & 0x8000 ? -value : value;
}

// Q4_K/Q5_K: sub-block j's six-bit scale and min, GGUF's packing of 12 bytes.
void scale_min(int j, const uint8_t* q, int* scale, int* min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// One block's values, in double, by the type's plain formula.
void decode_q4_0(const uint8_t* b, double* y) {
    for (int j = 0; j < 16; ++j) {
        y[j] = half(b) * ((b[2 + j] & 0xF) - 8);
        y[j + 16] = half(b) * ((b[2 + j] >> 4) - 8);
    }
}

void decode_q4_1(const uint8_t* b, double* y) {
    for (int j = 0; j < 16; ++j) {
        y[j] = half(b) * (b[4 + j] & 0xF) + half(b + 2);
        y[j + 16] = half(b) * (b[4 + j] >> 4) + half(b + 2);
    }
}

// Q5_0 (Min false: values less 16) or Q5_1 (Min: plus the float16 m).
template <bool Min>
void decode_q5(const uint8_t* b, double* y) {
    const uint8_t* qh = b + (Min ? 4 : 2);
    const uint8_t* qs = qh + 4;
    uint32_t high;
    std::memcpy(&high, qh, 4);
    for (int j = 0; j < 16; ++j) {
        const int low = (qs[j] & 0xF) | (((high >> j) & 1) << 4);
        const int up = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
        y[j] = Min ? half(b) * low + half(b + 2) : half(b) * (low - 16);
        y[j + 16] = Min ? half(b) * up + half(b + 2) : half(b) * (up - 16);
    }
}

void decode_q8_0(const uint8_t* b, double* y) {
    for (int j = 0; j < 32; ++j) y[j] = half(b) * static_cast<int8_t>(b[2 + j]);
}

// Q4_K (Fifth false) or Q5_K: per 64 values two sub-blocks, low then high nibbles of 32 bytes
// (Q5_K: qh's bits 2j and 2j+1 as the fifth bit), value d * scale * q - dmin * min.
template <bool Fifth>
void decode_k(const uint8_t* b, double* y) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (Fifth ? 48 : 16);
    for (int j = 0; j < 4; ++j) {
        int sc[2], mn[2];
        scale_min(2 * j, b + 4, &sc[0], &mn[0]);
        scale_min(2 * j + 1, b + 4, &sc[1], &mn[1]);
        for (int l = 0; l < 32; ++l) {
            for (int h = 0; h < 2; ++h) {
                int q = h ? qs[32 * j + l] >> 4 : qs[32 * j + l] & 0xF;
                if (Fifth && (qh[l] >> (2 * j + h)) & 1) q += 16;
                y[64 * j + 32 * h + l] = half(b) * sc[h] * q - half(b + 2) * mn[h];
            }
        }
    }
}

void decode_q6_k(const uint8_t* b, double* y) {
    const double d = half(b + 208);
    for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * n);
        for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q[4] = {((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32,
                              ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32,
                              ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32,
                              ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32};
            for (int i = 0; i < 4; ++i) y[128 * n + 32 * i + l] = d * sc[is + 2 * i] * q[i];
        }
    }
}

struct Type {
    const char* name;
    int id;  // quantized_matmul.KERNEL_TYPES
    int values, bytes;
    std::vector<int> halves;  // offsets of the block's float16 fields
    void (*decode)(const uint8_t*, double*);
};

const Type kTypes[] = {
    {"Q4_0", 0, 32, 18, {0}, decode_q4_0},
    {"Q4_1", 1, 32, 20, {0, 2}, decode_q4_1},
    {"Q8_0", 2, 32, 34, {0}, decode_q8_0},
    {"Q4_K", 3, 256, 144, {0, 2}, decode_k<false>},
    {"Q5_K", 4, 256, 176, {0, 2}, decode_k<true>},
    {"Q6_K", 5, 256, 210, {208}, decode_q6_k},
    {"Q5_0", 6, 32, 22, {0}, decode_q5<false>},
    {"Q5_1", 7, 32, 24, {0, 2}, decode_q5<true>},
};

struct Shape {
    int64_t n, k, pad;  // weight rows, values per row, bytes past each row's blocks
    int threads;
};

const Shape kShapes[] = {{13, 256, 6, 1}, {136, 2304, 0, 2}};
const int64_t kRows[] = {1, 3, 8, 17, 65};

// x's 32-value blocks quantized as the kernels do (activations.h): d = amax / 127, q =
// round-half-even(v * (127 / amax)), in float.
void quantize(const std::vector<float>& x, std::vector<double>& d, std::vector<int>& q) {
    d.resize(x.size() / 32);
    q.resize(x.size());
    for (size_t i = 0; i < d.size(); ++i) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[32 * i + j]));
        d[i] = amax / 127.0f;
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < 32; ++j)
            q[32 * i + j] = static_cast<int>(std::nearbyint(x[32 * i + j] * id));
    }
}

// Worst |got - want| / (sum of |terms|) over the outputs (a sum of 0 wants 0 exactly).
double worst(const std::vector<float>& got, const std::vector<double>& want,
             const std::vector<double>& magnitude) {
    double ratio = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double error = std::fabs(got[i] - want[i]);
        if (!std::isfinite(got[i])) return INFINITY;
        const double bound = magnitude[i] > 0 ? error / magnitude[i] : error > 0 ? INFINITY : 0;
        ratio = std::fmax(ratio, bound);
    }
    return ratio;
}

struct Case {
    const Type& type;
    const Shape& shape;
    std::vector<uint8_t> w;  // n rows of row_stride bytes
    std::vector<double> decoded;
    int64_t row_stride;
};

Case make_case(const Type& type, const Shape& shape, Random& random) {
    Case c{type, shape, {}, {}, shape.k / type.values * type.bytes + shape.pad};
    c.w.resize(shape.n * c.row_stride);
    for (uint8_t& byte : c.w) byte = random.byte();
    c.decoded.resize(shape.n * shape.k);
    for (int64_t o = 0; o < shape.n; ++o) {
        for (int64_t b = 0; b < shape.k / type.values; ++b) {
            uint8_t* block = &c.w[o * c.row_stride + b * type.bytes];
            for (int at : type.halves) random_half(random, block + at);
            type.decode(block, &c.decoded[o * shape.k + b * type.values]);
        }
    }
    return c;
}

// Random rows in [-1, 1), each scaled by its own power of two; x's first 32 values zero (the
// kernels' amax = 0 case).
std::vector<float> random_rows(int64_t m, int64_t k, Random& random, bool zero_block) {
    std::vector<float> x(m * k);
    for (int64_t r = 0; r < m; ++r) {
        const double scale = std::ldexp(1.0, static_cast<int>(random.next() % 7) - 3);
        for (int64_t i = 0; i < k; ++i)
            x[r * k + i] = static_cast<float>(scale * (2 * random.uniform() - 1));
    }
    if (zero_block) std::fill_n(x.begin(), 32, 0.0f);
    return x;
}

using Product = int (*)(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t,
                        float*, int);

bool report(const Case& c, int64_t m, const char* what, double ratio) {
    const bool ok = ratio <= kTolerance;
    std::printf("%-4s n=%-3lld k=%-4lld m=%-2lld %-16s worst %.3g %s\n", c.type.name,
                static_cast<long long>(c.shape.n), static_cast<long long>(c.shape.k),
                static_cast<long long>(m), what, ratio, ok ? "ok" : "FAIL");
    return ok;
}

// The three forward entry points against the reference y = quantized(x) . W^T.
bool check_forward(const Case& c, int64_t m, Random& random) {
    const int64_t n = c.shape.n, k = c.shape.k;
    const std::vector<float> x = random_rows(m, k, random, true);
    std::vector<double> xd, want(m * n, 0.0), magnitude(m * n, 0.0);
    std::vector<int> xq;
    quantize(x, xd, xq);
    for (int64_t r = 0; r < m; ++r)
        for (int64_t o = 0; o < n; ++o)
            for (int64_t i = 0; i < k; ++i) {
                const double term = xd[(r * k + i) / 32] * xq[r * k + i] * c.decoded[o * k + i];
                want[r * n + o] += term;
                magnitude[r * n + o] += std::fabs(term);
            }
    const std::pair<const char*, Product> products[] = {
        {"lt_matmul", lt_matmul},
        {"lt_matmul_rows", lt_matmul_rows},
        {"lt_matmul_panels", lt_matmul_panels}};
    bool ok = true;
    for (const auto& [name, product] : products) {
        std::vector<float> y(m * n, NAN);
        const int rc = product(c.type.id, c.w.data(), n, c.row_stride, x.data(), m, k, y.data(),
                               c.shape.threads);
        ok &= report(c, m, name, rc ? INFINITY : worst(y, want, magnitude));
    }
    return ok;
}

// lt_matmul_t against dx = G . W over the exactly decoded W.
bool check_backward(const Case& c, int64_t m, Random& random) {
    const int64_t n = c.shape.n, k = c.shape.k;
    const std::vector<float> g = random_rows(m, n, random, false);
    std::vector<double> want(m * k, 0.0), magnitude(m * k, 0.0);
    for (int64_t r = 0; r < m; ++r)
        for (int64_t o = 0; o < n; ++o)
            for (int64_t i = 0; i < k; ++i) {
                const double term = static_cast<double>(g[r * n + o]) * c.decoded[o * k + i];
                want[r * k + i] += term;
                magnitude[r * k + i] += std::fabs(term);
            }
    std::vector<float> dx(m * k, NAN);
    const int rc = lt_matmul_t(c.type.id, c.w.data(), n, c.row_stride, g.data(), m, k, dx.data(),
                               c.shape.threads);
    return report(c, m, "lt_matmul_t", rc ? INFINITY : worst(dx, want, magnitude));
}

}  // namespace

int main() {
    Random random{20240611};
    int failures = 0;
    for (const Type& type : kTypes) {
        for (const Shape& shape : kShapes) {
            const Case c = make_case(type, shape, random);
            for (int64_t m : kRows) {
                failures += !check_forward(c, m, random);
                failures += !check_backward(c, m, random);
            }
        }
    }
    std::printf("%s: %d failing case(s), tolerance %.0e of the sum of |terms|\n",
                failures ? "FAIL" : "PASS", failures, kTolerance);
    return failures ? 1 : 0;
}
