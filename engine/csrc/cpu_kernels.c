/* CPU float32 kernels of the engine's decode step (built by engine/native.py).
 *
 * 1. loraplex_decode_attention_f32: paged decode attention, reading K/V blocks in place.
 *
 * One query token per sequence (token row ``rows[b]`` of ``q`` and ``out``, or row ``b``
 * when ``rows`` is NULL). K/V of one layer live in ``[kv_heads, slots, head_dim]``
 * pools; a sequence's token at position p sits in slot
 * ``blocks[b * nb + p / block_size] * block_size + p % block_size``. Work is split over
 * (sequence, kv head) pairs; each pair scores its ``g = heads / kv_heads`` query heads
 * against the sequence's keys (two-pass softmax in a per-thread buffer), then
 * accumulates the weighted values (with head dim 64 and 2-4 query heads per KV head, for all
 * of them in one pass over the values: each value row loaded once). Compared with gathering the blocks into a
 * contiguous copy first, K/V are read once instead of read, written and read again. Over
 * bfloat16 pools a thread takes its next pair as it starts one and prefetches that pair's
 * blocks while widening the current one's keys.
 *    loraplex_decode_attention_bf16kv: the same over bfloat16 pools (``LORAPLEX_KV_CACHE_DTYPE``):
 *    each K/V element is widened to float32 on load (exact: a 16-bit shift), q, the scores,
 *    the softmax and the output stay float32; half the bytes to stream per cached token.
 *    Either writes its output in float32, or rounded to bfloat16 (``out_bf16``: the input of a
 *    bfloat16 o projection, without a separate conversion pass). With ``allow_amx`` on a CPU with
 *    AMX (and the tiles granted, see loraplex_tile_matmul_init), the scores come from AMX tiles
 *    (amx_attend_rows), to float32 rounding the same.
 *
 * 2. loraplex_lora_rows_f32: multi-LoRA shrink + expand for rows that each name their own
 *    adapter slot (decode-like batches: few rows per adapter). Per row,
 *    ``y += scale * B[s] (A[s] x)``; the adapter weights (float32 or bfloat16) are streamed
 *    once per row with no gather, padding or scatter copies; the math is float32. Several projections of the same input (q/k/v,
 *    gate/up) go in one call: one parallel region instead of one per projection. The AVX-512
 *    and AVX2 builds take each segment of rows of one adapter in blocks (B read once per
 *    segment), so they serve prefill segments too.
 *
 * 3. loraplex_gemv_f32: y = W x for a single row (one-sequence decode), streaming W once.
 *    loraplex_gemv_bf16: the same with W in bfloat16 (half the bytes to stream): x is
 *    rounded to bfloat16, the products summed in float32 and each sum rounded to bfloat16
 *    before the float32 bias, as oneDNN's bfloat16 matmul does for a batch, so one row and
 *    a batch agree.
 *
 * 4. Fused elementwise steps of a decoder layer, each one pass over its rows:
 *    loraplex_add_rms_norm_f32 (residual add + RMSNorm), loraplex_silu_mul_f32
 *    (SwiGLU's silu(gate) * up) and loraplex_rope_store_f32 (a fused q|k|v output's bias and
 *    rotary embedding, q out in float32, k and v into the paged pools). The math is
 *    float32; the first two also read a bfloat16 matmul output and write the bfloat16 input of
 *    the next one (bfloat16 base weights), saving the separate conversion passes.
 *
 * 5.-6. loraplex_q8_matmul_f32 / loraplex_q4_matmul_f32: 8- and 4-bit weight matmuls.
 *
 * 7. loraplex_tile_matmul_bf16: bfloat16 matmul on AMX tiles or AVX512-BF16, any batch size.
 *
 * 8. loraplex_f32_panel_matmul: float32 matmul on AVX2 CPUs without AVX-512, with the
 *    weights packed once into panels of 16 output columns.
 *
 * 9. loraplex_scan_rows_f32: the logits' per-row argmax and finiteness in one pass.
 *
 * 10. loraplex_decoder_layers: a step's decoder layers in one call (matrices on the tile, block
 *    or panel kernels, LoRA rows or none): sections 1-8 in the order the model calls them.
 *
 * Built by engine/native.py with ``-O3 -march=native -fopenmp`` (or $LORAPLEX_NATIVE_MARCH); OpenMP is the same
 * runtime PyTorch uses (libgomp.so.1), so the thread pool is shared.
 */
#define _DEFAULT_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>

#define MAX_GROUP 32
#define MAX_HEAD_DIM 512
#define MAX_RANK 1024
/* Rows of one prefill chunk that share one widening of their keys (see decode_attention). */
#define GROUP_ROWS 16
/* Key blocks decode attention asks for ahead of the one it computes (see attend_task). */
#ifndef KV_PREFETCH_BLOCKS
#define KV_PREFETCH_BLOCKS 4
#endif
/* Elementwise kernels fork threads only above this many elements: a decode batch's rows
 * are a few microseconds of work, less than waking a sleeping OpenMP thread. */
#define PARALLEL_MIN_ELEMS (1 << 16)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

struct amx_config {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Set by loraplex_tile_matmul_init once the kernel has granted this process AMX state: decode
 * attention uses the tiles only then. */
static int amx_granted;
#endif

/* bfloat16 -> float32 is exact: the 16 bits are the top half of the float's. */
static inline float bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } c = { .u = (uint32_t)h << 16 };
    return c.f;
}

/* float32 to the nearest bfloat16 (ties to even, as torch's conversion); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float x)
{
    union { uint32_t u; float f; } c = { .f = x };
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (Cephes-style range reduction + degree-6 polynomial, ~2 ulp);
 * written branch-free so the compiler vectorizes the loop that calls it. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);  /* rintf vectorizes, floorf does not */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float p;
    memcpy(&p, &bits, sizeof p);
    return y * p;
}

#ifdef __AVX512F__
#include <immintrin.h>
/* 16 lanes at a time, for the loops that dominate a prefill step's elementwise work (a 3200-token
 * step's fused SwiGLU epilogue was half the gate|up matmul's time as the compiler vectorized
 * silu_mul1 and f32_to_bf16, 8 lanes wide with a division). Where these exist, every SwiGLU (the
 * separate pass, the tile and the 8-bit kernels' epilogues) goes through silu_mul16, so the fused
 * and unfused paths still compute the same numbers. */

/* f32_to_bf16 of each lane, the bfloat16 in the lane's low 16 bits. */
static inline __attribute__((always_inline)) __m512i bf16_bits16(__m512 v)
{
    const __m512i b = _mm512_castps_si512(v), hi = _mm512_srli_epi32(b, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}

static inline __attribute__((always_inline)) __m256i f32x16_to_bf16(__m512 v)
{
    return _mm512_cvtepi32_epi16(bf16_bits16(v));
}

/* Each lane rounded to bfloat16 and widened back: bf16_to_f32(f32_to_bf16(x)). */
static inline __attribute__((always_inline)) __m512 round16_bf16(__m512 v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}

static inline __attribute__((always_inline)) __m512 bf16x16_to_f32(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp_nonpos, 16 lanes (the same reduction and polynomial). */
static inline __attribute__((always_inline)) __m512 exp16_nonpos(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* NaN stays NaN: max returns its second operand */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i p = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(p));
}

/* silu(x) * u, 16 lanes: silu_mul1's math with the division as a reciprocal estimate and one
 * Newton step (within an ulp of the quotient; a 512-bit division is ten times the cost). */
static inline __attribute__((always_inline)) __m512 silu_mul16(__m512 x, __m512 u)
{
    const __m512 neg = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000)));
    const __m512 e = exp16_nonpos(neg), one = _mm512_set1_ps(1.0f);
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
    const __m512 d = _mm512_add_ps(one, e), r0 = _mm512_rcp14_ps(d);
    const __m512 r1 = _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_mul_ps(num, r1)), u);
}
#endif

/* Element ``i`` of a K/V pool as float32: the pool holds float32 (``kv_bf16`` 0) or bfloat16
 * (``kv_bf16`` 1) values, widened exactly (the 16 bits are the top half of the float's).
 * Called with a constant ``kv_bf16``, so each kernel variant compiles to its own vector loads. */
static inline __attribute__((always_inline)) float kv_at(const void *pool, int64_t i, const int kv_bf16)
{
    if (!kv_bf16) return ((const float *)pool)[i];
    union { uint32_t u; float f; } c = { .u = (uint32_t)((const uint16_t *)pool)[i] << 16 };
    return c.f;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 consecutive pool elements from ``i`` as float32 (bfloat16 widened by a shift). */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *pool, int64_t i, const int kv_bf16)
{
    if (kv_bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)pool + i);
}

/* The 16 keys' product vectors a[t] summed across lanes together, key t's sum in lane t: a
 * transpose-and-add tree (15 shuffle pairs for 16 keys instead of a full horizontal reduction
 * per key). */
static inline __attribute__((always_inline)) __m512 sum16_keys(const __m512 a[16])
{
    /* per 128-bit lane L of b[i]: (k0_L02, k1_L02, k0_L13, k1_L13) for keys 2i, 2i+1 */
    __m512 b[8];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    /* per lane L of c[i]: the lane's partial sums of keys 4i..4i+3 */
    __m512 c[4];
    for (int i = 0; i < 4; i++) {
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* fold the four lanes: lanes of d[i] pair up c[2i]'s and c[2i+1]'s, then e holds keys 0..15 */
    __m512 d[2];
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* s[t] = q . k_t for the 16 consecutive keys of head dim 64 starting at element ``k0``; returns
 * their max. Each key's products stay a vector, the 16 vectors summed by sum16_keys. */
static inline __attribute__((always_inline)) float dot16_hd64(const __m512 q[4], const void *kbase, int64_t k0,
                                                              const int kv_bf16, float *s)
{
    /* Each key's four products in order, the keys interleaved: 16 independent chains in
     * registers. (A loop over the keys, each key's chain whole, compiled to one chain at a time
     * with its sum stored to the stack: the dependent FMAs' latency, a third of the decode
     * kernel's time on an Intel Xeon.) */
    __m512 a[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) a[t] = _mm512_mul_ps(q[0], kv_load16(kbase, k0 + (int64_t)t * 64, kv_bf16));
#pragma GCC unroll 4
    for (int c = 1; c < 4; c++)
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
            a[t] = _mm512_fmadd_ps(q[c], kv_load16(kbase, k0 + (int64_t)t * 64 + 16 * c, kv_bf16), a[t]);
    const __m512 e = sum16_keys(a);
    _mm512_storeu_ps(s, e);
    return _mm512_reduce_max_ps(e);
}

/* dot16_hd64 for ``G`` (2..4, constant at the call) query heads at once: each key's four vectors
 * are loaded (and widened) once for all of them, where a pass per head read every key from L2
 * again. Each head's key vectors are dot16_hd64's (the same products in the same order) and go
 * through the same tree: the same scores. Head j's go to s + j * hs; mv[j] keeps the maxima of the
 * ``valid`` lanes (keys), lane by lane. */
static inline __attribute__((always_inline)) void dot16_heads_hd64(const int G, const __m512 q[][4],
                                                                   const void *kbase, int64_t k0, const int kv_bf16,
                                                                   float *s, int64_t hs, __m512 *mv, __mmask16 valid)
{
    __m512 a[4][16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
        const int64_t o = k0 + (int64_t)t * 64;
        const __m512 k0v = kv_load16(kbase, o, kv_bf16), k1v = kv_load16(kbase, o + 16, kv_bf16),
                     k2v = kv_load16(kbase, o + 32, kv_bf16), k3v = kv_load16(kbase, o + 48, kv_bf16);
        for (int j = 0; j < G; j++)
            a[j][t] = _mm512_fmadd_ps(q[j][3], k3v, _mm512_fmadd_ps(q[j][2], k2v,
                                      _mm512_fmadd_ps(q[j][1], k1v, _mm512_mul_ps(q[j][0], k0v))));
    }
    for (int j = 0; j < G; j++) {
        const __m512 e = sum16_keys(a[j]);
        _mm512_storeu_ps(s + (int64_t)j * hs, e);
        mv[j] = _mm512_mask_max_ps(mv[j], valid, mv[j], e);
    }
}
#endif

#ifdef __AVX512F__
/* out_j = inv_j * sum_p scores_j[p] v_p for ``G`` (1..4, constant at the call) query heads of
 * head dim 64 at once: each value row is loaded (and widened) once for all of them, and the
 * G x 4 accumulators are independent FMA chains. scores_j[p] is ``scores[j * hs + p * ps]``. */
static inline __attribute__((always_inline)) void pv_heads_hd64(
    const int G, const float *scores, int64_t hs, int64_t ps, int len, const void *vbase, const int64_t *table,
    int block_size, const int kv_bf16, const float *inv, float *ob)
{
    __m512 a[4][4];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < 4; c++) a[j][c] = _mm512_setzero_ps();
    const int64_t block_elems = (int64_t)block_size * 64;
    for (int p0 = 0; p0 < len; p0 += block_size) {
        const int n = len - p0 < block_size ? len - p0 : block_size;
        const int64_t vb = table[p0 / block_size] * block_elems;
        for (int t = 0; t < n; t++) {
            const int64_t vp = vb + (int64_t)t * 64;
            const __m512 v0 = kv_load16(vbase, vp, kv_bf16), v1 = kv_load16(vbase, vp + 16, kv_bf16),
                         v2 = kv_load16(vbase, vp + 32, kv_bf16), v3 = kv_load16(vbase, vp + 48, kv_bf16);
            for (int j = 0; j < G; j++) {
                const __m512 w = _mm512_set1_ps(scores[(int64_t)j * hs + (int64_t)(p0 + t) * ps]);
                a[j][0] = _mm512_fmadd_ps(w, v0, a[j][0]);
                a[j][1] = _mm512_fmadd_ps(w, v1, a[j][1]);
                a[j][2] = _mm512_fmadd_ps(w, v2, a[j][2]);
                a[j][3] = _mm512_fmadd_ps(w, v3, a[j][3]);
            }
        }
    }
    for (int j = 0; j < G; j++) {
        const __m512 s = _mm512_set1_ps(inv[j]);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(ob + j * 64 + c * 16, _mm512_mul_ps(a[j][c], s));
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTN_AVX2 1

/* 8 consecutive pool elements from ``i`` as float32 (bfloat16 widened by a shift). */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *pool, int64_t i, const int kv_bf16)
{
    if (kv_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)pool + i);
}

/* AVX2's dot16_hd64: s[t] = q . k_t for the 8 consecutive keys of head dim 64 starting at element
 * ``k0``; returns their max. Each query chunk is loaded once for the 8 keys, and the 8 per-key
 * vectors are summed across lanes together (hadd tree + one 128-bit fold). */
static inline __attribute__((always_inline)) float dot8_hd64(const float *q, const void *kbase, int64_t k0,
                                                             const int kv_bf16, float *s)
{
    __m256 a[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int t = 0; t < 8; t++) a[t] = _mm256_mul_ps(q0, kv_load8(kbase, k0 + (int64_t)t * 64, kv_bf16));
    for (int c = 8; c < 64; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qc, kv_load8(kbase, k0 + (int64_t)t * 64 + c, kv_bf16), a[t]);
    }
    /* per 128-bit half: key t's partial sums, keys 0..3 then 4..7 */
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 e = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    _mm256_storeu_ps(s, e);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* AVX2's pv_heads_hd64 for ``G`` (1..3, constant at the call) query heads of head dim 64: two
 * passes of 32 dims each, so the G x 4 accumulators and a value row's 4 vectors fit the 16
 * registers; each value row is loaded (and widened) once per pass for all G heads. */
static inline __attribute__((always_inline)) void pv_heads_hd64(
    const int G, const float *scores, int len, const void *vbase, const int64_t *table, int block_size,
    const int kv_bf16, const float *inv, float *ob)
{
    const int64_t block_elems = (int64_t)block_size * 64;
    for (int half = 0; half < 64; half += 32) {
        __m256 a[3][4];
        for (int j = 0; j < G; j++)
            for (int c = 0; c < 4; c++) a[j][c] = _mm256_setzero_ps();
        for (int p0 = 0; p0 < len; p0 += block_size) {
            const int n = len - p0 < block_size ? len - p0 : block_size;
            const int64_t vb = table[p0 / block_size] * block_elems + half;
            for (int t = 0; t < n; t++) {
                const int64_t vp = vb + (int64_t)t * 64;
                const __m256 v0 = kv_load8(vbase, vp, kv_bf16), v1 = kv_load8(vbase, vp + 8, kv_bf16),
                             v2 = kv_load8(vbase, vp + 16, kv_bf16), v3 = kv_load8(vbase, vp + 24, kv_bf16);
                for (int j = 0; j < G; j++) {
                    const __m256 w = _mm256_broadcast_ss(scores + (int64_t)j * len + p0 + t);
                    a[j][0] = _mm256_fmadd_ps(w, v0, a[j][0]);
                    a[j][1] = _mm256_fmadd_ps(w, v1, a[j][1]);
                    a[j][2] = _mm256_fmadd_ps(w, v2, a[j][2]);
                    a[j][3] = _mm256_fmadd_ps(w, v3, a[j][3]);
                }
            }
        }
        for (int j = 0; j < G; j++) {
            const __m256 s = _mm256_set1_ps(inv[j]);
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(ob + j * 64 + half + c * 8, _mm256_mul_ps(a[j][c], s));
        }
    }
}
#endif

/* attend_task scores every query head in one pass (its joint_qk): head dim 64, 2-4 query heads per
 * kv head and blocks of whole 16-key runs, on AVX-512. */
static inline int joint_scores(int head_dim, int g, int block_size)
{
#ifdef __AVX512F__
    return head_dim == 64 && g >= 2 && g <= 4 && block_size % 16 == 0;
#else
    (void)head_dim; (void)g; (void)block_size;
    return 0;
#endif
}

/* attend_task's first pass over the keys, at the block from key ``p0``: ask for the key block
 * KV_PREFETCH_BLOCKS ahead (the first ones too, at the start) and this value block now, so
 * scattered blocks arrive while earlier ones are computed: one block of compute is shorter than a
 * memory round trip. */
static inline __attribute__((always_inline)) void prefetch_ahead(
    const void *kbase, const int64_t *ktable, int64_t k_bytes, const void *vbase, const int64_t *vtable,
    int64_t v_bytes, int p0, int len, int block_size, int64_t block_elems)
{
    const int bi = p0 / block_size, nblk = (len + block_size - 1) / block_size;
    for (int a = bi == 0 ? 1 : KV_PREFETCH_BLOCKS; a <= KV_PREFETCH_BLOCKS && bi + a < nblk; a++) {
        const char *kn = (const char *)kbase + ktable[bi + a] * block_elems * k_bytes;
        for (int64_t c = 0; c < block_elems * k_bytes; c += 64) __builtin_prefetch(kn + c, 0, 3);
    }
    const char *vb = (const char *)vbase + vtable[bi] * block_elems * v_bytes;
    for (int64_t c = 0; c < block_elems * v_bytes; c += 64) __builtin_prefetch(vb + c, 0, 3);
}

/* One (sequence, kv head) task of decode attention: ``g`` query heads against ``len``
 * keys. Always inlined into call sites with a constant ``head_dim`` (64, 128) and element
 * types (``k_bf16``/``v_bf16``, see ``kv_at``), so the per-key loops compile to straight vector
 * code; heads are the outer loop, so one head's query (or output accumulator) stays in
 * registers while the sequence's keys (values) stream past, reread from L1/L2 for the next
 * head. ``kbase``/``vbase`` point at the kv head's first slot, ``ktable``/``vtable`` map the
 * sequence's block i to its block in them (the keys may be a widened copy, see ``widen_keys``);
 * ``prefetch``: ask for the blocks ahead (not needed when ``widen_keys`` did). Offsets below
 * count elements. */
static inline __attribute__((always_inline)) void attend_task(
    const float *qb, int64_t q_stride_head, const void *kbase, const int64_t *ktable, const int k_bf16,
    const void *vbase, const int64_t *vtable, const int v_bf16, const int prefetch,
    int len, int block_size, int g, const int head_dim, float *scores, float *ob)
{
    const int64_t block_elems = (int64_t)block_size * head_dim;
    const int64_t k_bytes = k_bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float);
    const int64_t v_bytes = v_bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float);
#ifdef __AVX512F__
    const int joint_pv = head_dim == 64 && g >= 2 && g <= 4;  /* the heads' values in one pass */
#elif defined(ATTN_AVX2)
    const int joint_pv = head_dim == 64;  /* the heads' values, three heads per pass */
#else
    const int joint_pv = 0;
#endif
    float invs[MAX_GROUP];
    float joint_max[4];
