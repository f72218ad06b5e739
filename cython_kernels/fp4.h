/* FP4 products y = x @ W.T with W in FP4 E2M1 codes and a UE8M0 scale per 32 (core.quant.FP4:
 * DeepSeek V4's routed experts, Kimi K3's MXFP4, the bits they ship) -- cython_kernels/fp4.pxi.
 *
 * A row's byte i holds column 2i (low nibble) and 2i + 1 (high); a code's bit 3 is the sign,
 * bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}; group g (columns 32g .. 32g + 31) is scaled by
 * 2^(s[g] - 127) (byte 255: NaN).  value = E2M1[code] * scale is exact in float32 (or +-inf past
 * its range): decoding is a 16-entry table times a power of two, never a rounding.
 *
 * Order.  Each group's 16 bytes give, per byte j, columns 32g + 2j and 32g + 2j + 1.  We sum in
 * "positions": position 32g + j is column 32g + 2j, position 32g + 16 + j column 32g + 2j + 1 (zero
 * past K).  x is laid out once per call in that order (coli_f4_lay_x) and every y[t][o] is dense.h's
 * order over positions:
 *
 *     16 lanes: lane j = fma chain over positions p = j (mod 16) in increasing p, from +0,
 *     then dense.h's fixed tree (coli_dn_fold).
 *
 * So lane j takes, group after group, the low nibble of byte 16g + j, then its high nibble: one
 * 16-lane vector of bytes feeds two FMAs with no interleaving shuffle, and y is bit for bit
 * dense_matmul(x_pos, W_pos) of the permuted float32 arrays (tests/test_fp4.py).  Every variant
 * (AVX-512 one zmm of lanes, AVX2 two ymm, NEON four q registers, portable fmaf), every thread
 * count, every row count (decode runs a fused row kernel, many rows decode a panel of W and
 * run dense.h's tiles) and every grouping of matrices gives the same bits.  Partial last groups: the missing columns
 * are zero products (fma(0, 0, lane) = lane), and the padding nibble of an odd K is never read.
 *
 * Decode per group, AVX-512: the 16 bytes widened to 32-bit lanes, the scale byte's row of value
 * tables (coli_f4_val), vpermps of the byte (it reads the low 4 bits: the low nibble's code, sign
 * included) and of byte >> 4, two FMAs.  AVX2: vpermps reads 3 bits, so the values' two non-zero
 * bytes are looked up with vpshufb instead, 32 codes at once (coli_f4_group256).  NEON: the value
 * table looked up byte-wise (coli_f4_group_neon), two rows a pass.
 */
#ifndef COLI_FP4_H
#define COLI_FP4_H

#include <math.h>
#include "dense.h"

enum { COLI_F4_G = 32 };      /* columns per scale */
enum { COLI_F4_RB = 64 };     /* weight rows per work block of a one-row product */
enum { COLI_F4_R512 = 4 };    /* row streams per pass of the AVX-512 one-row kernel */
enum { COLI_F4_R256 = 2 };    /* and of the AVX2 one */

