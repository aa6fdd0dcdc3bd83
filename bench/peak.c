/* The multiply units' peak on this CPU, for bench/block_matmul.py: a loop of nothing but the
 * instruction each base-weights format's kernel multiplies with, on independent accumulators in
 * registers (no loads), on ``threads`` OpenMP threads. Returns GFLOP/s (a multiply-add counts 2),
 * or -1 where this build has no such instruction.
 *
 *   kind 0: float32 FMA, the widest vector this build has (zmm with AVX-512, else ymm with FMA)
 *   kind 1: bfloat16 pair dot product (AVX512-BF16 vdpbf16ps: 16 lanes x 2 multiply-adds)
 *   kind 2: 8-bit dot product (AVX512-VNNI vpdpbusd: 16 lanes x 4 multiply-adds)
 *
 * Built by block_matmul.py with the native kernels' compiler and flags (-march=native). */
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#define ACC 12 /* independent chains: enough to cover the latency of any of these on current cores */

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Keeps a vector alive without storing it: the loop cannot be dropped. */
#define KEEP(v) __asm__ volatile("" : "+v"(v))

static double fma_f32(long iters)
{
#if defined(__AVX512F__)
    __m512 a[ACC], x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
    for (int i = 0; i < ACC; i++) a[i] = _mm512_setzero_ps();
    for (long n = 0; n < iters; n++)
        for (int i = 0; i < ACC; i++) a[i] = _mm512_fmadd_ps(x, y, a[i]);
    for (int i = 0; i < ACC; i++) KEEP(a[i]);
    return 32.0 * ACC * (double)iters;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[ACC], x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(1e-9f);
    for (int i = 0; i < ACC; i++) a[i] = _mm256_setzero_ps();
    for (long n = 0; n < iters; n++)
        for (int i = 0; i < ACC; i++) a[i] = _mm256_fmadd_ps(x, y, a[i]);
    for (int i = 0; i < ACC; i++) KEEP(a[i]);
    return 16.0 * ACC * (double)iters;
#else
    (void)iters;
    return -1.0;
#endif
}

static double dp_bf16(long iters)
{
#if defined(__AVX512BF16__)
    __m512 a[ACC];
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3000);
    for (int i = 0; i < ACC; i++) a[i] = _mm512_setzero_ps();
    for (long n = 0; n < iters; n++)
        for (int i = 0; i < ACC; i++) a[i] = _mm512_dpbf16_ps(a[i], x, y);
    for (int i = 0; i < ACC; i++) KEEP(a[i]);
    return 64.0 * ACC * (double)iters;
#else
    (void)iters;
    return -1.0;
#endif
}

static double dp_int8(long iters)
{
#if defined(__AVX512VNNI__)
    __m512i a[ACC];
    const __m512i x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(1);
    for (int i = 0; i < ACC; i++) a[i] = _mm512_setzero_si512();
    for (long n = 0; n < iters; n++)
        for (int i = 0; i < ACC; i++) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
    for (int i = 0; i < ACC; i++) KEEP(a[i]);
    return 128.0 * ACC * (double)iters;
#else
    (void)iters;
    return -1.0;
#endif
}

double loraplex_bench_peak(int kind, long iters, int threads)
{
    double (*fn)(long) = kind == 0 ? fma_f32 : kind == 1 ? dp_bf16 : kind == 2 ? dp_int8 : NULL;
    if (fn == NULL || fn(1) < 0) return -1.0;
    double flops = 0.0;
    const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    flops += fn(iters);
    return flops / (now() - t0) / 1e9;
}