#ifdef __AVX512F__
    /* Every head's scores in one pass over the keys (dot16_heads_hd64), 16 keys at a time, a
     * block's last run whole (the slots past the row's length are read, their scores stored past
     * it and never used, and left out of the max): every score goes through the same tree,
     * whatever the pool's type and wherever the row ends, so a row's bits do not depend on
     * whether its keys were widened first (see decode_attention). Head j's scores start at
     * scores + j * hs. */
    const int joint_qk = joint_scores(head_dim, g, block_size);
    const int64_t hs = joint_qk ? (len + 15) & ~15 : len;
    if (joint_qk) {
        __m512 qv[4][4], mv[4];
        for (int j = 0; j < g; j++) {
            for (int c = 0; c < 4; c++) qv[j][c] = _mm512_loadu_ps(qb + (int64_t)j * q_stride_head + 16 * c);
            mv[j] = _mm512_set1_ps(-3.0e38f);
        }
        for (int p0 = 0; p0 < len; p0 += block_size) {
            const int n = len - p0 < block_size ? len - p0 : block_size;
            const int64_t kb = ktable[p0 / block_size] * block_elems;
            if (prefetch)
                prefetch_ahead(kbase, ktable, k_bytes, vbase, vtable, v_bytes, p0, len, block_size, block_elems);
            for (int t = 0; t < n; t += 16) {
                const int64_t k0 = kb + (int64_t)t * 64;
                const __mmask16 valid = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                if (g == 2) dot16_heads_hd64(2, qv, kbase, k0, k_bf16, scores + p0 + t, hs, mv, valid);
                else if (g == 3) dot16_heads_hd64(3, qv, kbase, k0, k_bf16, scores + p0 + t, hs, mv, valid);
                else dot16_heads_hd64(4, qv, kbase, k0, k_bf16, scores + p0 + t, hs, mv, valid);
            }
        }
        for (int j = 0; j < g; j++) joint_max[j] = _mm512_reduce_max_ps(mv[j]);
    }
#else
    const int joint_qk = 0;
    const int64_t hs = len;
#endif
    for (int j = 0; j < g; j++) {
        const float *qj = qb + (int64_t)j * q_stride_head;
        float *sj = scores + (int64_t)j * hs;
        /* scores: s_p = q_j . k_p (scored above on the joint pass) */
        float m = joint_qk ? joint_max[j] : -3.0e38f;
        for (int p0 = 0; p0 < len && !joint_qk; p0 += block_size) {
            const int n = len - p0 < block_size ? len - p0 : block_size;
            const int64_t kb = ktable[p0 / block_size] * block_elems;
            if (j == 0 && prefetch)
                prefetch_ahead(kbase, ktable, k_bytes, vbase, vtable, v_bytes, p0, len, block_size, block_elems);
            int t = 0;
#ifdef __AVX512F__
            if (head_dim == 64 && n >= 16) {
                const __m512 qv[4] = {_mm512_loadu_ps(qj), _mm512_loadu_ps(qj + 16), _mm512_loadu_ps(qj + 32),
                                      _mm512_loadu_ps(qj + 48)};
                for (; t + 16 <= n; t += 16) {
                    const float m16 = dot16_hd64(qv, kbase, kb + (int64_t)t * head_dim, k_bf16, sj + p0 + t);
                    m = m16 > m ? m16 : m;
                }
            }
#elif defined(ATTN_AVX2)
            if (head_dim == 64)
                for (; t + 8 <= n; t += 8) {
                    const float m8 = dot8_hd64(qj, kbase, kb + (int64_t)t * head_dim, k_bf16, sj + p0 + t);
                    m = m8 > m ? m8 : m;
                }
#endif
            for (; t + 4 <= n; t += 4) {  /* four keys at a time: independent accumulators */
                const int64_t k0 = kb + (int64_t)t * head_dim, k1 = k0 + head_dim, k2 = k1 + head_dim,
                              k3 = k2 + head_dim;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+:s0, s1, s2, s3)
                for (int i = 0; i < head_dim; i++) {
                    const float qi = qj[i];
                    s0 += qi * kv_at(kbase, k0 + i, k_bf16);
                    s1 += qi * kv_at(kbase, k1 + i, k_bf16);
                    s2 += qi * kv_at(kbase, k2 + i, k_bf16);
                    s3 += qi * kv_at(kbase, k3 + i, k_bf16);
                }
                sj[p0 + t] = s0;
                sj[p0 + t + 1] = s1;
                sj[p0 + t + 2] = s2;
                sj[p0 + t + 3] = s3;
                const float m01 = s0 > s1 ? s0 : s1, m23 = s2 > s3 ? s2 : s3, m4 = m01 > m23 ? m01 : m23;
                m = m4 > m ? m4 : m;
            }
            for (; t < n; t++) {
                const int64_t kp = kb + (int64_t)t * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+:s)
                for (int i = 0; i < head_dim; i++) s += qj[i] * kv_at(kbase, kp + i, k_bf16);
                sj[p0 + t] = s;
                m = s > m ? s : m;
            }
        }
        /* softmax numerators in place */
        float sum = 0.0f;
#pragma omp simd reduction(+:sum)
        for (int p = 0; p < len; p++) {
            float e = exp_nonpos(sj[p] - m);
            sj[p] = e;
            sum += e;
        }
        /* out_j = sum_p w_p v_p / sum */
        const float inv = 1.0f / sum;
        invs[j] = inv;
        if (joint_pv) continue;  /* after the last head: pv_heads_hd64 */
        float *oj = ob + (int64_t)j * head_dim;
#ifdef __AVX512F__
        if (head_dim == 64) {  /* the accumulator in four registers, two keys in flight */
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int p0 = 0; p0 < len; p0 += block_size) {
                const int n = len - p0 < block_size ? len - p0 : block_size;
                const int64_t vb = vtable[p0 / block_size] * block_elems;
                int t = 0;
                for (; t + 2 <= n; t += 2) {
                    const __m512 w = _mm512_set1_ps(sj[p0 + t]), x = _mm512_set1_ps(sj[p0 + t + 1]);
                    const int64_t vp = vb + (int64_t)t * 64;
                    a0 = _mm512_fmadd_ps(w, kv_load16(vbase, vp, v_bf16), a0);
                    a1 = _mm512_fmadd_ps(w, kv_load16(vbase, vp + 16, v_bf16), a1);
                    a2 = _mm512_fmadd_ps(w, kv_load16(vbase, vp + 32, v_bf16), a2);
                    a3 = _mm512_fmadd_ps(w, kv_load16(vbase, vp + 48, v_bf16), a3);
                    b0 = _mm512_fmadd_ps(x, kv_load16(vbase, vp + 64, v_bf16), b0);
                    b1 = _mm512_fmadd_ps(x, kv_load16(vbase, vp + 80, v_bf16), b1);
                    b2 = _mm512_fmadd_ps(x, kv_load16(vbase, vp + 96, v_bf16), b2);
                    b3 = _mm512_fmadd_ps(x, kv_load16(vbase, vp + 112, v_bf16), b3);
                }
                if (t < n) {
                    const __m512 w = _mm512_set1_ps(sj[p0 + t]);
                    const int64_t vp = vb + (int64_t)t * 64;
                    a0 = _mm512_fmadd_ps(w, kv_load16(vbase, vp, v_bf16), a0);
                    a1 = _mm512_fmadd_ps(w, kv_load16(vbase, vp + 16, v_bf16), a1);
                    a2 = _mm512_fmadd_ps(w, kv_load16(vbase, vp + 32, v_bf16), a2);
                    a3 = _mm512_fmadd_ps(w, kv_load16(vbase, vp + 48, v_bf16), a3);
                }
            }
            const __m512 vinv = _mm512_set1_ps(inv);
            _mm512_storeu_ps(oj, _mm512_mul_ps(_mm512_add_ps(a0, b0), vinv));
            _mm512_storeu_ps(oj + 16, _mm512_mul_ps(_mm512_add_ps(a1, b1), vinv));
            _mm512_storeu_ps(oj + 32, _mm512_mul_ps(_mm512_add_ps(a2, b2), vinv));
            _mm512_storeu_ps(oj + 48, _mm512_mul_ps(_mm512_add_ps(a3, b3), vinv));
            continue;
        }
#endif
        float acc[MAX_HEAD_DIM];
        for (int i = 0; i < head_dim; i++) acc[i] = 0.0f;
        for (int p0 = 0; p0 < len; p0 += block_size) {
            const int n = len - p0 < block_size ? len - p0 : block_size;
            const int64_t vb = vtable[p0 / block_size] * block_elems;
            for (int t = 0; t < n; t++) {
                const float w = sj[p0 + t];
                const int64_t vp = vb + (int64_t)t * head_dim;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) acc[i] += w * kv_at(vbase, vp + i, v_bf16);
            }
        }
#pragma omp simd
        for (int i = 0; i < head_dim; i++) oj[i] = acc[i] * inv;
    }
#ifdef __AVX512F__
    if (joint_pv) {
        if (g == 2) pv_heads_hd64(2, scores, hs, 1, len, vbase, vtable, block_size, v_bf16, invs, ob);
        else if (g == 3) pv_heads_hd64(3, scores, hs, 1, len, vbase, vtable, block_size, v_bf16, invs, ob);
        else pv_heads_hd64(4, scores, hs, 1, len, vbase, vtable, block_size, v_bf16, invs, ob);
    }
#elif defined(ATTN_AVX2)
    if (joint_pv)
        for (int j0 = 0; j0 < g; j0 += 3) {
            const float *sc = scores + (int64_t)j0 * len;
            float *o = ob + (int64_t)j0 * 64;
            if (g - j0 >= 3) pv_heads_hd64(3, sc, len, vbase, vtable, block_size, v_bf16, invs + j0, o);
            else if (g - j0 == 2) pv_heads_hd64(2, sc, len, vbase, vtable, block_size, v_bf16, invs + j0, o);
            else pv_heads_hd64(1, sc, len, vbase, vtable, block_size, v_bf16, invs + j0, o);
        }
#else
    (void)invs;
#endif
}

/* ``attend_task`` with a constant head dim where it is a common one. */
static inline __attribute__((always_inline)) void attend_head_dim(
    const float *qb, int64_t q_stride_head, const void *kbase, const int64_t *ktable, const int k_bf16,
    const void *vbase, const int64_t *vtable, const int v_bf16, const int prefetch,
    int len, int block_size, int g, int head_dim, float *scores, float *ob)
{
    if (head_dim == 64)
        attend_task(qb, q_stride_head, kbase, ktable, k_bf16, vbase, vtable, v_bf16, prefetch, len, block_size, g,
                    64, scores, ob);
    else if (head_dim == 128)
        attend_task(qb, q_stride_head, kbase, ktable, k_bf16, vbase, vtable, v_bf16, prefetch, len, block_size, g,
                    128, scores, ob);
    else
        attend_task(qb, q_stride_head, kbase, ktable, k_bf16, vbase, vtable, v_bf16, prefetch, len, block_size, g,
                    head_dim, scores, ob);
}

/* What a thread computes next (decode_attention): its kv head's bfloat16 pools, block table
 * and length (0: nothing next), for prefetching while the current task runs. */
struct kv_next {
    const uint16_t *k, *v;
    const int64_t *table;
    int len;
};

/* Prefetches of a task over bfloat16 pools as it reaches its block ``bi`` of ``nblk``: this block's
 * share of the next task's K/V blocks into L2, the key block KV_PREFETCH_BLOCKS ahead (the first
 * ones too, at the start) and this value block into L1. */
static inline __attribute__((always_inline)) void prefetch_kv_block(
    const uint16_t *kbase, const uint16_t *vbase, const int64_t *table, int bi, int nblk, int64_t block_elems,
    int block_size, const struct kv_next *next)
{
    if (next->len > 0) {
        const int nn = (next->len + block_size - 1) / block_size;
        for (int a = bi * nn / nblk; a < (bi + 1) * nn / nblk; a++) {
            const char *kn = (const char *)(next->k + next->table[a] * block_elems);
            const char *vn = (const char *)(next->v + next->table[a] * block_elems);
            for (int64_t c = 0; c < block_elems * 2; c += 64) {
                __builtin_prefetch(kn + c, 0, 2);
                __builtin_prefetch(vn + c, 0, 2);
            }
        }
    }
    for (int a = bi == 0 ? 1 : KV_PREFETCH_BLOCKS; a <= KV_PREFETCH_BLOCKS && bi + a < nblk; a++) {
        const char *kn = (const char *)(kbase + table[bi + a] * block_elems);
        for (int64_t c = 0; c < block_elems * 2; c += 64) __builtin_prefetch(kn + c, 0, 3);
    }
    const char *vb = (const char *)(vbase + table[bi] * block_elems);
    for (int64_t c = 0; c < block_elems * 2; c += 64) __builtin_prefetch(vb + c, 0, 3);
}

/* A task's keys widened once from bfloat16 into ``dst`` (the sequence's block i at
 * dst + i * block_size * head_dim) for the ``g`` heads that each read all of them: widening in
 * every head's pass cost more vector work than the dot products (two shuffles per 16 elements
 * against one FMA). Asks for the key blocks ahead and the value blocks on the way, as
 * attend_task's first pass does. */
static inline void widen_keys(const uint16_t *kbase, const uint16_t *vbase, const int64_t *table, int len,
                              int block_size, int head_dim, float *dst, const struct kv_next *next)
{
    const int64_t block_elems = (int64_t)block_size * head_dim;
    const int nblk = (len + block_size - 1) / block_size;
    for (int bi = 0; bi < nblk; bi++) {
        prefetch_kv_block(kbase, vbase, table, bi, nblk, block_elems, block_size, next);
        const int64_t n = (int64_t)(len - bi * block_size < block_size ? len - bi * block_size : block_size);
        const uint16_t *src = kbase + table[bi] * block_elems;
        float *d = dst + (int64_t)bi * block_elems;
#pragma omp simd
        for (int64_t i = 0; i < n * head_dim; i++) d[i] = bf16_to_f32(src[i]);
    }
}

#ifdef HAVE_AMX
/* Decode attention's scores on AMX tiles (bfloat16 pools, head dim 64, block size a multiple of 16,
 * up to 4 query heads per kv head). A tile of 16 keys (16 rows x 32 dims, loaded in place from a
 * block: its keys are 128 bytes apart) times a tile of query columns (32 dims in pairs x 16
 * columns) gives 16 keys' scores for every column in one product, where the vector path widens
 * the keys and reduces a 16-lane product across lanes per key and head. The tiles multiply
 * bfloat16, so each query is split into three bfloat16 parts (hi + mid + lo: 24 significant bits,
 * float32's), each multiplied into the same sums: the products are exact in float32 and summed in
 * float32, so the scores match the vector path's to float32 rounding. A prefill group's rows go
 * ``16 / g`` rows per pass (a group being a whole number of passes); there the scores stay key-major
 * as the tile stores them and the softmax runs down all 16 columns at once (against gathering each
 * column into a row, and packing the queries element by element: 32 prefill chunks of 100 tokens
 * over 30 layers, 126 -> 81 ms on 2 cores of a Xeon). The values go through pv_heads_hd64. */
#define AMX_COLS 16

static void amx_attention_configure(void)
{
    struct amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) {  /* 0: scores (16 keys x 16 columns), 1: keys, 2: queries */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Rows ``r0 .. r1 - 1`` of a group (one block table; lengths ``lens``, ascending) against kv head
 * ``kh``'s keys ``kbase`` / values ``vbase``. ``qpack``: 3072 bfloat16 (the parts' two 16 x 32
 * tiles each, zeroed before the first task), ``sc``: 16 scores per key (one per column) for the
 * longest row's blocks, ``first``: this is the group's first pass (it prefetches). */
static void amx_attend_rows(
    const float *q, int64_t q_stride_row, int64_t q_stride_head, const int64_t *rows, int r0, int r1, int kh,
    int g, const uint16_t *kbase, const uint16_t *vbase, const int64_t *table, const int64_t *lens, int block_size,
    uint16_t *qpack, float *sc, void *out, int64_t out_stride_row, int out_bf16, float *obuf, int first,
    const struct kv_next *next)
{
    const int nq = (r1 - r0) * g;  /* query columns (those past nq hold earlier tasks' queries: unread) */
    const int64_t block_elems = (int64_t)block_size * 64;
    /* Column n's parts: part p's 32 dim pairs of dims 32 h .. 32 h + 31 are one vector, scattered
     * down column n of the part's tile for those dims (pair r at qpairs[p * 512 + h * 256 + 16 r + n]). */
    const __m512i down = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(AMX_COLS));
    uint32_t *qpairs = (uint32_t *)qpack;
    for (int n = 0; n < nq; n++) {
        const int64_t row = rows != NULL ? rows[r0 + n / g] : r0 + n / g;
        const float *qn = q + row * q_stride_row + (int64_t)(kh * g + n % g) * q_stride_head;
        __m512 rest[4] = {_mm512_loadu_ps(qn), _mm512_loadu_ps(qn + 16), _mm512_loadu_ps(qn + 32),
                          _mm512_loadu_ps(qn + 48)};
        for (int part = 0; part < 3; part++) {
            __m512i h[4];
            for (int c = 0; c < 4; c++) {
                h[c] = bf16_bits16(rest[c]);
                rest[c] = _mm512_sub_ps(rest[c], _mm512_castsi512_ps(_mm512_slli_epi32(h[c], 16)));
            }
            for (int half = 0; half < 2; half++) {
                const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(h[2 * half])),
                                                         _mm512_cvtepi32_epi16(h[2 * half + 1]), 1);
                _mm512_i32scatter_epi32(qpairs + part * 512 + half * 256 + n, down, pairs, 4);
            }
        }
    }
    /* Many columns (a prefill pass): the scores key-major as the tile stores them, key p's 16 at
     * sc + 16 p, and the softmax down all columns at once. A few (decode rows): each column's
     * scores gathered into a row of its own (at sc + n * cs), its softmax along it. */
    const int by_key = nq > AMX_COLS / 2;
    const int len = (int)lens[r1 - 1];
    const int nblk = (len + block_size - 1) / block_size;
    const int64_t cs = (int64_t)nblk * block_size;
    const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(AMX_COLS));
    float c[16 * AMX_COLS] __attribute__((aligned(64)));
    for (int bi = 0; bi < nblk; bi++) {
        if (first) prefetch_kv_block(kbase, vbase, table, bi, nblk, block_elems, block_size, next);
        const uint16_t *kb = kbase + table[bi] * block_elems;
        for (int k0 = 0; k0 < block_size && bi * block_size + k0 < len; k0 += 16) {
            _tile_zero(0);
            for (int half = 0; half < 2; half++) {
                _tile_loadd(1, kb + k0 * 64 + half * 32, 128);
                for (int part = 0; part < 3; part++) {  /* hi, mid, lo: the large parts first */
                    _tile_loadd(2, qpack + part * 1024 + half * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
            }
            const int64_t p = (int64_t)bi * block_size + k0;
            if (by_key) {
                _tile_stored(0, sc + p * AMX_COLS, AMX_COLS * sizeof(float));
                continue;
            }
            _tile_stored(0, c, AMX_COLS * sizeof(float));
            for (int n = 0; n < nq; n++) _mm512_storeu_ps(sc + n * cs + p, _mm512_i32gather_ps(across, c + n, 4));
        }
    }
    /* each column's softmax over its own row's keys (a key past the row's length, stale bytes of a
     * block included, is never read, or masked: its weight is 0), then each row's values */
    float inv[AMX_COLS];
    if (by_key) {
        int lens_n[AMX_COLS];
        for (int n = 0; n < AMX_COLS; n++) lens_n[n] = n < nq ? (int)lens[r0 + n / g] : 0;
        const __m512i lv = _mm512_loadu_si512(lens_n);
        __m512 m = _mm512_set1_ps(-3.0e38f), sum = _mm512_setzero_ps();
        for (int p = 0; p < len; p++)
            m = _mm512_mask_max_ps(m, _mm512_cmpgt_epi32_mask(lv, _mm512_set1_epi32(p)), m,
                                   _mm512_loadu_ps(sc + p * AMX_COLS));
        for (int p = 0; p < len; p++) {
            float *sp = sc + p * AMX_COLS;
            const __m512 e = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(lv, _mm512_set1_epi32(p)),
                                                 exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sp), m)));
            _mm512_storeu_ps(sp, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));  /* columns past nq: unread */
    } else {
        for (int n = 0; n < nq; n++) {
            float *sn = sc + n * cs;
            const int ln = (int)lens[r0 + n / g];
            float m = -3.0e38f;
#pragma omp simd reduction(max:m)
            for (int p = 0; p < ln; p++) m = sn[p] > m ? sn[p] : m;
            float sum = 0.0f;
#pragma omp simd reduction(+:sum)
            for (int p = 0; p < ln; p++) {
                const float e = exp_nonpos(sn[p] - m);
                sn[p] = e;
                sum += e;
            }
            inv[n] = 1.0f / sum;
        }
    }
    const int64_t hs = by_key ? 1 : cs, ps = by_key ? AMX_COLS : 1;
    for (int b = r0; b < r1; b++) {
        const int n0 = (b - r0) * g;
        const int64_t row = rows != NULL ? rows[b] : b;
        const int64_t o0 = row * out_stride_row + (int64_t)kh * g * 64;
        float *ob = out_bf16 ? obuf : (float *)out + o0;
        const float *sb = sc + n0 * hs;
        const int lb = (int)lens[b];
        if (g == 1) pv_heads_hd64(1, sb, hs, ps, lb, vbase, table, block_size, 1, inv + n0, ob);
        else if (g == 2) pv_heads_hd64(2, sb, hs, ps, lb, vbase, table, block_size, 1, inv + n0, ob);
        else if (g == 3) pv_heads_hd64(3, sb, hs, ps, lb, vbase, table, block_size, 1, inv + n0, ob);
        else pv_heads_hd64(4, sb, hs, ps, lb, vbase, table, block_size, 1, inv + n0, ob);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + o0;
#pragma omp simd
            for (int i = 0; i < g * 64; i++) o[i] = f32_to_bf16(obuf[i]);
        }
    }
}
#endif