static const float coli_e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Every code's value under every scale byte b (2^(b - 127): b = 0 the subnormal 2^-127, b = 255
 * NaN), float32 products E2M1[c] * 2^(b - 127) (exact, or +-inf), filled once by coli_f4_init when
 * the extension loads: a group reads its 16 values (64 bytes) straight from here -- AVX-512's
 * vpermps takes them as its memory operand -- instead of scaling a table per group (one vmulps
 * per 16 bytes: 0.86-0.90 of the int4 kernel's decode speed on one core, 6 operations per 16
 * bytes like int4's without it).  coli_f4_b23: AVX2's byte form (coli_f4_group256). */
static float coli_f4_val[256][16];
static uint8_t coli_f4_b23[256][64];

/* AVX2's form of coli_f4_val: every value has its low 16 bits zero (at most two significant bits,
 * or a subnormal multiple of 2^-128, +-inf, NaN), so it is the 16-bit pattern of bits 16-31, and
 * a group looks up those two bytes with vpshufb (coli_f4_group256): row b holds byte 2 of the 16
 * values twice (both 128-bit lanes), then byte 3 twice. */
static void coli_f4_init_b23(int b)
{
    int c, k;
    for (c = 0; c < 16; c++) {
        uint32_t u;
        memcpy(&u, &coli_f4_val[b][c], sizeof u);
        for (k = 0; k < 2; k++) {
            coli_f4_b23[b][16 * k + c] = (uint8_t)(u >> 16);
            coli_f4_b23[b][32 + 16 * k + c] = (uint8_t)(u >> 24);
        }
    }
}

static void coli_f4_init(void)
{
    int b, c;
    for (b = 0; b < 256; b++) {
        uint32_t u = b == 0 ? 0x00400000u : b == 255 ? 0x7FC00000u : (uint32_t)b << 23;
        float s;
        memcpy(&s, &u, sizeof u);
        for (c = 0; c < 16; c++)
            coli_f4_val[b][c] = coli_e2m1[c] * s;
        coli_f4_init_b23(b);
    }
}

/* Positions per row: K rounded up to whole groups. */
static coli_idx coli_f4_kp(coli_idx K)
{
    return (K + COLI_F4_G - 1) / COLI_F4_G * COLI_F4_G;
}

/* Row stride of x laid out in positions: kp plus 16 floats (rows of a tile off each other's L1
 * sets, as coli_dn_ldx). */
static coli_idx coli_f4_ldx(coli_idx K)
{
    return coli_f4_kp(K) + 16;
}

/* Rows [t0, t1) of x [.][K] into X [.][ldx] in positions, zeros past K and up to ldx. */
static void coli_f4_lay_x(const float *x, coli_idx K, coli_idx t0, coli_idx t1, float *X,
                          coli_idx ldx)
{
    coli_idx t, p, kp = coli_f4_kp(K);
    for (t = t0; t < t1; t++) {
        const float *xr = x + t * K;
        float *o = X + t * ldx;
        for (p = 0; p < kp; p++) {
            coli_idx j = p % COLI_F4_G, col = p - j + (j < 16 ? 2 * j : 2 * (j - 16) + 1);
            o[p] = col < K ? xr[col] : 0.0f;
        }
        for (; p < ldx; p++)
            o[p] = 0.0f;
    }
}

/* Group g of a row (bytes w, ldb = ceil(K/2) a row) decoded into positions out[0..32): exact
 * values, zeros past K. */
static void coli_f4_group_portable(const uint8_t *w, coli_idx ldb, uint8_t sb, coli_idx g, coli_idx K,
                                   float *out)
{
    const float *v = coli_f4_val[sb];
    int j;
    for (j = 0; j < 16; j++) {
        coli_idx col = COLI_F4_G * g + 2 * j, byte = col / 2;
        uint8_t b = byte < ldb ? w[byte] : 0;
        out[j] = col < K ? v[b & 15] : 0.0f;
        out[16 + j] = col + 1 < K ? v[b >> 4] : 0.0f;
    }
}

#if COLI_X86
COLI_T_AVX512 static inline void coli_f4_group512(const uint8_t *w, uint8_t sb, __m512 *lo, __m512 *hi)
{
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
    __m512 lut = _mm512_loadu_ps(coli_f4_val[sb]);
    *lo = _mm512_permutexvar_ps(b, lut);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
}

/* A whole group (16 bytes w, the scale byte's coli_f4_b23 row t): v[0] = the values of the low
 * nibbles of bytes 0-7 (lanes 0-7), v[1] of bytes 8-15, v[2] / v[3] of the high nibbles.
 * vpermps reads 3 bits, so a 16-entry float table took a sign fix-up per 8 values (two shifts and
 * an xor: 20 vector operations a group with the FMAs, ~7 cycles on a Zen 4 core).  Here vpshufb
 * looks up 32 codes at once in the two 16-byte tables (bytes 2 and 3 of every value), an unpack
 * pairs them into 16-bit patterns, and each 32-bit lane takes its even pattern by a shift (the
 * low nibble of byte 4h + l for lane l of half h), its odd one by an and (byte 8 + 4h + l): 15
 * operations.  For that the codes are arranged first (a vpshufb, a shift of the odd qwords by 4,
 * an and): byte 2l / 2l + 1 of half h the codes of bytes 4h + l / 8 + 4h + l, the low nibbles in
 * bytes 0-7 of the half, the high ones in 8-15.  The same floats as coli_f4_val, -0 included. */
COLI_T_AVX2 static inline void coli_f4_group256(const uint8_t *w, const uint8_t *t, __m256 v[4])
{
    const __m256i arr = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 0, 8, 1, 9, 2, 10, 3, 11,
                                         4, 12, 5, 13, 6, 14, 7, 15, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i cnt = _mm256_setr_epi64x(0, 4, 0, 4), m15 = _mm256_set1_epi8(15);
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i y = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w));
    __m256i c = _mm256_and_si256(_mm256_srlv_epi64(_mm256_shuffle_epi8(y, arr), cnt), m15);
    __m256i b2 = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)t), c);
    __m256i b3 = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(t + 32)), c);
    __m256i lo = _mm256_unpacklo_epi8(b2, b3), hi = _mm256_unpackhi_epi8(b2, b3);
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(lo, top));
    v[2] = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
    v[3] = _mm256_castsi256_ps(_mm256_and_si256(hi, top));
}

