// The attention of one new token over sample.KVCache's blocks, for bench/attention_kernel.py,
// which compiles it as a plain shared library (no torch headers: a few seconds to build) and
// calls it through ctypes on the tensors' memory. Threads come from OpenMP: built by GCC, the
// library asks for libgomp.so.1, and where torch's Linux wheel ships its own under that name (torch
// 2.13's does) the one already loaded serves, so the kernel's threads are torch's own.
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t MOST_POSITIONS = 1024;  // a row's scores, kept on the stack
extern "C" const int64_t most_positions = MOST_POSITIONS;  // for the caller, which checks it

// bf16 and fp16 numbers as they lie in memory: 16 bits each, told apart by their type.
struct BFloat16 { uint16_t bits; };
struct Half { uint16_t bits; };

// 8 numbers as float32 ones: float32 as they are; a bf16 number is the upper half of a float32's bits;
// fp16 numbers widened by the CPU's own instruction (F16C, on every CPU with AVX2).
static inline __m256 load8(const float* from) { return _mm256_loadu_ps(from); }
static inline __m256 load8(const BFloat16* from) {
    __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
static inline __m256 load8(const Half* from) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
}

// One number of a query as float32, and an answer's number back in the query's type: bf16 keeps
// a float32's upper 16 bits, rounded to the nearest (ties to even), as torch rounds.
static inline float widen(float x) { return x; }
static inline float widen(BFloat16 x) {
    uint32_t bits = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
template <typename Q> static inline Q narrow(float x);
template <> inline float narrow<float>(float x) { return x; }
template <> inline BFloat16 narrow<BFloat16>(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    // A NaN stays one: the carry below could turn a NaN whose set bits are all in the lower half
    // into infinity.
    if (std::isnan(x)) return BFloat16{0x7FC0};
    // Adding 0x7FFF, and 1 more where the kept half is odd, carries into the kept half exactly
    // when the dropped half is more than half of its last bit, or half of it and the kept half odd.
    return BFloat16{uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)};
}

// e^x for 8 numbers at once, for the x <= 0 of a softmax (scores less their largest), where
// std::exp takes one at a time: x = n ln 2 + r, e^r as 1 + r + r^2 P(r) on |r| <= ln(2)/2,
// P of degree 5 (Cephes' expf), 2^n put in the exponent's bits; within 1.3 units in the last
// place of float32. x is taken no lower than -87 (e^-87 is 1.6e-38, nothing beside the largest
// score's 1), which keeps 2^n at 2^-126 or more, the least the exponent's bits hold. (Slots
// past a row's positions may give any x, NaN too: their e^x is computed and never used.)
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n ln 2, with ln 2 in two parts so that r keeps its low bits.
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}

// The sum of 8 numbers, and below their largest: halves, then quarters, then the last two.
static inline float sum8(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

static inline float max8(__m256 v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

// A block's scores, 32 positions at a time, from its keys channel by channel (`block`
// numbers a channel): the block is read as it lies in memory, one channel's 32 positions after
// another. For each 8 of the 32, one sum over the even channels and one over the odd: 8 sums,
// each waiting on half as many products as one sum a position would.
template <int CHANNELS, typename T>
static inline void block_scores(const float* q, const T* key, int64_t block, float* scores) {
    for (int64_t p = 0; p < block; p += 32) {
        __m256 even[4], odd[4];
        for (int i = 0; i < 4; i++) even[i] = odd[i] = _mm256_setzero_ps();
        for (int c = 0; c < CHANNELS; c += 2) {
            const __m256 qe = _mm256_set1_ps(q[c]), qo = _mm256_set1_ps(q[c + 1]);
            for (int i = 0; i < 4; i++) {
                even[i] = _mm256_fmadd_ps(qe, load8(key + c * block + p + 8 * i), even[i]);
                odd[i] = _mm256_fmadd_ps(qo, load8(key + (c + 1) * block + p + 8 * i), odd[i]);
            }
        }
        for (int i = 0; i < 4; i++) _mm256_store_ps(scores + p + 8 * i, _mm256_add_ps(even[i], odd[i]));
    }
}

// One row and head: its query over the first `seen` positions of its keys and values, which
// lie `block` positions at a time, `apart` numbers between one block and the next; a block's
// keys channel by channel (`block` numbers a channel), its values position by position.
template <int CHANNELS, typename Q, typename T>
static void attend_one(const Q* query, const T* keys, const T* values,
                       int64_t apart, int64_t block, int64_t seen, Q* out) {
    constexpr int PARTS = CHANNELS / 8;
    // Every 8 scores start at a multiple of 8 (a block is a multiple of 32), so that they load
    // and store as one aligned piece of 32 bytes.
    alignas(32) float scores[MOST_POSITIONS];
    float q[CHANNELS];
    const float scale = 1.0f / std::sqrt(static_cast<float>(CHANNELS));
    for (int c = 0; c < CHANNELS; c++) q[c] = widen(query[c]) * scale;
    // The scores in float32, block by block, each whole; the largest a row sees, which the
    // softmax subtracts. Slots past `seen` are kept out of it, the total and the weighed sum.
    for (int64_t start = 0; start < seen; start += block)
        block_scores<CHANNELS>(q, keys + (start / block) * apart, block, scores + start);
    __m256 largest8 = _mm256_set1_ps(-INFINITY);
    const int64_t whole = seen / 8 * 8;
    for (int64_t p = 0; p < whole; p += 8) largest8 = _mm256_max_ps(largest8, _mm256_load_ps(scores + p));
    float largest = max8(largest8);
    for (int64_t p = whole; p < seen; p++) largest = std::max(largest, scores[p]);
    // The softmax's weights, left unnormalized until the end (the last few one by one, so
    // that no slot past `seen` enters the total).
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t p = 0; p < whole; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(scores + p), _mm256_set1_ps(largest)));
        _mm256_store_ps(scores + p, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = sum8(total8);
    if (whole < seen) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(scores + whole), _mm256_set1_ps(largest)));
        _mm256_store_ps(scores + whole, e);
        for (int64_t p = whole; p < seen; p++) total += scores[p];
    }
    // The values weighed by them.
    __m256 sum[PARTS];
    for (int part = 0; part < PARTS; part++) sum[part] = _mm256_setzero_ps();
    for (int64_t start = 0; start < seen; start += block) {
        const T* value = values + (start / block) * apart;
        for (int64_t p = start; p < std::min(seen, start + block); p++, value += CHANNELS) {
            __m256 weight = _mm256_set1_ps(scores[p]);
            for (int part = 0; part < PARTS; part++)
                sum[part] = _mm256_fmadd_ps(weight, load8(value + 8 * part), sum[part]);
        }
    }
    float result[CHANNELS];
    for (int part = 0; part < PARTS; part++)
        _mm256_storeu_ps(result + 8 * part, _mm256_mul_ps(sum[part], _mm256_set1_ps(1.0f / total)));
    for (int c = 0; c < CHANNELS; c++) out[c] = narrow<Q>(result[c]);
}