/* Both exported decode-attention kernels: pools of float32 or bfloat16 (``kv_bf16``). */
static int decode_attention(
    const float *q, int64_t q_stride_row, int64_t q_stride_head, const int64_t *rows,
    const void *k_pool, const void *v_pool, int64_t pool_slots,
    const int64_t *blocks, int64_t blocks_per_seq, const int64_t *lens,
    void *out, int64_t out_stride_row, int out_bf16,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int max_len, int num_threads, const int kv_bf16, int allow_amx)
{
    const int g = num_heads / num_kv_heads;
    if (g > MAX_GROUP || head_dim > MAX_HEAD_DIM || g * num_kv_heads != num_heads) return -1;
    const int64_t head_bytes = pool_slots * head_dim * (kv_bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float));
#ifdef HAVE_AMX
    const int amx = allow_amx && kv_bf16 && head_dim == 64 && g <= 4 && block_size % 16 == 0
                    && __atomic_load_n(&amx_granted, __ATOMIC_ACQUIRE);  /* amx_attend_rows */
#else
    const int amx = 0;
    (void)allow_amx;
#endif
    const int widen = kv_bf16 && g > 1 && !amx;  /* several heads read each key: widen it once (widen_keys) */
    const int in_place_rows = joint_scores(head_dim, g, block_size);  /* a lone row reads its keys in place */
    const int64_t max_blocks = (max_len > 0 ? max_len : 1) / block_size + 1;
    /* Consecutive rows of one prefill chunk (the same block table, each one position further)
     * form a group whose keys are widened once for all its rows: a row alone would widen all
     * the keys before it again. group[i] is the first row of group i, group[ngroups] = num_seqs. */
    int *group = (int *)malloc(sizeof(int) * (size_t)(num_seqs + 1));
    if (group == NULL) return -2;
    int ngroups = 0;
#ifdef HAVE_AMX
    /* on AMX a whole number of passes (a pass takes AMX_COLS / g rows, see amx_attend_rows) */
    const int group_rows = amx ? AMX_COLS / g * (GROUP_ROWS / (AMX_COLS / g)) : GROUP_ROWS;
#else
    const int group_rows = GROUP_ROWS;
#endif
    for (int b = 0; b < num_seqs; b++) {
        const int64_t *tb = blocks + (int64_t)b * blocks_per_seq;
        const int joins = (widen || amx) && b > 0 && b - group[ngroups - 1] < group_rows && lens[b] == lens[b - 1] + 1
                          && memcmp(tb, tb - blocks_per_seq, sizeof(int64_t) * (size_t)blocks_per_seq) == 0;
        if (!joins) group[ngroups++] = b;
    }
    group[ngroups] = num_seqs;
    /* The groups in the order each head takes them: by their first block, so rows over one shared
     * prefix (the prefix cache's blocks) follow each other and read its keys from L2. */
    int *order = (int *)malloc(sizeof(int) * (size_t)(ngroups > 0 ? ngroups : 1));
    if (order == NULL) {
        free(group);
        return -2;
    }
    for (int i = 0; i < ngroups; i++) {  /* insertion sort, stable: a step has a few dozen groups */
        const int64_t key = blocks[(int64_t)group[i] * blocks_per_seq];
        int j = i;
        for (; j > 0 && blocks[(int64_t)group[order[j - 1]] * blocks_per_seq] > key; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    const int tasks = ngroups * num_kv_heads;
    int failed = 0, next_task = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* g heads' scores, each up to a multiple of 16 (attend_task's joint pass) */
        float *scores = (float *)malloc(sizeof(float) * (size_t)g * (size_t)((max_len > 0 ? max_len : 1) + 16));
        /* a task's float32 output, rounded into a bfloat16 out */
        float *obuf = out_bf16 ? (float *)malloc(sizeof(float) * (size_t)g * (size_t)head_dim) : NULL;
        /* a task's widened keys, and the identity block table that reads them */
        float *kwide = widen ? (float *)malloc(sizeof(float) * (size_t)(max_blocks * block_size * head_dim)) : NULL;
        int64_t *ident = widen ? (int64_t *)malloc(sizeof(int64_t) * (size_t)max_blocks) : NULL;
        /* the AMX path's scores (16 columns per key) and query tiles */
        float *sc = amx ? (float *)malloc(sizeof(float) * (size_t)(max_blocks * block_size * 16)) : NULL;
        uint16_t *qpack = amx ? (uint16_t *)calloc(3072, sizeof(uint16_t)) : NULL;
        const int ok = scores != NULL && (!out_bf16 || obuf != NULL) && (!widen || (kwide != NULL && ident != NULL))
                       && (!amx || (sc != NULL && qpack != NULL));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        if (ident != NULL)
            for (int64_t i = 0; i < max_blocks; i++) ident[i] = i;
#ifdef HAVE_AMX
        if (amx) amx_attention_configure();
#endif
        /* Tasks are handed out one at a time (their lengths differ), each thread taking its next
         * one as it starts the current one, so that the next one's K/V blocks are fetched while
         * the current one computes (with the widened keys: decode rows of 100-200 tokens waited
         * on memory for half their time without it). They go kv head by kv head, each head's
         * rows in ``order``: the rows of a prefill chunk (one block table), and rows over one
         * cached prefix, come one after another on the same head, so a row finds the keys and
         * values the row before it read still in L2 (one head's K/V of a 544-token context is
         * 280 KB in float32), where row-major order streamed the other heads' between them and
         * read every row's from L3. */
        int task = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
        int64_t last_first = -1;
        int last_kh = -1;
        while (task < tasks) {
            const int upcoming = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
            struct kv_next nx = {NULL, NULL, NULL, 0};
            if ((widen || amx) && upcoming < tasks) {
                const int ng = order[upcoming % ngroups], nk = upcoming / ngroups;
                nx.k = (const uint16_t *)((const char *)k_pool + nk * head_bytes);
                nx.v = (const uint16_t *)((const char *)v_pool + nk * head_bytes);
                nx.table = blocks + (int64_t)group[ng] * blocks_per_seq;
                nx.len = (int)lens[group[ng + 1] - 1];
            }
            const int current = task;
            task = upcoming;
            if (!ok) continue;
            const int gi = order[current % ngroups];
            const int kh = current / ngroups;
            const int first = group[gi], end = group[gi + 1];
            const int64_t *table = blocks + (int64_t)first * blocks_per_seq;
            const void *kbase = (const char *)k_pool + kh * head_bytes;
            const void *vbase = (const char *)v_pool + kh * head_bytes;
#ifdef HAVE_AMX
            if (amx) {
                const int per_pass = AMX_COLS / g;
                for (int r0 = first; r0 < end; r0 += per_pass)
                    amx_attend_rows(q, q_stride_row, q_stride_head, rows, r0, r0 + per_pass < end ? r0 + per_pass : end,
                                    kh, g, (const uint16_t *)kbase, (const uint16_t *)vbase, table, lens, block_size,
                                    qpack, sc, out, out_stride_row, out_bf16, obuf, r0 == first, &nx);
                continue;
            }
#endif
            /* the same first block and kv head as this thread's last task (the rows over one cached
             * prefix, a chunk's rows): its K/V are in this core's L2 already, and asking for them
             * again only fills the miss buffers */
            const int warm = table[0] == last_first && kh == last_kh;
            last_first = table[0];
            last_kh = kh;
            /* the keys of the group's longest row: every row's keys; a row alone reads them in
             * place where attend_task's joint pass widens each key once for every head (the same
             * bits either way: 128 bytes a key read from L2 instead of 256 written and read) */
            const int wide_k = widen && (end - first > 1 || !in_place_rows);
            if (wide_k)
                widen_keys((const uint16_t *)kbase, (const uint16_t *)vbase, table, (int)lens[end - 1], block_size,
                           head_dim, kwide, &nx);
            for (int b = first; b < end; b++) {
                const int len = (int)lens[b];
                const int64_t row = rows != NULL ? rows[b] : b;
                const float *qb = q + row * q_stride_row + (int64_t)kh * g * q_stride_head;
                const int64_t o0 = row * out_stride_row + (int64_t)kh * g * head_dim;
                float *ob = out_bf16 ? obuf : (float *)out + o0;
                /* The parallel region is outlined with kv_bf16 a variable: branch here, outside the
                 * loops, so each branch compiles its own constant-type vector loops. */
                if (wide_k)
                    attend_head_dim(qb, q_stride_head, kwide, ident, 0, vbase, table, 1, 0, len, block_size, g,
                                    head_dim, scores, ob);
                else if (kv_bf16)
                    attend_head_dim(qb, q_stride_head, kbase, table, 1, vbase, table, 1, !warm, len, block_size, g,
                                    head_dim, scores, ob);
                else
                    attend_head_dim(qb, q_stride_head, kbase, table, 0, vbase, table, 0, !warm, len, block_size, g,
                                    head_dim, scores, ob);
                if (out_bf16) {
                    uint16_t *o = (uint16_t *)out + o0;
#pragma omp simd
                    for (int i = 0; i < g * head_dim; i++) o[i] = f32_to_bf16(obuf[i]);
                }
            }
        }
        free(scores);
        free(obuf);
        free(kwide);
        free(ident);
        free(sc);
        free(qpack);
#ifdef HAVE_AMX
        if (amx) _tile_release();
#endif
    }
    free(group);
    free(order);
    return failed ? -2 : 0;
}

int loraplex_decode_attention_f32(
    const float *q, int64_t q_stride_row, int64_t q_stride_head, const int64_t *rows,
    const float *k_pool, const float *v_pool, int64_t pool_slots,
    const int64_t *blocks, int64_t blocks_per_seq, const int64_t *lens,
    void *out, int64_t out_stride_row, int out_bf16,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int max_len, int num_threads)
{
    return decode_attention(q, q_stride_row, q_stride_head, rows, k_pool, v_pool, pool_slots, blocks,
                            blocks_per_seq, lens, out, out_stride_row, out_bf16, num_seqs, num_heads, num_kv_heads, head_dim,
                            block_size, max_len, num_threads, 0, 0);
}

int loraplex_decode_attention_bf16kv(
    const float *q, int64_t q_stride_row, int64_t q_stride_head, const int64_t *rows,
    const uint16_t *k_pool, const uint16_t *v_pool, int64_t pool_slots,
    const int64_t *blocks, int64_t blocks_per_seq, const int64_t *lens,
    void *out, int64_t out_stride_row, int out_bf16,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int max_len, int num_threads, int allow_amx)
{
    return decode_attention(q, q_stride_row, q_stride_head, rows, k_pool, v_pool, pool_slots, blocks,
                            blocks_per_seq, lens, out, out_stride_row, out_bf16, num_seqs, num_heads, num_kv_heads, head_dim,
                            block_size, max_len, num_threads, 1, allow_amx);
}

/* s[k] = m[k] . x for the four rows m[0..3] (row stride ld) of a matrix: four independent
 * accumulators, x read once per element for all four. */
static inline void dot4(const float *m, int64_t ld, const float *x, int n, float s[4])
{
    const float *m0 = m, *m1 = m0 + ld, *m2 = m1 + ld, *m3 = m2 + ld;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+:s0, s1, s2, s3)
    for (int i = 0; i < n; i++) {
        const float xi = x[i];
        s0 += m0[i] * xi;
        s1 += m1[i] * xi;
        s2 += m2[i] * xi;
        s3 += m3[i] * xi;
    }
    s[0] = s0;
    s[1] = s1;
    s[2] = s2;
    s[3] = s3;
}

static inline void dot4_bf16(const uint16_t *m, int64_t ld, const float *x, int n, float s[4])
{
    const uint16_t *m0 = m, *m1 = m0 + ld, *m2 = m1 + ld, *m3 = m2 + ld;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+:s0, s1, s2, s3)
    for (int i = 0; i < n; i++) {
        const float xi = x[i];
        s0 += bf16_to_f32(m0[i]) * xi;
        s1 += bf16_to_f32(m1[i]) * xi;
        s2 += bf16_to_f32(m2[i]) * xi;
        s3 += bf16_to_f32(m3[i]) * xi;
    }
    s[0] = s0;
    s[1] = s1;
    s[2] = s2;
    s[3] = s3;
}

/* Element i of a float32 (wbf16 = 0) or bfloat16 (wbf16 = 1) array, as a float32. */
static inline __attribute__((always_inline)) float load_w(const void *p, int64_t i, const int wbf16)
{
    return wbf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* One row's LoRA for one projection: yr[0:out_dim] += B (scale * A xr). A and B are float32
 * or bfloat16 (wbf16, a constant at every call site, so each is its own specialization); the
 * input row, the sums and yr are float32. */
static inline __attribute__((always_inline)) void lora_row(
    const float *xr, float *yr, const void *as, const void *bs, float sc, int b_transposed,
    int in_dim, int out_dim, int rank, const int wbf16)
{
    float t[MAX_RANK];
    const size_t es = wbf16 ? 2 : 4;
    /* shrink, four rows of A at a time (independent accumulators) */
    int j = 0;
    for (; j + 4 <= rank; j += 4) {
        float s4[4];
        const char *aj = (const char *)as + (size_t)j * in_dim * es;
        if (wbf16)
            dot4_bf16((const uint16_t *)aj, in_dim, xr, in_dim, s4);
        else
            dot4((const float *)aj, in_dim, xr, in_dim, s4);
        for (int k = 0; k < 4; k++) t[j + k] = s4[k] * sc;
    }
    for (; j < rank; j++) {
        const void *aj = (const char *)as + (size_t)j * in_dim * es;
        float acc = 0.0f;
#pragma omp simd reduction(+:acc)
        for (int i = 0; i < in_dim; i++) acc += load_w(aj, i, wbf16) * xr[i];
        t[j] = acc * sc;
    }
    /* expand */
    if (b_transposed) {
        /* sequential passes over rows of B^T, eight, four then two at a time; y's row stays in L1 */
        int jj = 0;
        for (; jj + 8 <= rank; jj += 8) {
            const char *b0 = (const char *)bs + (size_t)jj * out_dim * es;
            const size_t ld = (size_t)out_dim * es;
            const float t0 = t[jj], t1 = t[jj + 1], t2 = t[jj + 2], t3 = t[jj + 3];
            const float t4 = t[jj + 4], t5 = t[jj + 5], t6 = t[jj + 6], t7 = t[jj + 7];
#pragma omp simd
            for (int o = 0; o < out_dim; o++)
                yr[o] += ((t0 * load_w(b0, o, wbf16) + t1 * load_w(b0 + ld, o, wbf16))
                          + (t2 * load_w(b0 + 2 * ld, o, wbf16) + t3 * load_w(b0 + 3 * ld, o, wbf16)))
                         + ((t4 * load_w(b0 + 4 * ld, o, wbf16) + t5 * load_w(b0 + 5 * ld, o, wbf16))
                            + (t6 * load_w(b0 + 6 * ld, o, wbf16) + t7 * load_w(b0 + 7 * ld, o, wbf16)));
        }
        for (; jj + 4 <= rank; jj += 4) {
            const float t0 = t[jj], t1 = t[jj + 1], t2 = t[jj + 2], t3 = t[jj + 3];
            const void *b0 = (const char *)bs + (size_t)jj * out_dim * es;
            const void *b1 = (const char *)b0 + (size_t)out_dim * es;
            const void *b2 = (const char *)b1 + (size_t)out_dim * es;
            const void *b3 = (const char *)b2 + (size_t)out_dim * es;
#pragma omp simd
            for (int o = 0; o < out_dim; o++)
                yr[o] += t0 * load_w(b0, o, wbf16) + t1 * load_w(b1, o, wbf16) + t2 * load_w(b2, o, wbf16)
                         + t3 * load_w(b3, o, wbf16);
        }
        for (; jj + 2 <= rank; jj += 2) {
            const float t0 = t[jj], t1 = t[jj + 1];
            const void *b0 = (const char *)bs + (size_t)jj * out_dim * es;
            const void *b1 = (const char *)b0 + (size_t)out_dim * es;
#pragma omp simd
            for (int o = 0; o < out_dim; o++) yr[o] += t0 * load_w(b0, o, wbf16) + t1 * load_w(b1, o, wbf16);
        }
        for (; jj < rank; jj++) {
            const float tj = t[jj];
            const void *bj = (const char *)bs + (size_t)jj * out_dim * es;
#pragma omp simd
            for (int o = 0; o < out_dim; o++) yr[o] += tj * load_w(bj, o, wbf16);
        }
    } else {
        for (int o = 0; o < out_dim; o++) {
            const void *bo = (const char *)bs + (size_t)o * rank * es;
            float acc = 0.0f;
#pragma omp simd reduction(+:acc)
            for (int jj = 0; jj < rank; jj++) acc += load_w(bo, jj, wbf16) * t[jj];
            yr[o] += acc;
        }
    }
}

/* Blocked LoRA segments (LORA_SEG): loraplex_lora_rows_f32 works on runs of rows that share an
 * adapter (segments), with B stored transposed and a rank that is a multiple of 8. Each thread
 * takes an even share of the rows, segment by segment, and asks for the next segment's A and B
 * (into L2) while it computes this one's: the AVX2 build all at once as a segment starts, the
 * AVX-512 build (LORA_PREFETCH_STREAM) a line of the next segment's for each line of this one's
 * it reads, so the requests stream out at the rate the data is used. Per target:
 *  - shrink: t = scale * A x for blocks of up to 4 rows against several rows of A at once (each
 *    A vector loaded once for the block's rows), into a per-call buffer of [rows, rank] floats;
 *  - expand: tiles of a few rows x a few vectors of columns, their sums held in registers
 *    through the whole rank: each y element loaded and stored once, B^T's rows read once per
 *    block of rows (from cache after the first), each element one chain y + t0 b0 + t1 b1 + ....
 * A row's sums run in the same order whatever its segment's length, its place in a block or the
 * thread count: its delta is the same, bit for bit, alone or in any batch (as row by row).
 * The ISA builds below provide lora_shrink_rows (one block of rows, every rank) and
 * lora_expand_rows (one segment's rows, every column); lora_segments drives them.
 *
 * AVX-512: 16-wide, the shrink 4 rows x 4 rows of A, the expand tiles of 4 rows x 64 columns
 * (2 x 128 and 1 x 128 for a segment's last rows). A first version (the expand 16 or 8 rows of B^T
 * held per 16-column block, the segment's rows through it with four partial sums each), measured
 * on bench/lora_ops.py's shapes over 30 layers with bfloat16 A/B on 2 Zen 5 threads: 8 adapters x
 * 100 rows 97 -> 58 ms a step against row by row, one adapter x 400 rows 37 -> 28 ms (torch's GEMMs
 * 132 and 39); decode, 8 x 4 rows 5.3-5.7 -> 4.7 ms, 32 x 1 12.0 -> 12.3-12.6 ms. On 2 Sapphire
 * Rapids threads the tiles (one chain per element, as the AVX2 build) against it: 8 x 100 rows
 * 64-69 -> 57 ms, 1 x 400 31.5 -> 28 ms, 8 x 4 6.2 -> 5.4 ms, 32 x 1 17.5-18 -> 16.6 ms; widening
 * a long segment's B^T to float32 once, to save the per-block widening, bought nothing. Streaming the next segment's
 * lines instead of asking for them all at once (a burst of some 1,300 prefetches per segment of a
 * q/k/v call, each holding one of the core's few line-fill buffers, stalled the loads behind it;
 * the kernel read 5-6 GB/s a core with the burst or without any prefetch, against 12 GB/s for a
 * plain stream), on 2 Sapphire Rapids threads, the model's calls (q/k/v, o, gate/up, down) over
 * 30 layers: 32 adapters x 1 row 19.2-19.8 -> 15.5-16.1 ms (313 MB of bfloat16 A/B: 16 -> 20
 * GB/s of the 24 a plain read gets), 8 x 4 rows 5.6 -> 4.9-5.0 ms, 8 x 100 rows and 1 x 400 unchanged.
 * AVX2 (16 vector registers): 8-wide; the shrink up to 6 rows against 2-8 rows of A (12 sums
 * held), the expand tiles of R rows x 8W columns (R x W = 8 sums held) through the whole rank,
 * one chain per output element (y + t0 b0 + t1 b1 + ...). On 2 Zen 3 threads: 8 adapters x 100
 * rows 177-219 -> 96-100 ms a step, one adapter x 400 rows 92-111 -> 46-58 ms. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LORA_SEG 1
#define LORA_PREFETCH_STREAM 1

static inline __attribute__((always_inline)) __m512 lora_ld(const void *p, int64_t i, __mmask16 mk, const int wbf16)
{
    if (mk == (__mmask16)0xFFFF) {
        if (wbf16)
            return _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
        return _mm512_loadu_ps((const float *)p + i);
    }
    if (wbf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(mk, (const float *)p + i);
}

static inline __attribute__((always_inline)) void lora_st(float *p, __mmask16 mk, __m512 v)
{
    if (mk == (__mmask16)0xFFFF)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, mk, v);
}

/* t[q * ts + j0 + c] = sc * A[j0 + c] . x_q for R rows q and c < 4 (A [rank, in_dim]). */
static inline __attribute__((always_inline)) void lora_shrink4(
    const float *const *xr, const void *a, int in_dim, int j0, float sc, float *t, int64_t ts, const int R,
    const int wbf16, const char *pf)
{
    const int es = wbf16 ? 2 : 4;
    __m512 acc[4][4];
    for (int q = 0; q < R; q++)
        for (int c = 0; c < 4; c++) acc[q][c] = _mm512_setzero_ps();
    for (int i = 0; i < in_dim; i += 16) {
        const __mmask16 mk = in_dim - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (in_dim - i)) - 1);
        __m512 av[4];
        for (int c = 0; c < 4; c++) av[c] = lora_ld(a, (int64_t)(j0 + c) * in_dim + i, mk, wbf16);
        if (pf && ((i * es) & 63) == 0)
            for (int c = 0; c < 4; c++) _mm_prefetch(pf + ((int64_t)(j0 + c) * in_dim + i) * es, _MM_HINT_T1);
        for (int q = 0; q < R; q++) {
            const __m512 xv = lora_ld(xr[q], i, mk, 0);
            for (int c = 0; c < 4; c++) acc[q][c] = _mm512_fmadd_ps(xv, av[c], acc[q][c]);
        }
    }
    for (int q = 0; q < R; q++)
        for (int c = 0; c < 4; c++) t[q * ts + j0 + c] = sc * _mm512_reduce_add_ps(acc[q][c]);
}