/* A whole group's 32 values into out, in positions. */
COLI_T_AVX512 static void coli_f4_store512(const uint8_t *w, uint8_t sb, float *out)
{
    __m512 lo, hi;
    coli_f4_group512(w, sb, &lo, &hi);
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
}

COLI_T_AVX2 static void coli_f4_store256(const uint8_t *w, uint8_t sb, float *out)
{
    __m256 v[4];
    int q;
    coli_f4_group256(w, coli_f4_b23[sb], v);
    for (q = 0; q < 4; q++)
        _mm256_storeu_ps(out + 8 * q, v[q]);
}
#endif

#if COLI_ARM
/* NEON: the group's 16 values (coli_f4_val, 64 bytes, four q registers) looked up byte-wise
 * (vqtbl4q_u8): four index bytes 4c .. 4c + 3 per value, from the codes by a spreading
 * vqtbl1q_u8 and an add.  The table's exact floats, -0 included. */
typedef struct { uint8x16x4_t tab; } coli_f4_tab_neon;

static inline coli_f4_tab_neon coli_f4_tab(uint8_t sb)
{
    coli_f4_tab_neon t;
    int q;
    for (q = 0; q < 4; q++)
        t.tab.val[q] = vld1q_u8((const uint8_t *)(coli_f4_val[sb] + 4 * q));
    return t;
}

