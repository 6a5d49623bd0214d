// One decoding step of a llama model's blocks, for one new token per row, in one call:
// every layer's RMS norms, rotary embedding, KV cache append, grouped-query attention over
// the cache, SwiGLU and residual adds, with the projections through the quantized kernels'
// lt_matmul (passed in as a function pointer: this library depends on no other).
//
// Why: at SmolLM2-135M's shape (30 layers, 576 wide) a decoding step's products take about
// half of its time when each small op is a PyTorch call from Python (tens of microseconds
// each, 30 layers x ~25 of them); here they are a few microseconds of plain loops.
//
// Layouts (all float32, row-major, contiguous unless a stride says otherwise):
//   x         (batch, dim): the hidden states in, the blocks' output out (in place)
//   cos, sin  (batch, head_dim / 2): each row's rotation angles at its position
//   padding   (batch, padding_stride) bytes or null: nonzero marks a key slot hidden from
//             every query but its own (the KV cache's padding)
//   k/v cache (batch, kv_heads, capacity, head_dim) of each layer; this step's keys and values
//             are written at slot `length`, and the attention reads slots 0..length
//   q rows    (batch, heads * head_dim), query head h at columns h * head_dim, reading kv head
//             h / (heads / kv_heads) (the grouping of flash_attn and of SDPA's enable_gqa)
//   rope      NORM pairs (2i, 2i + 1); NEOX pairs (i, i + head_dim / 2)
//   adapter   a projection's LoRA update y += scale * B (A x) (llamatrain.ops.lora's formula,
//             PEFT's), A (rank, in) and B (out, rank), after the base product; null A: none
//   bias      a projection's bias (out), added last (qwen2's q/k/v), as the modules add it
// Built with -ffp-contract=off (kernel_build): no fused multiply-adds the source did not write.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {

typedef int (*lt_matmul_fn)(int type, const uint8_t* w, int64_t n, int64_t row_stride,
                            const float* x, int64_t m, int64_t k, float* y, int threads);

struct lt_projection {
    const uint8_t* blocks;
    int64_t rows;
    int64_t row_stride;
    int64_t type;
    const float* lora_a;  // (rank, in), or null: no adapter
    const float* lora_b;  // (rows, rank)
    int64_t rank;
    double scale;
    const float* bias;  // (rows), or null: none
};

struct lt_layer {
    lt_projection q, k, v, o, gate, up, down;
    const float* attn_norm;
    const float* ffn_norm;
    float* k_cache;
    float* v_cache;
};

struct lt_step_shape {
    int64_t batch, dim, heads, kv_heads, head_dim, hidden, capacity, length, padding_stride;
    double eps, scale;
    int64_t neox, threads;
};

}  // extern "C"

namespace {

// Sums kept in kLanes independent partial sums, added up at the end: one running sum is a
// chain of dependent adds (4 cycles each, no vectors), which made the attention's dot products
// most of a batch-8 step's small ops; separate lanes vectorize without reassociating anything
// the source did not write.
constexpr int kLanes = 16;

float dot(const float* a, const float* b, int64_t n) {
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
    float total = 0.0f;
    for (int l = 0; l < kLanes; ++l) total += lanes[l];
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
}

// e^x to about 1 ulp for x in [-87, 88] (clamped there), in plain arithmetic the compiler
// turns into vector code: std::exp is a call per value, and the gating's silu takes one per
// hidden value (12,288 a layer at batch 8). Cephes' expf: 2^n times a degree-6 polynomial
// in the remainder r = x - n ln 2 (ln 2 in two parts), n rounded to nearest.
inline float vector_exp(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    const float shifted = x * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23: rounded
    const float n = shifted - 12582912.0f;  // (std::floor would keep the loop scalar)
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    return p * __builtin_bit_cast(float, bits);
}

double squares(const float* x, int64_t n) {
    double lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(x[i + l]) * x[i + l];
    double total = 0.0;
    for (int l = 0; l < kLanes; ++l) total += lanes[l];
    for (; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
    return total;
}

void rms_norm(const float* x, const float* weight, int64_t n, double eps, float* out) {
    const float mean = static_cast<float>(squares(x, n) / static_cast<double>(n));
    const float rstd = 1.0f / std::sqrt(mean + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) {
        const float normed = x[i] * rstd;  // ggml: rms_norm, then the weight's mul
        out[i] = normed * weight[i];
    }
}

void rotate(float* head, const float* cos, const float* sin, int64_t head_dim, bool neox) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        float* a = neox ? head + i : head + 2 * i;
        float* b = neox ? head + i + half : head + 2 * i + 1;
        const float x0 = *a, x1 = *b;
        *a = x0 * cos[i] - x1 * sin[i];
        *b = x0 * sin[i] + x1 * cos[i];
    }
}