#define LORA_SHRINK_ROWS 4

static inline __attribute__((always_inline)) void lora_shrink_rows(
    const float *const *xr, int R, const void *a, int in_dim, int rank, float sc, float *t, int64_t ts,
    const int wbf16, const char *pf)
{
    for (int j0 = 0; j0 < rank; j0 += 4) {
        switch (R) {
        case 4: lora_shrink4(xr, a, in_dim, j0, sc, t, ts, 4, wbf16, pf); break;
        case 3: lora_shrink4(xr, a, in_dim, j0, sc, t, ts, 3, wbf16, pf); break;
        case 2: lora_shrink4(xr, a, in_dim, j0, sc, t, ts, 2, wbf16, pf); break;
        default: lora_shrink4(xr, a, in_dim, j0, sc, t, ts, 1, wbf16, pf); break;
        }
    }
}

/* y[rows[q], o:o+16W] += sum_{c < rank} t_q[c] * B^T[c, o:o+16W] for R rows q (R x W sums held;
 * mk masks the last vector's columns past out_dim): each element is one chain y + t_0 b_0 + t_1 b_1
 * + ..., so its value does not depend on the tile it falls in. pf: where the next segment's B^T
 * is, a line of it asked for per line of this one's read (NULL: none). */
static inline __attribute__((always_inline)) void lora_expand_tile(
    const void *bt, int out_dim, int o, __mmask16 mk, int rank, const float *t, int64_t ts, float *y,
    int64_t y_stride, const int64_t *rows, const int R, const int W, const int wbf16, const char *pf)
{
    const int es = wbf16 ? 2 : 4;
    __m512 acc[4][8];
    for (int q = 0; q < R; q++)
        for (int w = 0; w < W; w++)
            acc[q][w] = lora_ld(y + rows[q] * y_stride + o + 16 * w, 0, w == W - 1 ? mk : (__mmask16)0xFFFF, 0);
    for (int c = 0; c < rank; c++) {
        __m512 bv[8];
        for (int w = 0; w < W; w++)
            bv[w] = lora_ld(bt, (int64_t)c * out_dim + o + 16 * w, w == W - 1 ? mk : (__mmask16)0xFFFF, wbf16);
        if (pf)
            for (int l = 0; l < 16 * W * es; l += 64) _mm_prefetch(pf + ((int64_t)c * out_dim + o) * es + l, _MM_HINT_T1);
        for (int q = 0; q < R; q++) {
            const __m512 tv = _mm512_set1_ps(t[q * ts + c]);
            for (int w = 0; w < W; w++) acc[q][w] = _mm512_fmadd_ps(tv, bv[w], acc[q][w]);
        }
    }
    for (int q = 0; q < R; q++)
        for (int w = 0; w < W; w++)
            lora_st(y + rows[q] * y_stride + o + 16 * w, w == W - 1 ? mk : (__mmask16)0xFFFF, acc[q][w]);
}

/* One block of R rows through every column: tiles of 16W columns, then 16 at a time. */
static inline __attribute__((always_inline)) void lora_expand_block(
    const void *bt, int out_dim, int rank, const float *t, int64_t ts, float *y, int64_t y_stride,
    const int64_t *rows, const int R, const int W, const int wbf16, const char *pf)
{
    int o = 0;
    for (; o + 16 * W <= out_dim; o += 16 * W)
        lora_expand_tile(bt, out_dim, o, 0xFFFF, rank, t, ts, y, y_stride, rows, R, W, wbf16, pf);
    for (; o < out_dim; o += 16) {
        const __mmask16 mk = out_dim - o >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (out_dim - o)) - 1);
        lora_expand_tile(bt, out_dim, o, mk, rank, t, ts, y, y_stride, rows, R, 1, wbf16, pf);
    }
}

static inline __attribute__((always_inline)) void lora_expand_rows(
    const void *bt, int out_dim, int rank, const float *t, int64_t ts, float *y, int64_t y_stride,
    const int64_t *rows, int m, const int wbf16, const char *pf)
{
    int n = 0;
    for (; n + 4 <= m; n += 4)
        lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 4, 4, wbf16, n == 0 ? pf : NULL);
    switch (m - n) {
    case 3: lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 3, 4, wbf16, n == 0 ? pf : NULL); break;
    case 2: lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 2, 8, wbf16, n == 0 ? pf : NULL); break;
    case 1: lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 1, 8, wbf16, n == 0 ? pf : NULL); break;
    default: break;
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define LORA_SEG 1

/* Elements i..i+7 of a float32 or bfloat16 array as float32; n < 8 (a tail) reads n and zeros. */
static inline __attribute__((always_inline)) __m256 lora_ld8(const void *p, int64_t i, int n, const int wbf16)
{
    if (n >= 8) {
        if (wbf16)
            return _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
        return _mm256_loadu_ps((const float *)p + i);
    }
    float b[8] = {0};
    for (int k = 0; k < n; k++) b[k] = load_w(p, i + k, wbf16);
    return _mm256_loadu_ps(b);
}

static inline __attribute__((always_inline)) void lora_st8(float *p, int n, __m256 v)
{
    if (n >= 8) {
        _mm256_storeu_ps(p, v);
        return;
    }
    float b[8];
    _mm256_storeu_ps(b, v);
    for (int k = 0; k < n; k++) p[k] = b[k];
}

static inline __attribute__((always_inline)) float lora_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One 8-wide step of lora_shrink_rc: n valid columns from i. */
static inline __attribute__((always_inline)) void lora_shrink_step(
    __m256 acc[6][8], const float *const *xr, const void *a, int in_dim, int j0, int i, int n, const int R,
    const int C, const int wbf16)
{
    __m256 av[8];
    for (int c = 0; c < C; c++) av[c] = lora_ld8(a, (int64_t)(j0 + c) * in_dim + i, n, wbf16);
    for (int q = 0; q < R; q++) {
        const __m256 xv = lora_ld8(xr[q], i, n, 0);
        for (int c = 0; c < C; c++) acc[q][c] = _mm256_fmadd_ps(xv, av[c], acc[q][c]);
    }
}

/* t[q * ts + j0 + c] = sc * A[j0 + c] . x_q for R rows q and C rows of A (R * C <= 12 sums). */
static inline __attribute__((always_inline)) void lora_shrink_rc(
    const float *const *xr, const void *a, int in_dim, int j0, float sc, float *t, int64_t ts, const int R,
    const int C, const int wbf16)
{
    __m256 acc[6][8];
    for (int q = 0; q < R; q++)
        for (int c = 0; c < C; c++) acc[q][c] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= in_dim; i += 8) lora_shrink_step(acc, xr, a, in_dim, j0, i, 8, R, C, wbf16);
    if (i < in_dim) lora_shrink_step(acc, xr, a, in_dim, j0, i, in_dim - i, R, C, wbf16);
    for (int q = 0; q < R; q++)
        for (int c = 0; c < C; c++) t[q * ts + j0 + c] = sc * lora_hsum8(acc[q][c]);
}

#define LORA_SHRINK_ROWS 6

static inline __attribute__((always_inline)) void lora_shrink_rows(
    const float *const *xr, int R, const void *a, int in_dim, int rank, float sc, float *t, int64_t ts,
    const int wbf16, const char *pf)
{
    (void)pf; /* this build asks for the next segment's A and B at once (lora_segments) */
    /* rank % 8 == 0; each sum runs over the same chunks in the same order whatever R and C */
    switch (R) {
    case 6: for (int j0 = 0; j0 < rank; j0 += 2) lora_shrink_rc(xr, a, in_dim, j0, sc, t, ts, 6, 2, wbf16); break;
    case 5: for (int j0 = 0; j0 < rank; j0 += 2) lora_shrink_rc(xr, a, in_dim, j0, sc, t, ts, 5, 2, wbf16); break;
    case 4: for (int j0 = 0; j0 < rank; j0 += 2) lora_shrink_rc(xr, a, in_dim, j0, sc, t, ts, 4, 2, wbf16); break;
    case 3: for (int j0 = 0; j0 < rank; j0 += 4) lora_shrink_rc(xr, a, in_dim, j0, sc, t, ts, 3, 4, wbf16); break;
    case 2: for (int j0 = 0; j0 < rank; j0 += 4) lora_shrink_rc(xr, a, in_dim, j0, sc, t, ts, 2, 4, wbf16); break;
    default: for (int j0 = 0; j0 < rank; j0 += 8) lora_shrink_rc(xr, a, in_dim, j0, sc, t, ts, 1, 8, wbf16); break;
    }
}

/* y[rows[q], o:o+8W] += sum_{c < rank} t_q[c] * B^T[c, o:o+8W] for R rows q (R * W <= 8 sums in
 * registers; the last vector has nc valid columns): each element is one chain y + t_0 b_0 + t_1 b_1
 * + ..., so its value does not depend on the tile it falls in. */
static inline __attribute__((always_inline)) void lora_expand_tile(
    const void *bt, int out_dim, int o, int nc, int rank, const float *t, int64_t ts, float *y, int64_t y_stride,
    const int64_t *rows, const int R, const int W, const int wbf16)
{
    __m256 acc[4][8];
    for (int q = 0; q < R; q++)
        for (int w = 0; w < W; w++) acc[q][w] = lora_ld8(y + rows[q] * y_stride + o + 8 * w, 0, w == W - 1 ? nc : 8, 0);
    for (int c = 0; c < rank; c++) {
        __m256 bv[8];
        for (int w = 0; w < W; w++) bv[w] = lora_ld8(bt, (int64_t)c * out_dim + o + 8 * w, w == W - 1 ? nc : 8, wbf16);
        for (int q = 0; q < R; q++) {
            const __m256 tv = _mm256_set1_ps(t[q * ts + c]);
            for (int w = 0; w < W; w++) acc[q][w] = _mm256_fmadd_ps(tv, bv[w], acc[q][w]);
        }
    }
    for (int q = 0; q < R; q++)
        for (int w = 0; w < W; w++) lora_st8(y + rows[q] * y_stride + o + 8 * w, w == W - 1 ? nc : 8, acc[q][w]);
}

/* One block of R rows through every column: tiles of 8W columns, then 8 at a time. */
static inline __attribute__((always_inline)) void lora_expand_block(
    const void *bt, int out_dim, int rank, const float *t, int64_t ts, float *y, int64_t y_stride,
    const int64_t *rows, const int R, const int W, const int wbf16)
{
    int o = 0;
    for (; o + 8 * W <= out_dim; o += 8 * W) lora_expand_tile(bt, out_dim, o, 8, rank, t, ts, y, y_stride, rows, R, W, wbf16);
    for (; o + 8 <= out_dim; o += 8) lora_expand_tile(bt, out_dim, o, 8, rank, t, ts, y, y_stride, rows, R, 1, wbf16);
    if (o < out_dim) lora_expand_tile(bt, out_dim, o, out_dim - o, rank, t, ts, y, y_stride, rows, R, 1, wbf16);
}

static inline __attribute__((always_inline)) void lora_expand_rows(
    const void *bt, int out_dim, int rank, const float *t, int64_t ts, float *y, int64_t y_stride,
    const int64_t *rows, int m, const int wbf16, const char *pf)
{
    (void)pf;
    int n = 0;
    for (; n + 4 <= m; n += 4) lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 4, 2, wbf16);
    switch (m - n) {
    case 3: lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 3, 2, wbf16); break;
    case 2: lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 2, 4, wbf16); break;
    case 1: lora_expand_block(bt, out_dim, rank, t + n * ts, ts, y, y_stride, rows + n, 1, 8, wbf16); break;
    default: break;
    }
}
#endif

#ifdef LORA_SEG
static inline __attribute__((always_inline)) void lora_segments(
    const float *x, int64_t x_stride, float *y, int64_t y_stride, int num_targets, const int64_t *y_cols,
    const int64_t *out_dims, const int64_t *a_ptrs, const int64_t *b_ptrs, const int64_t *scale_ptrs,
    const int64_t *rows, const int64_t *row_slots, int num_rows, int in_dim, int rank, float *t, const int wbf16)
{
    const size_t es = wbf16 ? 2 : 4;
    const int64_t ts = rank;
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    /* An even share of the rows, segment by segment: per target, its rows shrunk in blocks of
     * LORA_SHRINK_ROWS and expanded through B, while the next segment's A and B are asked for. */
    const int r0 = (int)((int64_t)num_rows * tid / nth), r1 = (int)((int64_t)num_rows * (tid + 1) / nth);
    for (int n = r0; n < r1;) {
        const int64_t s = row_slots[n];
        int e = n + 1;
        while (e < r1 && row_slots[e] == s) e++;
#ifndef LORA_PREFETCH_STREAM
        if (e < r1)
            for (int p = 0; p < num_targets; p++) {
                const size_t abytes = (size_t)rank * in_dim * es, bbytes = (size_t)rank * (size_t)out_dims[p] * es;
                const char *an = (const char *)(intptr_t)a_ptrs[p] + (size_t)row_slots[e] * abytes;
                const char *bn = (const char *)(intptr_t)b_ptrs[p] + (size_t)row_slots[e] * bbytes;
                for (size_t c = 0; c < abytes; c += 64) __builtin_prefetch(an + c, 0, 2);
                for (size_t c = 0; c < bbytes; c += 64) __builtin_prefetch(bn + c, 0, 2);
            }
#endif
        for (int p = 0; p < num_targets; p++) {
            const int out_dim = (int)out_dims[p];
            const void *as = (const char *)(intptr_t)a_ptrs[p] + (size_t)s * rank * in_dim * es;
            const void *bs = (const char *)(intptr_t)b_ptrs[p] + (size_t)s * out_dim * rank * es;
            const float sc = ((const float *)(intptr_t)scale_ptrs[p])[s];
            const char *pa = NULL, *pb = NULL; /* the next segment's A and B (LORA_PREFETCH_STREAM) */
            if (e < r1) {
                pa = (const char *)(intptr_t)a_ptrs[p] + (size_t)row_slots[e] * rank * in_dim * es;
                pb = (const char *)(intptr_t)b_ptrs[p] + (size_t)row_slots[e] * out_dim * rank * es;
            }
            for (int q = n; q < e; q += LORA_SHRINK_ROWS) {
                const int R = e - q < LORA_SHRINK_ROWS ? e - q : LORA_SHRINK_ROWS;
                const float *xr[LORA_SHRINK_ROWS];
                for (int u = 0; u < R; u++) xr[u] = x + rows[q + u] * x_stride;
                lora_shrink_rows(xr, R, as, in_dim, rank, sc, t + q * ts, ts, wbf16, q == n ? pa : NULL);
            }
            lora_expand_rows(bs, out_dim, rank, t + n * ts, ts, y + y_cols[p], y_stride, rows + n, e - n, wbf16, pb);
        }
        n = e;
    }
}
#endif

int loraplex_lora_rows_blocked(void)
{
    /* 1 where loraplex_lora_rows_f32 takes long segments in blocks (this build's LORA_SEG): it
     * then beats torch's GEMMs on prefill segments too (engine.lora.ops.native_max_tokens). */
#ifdef LORA_SEG
    return 1;
#else
    return 0;
#endif
}

int loraplex_lora_rows_f32(
    const float *x, int64_t x_stride, float *y, int64_t y_stride,
    int num_targets, const int64_t *y_cols, const int64_t *out_dims,
    const int64_t *a_ptrs, const int64_t *b_ptrs, const int64_t *scale_ptrs, int b_transposed,
    const int64_t *rows, const int64_t *row_slots, int num_rows, int in_dim, int rank, int weights_bf16,
    int num_threads)
{
    /* Target p (projections that read the same x, e.g. q/k/v): a_ptrs[p] -> A [slots, rank,
     * in_dim] contiguous; b_ptrs[p] -> B [slots, out_dim, rank] contiguous, or with
     * b_transposed its transpose [slots, rank, out_dim] contiguous (the expand is then plain
     * vector FMAs along out_dim, no horizontal sums); A and B float32, or bfloat16 with
     * weights_bf16 (half the bytes to stream: 32 distinct adapters on every projection are
     * more bytes than the base model's matrices); scale_ptrs[p] -> [slots] float32; its output
     * is columns [y_cols[p], y_cols[p] + out_dims[p]) of y. One parallel region for all
     * targets; rows sorted by slot, so a thread's consecutive rows of one adapter reuse its
     * weights from cache. Returns -1 for a rank past MAX_RANK, 1 when out of memory. */
    if (rank > MAX_RANK || num_targets <= 0) return -1;
#ifdef LORA_SEG
    if (b_transposed && rank % 8 == 0) {
        float *t = malloc(sizeof(float) * (size_t)num_rows * (size_t)rank);
        if (!t) return 1;
#pragma omp parallel num_threads(num_threads)
        {
            if (weights_bf16)
                lora_segments(x, x_stride, y, y_stride, num_targets, y_cols, out_dims, a_ptrs, b_ptrs, scale_ptrs,
                              rows, row_slots, num_rows, in_dim, rank, t, 1);
            else
                lora_segments(x, x_stride, y, y_stride, num_targets, y_cols, out_dims, a_ptrs, b_ptrs, scale_ptrs,
                              rows, row_slots, num_rows, in_dim, rank, t, 0);
        }
        free(t);
        return 0;
    }
#endif
    const size_t es = weights_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < num_rows; n++) {
        const int64_t s = row_slots[n];
        if (n + 1 < num_rows && row_slots[n + 1] != s) {
            /* The next row reads another adapter: ask for its A/B now (into L2), so their
             * scattered arrays stream in while this row computes instead of after it. */
            const int64_t sn = row_slots[n + 1];
            for (int p = 0; p < num_targets; p++) {
                const size_t bytes = (size_t)rank * in_dim * es, bbytes = (size_t)rank * (size_t)out_dims[p] * es;
                const char *an = (const char *)(intptr_t)a_ptrs[p] + (size_t)sn * bytes;
                const char *bn = (const char *)(intptr_t)b_ptrs[p] + (size_t)sn * bbytes;
                for (size_t c = 0; c < bytes; c += 64) __builtin_prefetch(an + c, 0, 2);
                for (size_t c = 0; c < bbytes; c += 64) __builtin_prefetch(bn + c, 0, 2);
            }
        }
        const float *xr = x + rows[n] * x_stride;
        for (int p = 0; p < num_targets; p++) {
            const int out_dim = (int)out_dims[p];
            const void *as = (const char *)(intptr_t)a_ptrs[p] + (size_t)s * rank * in_dim * es;
            const void *bs = (const char *)(intptr_t)b_ptrs[p] + (size_t)s * out_dim * rank * es;
            const float sc = ((const float *)(intptr_t)scale_ptrs[p])[s];
            float *yr = y + rows[n] * y_stride + y_cols[p];
            if (weights_bf16)
                lora_row(xr, yr, as, bs, sc, b_transposed, in_dim, out_dim, rank, 1);
            else
                lora_row(xr, yr, as, bs, sc, b_transposed, in_dim, out_dim, rank, 0);
        }
    }
    return 0;
}

int loraplex_gemv_f32(
    const float *x, const float *w, const float *bias, float *y, int out_dim, int in_dim, int num_threads)
{
    /* y = W x (+ bias) for one row x: W [out_dim, in_dim] contiguous. A single-sequence
     * decode step is this, once per projection: pure weight streaming, four output rows
     * per pass (independent accumulators, x reread from L1), rows split over threads. */
    const int blocks = (out_dim + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int blk = 0; blk < blocks; blk++) {
        const int o = blk * 4;
        if (o + 4 <= out_dim) {
            float s4[4];
            dot4(w + (int64_t)o * in_dim, in_dim, x, in_dim, s4);
            for (int k = 0; k < 4; k++) y[o + k] = s4[k] + (bias ? bias[o + k] : 0.0f);
        } else {
            for (int r = o; r < out_dim; r++) {
                const float *wr = w + (int64_t)r * in_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+:acc)
                for (int i = 0; i < in_dim; i++) acc += wr[i] * x[i];
                y[r] = acc + (bias ? bias[r] : 0.0f);
            }
        }
    }
    return 0;
}

/* float32 rounded to the nearest bfloat16 (ties to even), kept as a float32. */
static inline float round_bf16(float x)
{
    union { uint32_t u; float f; } c = { .f = x };
    c.u = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) & 0xffff0000u;
    return c.f;
}