/* values of codes c4 (= 4 * code, 16 of them) 4q .. 4q + 3 */
static inline float32x4_t coli_f4_look(const coli_f4_tab_neon *t, uint8x16_t c4, int q)
{
    static const uint8_t spread[4][16] = {
        {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
        {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
        {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};
    static const uint8_t inc[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
    uint8x16_t idx = vaddq_u8(vqtbl1q_u8(c4, vld1q_u8(spread[q])), vld1q_u8(inc));
    return vreinterpretq_f32_u8(vqtbl4q_u8(t->tab, idx));
}

/* A whole group (16 bytes) into 4 x 4 low-nibble values lo[q] and high-nibble values hi[q]. */
static inline void coli_f4_group_neon(const uint8_t *w, uint8_t sb, float32x4_t *lo, float32x4_t *hi)
{
    coli_f4_tab_neon t = coli_f4_tab(sb);
    uint8x16_t b = vld1q_u8(w);
    uint8x16_t l4 = vshlq_n_u8(vandq_u8(b, vdupq_n_u8(15)), 2), h4 = vshlq_n_u8(vshrq_n_u8(b, 4), 2);
    int q;
    for (q = 0; q < 4; q++) {
        lo[q] = coli_f4_look(&t, l4, q);
        hi[q] = coli_f4_look(&t, h4, q);
    }
}

static void coli_f4_store_neon(const uint8_t *w, uint8_t sb, float *out)
{
    float32x4_t lo[4], hi[4];
    int q;
    coli_f4_group_neon(w, sb, lo, hi);
    for (q = 0; q < 4; q++) {
        vst1q_f32(out + 4 * q, lo[q]);
        vst1q_f32(out + 16 + 4 * q, hi[q]);
    }
}

/* Two rows a pass, lanes 4q .. 4q + 3 of a row in accumulator q. */
static void coli_f4_rows_neon(const float *xp, const uint8_t *W, const uint8_t *S, coli_idx K,
                              coli_idx o0, coli_idx o1, float *y)
{
    coli_idx ldb = (K + 1) / 2, ng = (K + COLI_F4_G - 1) / COLI_F4_G, full = K / COLI_F4_G, o, g;
    float lanes[COLI_DN_L], v[COLI_F4_G];
    for (o = o0; o < o1;) {
        int R = o1 - o >= 2 ? 2 : 1, r, q;
        float32x4_t a[2][4], lo[4], hi[4];
        for (r = 0; r < 2; r++)
            for (q = 0; q < 4; q++)
                a[r][q] = vdupq_n_f32(0.0f);
        for (g = 0; g < ng; g++) {
            const float *xg = xp + COLI_F4_G * g;
            for (r = 0; r < R; r++) {
                const uint8_t *wr = W + (o + r) * ldb;
                uint8_t sc = S[(o + r) * ng + g];
                if (g < full) {
                    coli_f4_group_neon(wr + 16 * g, sc, lo, hi);
                } else {            /* a partial last group: the portable decoder's values */
                    coli_f4_group_portable(wr, ldb, sc, g, K, v);
                    for (q = 0; q < 4; q++) {
                        lo[q] = vld1q_f32(v + 4 * q);
                        hi[q] = vld1q_f32(v + 16 + 4 * q);
                    }
                }
                for (q = 0; q < 4; q++)
                    a[r][q] = vfmaq_f32(a[r][q], vld1q_f32(xg + 4 * q), lo[q]);
                for (q = 0; q < 4; q++)
                    a[r][q] = vfmaq_f32(a[r][q], vld1q_f32(xg + 16 + 4 * q), hi[q]);
            }
        }
        for (r = 0; r < R; r++) {
            for (q = 0; q < 4; q++)
                vst1q_f32(lanes + 4 * q, a[r][q]);
            y[o + r] = coli_dn_fold(lanes);
        }
        o += R;
    }
}
#endif

/* Positions [p0, p0 + n) (p0, n multiples of 32) of weight rows [o, o + c) decoded into
 * P [c][ldp]: the W panel of dense.h's tiles. */
static void coli_f4_panel(int lv, const uint8_t *W, const uint8_t *S, coli_idx K, coli_idx o, int c,
                          coli_idx p0, coli_idx n, float *P, coli_idx ldp)
{
    coli_idx ldb = (K + 1) / 2, ng = (K + COLI_F4_G - 1) / COLI_F4_G, g, full = K / COLI_F4_G;
    int r;
    for (r = 0; r < c; r++) {
        const uint8_t *w = W + (o + r) * ldb, *s = S + (o + r) * ng;
        for (g = p0 / COLI_F4_G; g < (p0 + n) / COLI_F4_G; g++) {
            uint8_t sc = s[g];
            float *out = P + r * ldp + (COLI_F4_G * g - p0);
#if COLI_X86
            if (g < full && lv == COLI_AVX512) {
                coli_f4_store512(w + 16 * g, sc, out);
                continue;
            }
            if (g < full && lv == COLI_AVX2) {
                coli_f4_store256(w + 16 * g, sc, out);
                continue;
            }
#endif
#if COLI_ARM
            if (g < full && lv == COLI_NEON) {
                coli_f4_store_neon(w + 16 * g, sc, out);
                continue;
            }
#endif
            coli_f4_group_portable(w, ldb, sc, g, K, out);
        }
    }
    (void)full;
    (void)lv;
}

/* ---- one row of x: fused decode + FMA, rows [o0, o1) -------------------------------------- */
static void coli_f4_rows_portable(const float *xp, const uint8_t *W, const uint8_t *S, coli_idx K,
                                  coli_idx o0, coli_idx o1, float *y)
{
    coli_idx ldb = (K + 1) / 2, ng = (K + COLI_F4_G - 1) / COLI_F4_G, o, g;
    float a[COLI_DN_L], v[COLI_F4_G];
    int j;
    for (o = o0; o < o1; o++) {
        for (j = 0; j < COLI_DN_L; j++)
            a[j] = 0.0f;
        for (g = 0; g < ng; g++) {
            const float *xg = xp + COLI_F4_G * g;
            coli_f4_group_portable(W + o * ldb, ldb, S[o * ng + g], g, K, v);
            for (j = 0; j < COLI_DN_L; j++)
                a[j] = fmaf(xg[j], v[j], a[j]);
            for (j = 0; j < COLI_DN_L; j++)
                a[j] = fmaf(xg[16 + j], v[16 + j], a[j]);
        }
        y[o] = coli_dn_fold(a);
    }
}

#if COLI_X86
/* Four row streams a pass (rows o0 + r q + i of a block of 4 q rows: one x load per group feeds
 * them), the rows left over alone; a partial last group decoded by the portable routine (the same
 * values).  Each stream asks for its next row one pass ahead, one prefetch per line.  One thread,
 * loaded machine, GB/s against the int4 kernel's: 4 adjacent rows with 512 bytes ahead in the row
 * 0.4-0.5 at 32768 x 4096 (DRAM); the next pass's rows prefetched 0.9, but 0.74 at 151936 x 2048;
 * 4 streams a quarter of the block apart (as int4's rows r and r + half) 0.93-1.0 at both and
 * ~1.0 at 7168 x 2048 (L3); 2 streams 0.88-0.92. */
COLI_T_AVX512 static void coli_f4_rows512(const float *xp, const uint8_t *W, const uint8_t *S,
                                          coli_idx K, coli_idx o0, coli_idx o1, float *y)
{
    coli_idx ldb = (K + 1) / 2, ng = (K + COLI_F4_G - 1) / COLI_F4_G, full = K / COLI_F4_G, i, g;
    coli_idx q = (o1 - o0) / COLI_F4_R512, o;     /* stream r: rows o0 + r q .. o0 + (r + 1) q - 1 */
    for (i = 0; i < q + (o1 - o0) % COLI_F4_R512; i++) {
        int R = i < q ? COLI_F4_R512 : 1, r;
        coli_idx rows[COLI_F4_R512];
        __m512 a[COLI_F4_R512];
        for (r = 0; r < COLI_F4_R512; r++) {
            rows[r] = i < q ? o0 + r * q + i : o0 + COLI_F4_R512 * q + (i - q);
            a[r] = _mm512_setzero_ps();
        }
        for (g = 0; g < full; g++) {
            __m512 xe = _mm512_loadu_ps(xp + COLI_F4_G * g), xo = _mm512_loadu_ps(xp + COLI_F4_G * g + 16);
#pragma GCC unroll 4
            for (r = 0; r < COLI_F4_R512; r++) {
                if (r < R) {
                    __m512 lo, hi;
                    if ((g & 3) == 0)     /* the stream's next row, one line in four groups */
                        _mm_prefetch((const char *)(W + (rows[r] + 1) * ldb + 16 * g), _MM_HINT_T0);
                    coli_f4_group512(W + rows[r] * ldb + 16 * g, S[rows[r] * ng + g], &lo, &hi);
                    a[r] = _mm512_fmadd_ps(xe, lo, a[r]);
                    a[r] = _mm512_fmadd_ps(xo, hi, a[r]);
                }
            }
        }
        for (r = 0; r < R; r++) {
            o = rows[r];
            if (g < ng) {
                float v[COLI_F4_G];
                coli_f4_group_portable(W + o * ldb, ldb, S[o * ng + g], g, K, v);
                a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + COLI_F4_G * g), _mm512_loadu_ps(v), a[r]);
                a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + COLI_F4_G * g + 16), _mm512_loadu_ps(v + 16), a[r]);
            }
            y[o] = coli_dn_fold512(a[r]);
        }
    }
}