// softmax(q . K^T * scale over the visible keys) . V for the `group` query heads of one row
// that read one kv head: each key and value is read once for all of them (3-8 heads, and a
// cache too large for the core's caches at a few hundred keys).
void attend(const float* q, int64_t group, const float* keys, const float* values,
            const uint8_t* hidden, const lt_step_shape& s, float* scores, float* out) {
    const int64_t hd = s.head_dim, last = s.length, width = last + 1;
    const float scale = static_cast<float>(s.scale);
    for (int64_t j = 0; j <= last; ++j) {
        const bool masked = hidden != nullptr && hidden[j] && j != last;
        for (int64_t h = 0; h < group; ++h)
            scores[h * width + j] = masked ? -INFINITY : dot(q + h * hd, keys + j * hd, hd) * scale;
    }
    for (int64_t h = 0; h < group; ++h) {
        float* row = scores + h * width;
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j <= last; ++j) top = std::max(top, row[j]);
        for (int64_t j = 0; j <= last; ++j)
            row[j] = row[j] == -INFINITY ? 0.0f : vector_exp(row[j] - top);
        for (int64_t j = 0; j <= last; ++j) total += row[j];
        for (int64_t j = 0; j <= last; ++j) row[j] /= total;
    }
    for (int64_t i = 0; i < group * hd; ++i) out[i] = 0.0f;
    for (int64_t j = 0; j <= last; ++j) {
        const float* value = values + j * hd;
        for (int64_t h = 0; h < group; ++h) {
            const float p = scores[h * width + j];
            if (p == 0.0f) continue;
            float* o = out + h * hd;
            for (int64_t d = 0; d < hd; ++d) o[d] += p * value[d];
        }
    }
}

// gate[i] = silu(gate[i]) * up[i]
void swiglu(float* __restrict gate, const float* __restrict up, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        gate[i] = g / (1.0f + vector_exp(-g)) * up[i];
    }
}

struct Scratch {
    std::vector<float> normed, q, k, v, attended, projected, gate, up, scores, low_rank;
    explicit Scratch(const lt_step_shape& s)
        : normed(s.batch * s.dim), q(s.batch * s.heads * s.head_dim),
          k(s.batch * s.kv_heads * s.head_dim), v(s.batch * s.kv_heads * s.head_dim),
          attended(s.batch * s.heads * s.head_dim), projected(s.batch * s.dim),
          gate(s.batch * s.hidden), up(s.batch * s.hidden),
          scores(s.batch * s.heads * (s.length + 1)) {}
};

// y += scale * (x A^T) B^T for the m rows of x (m, k): the rank-r bottleneck first, as
// ops.lora computes it (u = x A^T, then y + scale * u B^T), never a (rows, k) B A.
void add_low_rank(const lt_projection& p, const float* x, int64_t m, int64_t k, float* y,
                  int threads, std::vector<float>& u) {
    const int64_t r = p.rank, n = p.rows;
    u.resize(m * r);
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t b = 0; b < m; ++b)
        for (int64_t j = 0; j < r; ++j) u[b * r + j] = dot(x + b * k, p.lora_a + j * k, k);
    const float scale = static_cast<float>(p.scale);
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t b = 0; b < m; ++b)
        for (int64_t o = 0; o < n; ++o)
            y[b * n + o] += scale * dot(&u[b * r], p.lora_b + o * r, r);
}

int project(lt_matmul_fn matmul, const lt_projection& p, const float* x, int64_t m, int64_t k,
            float* y, int threads, std::vector<float>& u) {
    const int failed =
        matmul(static_cast<int>(p.type), p.blocks, p.rows, p.row_stride, x, m, k, y, threads);
    if (failed) return failed;
    if (p.lora_a != nullptr) add_low_rank(p, x, m, k, y, threads, u);
    if (p.bias != nullptr)
        for (int64_t b = 0; b < m; ++b)
            for (int64_t o = 0; o < p.rows; ++o) y[b * p.rows + o] += p.bias[o];
    return 0;
}