int loraplex_gemv_bf16(
    const float *x, const uint16_t *w, const float *bias, float *y, int out_dim, int in_dim, int num_threads)
{
    /* loraplex_gemv_f32 with W [out_dim, in_dim] in bfloat16: x rounded to bfloat16 first,
     * each float32 sum rounded to bfloat16 before the bias. */
    float *xr = malloc(sizeof(float) * (size_t)in_dim);
    if (!xr) return 1;
    for (int i = 0; i < in_dim; i++) xr[i] = round_bf16(x[i]);
    const int blocks = (out_dim + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int blk = 0; blk < blocks; blk++) {
        const int o = blk * 4;
        if (o + 4 <= out_dim) {
            float s4[4];
            dot4_bf16(w + (int64_t)o * in_dim, in_dim, xr, in_dim, s4);
            for (int k = 0; k < 4; k++) y[o + k] = round_bf16(s4[k]) + (bias ? bias[o + k] : 0.0f);
        } else {
            for (int r = o; r < out_dim; r++) {
                const uint16_t *wr = w + (int64_t)r * in_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+:acc)
                for (int i = 0; i < in_dim; i++) acc += bf16_to_f32(wr[i]) * xr[i];
                y[r] = round_bf16(acc) + (bias ? bias[r] : 0.0f);
            }
        }
    }
    free(xr);
    return 0;
}

/* One row of add_rms_norm: ``delta_bf16``/``out_bf16`` are constants at each call site, so each
 * variant compiles to its own vector loop; the float32 arithmetic is the same in all four, so a
 * bfloat16 output is exactly the float32 one rounded (as a bfloat16 matmul rounds its input). */
static inline __attribute__((always_inline)) void add_rms_norm_row(
    float *hr, const void *delta, void *out, const float *weight, float eps, int dim,
    const int delta_bf16, const int out_bf16)
{
    if (delta != NULL) {
#pragma omp simd
        for (int i = 0; i < dim; i++)
            hr[i] += delta_bf16 ? bf16_to_f32(((const uint16_t *)delta)[i]) : ((const float *)delta)[i];
    }
    /* the sum of squares in its own loop, the same in every variant: the same summation order */
    float ss = 0.0f;
#pragma omp simd reduction(+:ss)
    for (int i = 0; i < dim; i++) ss += hr[i] * hr[i];
    const float inv = 1.0f / __builtin_sqrtf(ss / (float)dim + eps);
    if (out_bf16) {
#pragma omp simd
        for (int i = 0; i < dim; i++) ((uint16_t *)out)[i] = f32_to_bf16(hr[i] * inv * weight[i]);
    } else {
#pragma omp simd
        for (int i = 0; i < dim; i++) ((float *)out)[i] = hr[i] * inv * weight[i];
    }
}

int loraplex_add_rms_norm_f32(
    float *h, int64_t h_stride, const void *delta, int64_t delta_stride, int delta_bf16,
    void *out, int64_t out_stride, int out_bf16, const float *weight, float eps,
    int rows, int dim, int num_threads)
{
    /* h += delta (when delta is not NULL), then out = h / rms(h) * weight, per row, in float32;
     * delta (read) and out (written) float32 or bfloat16; strides count elements. */
    const int64_t de = delta_bf16 ? 2 : 4, oe = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)rows * dim >= PARALLEL_MIN_ELEMS)
    for (int t = 0; t < rows; t++) {
        float *hr = h + (int64_t)t * h_stride;
        const void *dr = delta != NULL ? (const char *)delta + t * delta_stride * de : NULL;
        void *orow = (char *)out + t * out_stride * oe;
        if (delta_bf16 && out_bf16) add_rms_norm_row(hr, dr, orow, weight, eps, dim, 1, 1);
        else if (delta_bf16) add_rms_norm_row(hr, dr, orow, weight, eps, dim, 1, 0);
        else if (out_bf16) add_rms_norm_row(hr, dr, orow, weight, eps, dim, 0, 1);
        else add_rms_norm_row(hr, dr, orow, weight, eps, dim, 0, 0);
    }
    return 0;
}

/* silu(g) * u in float32 (silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) so no exponent overflows). */
static inline __attribute__((always_inline)) float silu_mul1(float x, float u)
{
    const float e = exp_nonpos(-__builtin_fabsf(x));
    const float num = x >= 0.0f ? 1.0f : e;
    return x * (num / (1.0f + e)) * u;
}

int loraplex_silu_mul_f32(
    const void *gate_up, int64_t gu_stride, int gu_bf16, void *out, int64_t out_stride, int out_bf16,
    int rows, int inter, int num_threads)
{
    /* out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i] in float32; gate_up (read) and out
     * (written) float32 or bfloat16, a bfloat16 out being the float32 result rounded; strides
     * count elements. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)rows * inter >= PARALLEL_MIN_ELEMS)
    for (int t = 0; t < rows; t++) {
#ifdef __AVX512F__
        const char *g = (const char *)gate_up + (int64_t)t * gu_stride * (gu_bf16 ? 2 : 4);
        const char *u = g + (int64_t)inter * (gu_bf16 ? 2 : 4);
        char *o = (char *)out + (int64_t)t * out_stride * (out_bf16 ? 2 : 4);
        for (int i = 0; i < inter; i += 16) {
            const __mmask16 k = inter - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (inter - i)) - 1u);
            __m512 gv, uv;
            if (gu_bf16) {
                gv = bf16x16_to_f32(_mm256_maskz_loadu_epi16(k, g + 2 * i));
                uv = bf16x16_to_f32(_mm256_maskz_loadu_epi16(k, u + 2 * i));
            } else {
                gv = _mm512_maskz_loadu_ps(k, g + 4 * i);
                uv = _mm512_maskz_loadu_ps(k, u + 4 * i);
            }
            const __m512 y = silu_mul16(gv, uv);
            if (out_bf16) _mm256_mask_storeu_epi16(o + 2 * i, k, f32x16_to_bf16(y));
            else _mm512_mask_storeu_ps(o + 4 * i, k, y);
        }
        continue;
#endif
        if (gu_bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + (int64_t)t * gu_stride, *u = g + inter;
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + (int64_t)t * out_stride;
#pragma omp simd
                for (int i = 0; i < inter; i++) o[i] = f32_to_bf16(silu_mul1(bf16_to_f32(g[i]), bf16_to_f32(u[i])));
            } else {
                float *o = (float *)out + (int64_t)t * out_stride;
#pragma omp simd
                for (int i = 0; i < inter; i++) o[i] = silu_mul1(bf16_to_f32(g[i]), bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)gate_up + (int64_t)t * gu_stride, *u = g + inter;
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + (int64_t)t * out_stride;
#pragma omp simd
                for (int i = 0; i < inter; i++) o[i] = f32_to_bf16(silu_mul1(g[i], u[i]));
            } else {
                float *o = (float *)out + (int64_t)t * out_stride;
#pragma omp simd
                for (int i = 0; i < inter; i++) o[i] = silu_mul1(g[i], u[i]);
            }
        }
    }
    return 0;
}

int loraplex_rope_store_f32(
    const void *qkv, int64_t qkv_stride, int qkv_bf16, const float *bias,
    const float *cos, const float *sin, int64_t cs_row_stride, int64_t cs_head_stride, const float *head_scale,
    float *q_out, int64_t q_stride,
    void *k_pool, void *v_pool, int kv_bf16, int64_t pool_slots, const int64_t *slots,
    int rows, int heads, int kv_heads, int head_dim, int num_threads)
{
    /* Per row t of a fused q|k|v matmul output (float32 or bfloat16; strides count elements):
     * widen, add ``bias`` [(heads + 2 kv_heads) * head_dim] (or none), rotate the q and k heads
     * (x * cos + rotate(x) * sin with rotate(x) = [x2, x1]: rotate_half's sign is folded into
     * sin; a table head stride of 0 broadcasts one row over the heads; ``head_scale`` [heads +
     * kv_heads], or none, multiplies each head's cos and sin: one [T, head_dim] table for all the
     * heads, where tables with the scale folded in per head read 12 x the bytes in every layer,
     * 20 MB for a 3200-token step), write q to ``q_out``
     * (float32) and k and v to the pools ``[kv_heads, pool_slots, head_dim]`` at slot
     * ``slots[t]`` (float32, or rounded to the nearest bfloat16, ties to even). */
    const int half = head_dim / 2;
    if (head_dim > MAX_HEAD_DIM || 2 * half != head_dim) return -1;
    const int all = heads + 2 * kv_heads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)rows * all * head_dim >= PARALLEL_MIN_ELEMS)
    for (int t = 0; t < rows; t++) {
        const int64_t row = (int64_t)t * qkv_stride;
        for (int hh = 0; hh < all; hh++) {
            const int64_t col = (int64_t)hh * head_dim;
            float x[MAX_HEAD_DIM], y[MAX_HEAD_DIM];
            if (qkv_bf16) {
                const uint16_t *src = (const uint16_t *)qkv + row + col;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) x[i] = bf16_to_f32(src[i]);
            } else {
                const float *src = (const float *)qkv + row + col;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) x[i] = src[i];
            }
            if (bias != NULL) {
#pragma omp simd
                for (int i = 0; i < head_dim; i++) x[i] += bias[col + i];
            }
            const float *res = x;
            if (hh < heads + kv_heads) {  /* a q or k head: rotate */
                const float *c = cos + (int64_t)t * cs_row_stride + (int64_t)hh * cs_head_stride;
                const float *sn = sin + (int64_t)t * cs_row_stride + (int64_t)hh * cs_head_stride;
                const float hs = head_scale != NULL ? head_scale[hh] : 1.0f;
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    y[i] = x[i] * (c[i] * hs) + x[half + i] * (sn[i] * hs);
                    y[half + i] = x[half + i] * (c[half + i] * hs) + x[i] * (sn[half + i] * hs);
                }
                res = y;
            }
            if (hh < heads) {
                float *dst = q_out + (int64_t)t * q_stride + col;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) dst[i] = res[i];
                continue;
            }
            const int is_v = hh >= heads + kv_heads;
            const int64_t kh = hh - heads - (is_v ? kv_heads : 0);
            const int64_t at = (kh * pool_slots + slots[t]) * head_dim;
            void *pool = is_v ? v_pool : k_pool;
            if (kv_bf16) {
                uint16_t *dst = (uint16_t *)pool + at;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) dst[i] = f32_to_bf16(res[i]);
            } else {
                float *dst = (float *)pool + at;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) dst[i] = res[i];
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * 5. loraplex_q8_matmul_f32: y = x W^T (+ bias) with W in 8 bits (llama.cpp's Q8_0 idea).
 *
 * W [n, k] is int8 with one float32 scale per block of 32 consecutive inputs of an output row:
 * w[o, i] ~= d[o, i / 32] * q[o, i]. Each row of x is quantized the same way on the fly
 * (absmax / 127 per block of 32, rounded to nearest even), so each block's product is an exact
 * integer dot product scaled by d_w[o, b] * d_x[r, b] into a float32 sum.
 *
 * The weights are packed once at load (engine.quant.pack_q8) into tiles of 16 output rows:
 * per tile and block, 8 groups of 4 consecutive inputs, each group 16 rows x 4 int8 (64 bytes,
 * one 512-bit load); then the tile's 16 scales per block (float32) and 16 compensations
 * (int32, 128 * sum of the block's q). With AVX512-VNNI, one _mm512_dpbusd_epi32 multiplies a
 * group by 4 activations broadcast to all lanes: dpbusd takes unsigned x signed bytes, so the
 * activations are stored + 128 and the compensation subtracted per block. Two tiles go through
 * together (q8_tile2: 6 rows x 2 tiles of int32 sums and float32 accumulators in 24 registers,
 * each broadcast activation group feeding both tiles), and while a pair's row blocks run, the
 * next pair's weights are prefetched. loraplex_q8_swiglu_f32 pairs each gate tile with its up
 * tile instead and writes silu(gate) * up. Without AVX512-VNNI the same layout runs one tile at a
 * time through AVX2's _mm256_maddubs_epi16, and without AVX2 through plain C loops.
 * Rows n and inputs k need not be multiples of 16 / 32: the pack pads with zeros.
 * --------------------------------------------------------------------------------------------- */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define Q8_VNNI 1
#endif

#define Q8_BLOCK 32
#define Q8_TILE 16
#define Q8_SPLIT_ROWS 128
#define Q8_RCHUNK 48

/* One row of x to blocks of 32: xq = round(x / d) + 128 (uint8), xd = d = absmax / 127. */
#ifdef Q8_VNNI
static void q8_quantize_row(const float *x, int k, int nb, uint8_t *xq, float *xd)
{
    const __m512i off = _mm512_set1_epi32(128);
    for (int b = 0; b < nb; b++) {
        const int i0 = b * Q8_BLOCK;
        const int len = k - i0 < Q8_BLOCK ? k - i0 : Q8_BLOCK;
        const __mmask16 m0 = len >= 16 ? 0xFFFF : (__mmask16)((1u << len) - 1u);
        const __mmask16 m1 = len >= 32 ? 0xFFFF : len <= 16 ? 0 : (__mmask16)((1u << (len - 16)) - 1u);
        const __m512 a = _mm512_maskz_loadu_ps(m0, x + i0), c = _mm512_maskz_loadu_ps(m1, x + i0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        xd[b] = d;
        /* cvtps rounds to nearest even (the default rounding, as rintf) */
        const __m512 vid = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(xq + i0), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, vid)), off)));
        _mm_storeu_si128((__m128i *)(xq + i0 + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(c, vid)), off)));
    }
}
#else
static void q8_quantize_row(const float *x, int k, int nb, uint8_t *xq, float *xd)
{
    for (int b = 0; b < nb; b++) {
        const int i0 = b * Q8_BLOCK;
        const int len = k - i0 < Q8_BLOCK ? k - i0 : Q8_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < len; i++) {
            const float a = x[i0 + i] < 0 ? -x[i0 + i] : x[i0 + i];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        xd[b] = d;
        for (int i = 0; i < Q8_BLOCK; i++)
            xq[i0 + i] = (uint8_t)((int)__builtin_rintf(i < len ? x[i0 + i] * id : 0.0f) + 128);
    }
}

#endif

#ifdef Q8_VNNI
/* ``mr`` rows of x against one tile of 16 output rows; always inlined with a constant ``mr``. */
static inline __attribute__((always_inline)) void q8_tile(
    const int8_t *wt, const float *wd, const int32_t *wc, const uint8_t *xq, int64_t xq_stride,
    const float *xd, int nb, const int mr, float *y, int64_t y_stride, const float *bias, int cols)
{
    __m512 acc[8];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i ia[8];
        for (int r = 0; r < mr; r++) ia[r] = _mm512_setzero_si512();
        const int8_t *wb = wt + (int64_t)b * Q8_BLOCK * Q8_TILE;
        for (int g = 0; g < Q8_BLOCK / 4; g++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wb + g * 64));
            for (int r = 0; r < mr; r++) {
                int32_t a4;
                memcpy(&a4, xq + r * xq_stride + b * Q8_BLOCK + g * 4, 4);
                ia[r] = _mm512_dpbusd_epi32(ia[r], _mm512_set1_epi32(a4), w);
            }
        }
        const __m512i comp = _mm512_loadu_si512((const void *)(wc + b * Q8_TILE));
        const __m512 dw = _mm512_loadu_ps(wd + b * Q8_TILE);
        for (int r = 0; r < mr; r++) {
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ia[r], comp)), s, acc[r]);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(y + r * y_stride, mask, _mm512_add_ps(acc[r], bv));
}

#define Q8_ROWS2 6
/* ``mr`` rows of x against two tiles (adjacent ones, or with ``swiglu`` a gate tile and its up
 * tile): each broadcast activation group feeds both tiles' products. The same per-row arithmetic
 * as q8_tile, in the same order. */
static inline __attribute__((always_inline)) void q8_tile2(
    const int8_t *w0, const float *d0, const int32_t *c0, const int8_t *w1, const float *d1, const int32_t *c1,
    const uint8_t *xq, int64_t xq_stride, const float *xd, int nb, const int mr, float *y, int64_t y_stride,
    const float *bias, int cols1, int swiglu, const char *pf0, const char *pf1, int pf_lines)
{
    __m512 acc0[Q8_ROWS2], acc1[Q8_ROWS2];
    for (int r = 0; r < mr; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int l = 0; l < pf_lines; l++) {
            _mm_prefetch(pf0 + ((int64_t)b * pf_lines + l) * 64, _MM_HINT_T0);
            _mm_prefetch(pf1 + ((int64_t)b * pf_lines + l) * 64, _MM_HINT_T0);
        }
        __m512i i0[Q8_ROWS2], i1[Q8_ROWS2];
        for (int r = 0; r < mr; r++) i0[r] = i1[r] = _mm512_setzero_si512();
        const int8_t *wa = w0 + (int64_t)b * Q8_BLOCK * Q8_TILE, *wb = w1 + (int64_t)b * Q8_BLOCK * Q8_TILE;
        for (int g = 0; g < Q8_BLOCK / 4; g++) {
            const __m512i va = _mm512_loadu_si512((const void *)(wa + g * 64));
            const __m512i vb = _mm512_loadu_si512((const void *)(wb + g * 64));
            for (int r = 0; r < mr; r++) {
                int32_t a4;
                memcpy(&a4, xq + r * xq_stride + b * Q8_BLOCK + g * 4, 4);
                const __m512i xa = _mm512_set1_epi32(a4);
                i0[r] = _mm512_dpbusd_epi32(i0[r], xa, va);
                i1[r] = _mm512_dpbusd_epi32(i1[r], xa, vb);
            }
        }
        const __m512i ca = _mm512_loadu_si512((const void *)(c0 + b * Q8_TILE));
        const __m512i cb = _mm512_loadu_si512((const void *)(c1 + b * Q8_TILE));
        const __m512 da = _mm512_loadu_ps(d0 + b * Q8_TILE), db = _mm512_loadu_ps(d1 + b * Q8_TILE);
        for (int r = 0; r < mr; r++) {
            const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
            acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i0[r], ca)), _mm512_mul_ps(da, dx), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i1[r], cb)), _mm512_mul_ps(db, dx), acc1[r]);
        }
    }
    if (swiglu) {  /* the tiles are a gate tile and its up tile: y gets silu(gate) * up */
        for (int r = 0; r < mr; r++) {
            _mm512_storeu_ps(y + r * y_stride, silu_mul16(acc0[r], acc1[r]));
        }
        return;
    }
    const __mmask16 mask = (__mmask16)((1u << cols1) - 1u);
    const __m512 ba = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 bb = bias ? _mm512_maskz_loadu_ps(mask, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * y_stride, _mm512_add_ps(acc0[r], ba));
        _mm512_mask_storeu_ps(y + r * y_stride + 16, mask, _mm512_add_ps(acc1[r], bb));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2 (no VNNI): _mm256_maddubs_epi16 multiplies unsigned x signed bytes into saturating int16
 * pair sums, so as llama.cpp does the activation's sign moves onto the weight (|x| <= 127 keeps
 * each pair sum below 2^15) and no compensation is needed. Rows one at a time (16 registers). */
static inline void q8_tile(
    const int8_t *wt, const float *wd, const int32_t *wc, const uint8_t *xq, int64_t xq_stride,
    const float *xd, int nb, const int mr, float *y, int64_t y_stride, const float *bias, int cols)
{
    (void)wc;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < mr; r++) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m256i ia0 = _mm256_setzero_si256(), ia1 = _mm256_setzero_si256();
            const int8_t *wb = wt + (int64_t)b * Q8_BLOCK * Q8_TILE;
            for (int g = 0; g < Q8_BLOCK / 4; g++) {
                int32_t a4;
                memcpy(&a4, xq + r * xq_stride + b * Q8_BLOCK + g * 4, 4);
                const __m256i a = _mm256_set1_epi32(a4 ^ (int32_t)0x80808080u);  /* back to signed */
                const __m256i ax = _mm256_abs_epi8(a);
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + g * 64));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + g * 64 + 32));
                ia0 = _mm256_add_epi32(ia0, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, a)), ones));
                ia1 = _mm256_add_epi32(ia1, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, a)), ones));
            }
            const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia0), _mm256_mul_ps(_mm256_loadu_ps(wd + b * Q8_TILE), dx), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia1), _mm256_mul_ps(_mm256_loadu_ps(wd + b * Q8_TILE + 8), dx),
                                   acc1);
        }
        float out[Q8_TILE];
        _mm256_storeu_ps(out, acc0);
        _mm256_storeu_ps(out + 8, acc1);
        for (int j = 0; j < cols; j++) y[r * y_stride + j] = out[j] + (bias ? bias[j] : 0.0f);
    }
}
#else
static inline void q8_tile(
    const int8_t *wt, const float *wd, const int32_t *wc, const uint8_t *xq, int64_t xq_stride,
    const float *xd, int nb, const int mr, float *y, int64_t y_stride, const float *bias, int cols)
{
    for (int r = 0; r < mr; r++) {
        float acc[Q8_TILE] = {0};
        for (int b = 0; b < nb; b++) {
            int32_t ia[Q8_TILE] = {0};
            const int8_t *wb = wt + (int64_t)b * Q8_BLOCK * Q8_TILE;
            const uint8_t *xb = xq + r * xq_stride + b * Q8_BLOCK;
            for (int g = 0; g < Q8_BLOCK / 4; g++)
                for (int j = 0; j < Q8_TILE; j++)
                    for (int t = 0; t < 4; t++) ia[j] += (int32_t)xb[g * 4 + t] * wb[g * 64 + j * 4 + t];
            const float dx = xd[r * nb + b];
            for (int j = 0; j < Q8_TILE; j++)
                acc[j] += (float)(ia[j] - wc[b * Q8_TILE + j]) * (wd[b * Q8_TILE + j] * dx);
        }
        for (int j = 0; j < cols; j++) y[r * y_stride + j] = acc[j] + (bias ? bias[j] : 0.0f);
    }
}
#endif