/* The whole groups of R rows (a constant where it is inlined): row r's lanes 0-7 / 8-15 in
 * a[r][0] / a[r][1], one x load feeding the R rows; each stream asks for its next row one line
 * (four groups) ahead. */
COLI_T_AVX2 COLI_INLINE void coli_f4_pass256(const float *xp, const uint8_t *W, const uint8_t *S,
                                             coli_idx ldb, coli_idx ng, coli_idx full,
                                             const coli_idx *rows, const int R, __m256 (*a)[2])
{
    coli_idx g;
    int r, h;
    for (g = 0; g < full; g++) {
        const float *xg = xp + COLI_F4_G * g;
        if ((g & 3) == 0)
            for (r = 0; r < R; r++)
                _mm_prefetch((const char *)(W + (rows[r] + 1) * ldb + 16 * g), _MM_HINT_T0);
        for (r = 0; r < R; r++) {
            __m256 v[4];
            coli_f4_group256(W + rows[r] * ldb + 16 * g, coli_f4_b23[S[rows[r] * ng + g]], v);
            for (h = 0; h < 2; h++) {
                a[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * h), v[h], a[r][h]);
                a[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16 + 8 * h), v[2 + h], a[r][h]);
            }
        }
    }
}

/* Two row streams a pass, half the block apart (rows o0 + i and o0 + q + i, as int4's AVX2 lane
 * kernel pairs r with r + half), a row left over alone; a partial last group decoded by the
 * portable routine (the same values).  Four streams (the AVX-512 kernel's) ran no faster: the
 * decode's operations, not the FMA chains, set the pace, and eight accumulators spill. */