// Every row and head of a step: the query and the answer of type Q, the cache of type T.
// q: (rows, heads, 1, channels); keys and values: (blocks, rows, heads, positions of a block,
// channels), as sample.KVCache keeps them (each block's keys channel by channel in memory); a
// row sees its first seen[row] positions, all the cache holds where it counts more. The caller
// has checked the types, shapes and layout. False, and nothing written, where a row would see no
// position (a softmax over none has no answer).
template <typename Q, typename T>
static bool attend_all(const Q* query, const T* keys, const T* values, const int64_t* seen, Q* out,
                       int64_t blocks, int64_t rows, int64_t heads, int64_t block, int64_t channels, int threads) {
    for (int64_t row = 0; row < rows; row++)
        if (seen[row] < 1) return false;
    const int64_t apart = rows * heads * block * channels;
    // Each row and head on its own: the threads share them out.
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows * heads; i++) {
        const int64_t first = i * block * channels, at = i * channels;
        const int64_t seen_here = std::min(seen[i / heads], blocks * block);
        if (channels == 16) attend_one<16>(query + at, keys + first, values + first, apart, block, seen_here, out + at);
        if (channels == 32) attend_one<32>(query + at, keys + first, values + first, apart, block, seen_here, out + at);
        if (channels == 64) attend_one<64>(query + at, keys + first, values + first, apart, block, seen_here, out + at);
    }
    return true;
}

// The three pairs of types, each its own name for ctypes: float32 throughout, bf16 throughout, and a
// float32 query over a cache kept in fp16 (half the bytes to read). Each takes the query, keys,
// values, each row's count of positions and the answer's room (5 pointers), then blocks, rows, heads,
// positions of a block and channels (5 int64), then the threads to run (an int).
extern "C" {
bool attend_float(const float* q, const float* k, const float* v, const int64_t* seen, float* out,
                  int64_t blocks, int64_t rows, int64_t heads, int64_t block, int64_t channels, int threads) {
    return attend_all(q, k, v, seen, out, blocks, rows, heads, block, channels, threads);
}
bool attend_bf16(const BFloat16* q, const BFloat16* k, const BFloat16* v, const int64_t* seen, BFloat16* out,
                 int64_t blocks, int64_t rows, int64_t heads, int64_t block, int64_t channels, int threads) {
    return attend_all(q, k, v, seen, out, blocks, rows, heads, block, channels, threads);
}
bool attend_float_over_fp16(const float* q, const Half* k, const Half* v, const int64_t* seen, float* out,
                            int64_t blocks, int64_t rows, int64_t heads, int64_t block, int64_t channels,
                            int threads) {
    return attend_all(q, k, v, seen, out, blocks, rows, heads, block, channels, threads);
}
}