/* The driver of both entry points below: y = x W^T (+ bias), or with ``swiglu`` (W a fused
 * gate|up weight, n a multiple of 32, no bias) y [m, n / 2] = silu(gate) * up. */
static int q8_matmul(
    const float *x, int64_t x_stride, int m, int k, const int8_t *wq, const float *wd, const int32_t *wc,
    int n, const float *bias, float *y, int64_t y_stride, int swiglu, int num_threads)
{
    const int nb = (k + Q8_BLOCK - 1) / Q8_BLOCK;
    const int tiles = (n + Q8_TILE - 1) / Q8_TILE;
    const int64_t kp = (int64_t)nb * Q8_BLOCK;
    const int64_t tile_q = (int64_t)nb * Q8_BLOCK * Q8_TILE, tile_s = (int64_t)nb * Q8_TILE;
    uint8_t *xq = malloc((size_t)m * (size_t)kp);
    float *xd = malloc(sizeof(float) * (size_t)m * (size_t)nb);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return 1;
    }
    const int threads = (int64_t)m * n * k < PARALLEL_MIN_ELEMS ? 1 : num_threads;
#ifdef Q8_VNNI
    /* Work items (row chunk, tile pair). A few rows: one chunk, split between threads by pairs
     * (each thread streams its part of W once). From Q8_SPLIT_ROWS rows per thread on, chunks of
     * about Q8_RCHUNK rows, each thread taking whole chunks: a chunk's activations stay in L1/L2
     * while the weights pass (Zen 4, 2 threads, 3200 x 576 x 3072: 25.8 ms by pairs over all
     * rows with single tiles, 21.1 by chunks with pairs). */
    const int pairs = swiglu ? tiles / 2 : (tiles + 1) / 2;
    const int per = (m + threads - 1) / threads;
    int rchunk = m;
    if (m >= Q8_SPLIT_ROWS * threads) {
        const int cpt = (per + Q8_RCHUNK - 1) / Q8_RCHUNK;
        rchunk = (per + cpt - 1) / cpt;
    }
    const int rchunks = (m + rchunk - 1) / rchunk;
#else
    (void)swiglu;
#endif
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) q8_quantize_row(x + r * x_stride, k, nb, xq + r * kp, xd + (int64_t)r * nb);
#ifdef Q8_VNNI
#pragma omp for schedule(static)
        for (int it = 0; it < rchunks * pairs; it++) {
            const int p = it % pairs, r0 = it / pairs * rchunk, r1 = r0 + rchunk < m ? r0 + rchunk : m;
            const int t = swiglu ? p : 2 * p, o = t * Q8_TILE;
            const int t1 = swiglu ? p + pairs : t + 1;
            const float *bt = bias ? bias + o : NULL;
            /* row blocks of at most Q8_ROWS2, as even as they go */
            const int rows = r1 - r0, blocks = (rows + Q8_ROWS2 - 1) / Q8_ROWS2;
            /* While the row blocks run, the next pair's weights are fetched: each block asks for
             * its share of them (from memory a pair's first row block would wait on its weights:
             * a 32-row decode step streamed them at 7 GB/s). */
            const int tn = swiglu ? t + 1 : t + 2, tn1 = swiglu ? t1 + 1 : t1 + 2;
            const int pf_lines = it + 1 < rchunks * pairs && it % pairs + 1 < pairs
                                 ? (int)((tile_q / 64 + (int64_t)blocks * nb - 1) / ((int64_t)blocks * nb)) : 0;
            for (int i = 0, r = r0; i < blocks; i++) {
                const int mr = rows / blocks + (i < rows % blocks);
                const char *pf0 = (const char *)(wq + tn * tile_q) + (int64_t)i * nb * pf_lines * 64;
                const char *pf1 = (const char *)(wq + (tn1 < tiles ? tn1 : tn) * tile_q) + (int64_t)i * nb * pf_lines * 64;
                if (t1 < tiles) {
                    const int cols1 = n - t1 * Q8_TILE < Q8_TILE ? n - t1 * Q8_TILE : Q8_TILE;
                    switch (mr) {
#define Q8_PAIR(R) case R: q8_tile2(wq + t * tile_q, wd + t * tile_s, wc + t * tile_s, wq + t1 * tile_q, \
                                    wd + t1 * tile_s, wc + t1 * tile_s, xq + r * kp, kp, xd + (int64_t)r * nb, nb, \
                                    R, y + r * y_stride + o, y_stride, bt, cols1, swiglu, pf0, pf1, pf_lines); break;
                    Q8_PAIR(1) Q8_PAIR(2) Q8_PAIR(3) Q8_PAIR(4) Q8_PAIR(5) Q8_PAIR(6)
#undef Q8_PAIR
                    }
                } else {  /* an odd last tile */
                    for (int j = 0; j < mr; j++)
                        q8_tile(wq + t * tile_q, wd + t * tile_s, wc + t * tile_s, xq + (r + j) * kp, kp,
                                xd + (int64_t)(r + j) * nb, nb, 1, y + (r + j) * y_stride + o, y_stride, bt, n - o);
                }
                r += mr;
            }
        }
#else
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const int8_t *wt = wq + t * tile_q;
            const float *wdt = wd + t * tile_s;
            const int32_t *wct = wc + t * tile_s;
            const int o = t * Q8_TILE;
            const int cols = n - o < Q8_TILE ? n - o : Q8_TILE;
            const float *bt = bias ? bias + o : NULL;
            int r = 0;
            for (; r + 8 <= m; r += 8)
                q8_tile(wt, wdt, wct, xq + r * kp, kp, xd + (int64_t)r * nb, nb, 8, y + r * y_stride + o, y_stride,
                        bt, cols);
            for (; r + 4 <= m; r += 4)
                q8_tile(wt, wdt, wct, xq + r * kp, kp, xd + (int64_t)r * nb, nb, 4, y + r * y_stride + o, y_stride,
                        bt, cols);
            for (; r < m; r++)
                q8_tile(wt, wdt, wct, xq + r * kp, kp, xd + (int64_t)r * nb, nb, 1, y + r * y_stride + o, y_stride,
                        bt, cols);
        }
#endif
    }
    free(xq);
    free(xd);
    return 0;
}

int loraplex_q8_matmul_f32(
    const float *x, int64_t x_stride, int m, int k, const int8_t *wq, const float *wd, const int32_t *wc,
    int n, const float *bias, float *y, int64_t y_stride, int num_threads)
{
    /* x [m, k] (rows x_stride apart), y [m, n] (rows y_stride apart); wq/wd/wc as packed by
     * engine.quant.pack_q8 for n rows and k inputs. Returns 1 when out of memory. */
    return q8_matmul(x, x_stride, m, k, wq, wd, wc, n, bias, y, y_stride, 0, num_threads);
}

int loraplex_q8_swiglu_f32(
    const float *x, int64_t x_stride, int m, int k, const int8_t *wq, const float *wd, const int32_t *wc,
    int n, float *y, int64_t y_stride, int num_threads)
{
    /* W a fused gate|up weight (gate rows 0 .. n/2 - 1, up rows n/2 .. n - 1), packed as above;
     * y [m, n / 2] = silu(gate) * up (loraplex_silu_mul_f32's float32 math on the sums), without
     * the [m, n] sums. AVX512-VNNI builds only (-1 elsewhere, or when n is not a multiple of 32);
     * 1 when out of memory. */
#ifdef Q8_VNNI
    if (n % (2 * Q8_TILE) != 0) return -1;
    return q8_matmul(x, x_stride, m, k, wq, wd, wc, n, NULL, y, y_stride, 1, num_threads);
#else
    (void)x; (void)x_stride; (void)m; (void)k; (void)wq; (void)wd; (void)wc; (void)n; (void)y; (void)y_stride;
    (void)num_threads;
    return -1;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * 6. loraplex_q4_matmul_f32: y = x W^T (+ bias) with W in 4 bits (GGUF Q4_1's form).
 *
 * w[o, i] = d[o, i / 32] * q[o, i] + m[o, i / 32], q in 0..15, float32 d and m per block of 32
 * inputs of an output row (GGUF Q4_1 exactly; Q4_0 with m = -8 d). Each row of x is quantized
 * as for the 8-bit kernel, but kept signed, with each block's dx * sum(xq); a block then adds
 * d_w * dx * dot(q, xq) + m_w * (dx * sum(xq)): an exact integer dot product and the offset.
 *
 * The weights are packed once at load (engine.quant.pack_q4) into tiles of 16 output rows: per
 * tile and block, 4 pairs of 64 bytes, each 16 rows x 4 bytes whose low nibbles are inputs
 * 4p..4p+3 and high nibbles inputs 16+4p..16+4p+3 of the block; then the tile's 16 d and 16 m
 * per block. A pair unpacks with one and and one shift+and into two groups laid out as the
 * 8-bit kernel's. With AVX512-VNNI, _mm512_dpbusd_epi32 takes the nibbles as its unsigned
 * operand and the activations as its signed one: no compensation. AVX2 runs the same through
 * _mm256_maddubs_epi16 (pair sums at most 2 * 15 * 127: no saturation), else plain C.
 * --------------------------------------------------------------------------------------------- */
#define Q4_TILE_BYTES (Q8_BLOCK / 2 * Q8_TILE)
#define Q4_CHUNK_BYTES (256 * 1024)
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* One row of x to blocks of 32: xq = round(x / d) (int8), xd = d = absmax / 127 and
 * xs = d * sum(xq) (the block's weight for the offsets m). With AVX2 whole blocks go 8 lanes at a
 * time (the same float32 math: x * (1 / d) rounded to nearest even); a 3200-token prefill step
 * quantizes 300M activations. */
static void q4_quantize_row(const float *x, int k, int nb, int8_t *xq, float *xd, float *xs)
{
    for (int b = 0; b < nb; b++) {
        const int i0 = b * Q8_BLOCK;
        const int len = k - i0 < Q8_BLOCK ? k - i0 : Q8_BLOCK;
#ifdef __AVX2__
        if (len == Q8_BLOCK) {
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4];
            for (int c = 0; c < 4; c++) v[c] = _mm256_loadu_ps(x + i0 + 8 * c);
            const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float d = _mm_cvtss_f32(h) / 127.0f;
            const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i q[4];
            for (int c = 0; c < 4; c++) q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], id));
            __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
            /* packs work per 128-bit lane: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] ... */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + i0),
                                _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            xd[b] = d;
            xs[b] = d * (float)_mm_cvtsi128_si32(u);
            continue;
        }
#endif
        float amax = 0.0f;
        for (int i = 0; i < len; i++) {
            const float a = x[i0 + i] < 0 ? -x[i0 + i] : x[i0 + i];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < Q8_BLOCK; i++) {
            const int v = (int)__builtin_rintf(i < len ? x[i0 + i] * id : 0.0f);
            xq[i0 + i] = (int8_t)v;
            sum += v;
        }
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

#ifdef Q8_VNNI
/* ``mr`` rows of x against one tile of 16 output rows; always inlined with a constant ``mr``. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint8_t *wt, const float *wd, const float *wm, const int8_t *xq, int64_t xq_stride,
    const float *xd, const float *xs, int nb, const int mr, float *y, int64_t y_stride, const float *bias,
    int cols)
{
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[8];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i ia[8];
        for (int r = 0; r < mr; r++) ia[r] = _mm512_setzero_si512();
        const uint8_t *wb = wt + (int64_t)b * Q4_TILE_BYTES;
        for (int p = 0; p < 4; p++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wb + p * 64));
            const __m512i wl = _mm512_and_si512(w, low);
            const __m512i wh = _mm512_and_si512(_mm512_srli_epi32(w, 4), low);
            for (int r = 0; r < mr; r++) {
                int32_t al, ah;
                memcpy(&al, xq + r * xq_stride + b * Q8_BLOCK + p * 4, 4);
                memcpy(&ah, xq + r * xq_stride + b * Q8_BLOCK + 16 + p * 4, 4);
                ia[r] = _mm512_dpbusd_epi32(ia[r], wl, _mm512_set1_epi32(al));
                ia[r] = _mm512_dpbusd_epi32(ia[r], wh, _mm512_set1_epi32(ah));
            }
        }
        const __m512 dw = _mm512_loadu_ps(wd + b * Q8_TILE);
        const __m512 mw = _mm512_loadu_ps(wm + b * Q8_TILE);
        for (int r = 0; r < mr; r++) {
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), s, acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(y + r * y_stride, mask, _mm512_add_ps(acc[r], bv));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define Q4_ROWS 4
/* AVX2: ``mr`` rows (1..Q4_ROWS, constant at each call) against one tile, the tile's outputs 0..7
 * and 8..15 in two 256-bit halves. Each 64 weight bytes are unpacked into nibbles once for all
 * the rows (unpacking them again per row cost as much as the products). _mm256_maddubs_epi16
 * takes the nibbles as its unsigned operand and the activations as its signed one; its int16
 * pair sums are added in int16 over a whole block (8 x 2 x 15 x 127 = 30480 < 2^15) and widened
 * once. On this ISA the integer multiply unit, not FMA, bounds the kernel: about one maddubs (32
 * products) a cycle against two 8-lane FMAs, so 4-bit blocks outrun float32 (an 8-bit weight
 * needs a second multiply, madd, per maddubs to stay within int16). The float32 sums stay in
 * memory between blocks: the 16 registers hold the int16 sums, unpacked weights and broadcasts. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint8_t *wt, const float *wd, const float *wm, const int8_t *xq, int64_t xq_stride,
    const float *xd, const float *xs, int nb, const int mr, float *y, int64_t y_stride, const float *bias,
    int cols)
{
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[Q4_ROWS][Q8_TILE];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < Q8_TILE; j++) acc[r][j] = 0.0f;
    for (int b = 0; b < nb; b++) {
        __m256i s[Q4_ROWS][2];
        for (int r = 0; r < mr; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        const uint8_t *wb = wt + (int64_t)b * Q4_TILE_BYTES;
        const int8_t *xb = xq + b * Q8_BLOCK;
#pragma GCC unroll 1
        for (int p = 0; p < 4; p++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + p * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + p * 64 + 32));
            const __m256i l0 = _mm256_and_si256(w0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low);
            const __m256i l1 = _mm256_and_si256(w1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low);
            for (int r = 0; r < mr; r++) {
                int32_t al, ah;
                memcpy(&al, xb + r * xq_stride + p * 4, 4);
                memcpy(&ah, xb + r * xq_stride + 16 + p * 4, 4);
                const __m256i a_lo = _mm256_set1_epi32(al), a_hi = _mm256_set1_epi32(ah);
                s[r][0] = _mm256_add_epi16(s[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(l0, a_lo),
                                                                     _mm256_maddubs_epi16(h0, a_hi)));
                s[r][1] = _mm256_add_epi16(s[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(l1, a_lo),
                                                                     _mm256_maddubs_epi16(h1, a_hi)));
            }
        }
        const __m256 dw0 = _mm256_loadu_ps(wd + b * Q8_TILE), dw1 = _mm256_loadu_ps(wd + b * Q8_TILE + 8);
        const __m256 mw0 = _mm256_loadu_ps(wm + b * Q8_TILE), mw1 = _mm256_loadu_ps(wm + b * Q8_TILE + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 dx = _mm256_set1_ps(xd[r * nb + b]), sx = _mm256_set1_ps(xs[r * nb + b]);
            const __m256 i0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][0], ones));
            const __m256 i1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][1], ones));
            _mm256_storeu_ps(acc[r], _mm256_fmadd_ps(mw0, sx, _mm256_fmadd_ps(i0, _mm256_mul_ps(dw0, dx),
                                                                               _mm256_loadu_ps(acc[r]))));
            _mm256_storeu_ps(acc[r] + 8, _mm256_fmadd_ps(mw1, sx, _mm256_fmadd_ps(i1, _mm256_mul_ps(dw1, dx),
                                                                                   _mm256_loadu_ps(acc[r] + 8))));
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < cols; j++) y[r * y_stride + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
}
#else
#define Q4_ROWS 4
static inline void q4_tile(
    const uint8_t *wt, const float *wd, const float *wm, const int8_t *xq, int64_t xq_stride,
    const float *xd, const float *xs, int nb, const int mr, float *y, int64_t y_stride, const float *bias,
    int cols)
{
    for (int r = 0; r < mr; r++) {
        float acc[Q8_TILE] = {0};
        for (int b = 0; b < nb; b++) {
            int32_t ia[Q8_TILE] = {0};
            const uint8_t *wb = wt + (int64_t)b * Q4_TILE_BYTES;
            const int8_t *xb = xq + r * xq_stride + b * Q8_BLOCK;
            for (int p = 0; p < 4; p++)
                for (int j = 0; j < Q8_TILE; j++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t v = wb[p * 64 + j * 4 + t];
                        ia[j] += (v & 0x0F) * xb[p * 4 + t] + (v >> 4) * xb[16 + p * 4 + t];
                    }
            const float dx = xd[r * nb + b], sx = xs[r * nb + b];
            for (int j = 0; j < Q8_TILE; j++) {
                acc[j] += (float)ia[j] * (wd[b * Q8_TILE + j] * dx);
                acc[j] += wm[b * Q8_TILE + j] * sx;
            }
        }
        for (int j = 0; j < cols; j++) y[r * y_stride + j] = acc[j] + (bias ? bias[j] : 0.0f);
    }
}
#endif

int loraplex_q4_matmul_f32(
    const float *x, int64_t x_stride, int m, int k, const uint8_t *wq, const float *wd, const float *wm,
    int n, const float *bias, float *y, int64_t y_stride, int num_threads)
{
    /* x [m, k] (rows x_stride apart), y [m, n] (rows y_stride apart); wq/wd/wm as packed by
     * engine.quant.pack_q4 for n rows and k inputs. Returns 1 when out of memory. */
    const int nb = (k + Q8_BLOCK - 1) / Q8_BLOCK;
    const int tiles = (n + Q8_TILE - 1) / Q8_TILE;
    const int64_t kp = (int64_t)nb * Q8_BLOCK;
    int8_t *xq = malloc((size_t)m * (size_t)kp);
    float *xd = malloc(sizeof(float) * 2 * (size_t)m * (size_t)nb);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return 1;
    }
    float *xs = xd + (int64_t)m * nb;
    const int threads = (int64_t)m * n * k < PARALLEL_MIN_ELEMS ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++)
            q4_quantize_row(x + r * x_stride, k, nb, xq + r * kp, xd + (int64_t)r * nb, xs + (int64_t)r * nb);
        /* Without VNNI, rows go in chunks of about Q4_CHUNK_BYTES of activations, which stay in L2
         * while the tiles pass; each thread takes whole tiles of a chunk and runs its rows through
         * them in even blocks of at most Q4_ROWS (32 rows: 8 x 4). With VNNI, one chunk. */
#ifdef Q8_VNNI
        const int rchunk = m;
#else
        const int rchunk = kp * Q4_ROWS < Q4_CHUNK_BYTES ? (int)(Q4_CHUNK_BYTES / kp) : Q4_ROWS;