COLI_T_AVX2 static void coli_f4_rows256(const float *xp, const uint8_t *W, const uint8_t *S,
                                        coli_idx K, coli_idx o0, coli_idx o1, float *y)
{
    coli_idx ldb = (K + 1) / 2, ng = (K + COLI_F4_G - 1) / COLI_F4_G, full = K / COLI_F4_G, i;
    coli_idx g = full, q = (o1 - o0) / COLI_F4_R256, o;
    for (i = 0; i < q + (o1 - o0) % COLI_F4_R256; i++) {
        int R = i < q ? COLI_F4_R256 : 1, r, h;
        coli_idx rows[COLI_F4_R256];
        __m256 a[COLI_F4_R256][2];
        for (r = 0; r < COLI_F4_R256; r++) {
            rows[r] = i < q ? o0 + r * q + i : o0 + COLI_F4_R256 * q + (i - q);
            a[r][0] = a[r][1] = _mm256_setzero_ps();
        }
        if (R == COLI_F4_R256)
            coli_f4_pass256(xp, W, S, ldb, ng, full, rows, COLI_F4_R256, a);
        else
            coli_f4_pass256(xp, W, S, ldb, ng, full, rows, 1, a);
        for (r = 0; r < R; r++) {
            o = rows[r];
            if (g < ng) {
                float v[COLI_F4_G];
                coli_f4_group_portable(W + o * ldb, ldb, S[o * ng + g], g, K, v);
                for (h = 0; h < 2; h++) {
                    a[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + COLI_F4_G * g + 8 * h),
                                              _mm256_loadu_ps(v + 8 * h), a[r][h]);
                    a[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + COLI_F4_G * g + 16 + 8 * h),
                                              _mm256_loadu_ps(v + 16 + 8 * h), a[r][h]);
                }
            }
            y[o] = coli_dn_fold256(a[r][0], a[r][1]);
        }
    }
}
#endif

/* y[o] for o in [o0, o1) of one laid-out row xp (positions). */
static void coli_f4_rows(int level, const float *xp, const uint8_t *W, const uint8_t *S, coli_idx K,
                         coli_idx o0, coli_idx o1, float *y)
{
    int lv = coli_dn_level(level);
#if COLI_X86
    if (lv == COLI_AVX512) {
        coli_f4_rows512(xp, W, S, K, o0, o1, y);
        return;
    }
    if (lv == COLI_AVX2) {
        coli_f4_rows256(xp, W, S, K, o0, o1, y);
        return;
    }
#endif
#if COLI_ARM
    if (lv == COLI_NEON) {
        coli_f4_rows_neon(xp, W, S, K, o0, o1, y);
        return;
    }
#endif
    coli_f4_rows_portable(xp, W, S, K, o0, o1, y);
}

/* ---- many rows: dense.h's tiles over decoded W panels ---------------------------------------- */
/* One work block: y[t * ldy + o], t in [t0, t1) (<= COLI_DN_TB), o in [o0, o1) (<= COLI_DN_OB);
 * X laid out by coli_f4_lay_x (stride ldx).  scratch: coli_dn_scratch_floats(T > 1, .). */
static void coli_f4_block(int level, const float *X, coli_idx ldx, const uint8_t *W, const uint8_t *S,
                          coli_idx K, coli_idx t0, coli_idx t1, coli_idx o0, coli_idx o1, float *y,
                          coli_idx ldy, float *scratch)
{
    int lv = coli_dn_level(level), R, C;
    coli_idx k0, o, t, kp = coli_f4_kp(K);
    float *accs = scratch, *wp = scratch + COLI_DN_TB * COLI_DN_OB * COLI_DN_L;
    coli_dn_tile_shape(lv, 2, &R, &C);
    for (k0 = 0; k0 < kp || k0 == 0; k0 += COLI_DN_KC) {     /* K == 0: one empty panel, y = 0 */
        coli_idx kn = kp - k0 < COLI_DN_KC ? kp - k0 : COLI_DN_KC;
        int first = k0 == 0, last = k0 + kn >= kp, c;
        for (o = o0; o < o1; o += c) {
            c = o1 - o >= C ? C : lv == COLI_AVX512 || lv == COLI_AVX2 ? 1 : (int)(o1 - o);
            coli_f4_panel(lv, W, S, K, o, c, k0, kn, wp, COLI_DN_LDP);
            for (t = t0; t < t1; t += R) {
                int r = t1 - t >= R ? R : (int)(t1 - t);
                coli_dn_tile(lv, X + t * ldx + k0, ldx, wp, COLI_DN_LDP, kn, r, c,
                             accs + ((t - t0) * COLI_DN_OB + (o - o0)) * COLI_DN_L, y + t * ldy + o,
                             ldy, first, last);
            }
        }
    }
}

#endif /* COLI_FP4_H */