// q, k rotated, k and v written into the cache at slot `length`, the attention of every head
int attention(const lt_layer& layer, const lt_step_shape& s, const float* cos, const float* sin,
              const uint8_t* padding, Scratch& t) {
    const int64_t hd = s.head_dim, half = hd / 2, group = s.heads / s.kv_heads;
    for (int64_t b = 0; b < s.batch; ++b) {
        for (int64_t h = 0; h < s.heads; ++h)
            rotate(&t.q[(b * s.heads + h) * hd], cos + b * half, sin + b * half, hd, s.neox);
        for (int64_t g = 0; g < s.kv_heads; ++g) {
            const int64_t row = (b * s.kv_heads + g) * hd;
            rotate(&t.k[row], cos + b * half, sin + b * half, hd, s.neox);
            const int64_t slot = ((b * s.kv_heads + g) * s.capacity + s.length) * hd;
            for (int64_t d = 0; d < hd; ++d) {
                layer.k_cache[slot + d] = t.k[row + d];
                layer.v_cache[slot + d] = t.v[row + d];
            }
        }
    }
#pragma omp parallel for collapse(2) num_threads(s.threads) schedule(static)
    for (int64_t b = 0; b < s.batch; ++b) {
        for (int64_t g = 0; g < s.kv_heads; ++g) {
            const int64_t start = (b * s.kv_heads + g) * s.capacity * hd;
            const int64_t first = b * s.heads + g * group;  // its query heads, in a row
            const uint8_t* hidden = padding ? padding + b * s.padding_stride : nullptr;
            attend(&t.q[first * hd], group, layer.k_cache + start, layer.v_cache + start, hidden,
                   s, &t.scores[first * (s.length + 1)], &t.attended[first * hd]);
        }
    }
    return 0;
}

int one_layer(lt_matmul_fn matmul, const lt_layer& layer, const lt_step_shape& s, float* x,
              const float* cos, const float* sin, const uint8_t* padding, Scratch& t) {
    const int64_t m = s.batch, dim = s.dim, threads = s.threads;
    const int64_t qd = s.heads * s.head_dim;
    auto product = [&](const lt_projection& p, const float* in, int64_t k, float* out) {
        return project(matmul, p, in, m, k, out, static_cast<int>(threads), t.low_rank);
    };
    for (int64_t b = 0; b < m; ++b)
        rms_norm(x + b * dim, layer.attn_norm, dim, s.eps, &t.normed[b * dim]);
    int failed = product(layer.q, t.normed.data(), dim, t.q.data());
    failed |= product(layer.k, t.normed.data(), dim, t.k.data());
    failed |= product(layer.v, t.normed.data(), dim, t.v.data());
    if (failed) return failed;
    attention(layer, s, cos, sin, padding, t);
    failed = product(layer.o, t.attended.data(), qd, t.projected.data());
    if (failed) return failed;
    for (int64_t i = 0; i < m * dim; ++i) x[i] += t.projected[i];
    for (int64_t b = 0; b < m; ++b)
        rms_norm(x + b * dim, layer.ffn_norm, dim, s.eps, &t.normed[b * dim]);
    failed = product(layer.gate, t.normed.data(), dim, t.gate.data());
    failed |= product(layer.up, t.normed.data(), dim, t.up.data());
    if (failed) return failed;
    swiglu(t.gate.data(), t.up.data(), m * s.hidden);
    failed = product(layer.down, t.gate.data(), s.hidden, t.projected.data());
    if (failed) return failed;
    for (int64_t i = 0; i < m * dim; ++i) x[i] += t.projected[i];
    return 0;
}

}  // namespace

extern "C" {

// Runs `n_layers` layers over x in place. 0, or the first nonzero lt_matmul status.
int lt_decode_step(lt_matmul_fn matmul, const lt_layer* layers, int64_t n_layers,
                   const lt_step_shape* shape, float* x, const float* cos, const float* sin,
                   const uint8_t* padding) {
    Scratch scratch(*shape);
    for (int64_t i = 0; i < n_layers; ++i) {
        const int failed = one_layer(matmul, layers[i], *shape, x, cos, sin, padding, scratch);
        if (failed) return failed;
    }
    return 0;
}

}  // extern "C"