#endif
        for (int r0 = 0; r0 < m; r0 += rchunk) {
            const int mc = m - r0 < rchunk ? m - r0 : rchunk;
#pragma omp for schedule(static) nowait
            for (int t = 0; t < tiles; t++) {
                const uint8_t *wt = wq + (int64_t)t * nb * Q4_TILE_BYTES;
                const float *wdt = wd + (int64_t)t * nb * Q8_TILE;
                const float *wmt = wm + (int64_t)t * nb * Q8_TILE;
                const int o = t * Q8_TILE;
                const int cols = n - o < Q8_TILE ? n - o : Q8_TILE;
                const float *bt = bias ? bias + o : NULL;
#define Q4_AT(r, R) q4_tile(wt, wdt, wmt, xq + (r) * kp, kp, xd + (int64_t)(r) * nb, xs + (int64_t)(r) * nb, \
                            nb, R, y + (r) * y_stride + o, y_stride, bt, cols)
#ifdef Q8_VNNI
                int r = r0;
                for (; r + 8 <= r0 + mc; r += 8) Q4_AT(r, 8);
                for (; r + 4 <= r0 + mc; r += 4) Q4_AT(r, 4);
                for (; r < r0 + mc; r++) Q4_AT(r, 1);
#else
                const int blocks = (mc + Q4_ROWS - 1) / Q4_ROWS, base = mc / blocks, extra = mc % blocks;
                for (int i = 0, r = r0; i < blocks; i++) {
                    const int mr = base + (i < extra);
                    switch (mr) {  /* a constant row count for each build of q4_tile */
                    case 4: Q4_AT(r, 4); break;
                    case 3: Q4_AT(r, 3); break;
                    case 2: Q4_AT(r, 2); break;
                    case 1: Q4_AT(r, 1); break;
                    default: break;
                    }
                    r += mr;
                }
#endif
#undef Q4_AT
            }
        }
    }
    free(xq);
    free(xd);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * 7. loraplex_tile_matmul_bf16: y = x W^T for bfloat16 x and W (float32 sums), any batch size,
 *    on AMX tiles, or with AVX512-BF16's vdpbf16ps on CPUs without AMX (AMD Zen 4 and later).
 *
 * W [n, k] is packed once (engine.native.TileMatmul.pack) into 16 x 32 tiles in AMX's pair
 * layout: tile (nb, kb), for output columns 16 nb .. 16 nb + 15 and inputs 32 kb .. 32 kb + 31,
 * holds at row r, column c, lane j the weight W[16 nb + c][32 kb + 2 r + j] (1 KiB, contiguous;
 * a column block's tiles follow each other, so a block streams as one run of memory). Each thread
 * takes pairs of column blocks (32 outputs) and runs every TILE_ROWS-row block of x through them.
 *  - AMX: four 16 x 16 float32 accumulator tiles, two tiles of x (16 rows x 32 inputs each, loaded
 *    in place from x's rows) and two of W per step of 32 inputs.
 *  - AVX512-BF16: a tile's row r (16 columns x inputs 2r, 2r + 1) is exactly one vdpbf16ps operand
 *    against a broadcast of an x row's input pair, so up to 12 rows x 2 column blocks accumulate in
 *    24 zmm registers while the pair's two blocks stream past once.
 * Either way the sums over the inputs run in order, pair by pair, as oneDNN's bfloat16 matmul sums
 * them; they are rounded to bfloat16 (as that matmul rounds its output) and written as bfloat16,
 * or widened back to float32 plus ``bias``. k and n must be multiples of 32.
 *
 * With ``swiglu`` set, W is a fused gate|up projection (gate rows 0 .. n/2 - 1, up rows n/2 ..
 * n - 1) and the kernel writes SwiGLU's product instead of the sums: pair p is gate block p with
 * up block p + n/32, and y [m, n/2] gets silu(g) * u of the bfloat16-rounded sums (the float32
 * math of loraplex_silu_mul_f32, so the same numbers as the matmul followed by it), without
 * writing the [m, n] sums or reading them back.
 *
 * loraplex_tile_matmul_init says which build runs: 1 AMX, 2 AVX512-BF16, -1 neither. Linux hands
 * AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM): init asks for it once;
 * without it the first tile instruction would fault.
 * --------------------------------------------------------------------------------------------- */
#if defined(HAVE_AMX) || defined(__AVX512BF16__)
/* SwiGLU of a gate block ``g`` and its up block ``u`` (float32 sums, 16 per row) into y's columns
 * cols0 .. cols0 + 15, bfloat16 or float32: the sums rounded to bfloat16 first, as the unfused
 * matmul's output would be. */
static inline void tile_store_swiglu(const float *g, const float *u, int rows, int cols0, void *y,
                                     int64_t y_stride, int64_t r0, int y_bf16)
{
    for (int r = 0; r < rows; r++) {
        const __m512 s = silu_mul16(round16_bf16(_mm512_loadu_ps(g + r * 16)), round16_bf16(_mm512_loadu_ps(u + r * 16)));
        if (y_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + (r0 + r) * y_stride + cols0), f32x16_to_bf16(s));
        else _mm512_storeu_ps((float *)y + (r0 + r) * y_stride + cols0, s);
    }
}

static inline void tile_store_block(const float *c, int rows, int cols0, const float *bias, void *y,
                                    int64_t y_stride, int64_t r0, int y_bf16)
{
    const __m512 b = bias != NULL ? _mm512_loadu_ps(bias + cols0) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_loadu_ps(c + r * 16);
        if (y_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + (r0 + r) * y_stride + cols0), f32x16_to_bf16(v));
        else _mm512_storeu_ps((float *)y + (r0 + r) * y_stride + cols0, _mm512_add_ps(round16_bf16(v), b));
    }
}

/* Where a column pair's sums go: y's rows and columns, the epilogue to apply. */
struct tile_dst {
    const float *bias;
    void *y;
    int64_t y_stride;
    int y_bf16, swiglu;
};

/* A column pair's stored sums waiting for their epilogue: column pair ``p``, ``rows`` rows from
 * row ``r0`` of y, row r's 16 + 16 sums at c0 + 16 r and c1 + 16 r. */
struct tile_out {
    const float *c0, *c1;
    int rows, p, r0;
};

/* Rows lo .. hi - 1 of the pending sums ``o`` into y. */
static inline __attribute__((always_inline)) void tile_epilogue(const struct tile_dst *d, const struct tile_out *o,
                                                                 int lo, int hi)
{
    if (d->swiglu) {
        tile_store_swiglu(o->c0 + 16 * lo, o->c1 + 16 * lo, hi - lo, 16 * o->p, d->y, d->y_stride, o->r0 + lo,
                          d->y_bf16);
    } else {
        tile_store_block(o->c0 + 16 * lo, hi - lo, 32 * o->p, d->bias, d->y, d->y_stride, o->r0 + lo, d->y_bf16);
        tile_store_block(o->c1 + 16 * lo, hi - lo, 32 * o->p + 16, d->bias, d->y, d->y_stride, o->r0 + lo, d->y_bf16);
    }
}

#endif

#ifdef HAVE_AMX
#define TILE_ROWS 32
#ifndef AMX_PREFETCH
#define AMX_PREFETCH 2
#endif
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int loraplex_tile_matmul_fma(int mode) { (void)mode; return -1; }  /* AMX tiles: no such choice */

int loraplex_tile_matmul_init(void)
{
    const int ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&amx_granted, ok, __ATOMIC_RELEASE);
    return ok ? 1 : -1;
}

/* Tiles: 0-3 accumulators (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31),
 * 4-5 x (rows 0-15, 16-31), 6-7 W (columns 0-15, 16-31). ``m0``/``m1``: rows of x in each half. */
static void amx_configure(int m0, int m1)
{
    struct amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* ``rows`` (1..32) rows of x from ``xa`` against column blocks ``b0`` and ``b1``: the float32 sums
 * into c0 and c1 (16 per row). ``configured``: this thread's loaded tile configuration. ``pend``
 * (or NULL): the previous pair's sums, whose epilogue into ``dst`` runs a few rows after each
 * step's products, while the tile unit works. Run after the products, the epilogue waited for
 * them (tiles are not renamed: the next pair's products wait for this pair's sums to be stored,
 * so each pair drains the tile unit): a 3200-row gate|up with SwiGLU went 229 -> 150 ms on 2
 * threads of a Xeon, and one pair's products and plain epilogue with every operand in L1 ran
 * 670 ns interleaved against 890 after each other (products alone 556). */
static inline void tile_pair(const uint16_t *xa, int64_t x_stride, const float *xf, int rows, int kbs,
                             const uint16_t *b0, const uint16_t *b1, float *c0, float *c1, int *configured,
                             const struct tile_dst *dst, const struct tile_out *pend)
{
    (void)xf;  /* the FMA build's widened x: tiles multiply bfloat16 */
    const int pend_step = pend != NULL ? (pend->rows + kbs - 1) / kbs : 0;
    const int m0 = rows < 16 ? rows : 16, m1 = rows - m0;
    const int64_t xs_bytes = x_stride * (int64_t)sizeof(uint16_t);
    if (*configured != m0 * 64 + m1) {
        amx_configure(m0, m1);
        *configured = m0 * 64 + m1;
    }
    const uint16_t *xb = xa + 16 * x_stride;
    _tile_zero(0);
    _tile_zero(1);
    if (m1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    /* Each load right before the first product that reads it (tiles are not renamed: a load
     * waits for the products still reading the tile's last contents), and W's tiles asked for
     * ahead: a 32-row LM head (49152 x 576) went from 290-300 to 390-430 GFLOP/s on 2 threads of
     * a Sapphire Rapids, a 32-row gate|up by ~10%. */
    for (int kb = 0; kb < kbs; kb++) {
        /* W's tiles AMX_PREFETCH steps ahead into L1: a tile load that misses stalls the products
         * behind it (past the block's end: the next block's first tiles) */
        const char *n0 = (const char *)(b0 + (int64_t)(kb + AMX_PREFETCH) * 512);
        const char *n1 = (const char *)(b1 + (int64_t)(kb + AMX_PREFETCH) * 512);
        for (int c = 0; c < 1024; c += 64) {
            _mm_prefetch(n0 + c, _MM_HINT_T0);
            _mm_prefetch(n1 + c, _MM_HINT_T0);
        }
        _tile_loadd(4, xa + kb * 32, xs_bytes);
        _tile_loadd(6, b0 + (int64_t)kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + (int64_t)kb * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (m1) {
            _tile_loadd(5, xb + kb * 32, xs_bytes);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (pend_step) {
            const int lo = kb * pend_step, hi = lo + pend_step < pend->rows ? lo + pend_step : pend->rows;
            if (lo < hi) tile_epilogue(dst, pend, lo, hi);
        }
    }
    _tile_stored(0, c0, 64);
    _tile_stored(1, c1, 64);
    if (m1) {
        _tile_stored(2, c0 + 256, 64);
        _tile_stored(3, c1 + 256, 64);
    }
}

static inline void tile_done(int configured)
{
    if (configured >= 0) _tile_release();
}
#elif defined(__AVX512BF16__)
#define TILE_ROWS 12
/* Tiles of W asked for ahead into L1, one tile row per input pair (one tile ahead: 6-8% on a
 * Zen 4 core at 32 and 256 rows). */
#ifndef DP_PREFETCH
#define DP_PREFETCH 1
#endif

/* 1: dp_pair's sums come from float32 FMAs (fma_pair) instead of vdpbf16ps; set by
 * loraplex_tile_matmul_init from the two instructions' rates on this core. */
static int dp_by_fma;

/* Multiply-accumulates per second of a register loop of ``fma`` ? FMAs : vdpbf16ps (eight
 * independent chains), on the calling thread. */
static double dp_loop_rate(int fma, long iters)
{
    __m512 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_ps(1e-3f * (float)(i + 1));
    const __m512 x = _mm512_set1_ps(0.999f);
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f), yb = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < iters; it++) {
        if (fma)
            for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(a[i], x, a[i]);
        else
            for (int i = 0; i < 8; i++) a[i] = _mm512_dpbf16_ps(a[i], xb, yb);
        __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]), "+v"(a[6]),
                         "+v"(a[7]));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return (double)iters * 8.0 * (fma ? 16.0 : 32.0) / (s > 0 ? s : 1e-9);
}

int loraplex_tile_matmul_init(void)
{
    /* Some cores run vdpbf16ps at a quarter of their FMA rate per instruction (2 cores of an Intel
     * Xeon with AVX512-BF16 but no AMX: its register loop 157 GFLOP/s against float32 FMA's 336),
     * others at full rate (Zen 4). The best of three short alternated loops (about 1 ms in all)
     * says which: FMAs over the widened bfloat16 when they multiply-accumulate 1.25x faster. */
    double dp = 0, fma = 0;
    for (int i = 0; i < 3; i++) {
        const double d = dp_loop_rate(0, 20000), f = dp_loop_rate(1, 20000);
        dp = d > dp ? d : dp;
        fma = f > fma ? f : fma;
    }
    __atomic_store_n(&dp_by_fma, fma > 1.25 * dp, __ATOMIC_RELEASE);
    return 2;
}

int loraplex_tile_matmul_fma(int mode)
{
    if (mode == 0 || mode == 1) __atomic_store_n(&dp_by_fma, mode, __ATOMIC_RELEASE);
    return __atomic_load_n(&dp_by_fma, __ATOMIC_ACQUIRE);
}

/* dp_pair's sums (the same bits but where vdpbf16ps flushes a denormal) from float32 FMAs: a tile
 * row's 16 columns x input pair widened into the odd inputs' floats (the pair's high halves, masked)
 * and the even ones' (shifted up), against ``xf``, the row block's x widened once for all the column
 * pairs that read it (tile_x_widen; rows ``xf_stride`` apart). As vdpbf16ps does, each lane adds
 * the odd input's exact product, then the even one's, rounding after each: two FMAs where
 * vdpbf16ps is one instruction, at twice its rate where FMAs run 4x as fast. 2 x rows
 * accumulators, four widened weight vectors and a broadcast: 29 of the 32 zmm. */
static inline __attribute__((always_inline)) void fma_pair(const float *xf, int64_t xf_stride, const int rows,
                                                           int kbs, const uint16_t *b0, const uint16_t *b1,
                                                           float *c0, float *c1)
{
    __m512 a0[TILE_ROWS], a1[TILE_ROWS];
    for (int i = 0; i < rows; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int kb = 0; kb < kbs; kb++) {
        const uint16_t *w0 = b0 + (int64_t)kb * 512, *w1 = b1 + (int64_t)kb * 512;
        const float *xk = xf + kb * 32;
        for (int r = 0; r < 16; r++) {
            _mm_prefetch((const char *)(w0 + DP_PREFETCH * 512 + 32 * r), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + DP_PREFETCH * 512 + 32 * r), _MM_HINT_T0);
            const __m512i v0 = _mm512_loadu_si512(w0 + 32 * r), v1 = _mm512_loadu_si512(w1 + 32 * r);
            const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
            const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
            const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
            const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
            for (int i = 0; i < rows; i++) {
                const __m512 xo = _mm512_set1_ps(xk[i * xf_stride + 2 * r + 1]);
                const __m512 xe = _mm512_set1_ps(xk[i * xf_stride + 2 * r]);
                a0[i] = _mm512_fmadd_ps(xe, e0, _mm512_fmadd_ps(xo, o0, a0[i]));
                a1[i] = _mm512_fmadd_ps(xe, e1, _mm512_fmadd_ps(xo, o1, a1[i]));
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        _mm512_storeu_ps(c0 + 16 * i, a0[i]);
        _mm512_storeu_ps(c1 + 16 * i, a1[i]);
    }
}

/* The calling thread's buffer of at least ``n`` floats (grown, never shrunk: the OpenMP team's
 * threads live as long as the process), or NULL. */
static float *tile_x_buffer(size_t n)
{
    static __thread float *buf;
    static __thread size_t cap;
    if (n > cap) {
        float *grown = (float *)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        if (grown == NULL) return NULL;
        free(buf);
        buf = grown;
        cap = n;
    }
    return buf;
}

/* Rows of bfloat16 x (``rows`` x ``k``, k a multiple of 32) widened into ``xf`` (rows k apart). */
static inline void tile_x_widen(const uint16_t *x, int64_t x_stride, int rows, int k, float *xf)
{
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < k; c += 32) {
            const __m512i h = _mm512_loadu_si512(x + i * x_stride + c);
            _mm512_store_si512(xf + (int64_t)i * k + c,
                               _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
            _mm512_store_si512(xf + (int64_t)i * k + c + 16,
                               _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        }
}

/* ``rows`` (constant at each call) rows of x against column blocks ``b0`` and ``b1``: 2 x rows
 * accumulators; per input pair, one load of each block's tile row and one broadcast per x row. */
static inline __attribute__((always_inline)) void dp_pair(const uint16_t *xa, int64_t x_stride, const int rows,
                                                          int kbs, const uint16_t *b0, const uint16_t *b1,
                                                          float *c0, float *c1)
{
    __m512 a0[TILE_ROWS], a1[TILE_ROWS];
    for (int i = 0; i < rows; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int kb = 0; kb < kbs; kb++) {
        const uint16_t *w0 = b0 + (int64_t)kb * 512, *w1 = b1 + (int64_t)kb * 512, *xk = xa + kb * 32;
        for (int r = 0; r < 16; r++) {
            _mm_prefetch((const char *)(w0 + DP_PREFETCH * 512 + 32 * r), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + DP_PREFETCH * 512 + 32 * r), _MM_HINT_T0);
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + 32 * r);
            const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w1 + 32 * r);
            for (int i = 0; i < rows; i++) {
                int32_t pair;
                memcpy(&pair, xk + i * x_stride + 2 * r, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                a0[i] = _mm512_dpbf16_ps(a0[i], xb, v0);
                a1[i] = _mm512_dpbf16_ps(a1[i], xb, v1);
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        _mm512_storeu_ps(c0 + 16 * i, a0[i]);
        _mm512_storeu_ps(c1 + 16 * i, a1[i]);
    }
}

static inline void tile_pair(const uint16_t *xa, int64_t x_stride, const float *xf, int rows, int kbs,
                             const uint16_t *b0, const uint16_t *b1, float *c0, float *c1, int *configured,
                             const struct tile_dst *dst, const struct tile_out *pend)
{
    (void)configured;
    if (pend != NULL) tile_epilogue(dst, pend, 0, pend->rows);
    if (xf != NULL) {
        switch (rows) {
#define FMA_ROWS(r) case r: fma_pair(xf, (int64_t)kbs * 32, r, kbs, b0, b1, c0, c1); break;
        FMA_ROWS(1) FMA_ROWS(2) FMA_ROWS(3) FMA_ROWS(4) FMA_ROWS(5) FMA_ROWS(6)
        FMA_ROWS(7) FMA_ROWS(8) FMA_ROWS(9) FMA_ROWS(10) FMA_ROWS(11) FMA_ROWS(12)
#undef FMA_ROWS
        }
        return;
    }
    switch (rows) {
#define DP_ROWS(r) case r: dp_pair(xa, x_stride, r, kbs, b0, b1, c0, c1); break;
    DP_ROWS(1) DP_ROWS(2) DP_ROWS(3) DP_ROWS(4) DP_ROWS(5) DP_ROWS(6)
    DP_ROWS(7) DP_ROWS(8) DP_ROWS(9) DP_ROWS(10) DP_ROWS(11) DP_ROWS(12)
#undef DP_ROWS
    }
}

static inline void tile_done(int configured) { (void)configured; }
#endif

#ifdef TILE_ROWS
#define TILE_CHUNK 8
#define TILE_SPLIT_ROWS 128

int loraplex_tile_matmul_bf16(
    const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *wt, int n,
    const float *bias, void *y, int64_t y_stride, int y_bf16, int swiglu, int num_threads)
{
    /* x [m, k] bfloat16 (rows x_stride apart), y [m, n] (swiglu: [m, n / 2]) bfloat16 or float32
     * (rows y_stride apart); wt as packed for n outputs and k inputs. */
    if (k % 32 != 0 || n % 32 != 0 || m < 1 || num_threads < 1 || (swiglu && bias != NULL)) return -1;
    const int kbs = k / 32, pairs = n / 32;
    /* Chunks of up to TILE_CHUNK column pairs: a chunk's W tiles stay in L2 while every row block
     * of x passes through them, so x is read once per chunk rather than once per pair (AMX, 1000
     * rows through gate|up: 1.9 ms before, 1.56 ms with chunks of 8). Work items are (chunk, row
     * part): a few rows split by column chunks, a whole number per thread; from TILE_SPLIT_ROWS
     * rows per thread on, by rows, each thread taking all chunks of its rows (Zen 4, 2 threads:
     * 3200 x 576 x 1536 took 15.2 ms split by columns, 13.9 split by rows; oneDNN 13.3). */
    const int rparts = m >= TILE_SPLIT_ROWS * num_threads ? num_threads : 1;
    const int per_thread = rparts > 1 ? 1 : num_threads;
    const int chunks = per_thread * ((pairs + per_thread * TILE_CHUNK - 1) / (per_thread * TILE_CHUNK));
    const int rstep = ((m + rparts - 1) / rparts + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        /* Two sets of sums: the one being computed, and the previous pair's (its epilogue runs
         * inside the next pair's products, see tile_pair). */
        float c[2][2][TILE_ROWS * 16];
        const struct tile_dst dst = {bias, y, y_stride, y_bf16, swiglu};
        struct tile_out pend = {NULL, NULL, 0, 0, 0};
        int configured = -1, cur = 0;
        /* the FMA build widens each row block of x once for every column pair of its item */
#if defined(HAVE_AMX) || !defined(__AVX512BF16__)
        float *xw = NULL;
#else
        float *xw = __atomic_load_n(&dp_by_fma, __ATOMIC_RELAXED) ? tile_x_buffer((size_t)TILE_ROWS * k) : NULL;
#endif
#pragma omp for schedule(static)
        for (int it = 0; it < rparts * chunks; it++) {
        const int ch = it % chunks, rbeg = it / chunks * rstep, rend = rbeg + rstep < m ? rbeg + rstep : m;
        for (int r0 = rbeg; r0 < rend; r0 += TILE_ROWS) {
#if !defined(HAVE_AMX) && defined(__AVX512BF16__)
        if (xw != NULL) tile_x_widen(x + (int64_t)r0 * x_stride, x_stride, rend - r0 < TILE_ROWS ? rend - r0 : TILE_ROWS, k, xw);
#endif
        for (int p = ch * pairs / chunks; p < (ch + 1) * pairs / chunks; p++) {
            const uint16_t *b0 = wt + (int64_t)(swiglu ? p : 2 * p) * kbs * 512,
                           *b1 = b0 + (int64_t)(swiglu ? pairs : 1) * kbs * 512;
            const int rows = rend - r0 < TILE_ROWS ? rend - r0 : TILE_ROWS;
            tile_pair(x + (int64_t)r0 * x_stride, x_stride, xw, rows, kbs, b0, b1, c[cur][0], c[cur][1], &configured,
                      &dst, pend.rows ? &pend : NULL);
            pend = (struct tile_out){c[cur][0], c[cur][1], rows, p, r0};
            cur ^= 1;
        }
        }
        }
        if (pend.rows) tile_epilogue(&dst, &pend, 0, pend.rows);
        tile_done(configured);
    }
    return 0;
}
#else
int loraplex_tile_matmul_init(void) { return -1; }
int loraplex_tile_matmul_fma(int mode) { (void)mode; return -1; }

int loraplex_tile_matmul_bf16(
    const uint16_t *x, int64_t x_stride, int m, int k, const uint16_t *wt, int n,
    const float *bias, void *y, int64_t y_stride, int y_bf16, int swiglu, int num_threads)
{
    (void)x; (void)x_stride; (void)m; (void)k; (void)wt; (void)n; (void)bias; (void)y; (void)y_stride;
    (void)y_bf16; (void)swiglu; (void)num_threads;
    return -1;
}
#endif

/* ---------------------------------------------------------------------------------------------
 * 8. loraplex_f32_panel_matmul: y = x W^T (+ bias), float32, on AVX2 CPUs without AVX-512.
 *
 * On an AMD Zen 3 (AVX2 + FMA, 2 threads) oneDNN's prepacked float32 linear ran a 32-row
 * decode step's shapes at 35-50 GMAC/s, 40-55% of the FMA units' rate measured in a register
 * loop (87 GMAC/s). This is the classic register-blocked kernel: W packed once at load
 * (loraplex_f32_panel_pack) into panels of 16 output columns, panel p holding W[16p + j, i] at
 * [i * 16 + j]; a 6-row x 16-column block of y lives in 12 ymm accumulators while the panel
 * streams through (2 loads and 6 broadcasts per 12 FMAs). The threads split the panels, and
 * each thread prefetches its next panel while the current one's row blocks run (a 32-row step's
 * matmuls over 30 layers of weights streamed from memory: 1.15-1.2x faster than without). The
 * accumulators are named variables (an array of them is spilled to the stack each iteration
 * by GCC, a quarter of the speed).
 * --------------------------------------------------------------------------------------------- */
#define PANEL 16
#define PANEL_RCHUNK 512
int loraplex_f32_panel_available(void)
{
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int loraplex_f32_panel_pack(const float *w, int n, int k, float *out)
{
    /* w [n, k] row-major -> out [ceil(n / 16), k, 16], zero-padded past n. */
    const int panels = (n + PANEL - 1) / PANEL;
    for (int p = 0; p < panels; p++)
        for (int i = 0; i < k; i++)
            for (int j = 0; j < PANEL; j++) {
                const int o = p * PANEL + j;
                out[((int64_t)p * k + i) * PANEL + j] = o < n ? w[(int64_t)o * k + i] : 0.0f;
            }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
/* ``mr`` (1..6, constant at each call) rows of x against one panel. Every ``pf_every``
 * iterations one line of the next panel (``pf``, this block's share of it; NULL: none) is
 * prefetched, so the next panel arrives while this one is still being read from cache. */
static inline __attribute__((always_inline)) void panel_block(
    const float *x, int64_t x_stride, const float *wp, int k, const int mr, float *y, int64_t y_stride,
    const float *bias, int cols, const char *pf, int pf_every)
{
#define PANEL_DECL(r) __m256 lo##r = _mm256_setzero_ps(), hi##r = _mm256_setzero_ps();
    PANEL_ROWS(PANEL_DECL)
    int i = 0;
    for (int64_t line = 0; i < k; line++) {
        if (pf) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
        const int end = pf && i + pf_every < k ? i + pf_every : k;
        for (; i < end; i++) {
            const __m256 w0 = _mm256_loadu_ps(wp + (int64_t)i * PANEL), w1 = _mm256_loadu_ps(wp + (int64_t)i * PANEL + 8);
#define PANEL_FMA(r)                                                        \
            if (r < mr) {                                                   \
                const __m256 a = _mm256_broadcast_ss(x + r * x_stride + i); \
                lo##r = _mm256_fmadd_ps(a, w0, lo##r);                      \
                hi##r = _mm256_fmadd_ps(a, w1, hi##r);                      \
            }
            PANEL_ROWS(PANEL_FMA)
        }
    }
    float b[PANEL] = {0};
    if (bias)
        for (int j = 0; j < cols; j++) b[j] = bias[j];
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#define PANEL_STORE(r)                                                      \
    if (r < mr) {                                                           \
        float *yr = y + r * y_stride;                                       \
        if (cols == PANEL) {                                                \
            _mm256_storeu_ps(yr, _mm256_add_ps(lo##r, b0));                 \
            _mm256_storeu_ps(yr + 8, _mm256_add_ps(hi##r, b1));             \
        } else {                                                            \
            float t[PANEL];                                                 \
            _mm256_storeu_ps(t, _mm256_add_ps(lo##r, b0));                  \
            _mm256_storeu_ps(t + 8, _mm256_add_ps(hi##r, b1));              \
            for (int j = 0; j < cols; j++) yr[j] = t[j];                    \
        }                                                                   \
    }
    PANEL_ROWS(PANEL_STORE)
#undef PANEL_DECL
#undef PANEL_FMA
#undef PANEL_STORE
}

int loraplex_f32_panel_matmul(const float *x, int64_t x_stride, int m, int k, const float *wp, int n,
                              const float *bias, float *y, int64_t y_stride, int num_threads)
{
    /* x [m, k] (rows x_stride apart), wp as packed by loraplex_f32_panel_pack for n and k,
     * y [m, n] (rows y_stride apart). Each thread takes a contiguous run of panels; the rows go
     * in even blocks of at most 6 (32 rows: 6+6+5+5+5+5, not 6x5+2, whose 2-row block would
     * cost nearly a 6-row block's time: its 4 accumulators wait on the FMA latency). Block ``b``
     * of a panel prefetches the lines ``b * share ..`` of the thread's next panel (a panel row
     * of 16 floats is one 64-byte line), so the next panel's trip from memory overlaps this
     * one's work instead of stalling its first block. Past PANEL_RCHUNK rows (prefill) the rows
     * go in even chunks, each over all of the thread's panels, so a chunk of x stays in cache
     * while the panels pass (3200 rows: 74-76 -> 82-84 GMAC/s). */
    const int panels = (n + PANEL - 1) / PANEL;
    const int threads = (int64_t)m * n * k < PARALLEL_MIN_ELEMS ? 1 : num_threads;
    const int nchunks = (m + PANEL_RCHUNK - 1) / PANEL_RCHUNK;
    const int chunk = nchunks > 1 ? (m + nchunks - 1) / nchunks : m;
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int r0 = 0; r0 < m; r0 += chunk) {
            const int mc = m - r0 < chunk ? m - r0 : chunk;
            const int blocks = (mc + 5) / 6, base = mc / blocks, extra = mc % blocks;
            const int share = (k + blocks - 1) / blocks;
            for (int p = p0; p < p1; p++) {
                const float *w = wp + (int64_t)p * k * PANEL;
                const char *next = p + 1 < p1 ? (const char *)(w + (int64_t)k * PANEL) : NULL;
                const int o = p * PANEL, cols = n - o < PANEL ? n - o : PANEL;
                const float *bp = bias ? bias + o : NULL;
                int r = r0;
                for (int b = 0; b < blocks; b++) {
                    const int mr = base + (b < extra);
                    const float *xr = x + r * x_stride;
                    float *yr = y + r * y_stride + o;
                    const char *pf = next && b * share < k ? next + (int64_t)b * share * 64 : NULL;
                    switch (mr) {
                    case 6: panel_block(xr, x_stride, w, k, 6, yr, y_stride, bp, cols, pf, blocks); break;
                    case 5: panel_block(xr, x_stride, w, k, 5, yr, y_stride, bp, cols, pf, blocks); break;
                    case 4: panel_block(xr, x_stride, w, k, 4, yr, y_stride, bp, cols, pf, blocks); break;
                    case 3: panel_block(xr, x_stride, w, k, 3, yr, y_stride, bp, cols, pf, blocks); break;
                    case 2: panel_block(xr, x_stride, w, k, 2, yr, y_stride, bp, cols, pf, blocks); break;
                    case 1: panel_block(xr, x_stride, w, k, 1, yr, y_stride, bp, cols, pf, blocks); break;
                    default: break;
                    }
                    r += mr;
                }
            }
        }
    }
    return 0;
}
#else
int loraplex_f32_panel_matmul(const float *x, int64_t x_stride, int m, int k, const float *wp, int n,
                              const float *bias, float *y, int64_t y_stride, int num_threads)
{
    (void)x; (void)x_stride; (void)m; (void)k; (void)wp; (void)n; (void)bias; (void)y; (void)y_stride;
    (void)num_threads;
    return -1;
}
#endif

/* ---------------------------------------------------------------------------------------------
 * 9. loraplex_scan_rows_f32: per row of float32 logits, in one pass, the index of the maximum
 * (the first one; a NaN counts as larger than any number, as torch's max(dim) has it) and
 * whether every value is finite. After each step's LM head the engine asked torch for both
 * (max(-1) and isfinite(sum(1))), two passes over [32, 49152] floats on one thread each.
 * Either output may be NULL. Sixteen lanes keep their own first maximum (strictly larger
 * replaces), then the lanes' largest value with the smallest index wins.
 * --------------------------------------------------------------------------------------------- */
#define SCAN_LANES 16

static inline int scan_beats(float v, int64_t i, float best, int64_t at)
{
    const int v_nan = v != v, best_nan = best != best;
    if (v_nan || best_nan) return v_nan && (!best_nan || i < at);
    return v > best || (v == best && i < at);
}

int loraplex_scan_rows_f32(const float *x, int64_t stride, int rows, int cols, int64_t *argmax, uint8_t *finite,
                           int num_threads)
{
    if (rows < 0 || cols < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)rows * cols >= PARALLEL_MIN_ELEMS)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * stride;
        if (argmax == NULL) {  /* finiteness alone: v * 0 stays 0 unless v is infinite or NaN */
            float z = 0.0f;
#pragma omp simd reduction(+:z)
            for (int c = 0; c < cols; c++) z += xr[c] * 0.0f;
            if (finite != NULL) finite[r] = z == 0.0f;
            continue;
        }
        float best[SCAN_LANES], zero[SCAN_LANES];
        int32_t at[SCAN_LANES];
        for (int l = 0; l < SCAN_LANES; l++) {
            best[l] = -__builtin_inff();
            at[l] = l;
            zero[l] = 0.0f;
        }
        int c = 0;
        for (; c + SCAN_LANES <= cols; c += SCAN_LANES) {
#pragma omp simd
            for (int l = 0; l < SCAN_LANES; l++) {
                const float v = xr[c + l];
                /* larger, or the lane's first NaN (NaN compares false both ways) */
                const int takes = v > best[l] || (v != v && best[l] == best[l]);
                best[l] = takes ? v : best[l];
                at[l] = takes ? c + l : at[l];
                zero[l] += v * 0.0f;  /* stays 0 unless some value is infinite or NaN */
            }
        }
        float bv = best[0], z = zero[0];
        int64_t bi = at[0] < cols ? at[0] : 0;
        for (int l = 1; l < SCAN_LANES && l < cols; l++) {
            z += zero[l];
            if (scan_beats(best[l], at[l], bv, bi)) {
                bv = best[l];
                bi = at[l];
            }
        }
        for (; c < cols; c++) {
            const float v = xr[c];
            z += v * 0.0f;
            if (scan_beats(v, c, bv, bi)) {
                bv = v;
                bi = c;
            }
        }
        if (argmax != NULL) argmax[r] = bi;
        if (finite != NULL) finite[r] = z == 0.0f;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * 10. loraplex_decoder_layers: a step's decoder layers in one call, where every matrix runs on a
 * native kernel: bfloat16 on the tile kernel (section 7), 8- and 4-bit blocks (sections 5-6), or
 * float32 panels (section 8, AVX2 builds; a single row on the gemv of section 3, as Linear does).
 * Per layer the same kernels, in the same order and with the same arguments, that engine/model.py
 * calls one by one (add_rms_norm, the q|k|v matmul, rope_store, decode attention, the o matmul,
 * add_rms_norm, gate|up and SwiGLU, down, and after each matmul the LoRA rows of section 2),
 * without going back to Python between them: a step of 30 layers made 240 calls through ctypes
 * (about 400 with adapters), each with its checks, tensor allocations and a few microseconds of
 * interpreter while the second OpenMP thread spun. The same numbers bit for bit.
 *
 * In a step without LoRA rows on the tile kernel the activations between the matmuls are
 * bfloat16 (each matmul's rounded sums, read by the next step: the model's narrow flow) and the
 * q|k|v bias goes in with rope_store's widening. Otherwise they are float32, each bias goes in
 * with its matmul and the tile kernel's input is rounded to bfloat16 first (as torch rounds it).
 */
enum { LP_TILE = 0, LP_Q8 = 1, LP_Q4 = 2, LP_PANEL = 3 };

struct loraplex_weight {
    const void *w;          /* tile: packed tiles; q8/q4: the packed blocks; panel: the packed panels */
    const float *d;         /* q8/q4: block scales */
    const void *extra;      /* q8: int32 compensations; q4: float offsets; panel: the [n, k] float32
                             * matrix for single rows (gemv), or NULL: panels for them too */
    const float *bias;      /* or NULL */
    int format, n, k;       /* n outputs, k inputs */
};

struct loraplex_layer {
    const float *input_norm, *post_norm;
    struct loraplex_weight qkv, o, gate_up, down;
    void *k_pool, *v_pool;  /* [kv_heads, pool_slots, head_dim] */
};

/* One loraplex_lora_rows_f32 call's stacks (the projections of one input that a rank class's
 * adapters touch in one layer); y_cols: each target's first column in the matmul's output. */
struct loraplex_lora_call {
    const int64_t *y_cols, *out_dims, *a_ptrs, *b_ptrs, *scale_ptrs;
    int num_targets, b_transposed, in_dim, rank, weights_bf16;
};

/* The rows of one rank class, sorted by slot. */
struct loraplex_lora_pass {
    const int64_t *rows, *row_slots;
    int num_rows;
};

struct loraplex_lora {
    const struct loraplex_lora_pass *passes;
    const struct loraplex_lora_call *const *calls;  /* [layer][4 inputs][pass], NULL where none */
    int num_passes;
};

struct loraplex_step {
    float *h;               /* [rows, hidden] float32 residual stream, updated */
    void *x, *qkv, *attn, *res, *mlp;   /* scratch in the activations' dtype: [rows, hidden], [rows, width],
                                         * [rows, heads * head_dim], [rows, hidden], [rows, inter] */
    void *gate_up;          /* [rows, 2 inter] scratch, or NULL: SwiGLU fused into the gate|up matmul */
    uint16_t *xb;           /* [rows, max(hidden, heads * head_dim, inter)] bfloat16 scratch, or NULL:
                             * the tile kernel's rounded input under float32 activations */
    float *q;               /* [rows, heads * head_dim] float32 scratch */
    const struct loraplex_lora *lora;   /* or NULL: no LoRA rows (float32 activations otherwise) */
    const float *cos, *sin, *head_scale;
    int64_t cs_row_stride, cs_head_stride;
    const int64_t *slots, *row_blocks, *row_lens;
    int64_t blocks_per_seq, pool_slots;
    int max_len, block_size, kv_bf16, amx, act_bf16;
    int rows, hidden, heads, kv_heads, head_dim, inter;
    float eps;
};

/* y = x W^T (+ W's bias, except on tiles with bfloat16 activations), or silu(gate) * up of a
 * fused gate|up W; x and y in the step's activations' dtype. */
static int lp_matmul(const struct loraplex_step *s, const struct loraplex_weight *w, const void *x, void *y,
                     int swiglu, int num_threads)
{
    const int m = s->rows, cols = swiglu ? w->n / 2 : w->n;
    switch (w->format) {
    case LP_TILE:
        if (s->act_bf16)
            return loraplex_tile_matmul_bf16(x, w->k, m, w->k, w->w, w->n, NULL, y, cols, 1, swiglu, num_threads);
        if (s->xb == NULL || swiglu) return -1;
        {
            const float *xf = x;
            const int64_t n = (int64_t)m * w->k;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= PARALLEL_MIN_ELEMS)
            for (int64_t e = 0; e < n; e++) s->xb[e] = f32_to_bf16(xf[e]);
        }
        return loraplex_tile_matmul_bf16(s->xb, w->k, m, w->k, w->w, w->n, w->bias, y, cols, 0, 0, num_threads);
    case LP_Q8:
        if (swiglu) return loraplex_q8_swiglu_f32(x, w->k, m, w->k, w->w, w->d, w->extra, w->n, y, cols, num_threads);
        return loraplex_q8_matmul_f32(x, w->k, m, w->k, w->w, w->d, w->extra, w->n, w->bias, y, cols, num_threads);
    case LP_Q4:
        if (swiglu) return -1;
        return loraplex_q4_matmul_f32(x, w->k, m, w->k, w->w, w->d, w->extra, w->n, w->bias, y, cols, num_threads);
    case LP_PANEL:
        if (swiglu || s->act_bf16) return -1;
        if (m == 1 && w->extra != NULL) return loraplex_gemv_f32(x, w->extra, w->bias, y, w->n, w->k, num_threads);
        return loraplex_f32_panel_matmul(x, w->k, m, w->k, w->w, w->n, w->bias, y, cols, num_threads);
    }
    return -1;
}

/* y += each LoRA row's delta for input ``input`` (0 q|k|v, 1 o, 2 gate|up, 3 down) of layer
 * ``layer``: 0, or LP_LORA_FAILED + the index of the pass that failed. */
#define LP_LORA_FAILED 1000
static int lp_lora(const struct loraplex_step *s, int layer, int input, const float *x, int64_t x_stride, float *y,
                   int64_t y_stride, int num_threads)
{
    const struct loraplex_lora *l = s->lora;
    if (l == NULL) return 0;
    for (int p = 0; p < l->num_passes; p++) {
        const struct loraplex_lora_call *c = l->calls[((int64_t)layer * 4 + input) * l->num_passes + p];
        const struct loraplex_lora_pass *ps = &l->passes[p];
        if (c == NULL || ps->num_rows == 0) continue;
        if (loraplex_lora_rows_f32(x, x_stride, y, y_stride, c->num_targets, c->y_cols, c->out_dims, c->a_ptrs,
                                   c->b_ptrs, c->scale_ptrs, c->b_transposed, ps->rows, ps->row_slots, ps->num_rows,
                                   c->in_dim, c->rank, c->weights_bf16, num_threads) != 0)
            return LP_LORA_FAILED + p;
    }
    return 0;
}

int loraplex_decoder_layers(const struct loraplex_layer *layers, int n_layers, const struct loraplex_step *s,
                            int num_threads)
{
    /* On return h holds the residual stream after the last layer (its MLP output added). */
    const int m = s->rows, width = (s->heads + 2 * s->kv_heads) * s->head_dim, qw = s->heads * s->head_dim;
    const int nb = s->act_bf16, hid = s->hidden;
    if (nb && s->lora != NULL) return -1;
    int rc = 0;
    for (int i = 0; i < n_layers && rc == 0; i++) {
        const struct loraplex_layer *l = &layers[i];
        loraplex_add_rms_norm_f32(s->h, hid, i > 0 ? s->res : NULL, hid, nb, s->x, hid, nb, l->input_norm, s->eps,
                                  m, hid, num_threads);
        if ((rc = lp_matmul(s, &l->qkv, s->x, s->qkv, 0, num_threads)) != 0) break;
        if ((rc = lp_lora(s, i, 0, s->x, hid, s->qkv, width, num_threads)) != 0) break;
        rc = loraplex_rope_store_f32(s->qkv, width, nb, nb ? l->qkv.bias : NULL, s->cos, s->sin, s->cs_row_stride,
                                     s->cs_head_stride, s->head_scale, s->q, qw, l->k_pool, l->v_pool, s->kv_bf16,
                                     s->pool_slots, s->slots, m, s->heads, s->kv_heads, s->head_dim, num_threads);
        if (rc != 0) break;
        rc = decode_attention(s->q, qw, s->head_dim, NULL, l->k_pool, l->v_pool, s->pool_slots, s->row_blocks,
                              s->blocks_per_seq, s->row_lens, s->attn, qw, nb, m, s->heads, s->kv_heads, s->head_dim,
                              s->block_size, s->max_len, num_threads, s->kv_bf16, s->amx);
        if (rc != 0) break;
        if ((rc = lp_matmul(s, &l->o, s->attn, s->res, 0, num_threads)) != 0) break;
        if ((rc = lp_lora(s, i, 1, s->attn, qw, s->res, hid, num_threads)) != 0) break;
        loraplex_add_rms_norm_f32(s->h, hid, s->res, hid, nb, s->x, hid, nb, l->post_norm, s->eps, m, hid,
                                  num_threads);
        if (s->gate_up == NULL) {
            if ((rc = lp_matmul(s, &l->gate_up, s->x, s->mlp, 1, num_threads)) != 0) break;
        } else {
            if ((rc = lp_matmul(s, &l->gate_up, s->x, s->gate_up, 0, num_threads)) != 0) break;
            if ((rc = lp_lora(s, i, 2, s->x, hid, s->gate_up, 2 * s->inter, num_threads)) != 0) break;
            loraplex_silu_mul_f32(s->gate_up, 2 * s->inter, nb, s->mlp, s->inter, nb, m, s->inter, num_threads);
        }
        if ((rc = lp_matmul(s, &l->down, s->mlp, s->res, 0, num_threads)) != 0) break;
        if ((rc = lp_lora(s, i, 3, s->mlp, s->inter, s->res, hid, num_threads)) != 0) break;
    }
    if (rc != 0) return rc;
    const int64_t n = (int64_t)m * hid;
    if (nb) {
        const uint16_t *r = s->res;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= PARALLEL_MIN_ELEMS)
        for (int64_t e = 0; e < n; e++) s->h[e] += bf16_to_f32(r[e]);
    } else {
        const float *r = s->res;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= PARALLEL_MIN_ELEMS)
        for (int64_t e = 0; e < n; e++) s->h[e] += r[e];
    }
    return 0;
}
