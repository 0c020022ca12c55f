/* deploykit::SaPE2Distance for ONNX Runtime's CPU provider: a custom-op library.
 *
 * out[b, h, P + i, P + j] = |Zx_i - Zx_j| + |Zy_i - Zy_j|  (SaPE² Eq. 15, the direct form), prefix
 * rows and columns 0, from Zx [B, h, N, W] and Zy [B, h, N, H] (fp32, tokens row-major). With the
 * optional third input, logits [B, h, P + N, P + N], out = logits + distances: the Add of the
 * attention logits that would otherwise read and write [B, h, T, T] once more, in the same fp32
 * addition it does.
 *
 * The direct form in fp32 is exact where the arithmetic allows: the diagonal and every pair of
 * equal signatures are exactly 0 and the result is exactly symmetric, since (a - b)^2 == (b - a)^2
 * and every pair's terms are summed in one order. Each pair is computed once (tiles on and above
 * the diagonal; the tile below is its mirror), over ONNX Runtime's own intra-op thread pool.
 *
 * ONNX Runtime's wheel has no C headers, so this file declares the part of its stable C ABI it
 * uses: OrtApi is a table of function pointers that only ever grows at its end, and each entry
 * used here is named by its index in that table (onnxruntime_c_api.h, API version 17 onwards; the
 * Python side checks the library against the running ONNX Runtime before any session uses it).
 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define API_VERSION 17 /* KernelContext_ParallelFor arrived in 1.17 */

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef void *const *OrtApiTable;

typedef struct OrtApiBase {
  OrtApiTable (*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

/* Indices into OrtApi. */
enum {
  CREATE_STATUS = 0,
  GET_TENSOR_MUTABLE_DATA = 51,
  GET_TENSOR_ELEMENT_TYPE = 60,
  GET_DIMENSIONS_COUNT = 61,
  GET_DIMENSIONS = 62,
  GET_TENSOR_TYPE_AND_SHAPE = 65,
  CREATE_CUSTOM_OP_DOMAIN = 26,
  CUSTOM_OP_DOMAIN_ADD = 27,
  ADD_CUSTOM_OP_DOMAIN = 28,
  KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
  KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
  KERNEL_CONTEXT_GET_INPUT = 90,
  KERNEL_CONTEXT_GET_OUTPUT = 91,
  RELEASE_STATUS = 93,
  RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
  KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { ELEMENT_FLOAT = 1 };

typedef OrtStatus *(*CreateStatusFn)(int code, const char *msg);
typedef OrtStatus *(*GetTensorMutableDataFn)(OrtValue *, void **);
typedef OrtStatus *(*GetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo *, int *);
typedef OrtStatus *(*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t);
typedef OrtStatus *(*GetTensorTypeAndShapeFn)(const OrtValue *, OrtTensorTypeAndShapeInfo **);
typedef OrtStatus *(*CreateCustomOpDomainFn)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*CustomOpDomainAddFn)(OrtCustomOpDomain *, const void *);
typedef OrtStatus *(*AddCustomOpDomainFn)(OrtSessionOptions *, OrtCustomOpDomain *);
typedef OrtStatus *(*KernelInfoGetAttributeInt64Fn)(const OrtKernelInfo *, const char *, int64_t *);
typedef OrtStatus *(*KernelInfoGetAttributeFloatFn)(const OrtKernelInfo *, const char *, float *);
typedef OrtStatus *(*KernelContextGetInputFn)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*KernelContextGetOutputFn)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef void (*ReleaseFn)(void *);
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);

#define API(table, index, type) ((type)(table)[index])

/* OrtCustomOp as of version 17 (the fields ONNX Runtime reads for that version). */
typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *, OrtApiTable, const OrtKernelInfo *);
  const char *(*GetName)(const struct OrtCustomOp *);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *);
  int (*GetInputType)(const struct OrtCustomOp *, size_t);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *);
  int (*GetOutputType)(const struct OrtCustomOp *, size_t);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *);
  void (*KernelCompute)(void *, OrtKernelContext *);
  void (*KernelDestroy)(void *);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *, size_t);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *, size_t);
  int (*GetInputMemoryType)(const struct OrtCustomOp *, size_t);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp *);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *);
  OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *, OrtApiTable, const OrtKernelInfo *, void **);
  OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
  OrtStatus *(*InferOutputShapeFn)(const struct OrtCustomOp *, void *);
  int (*GetStartVersion)(const struct OrtCustomOp *);
  int (*GetEndVersion)(const struct OrtCustomOp *);
  void *reserved[4]; /* fields of later versions, unset */
} OrtCustomOp;

/* ---- the kernel ---------------------------------------------------------------------------- */

/* One vector: 16 floats where AVX-512 gives 32 registers of 16, else 8 (AVX2's 16 registers of 8
 * would spill the accumulators of 16-float vectors, which run 10x slower there). */
#ifndef LANES /* (tests build both widths on any machine) */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#endif
#define TILE (2 * LANES) /* rows and columns of a tile: 2 vectors of columns, rows in groups of ROWS */
#define ROWS 4
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

typedef struct {
  const float *zx, *zy; /* [BH, N, W], [BH, N, H] */
  float *zt;            /* per (b, h): Zx then Zy in blocks of TILE tokens, [Npad / TILE, W or H, TILE], zero past N */
  const float *add;     /* [BH, T, T] logits added to the distances, or NULL */
  float *out;           /* [BH, T, T] */
  int64_t bh, n, w, h, p, npad, tiles;
} Job;

/* Squared distances of ROWS rows (row i0 of the block `rows`) to the TILE columns of the block
 * `cols` along one axis, added to acc. A block holds each dimension's TILE values side by side, so
 * the loop reads two contiguous blocks (a layout of one row per dimension across all N tokens
 * would put the dimensions a whole row apart, 4 KiB at N = 1024, all in one set of L1). */
static inline void axis_tile(const float *rows, const float *cols, int64_t dims, int64_t i0, vec acc[ROWS][2]) {
  for (int64_t k = 0; k < dims; ++k) {
    vec c0, c1;
    memcpy(&c0, cols + k * TILE, sizeof(vec));
    memcpy(&c1, cols + k * TILE + LANES, sizeof(vec));
    for (int r = 0; r < ROWS; ++r) {
      const float v = rows[k * TILE + i0 + r];
      vec d0 = c0 - v, d1 = c1 - v;
      acc[r][0] += d0 * d0;
      acc[r][1] += d1 * d1;
    }
  }
}

/* One tile: rows I..I+TILE, columns J..J+TILE of one (b, h); written at (i, j) and, off the
 * diagonal, at (j, i). */
static void tile(const Job *job, int64_t bh, int64_t I, int64_t J) {
  const int64_t n = job->n, npad = job->npad, t = job->p + n, w = job->w, h = job->h;
  const float *zx = job->zt + bh * npad * (w + h), *zy = zx + npad * w;
  float *out = job->out + bh * t * t;
  const float *add = job->add ? job->add + bh * t * t : NULL;
  float block[TILE][TILE];
  for (int64_t i0 = 0; i0 < TILE; i0 += ROWS) {
    vec ax[ROWS][2] = {{{0}}}, ay[ROWS][2] = {{{0}}};
    axis_tile(zx + I * w, zx + J * w, w, i0, ax);
    axis_tile(zy + I * h, zy + J * h, h, i0, ay);
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 2; ++c)
        for (int l = 0; l < LANES; ++l) block[i0 + r][c * LANES + l] = sqrtf(ax[r][c][l]) + sqrtf(ay[r][c][l]);
  }
  const int64_t rows = n - I < TILE ? n - I : TILE, cols = n - J < TILE ? n - J : TILE;
  if (add) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (job->p + I + r) * t + job->p + J;
      for (int64_t c = 0; c < cols; ++c) out[at + c] = add[at + c] + block[r][c];
    }
    if (I != J)
      for (int64_t c = 0; c < cols; ++c)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = (job->p + J + c) * t + job->p + I + r;
          out[at] = add[at] + block[r][c];
        }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) memcpy(out + (job->p + I + r) * t + job->p + J, block[r], cols * sizeof(float));
  if (I != J)
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = 0; r < rows; ++r) out[(job->p + J + c) * t + job->p + I + r] = block[r][c];
}

static void transpose_one(void *data, size_t bh) {
  const Job *job = data;
  const int64_t n = job->n, npad = job->npad;
  float *xt = job->zt + bh * npad * (job->w + job->h), *yt = xt + npad * job->w;
  const float *zx = job->zx + bh * n * job->w, *zy = job->zy + bh * n * job->h;
  memset(xt, 0, sizeof(float) * npad * (job->w + job->h));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = i / TILE * TILE, lane = i % TILE;
    for (int64_t k = 0; k < job->w; ++k) xt[(block * job->w) + k * TILE + lane] = zx[i * job->w + k];
    for (int64_t k = 0; k < job->h; ++k) yt[(block * job->h) + k * TILE + lane] = zy[i * job->h + k];
  }
  const int64_t t = job->p + n;
  float *out = job->out + bh * t * t;
  const float *add = job->add ? job->add + bh * t * t : NULL;
  if (job->p) { /* prefix rows, and the prefix columns of the patch rows: 0, or the logits there */
    if (add) {
      memcpy(out, add, sizeof(float) * job->p * t);
      for (int64_t i = 0; i < n; ++i) memcpy(out + (job->p + i) * t, add + (job->p + i) * t, sizeof(float) * job->p);
    } else {
      memset(out, 0, sizeof(float) * job->p * t);
      for (int64_t i = 0; i < n; ++i) memset(out + (job->p + i) * t, 0, sizeof(float) * job->p);
    }
  }
}

/* Work item: one (b, h) and one row of tiles, from the diagonal tile to the last. */
static void tile_row(void *data, size_t item) {
  const Job *job = data;
  const int64_t bh = (int64_t)item / job->tiles, I = ((int64_t)item % job->tiles) * TILE;
  for (int64_t J = I; J < job->n; J += TILE) tile(job, bh, I, J);
}

/* ---- the signatures (Eq. 9-14), deploykit::SaPE2Signatures ---------------------------------- */

/* out[i * ldo + j] = sum_k x[i * ldx + k] * yt[k * ldy + j] for i < rows, j < cols: a small matrix
 * product in the tiles above (ROWS rows by two vectors of columns); yt's rows are zero past cols up
 * to a whole tile (ldy). */
static void small_product(const float *x, int64_t ldx, const float *yt, int64_t ldy, int64_t rows, int64_t cols, int64_t d,
                          float *out, int64_t ldo) {
  for (int64_t i0 = 0; i0 < rows; i0 += ROWS) {
    const float *xr[ROWS];
    for (int r = 0; r < ROWS; ++r) xr[r] = x + (i0 + r < rows ? i0 + r : i0) * ldx; /* rows past the end repeat one */
    for (int64_t j0 = 0; j0 < cols; j0 += TILE) {
      vec acc[ROWS][2] = {{{0}}};
      for (int64_t k = 0; k < d; ++k) {
        vec c0, c1;
        memcpy(&c0, yt + k * ldy + j0, sizeof(vec));
        memcpy(&c1, yt + k * ldy + j0 + LANES, sizeof(vec));
        for (int r = 0; r < ROWS; ++r) {
          const float v = xr[r][k];
          acc[r][0] += c0 * v;
          acc[r][1] += c1 * v;
        }
      }
      const int64_t n = cols - j0 < TILE ? cols - j0 : TILE;
      for (int r = 0; r < ROWS && i0 + r < rows; ++r) {
        float row[TILE];
        memcpy(row, &acc[r][0], sizeof(vec));
        memcpy(row + LANES, &acc[r][1], sizeof(vec));
        memcpy(out + (i0 + r) * ldo + j0, row, n * sizeof(float));
      }
    }
  }
}

static int64_t whole_tiles(int64_t n) { return (n + TILE - 1) / TILE * TILE; }

typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec splat(float v) { return (vec){0} + v; }

/* 1 / (1 + exp(x)) lane by lane, x clamped to [-87, 87]: exp as 2^n times a degree-6 polynomial of
 * the rest (Cody-Waite reduction, within 2 ulp), in vector arithmetic, since the C library's expf
 * runs one lane at a time without -ffast-math. */
static inline vec logistic_of_minus(vec x) {
  const ivec low = x < splat(-87.f), high = x > splat(87.f);
  x = (vec)(((ivec)x & ~(low | high)) | ((ivec)splat(-87.f) & low) | ((ivec)splat(87.f) & high));
  const vec magic = splat(12582912.f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
  const vec n = (x * 1.44269504088896341f + magic) - magic;
  const vec r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  vec p = splat(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  p = (vec)((ivec)p + (__builtin_convertvector(n, ivec) << 23));
  return 1.f / (1.f + p);
}

/* One axis of one (b, h): `lines` lines of S tokens, token s of line l at row l * line_step + s *
 * token_step of a, b, c ([N, d]); e [d, M] padded to ldm columns. Gates sigma(scale a.b) within the
 * line (Eq. 9), their reverse cumulative sum clamped to M - 1 (Eq. 10), and c.E interpolated there
 * (Eq. 13-14), written at out[l * out_line + s * out_token + m]. */
static void axis_signatures(const float *a, const float *b, const float *c, const float *e, int64_t ldm, int64_t d, int64_t M,
                            int64_t lines, int64_t S, int64_t line_step, int64_t token_step, float scale, float *out, int64_t out_line,
                            int64_t out_token, float *work) {
  const int64_t lds = whole_tiles(S);
  float *at = work;            /* [d, lds]: a of the line, transposed, zero past S */
  float *gates = at + d * lds; /* [S, lds]: gates[m][s], the logit of token s's gate on token m */
  float *ce = gates + S * lds; /* [S, ldm]: c . E */
  float *pos = ce + S * ldm;   /* [lds]: each token's running suffix sum */
  memset(at, 0, sizeof(float) * d * lds);
  const float top = (float)(M - 1);
  for (int64_t line = 0; line < lines; ++line) {
    const int64_t first = line * line_step;
    for (int64_t s = 0; s < S; ++s)
      for (int64_t k = 0; k < d; ++k) at[k * lds + s] = a[(first + s * token_step) * d + k];
    small_product(b + first * d, token_step * d, at, lds, S, S, d, gates, lds);
    small_product(c + first * d, token_step * d, e, ldm, S, M, d, ce, ldm);
    memset(pos, 0, sizeof(float) * lds);
    float *o = out + line * out_line;
    for (int64_t m = S - 1; m >= 0; --m) { /* the suffix sum, added from the end as ONNX's reverse CumSum adds */
      const float *g = gates + m * lds;
      for (int64_t s = 0; s < S; s += LANES) { /* whole vectors: the rows are padded to a tile */
        vec gv, sum;
        memcpy(&gv, g + s, sizeof(vec));
        memcpy(&sum, pos + s, sizeof(vec));
        sum += logistic_of_minus(gv * -scale);
        memcpy(pos + s, &sum, sizeof(vec));
      }
      for (int64_t s = 0; s < S; ++s) {
        const float p = pos[s] < top ? pos[s] : top, lo = floorf(p);
        const int64_t i = (int64_t)lo, next = i + 1 < M ? i + 1 : M - 1;
        const float *row = ce + s * ldm;
        o[s * out_token + m] = row[i] + (p - lo) * (row[next] - row[i]);
      }
    }
  }
}

/* Zx [N, W] and Zy [N, H] of one (b, h) from its q, k [P + N, d] (prefix first, then the grid row
 * by row) and the tables ex, ey [d, M]; mode 0 gates (q, k) and projects q, 1 gates (q, k) and
 * projects k, 2 gates (k, q) and projects k. Returns non-zero when out of memory. */
int deploykit_sape2_signatures(const float *q, const float *k, const float *ex, const float *ey, int64_t d, int64_t M, int64_t H,
                               int64_t W, int64_t P, float scale, int64_t mode, float *zx, float *zy) {
  const float *a = (mode == 2 ? k : q) + P * d, *b = (mode == 2 ? q : k) + P * d, *c = (mode == 0 ? q : k) + P * d;
  const int64_t S = W > H ? W : H, lds = whole_tiles(S), ldm = whole_tiles(M);
  float *tables = calloc((size_t)(2 * d * ldm + d * lds + S * lds + S * ldm + lds), sizeof(float));
  if (!tables) return 1;
  for (int64_t r = 0; r < d; ++r) {
    memcpy(tables + r * ldm, ex + r * M, sizeof(float) * M);
    memcpy(tables + (d + r) * ldm, ey + r * M, sizeof(float) * M);
  }
  float *work = tables + 2 * d * ldm;
  axis_signatures(a, b, c, tables, ldm, d, M, H, W, W, 1, scale, zx, W * W, W, work);               /* rows */
  axis_signatures(a, b, c, tables + d * ldm, ldm, d, M, W, H, 1, W, scale, zy, H, W * H, work);     /* columns */
  free(tables);
  return 0;
}

/* Serial stand-in for ParallelFor (tests, and a context-free call). */
static void serial_for(void (*fn)(void *, size_t), size_t total, void *data) {
  for (size_t i = 0; i < total; ++i) fn(data, i);
}

/* The whole op on plain buffers: what the kernel runs, and what tests call through ctypes. */
int deploykit_sape2_distance(const float *zx, const float *zy, int64_t bh, int64_t n, int64_t w, int64_t h, int64_t p,
                             float *out) {
  Job job = {zx, zy, NULL, NULL, out, bh, n, w, h, p, (n + TILE - 1) / TILE * TILE, (n + TILE - 1) / TILE};
  job.zt = malloc(sizeof(float) * (size_t)(bh * job.npad * (w + h)) + 1);
  if (!job.zt) return 1;
  serial_for(transpose_one, (size_t)bh, &job);
  serial_for(tile_row, (size_t)(bh * job.tiles), &job);
  free(job.zt);
  return 0;
}

/* The same with `threads` threads of its own (runtimes that give a custom op no thread pool:
 * OpenVINO's evaluate): tile rows dealt out round-robin, which evens out the triangle. */
typedef struct {
  Job *job;
  int64_t first, step;
} Share;

static void *share_run(void *data) {
  const Share *share = data;
  for (int64_t item = share->first; item < share->job->bh * share->job->tiles; item += share->step) tile_row(share->job, (size_t)item);
  return NULL;
}

/* With `add` (logits [BH, T, T], or NULL), out = add + distances, as the ONNX Runtime op's third input. */
int deploykit_sape2_distance_add_threads(const float *zx, const float *zy, const float *add, int64_t bh, int64_t n, int64_t w, int64_t h,
                                         int64_t p, float *out, int threads) {
  Job job = {zx, zy, NULL, add, out, bh, n, w, h, p, (n + TILE - 1) / TILE * TILE, (n + TILE - 1) / TILE};
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  job.zt = malloc(sizeof(float) * (size_t)(bh * job.npad * (w + h)) + 1);
  if (!job.zt) return 1;
  serial_for(transpose_one, (size_t)bh, &job);
  pthread_t ids[64];
  Share shares[64];
  int running[64] = {0};
  for (int i = 0; i < threads; ++i) shares[i] = (Share){&job, i, threads};
  for (int i = 1; i < threads; ++i) running[i] = pthread_create(&ids[i], NULL, share_run, &shares[i]) == 0;
  share_run(&shares[0]);
  for (int i = 1; i < threads; ++i) {
    if (running[i])
      pthread_join(ids[i], NULL);
    else
      share_run(&shares[i]); /* a thread that could not start: its share runs here */
  }
  free(job.zt);
  return 0;
}

int deploykit_sape2_distance_threads(const float *zx, const float *zy, int64_t bh, int64_t n, int64_t w, int64_t h, int64_t p,
                                     float *out, int threads) {
  return deploykit_sape2_distance_add_threads(zx, zy, NULL, bh, n, w, h, p, out, threads);
}

/* Signatures of bh (b, h) pairs (q, k [bh, P + N, d]) with `threads` threads of its own, pairs dealt
 * round-robin: what OpenVINO's evaluate and PyTorch's CPU op call. */
typedef struct {
  const float *q, *k, *ex, *ey;
  float *zx, *zy;
  int64_t bh, d, m, grid_h, grid_w, p, mode, first, step;
  float scale;
  int failed;
} SignatureShare;

static void *signature_share_run(void *data) {
  SignatureShare *share = data;
  const int64_t n = share->grid_h * share->grid_w, t = share->p + n;
  for (int64_t at = share->first; at < share->bh; at += share->step)
    if (deploykit_sape2_signatures(share->q + at * t * share->d, share->k + at * t * share->d, share->ex, share->ey, share->d, share->m,
                                   share->grid_h, share->grid_w, share->p, share->scale, share->mode, share->zx + at * n * share->grid_w,
                                   share->zy + at * n * share->grid_h))
      share->failed = 1;
  return NULL;
}

int deploykit_sape2_signatures_threads(const float *q, const float *k, const float *ex, const float *ey, int64_t bh, int64_t d, int64_t m,
                                       int64_t grid_h, int64_t grid_w, int64_t p, float scale, int64_t mode, float *zx, float *zy,
                                       int threads) {
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  pthread_t ids[64];
  SignatureShare shares[64];
  int running[64] = {0}, failed = 0;
  for (int i = 0; i < threads; ++i)
    shares[i] = (SignatureShare){q, k, ex, ey, zx, zy, bh, d, m, grid_h, grid_w, p, mode, i, threads, scale, 0};
  for (int i = 1; i < threads; ++i) running[i] = pthread_create(&ids[i], NULL, signature_share_run, &shares[i]) == 0;
  signature_share_run(&shares[0]);
  for (int i = 0; i < threads; ++i) {
    if (i > 0 && running[i])
      pthread_join(ids[i], NULL);
    else if (i > 0)
      signature_share_run(&shares[i]); /* a thread that could not start: its share runs here */
    failed |= shares[i].failed;
  }
  return failed;
}

/* ---- ONNX Runtime's side ------------------------------------------------------------------- */

static OrtApiTable api;

typedef struct {
  int64_t grid_h, grid_w, prefix;
} Kernel;

static OrtStatus *fail(int code, const char *msg) { return API(api, CREATE_STATUS, CreateStatusFn)(code, msg); }

#define TRY(call)                           \
  do {                                      \
    OrtStatus *status_ = (call);            \
    if (status_) return status_;            \
  } while (0)

static OrtStatus *shape_of_rank(const OrtValue *value, int64_t *dims, size_t rank) { /* float32 of that rank */
  OrtTensorTypeAndShapeInfo *info;
  TRY(API(api, GET_TENSOR_TYPE_AND_SHAPE, GetTensorTypeAndShapeFn)(value, &info));
  size_t count = 0;
  int type = 0;
  OrtStatus *status = API(api, GET_DIMENSIONS_COUNT, GetDimensionsCountFn)(info, &count);
  if (!status) status = API(api, GET_TENSOR_ELEMENT_TYPE, GetTensorElementTypeFn)(info, &type);
  if (!status && (count != rank || type != ELEMENT_FLOAT))
    status = fail(ORT_INVALID_ARGUMENT, rank == 4 ? "SaPE2: an input is not float32 of rank 4" : "SaPE2: a table is not float32 [d, M]");
  if (!status) status = API(api, GET_DIMENSIONS, GetDimensionsFn)(info, dims, rank);
  API(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseFn)(info);
  return status;
}

static OrtStatus *shape_of(const OrtValue *value, int64_t dims[4]) { return shape_of_rank(value, dims, 4); }

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const Kernel *kernel = state;
  const OrtValue *zx_value, *zy_value;
  TRY(API(api, KERNEL_CONTEXT_GET_INPUT, KernelContextGetInputFn)(context, 0, &zx_value));
  TRY(API(api, KERNEL_CONTEXT_GET_INPUT, KernelContextGetInputFn)(context, 1, &zy_value));
  int64_t sx[4], sy[4];
  TRY(shape_of(zx_value, sx));
  TRY(shape_of(zy_value, sy));
  const int64_t n = kernel->grid_h * kernel->grid_w;
  if (sx[0] != sy[0] || sx[1] != sy[1] || sx[2] != n || sy[2] != n || sx[3] != kernel->grid_w || sy[3] != kernel->grid_h)
    return fail(ORT_INVALID_ARGUMENT, "SaPE2Distance: Zx must be [B, h, grid_h*grid_w, grid_w] and Zy [B, h, grid_h*grid_w, grid_h]");
  const int64_t t = kernel->prefix + n, dims[4] = {sx[0], sx[1], t, t};
  const OrtValue *add_value = NULL; /* the optional logits: absent inputs come back NULL */
  TRY(API(api, KERNEL_CONTEXT_GET_INPUT, KernelContextGetInputFn)(context, 2, &add_value));
  void *add = NULL;
  if (add_value) {
    int64_t sa[4];
    TRY(shape_of(add_value, sa));
    if (memcmp(sa, dims, sizeof(dims)) != 0)
      return fail(ORT_INVALID_ARGUMENT, "SaPE2Distance: the logits must be [B, h, P + N, P + N] like its output");
    TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)add_value, &add));
  }
  OrtValue *out_value;
  TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, KernelContextGetOutputFn)(context, 0, dims, 4, &out_value));
  void *zx, *zy, *out;
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)zx_value, &zx));
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)zy_value, &zy));
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(out_value, &out));
  const int64_t bh = sx[0] * sx[1];
  if (bh == 0 || n == 0) return NULL;
  Job job = {zx, zy, NULL, add, out, bh, n, kernel->grid_w, kernel->grid_h, kernel->prefix, (n + TILE - 1) / TILE * TILE,
             (n + TILE - 1) / TILE};
  job.zt = malloc(sizeof(float) * (size_t)(bh * job.npad * (job.w + job.h)));
  if (!job.zt) return fail(ORT_FAIL, "SaPE2Distance: out of memory");
  ParallelForFn parallel_for = API(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn);
  OrtStatus *status = parallel_for(context, transpose_one, (size_t)bh, 0, &job);
  if (!status) status = parallel_for(context, tile_row, (size_t)(bh * job.tiles), 0, &job);
  free(job.zt);
  return status;
}

static OrtStatus *create(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info, void **state) {
  (void)op;
  (void)table;
  Kernel *kernel = malloc(sizeof(Kernel));
  if (!kernel) return fail(ORT_FAIL, "SaPE2Distance: out of memory");
  KernelInfoGetAttributeInt64Fn attribute = API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, KernelInfoGetAttributeInt64Fn);
  OrtStatus *status = attribute(info, "grid_h", &kernel->grid_h);
  if (!status) status = attribute(info, "grid_w", &kernel->grid_w);
  if (!status) status = attribute(info, "num_prefix_tokens", &kernel->prefix);
  if (!status && (kernel->grid_h < 1 || kernel->grid_w < 1 || kernel->prefix < 0))
    status = fail(ORT_INVALID_ARGUMENT, "SaPE2Distance: grid_h, grid_w must be positive and num_prefix_tokens >= 0");
  if (status) {
    free(kernel);
    return status;
  }
  *state = kernel;
  return NULL;
}

static void destroy(void *state) { free(state); }
static const char *name(const OrtCustomOp *op) { (void)op; return "SaPE2Distance"; }
static const char *provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ELEMENT_FLOAT; }
static size_t three(const OrtCustomOp *op) { (void)op; return 3; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
enum { REQUIRED = 0, OPTIONAL = 1 }; /* OrtCustomOpInputOutputCharacteristic */
static int input_kind(const OrtCustomOp *op, size_t i) { (void)op; return i == 2 ? OPTIONAL : REQUIRED; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return REQUIRED; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int arity(const OrtCustomOp *op) { (void)op; return 1; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return 1 << 30; }

static const OrtCustomOp sape2_distance_op = {
    .version = API_VERSION,
    .GetName = name,
    .GetExecutionProviderType = provider,
    .GetInputType = float_type,
    .GetInputTypeCount = three,
    .GetOutputType = float_type,
    .GetOutputTypeCount = one,
    .KernelDestroy = destroy,
    .GetInputCharacteristic = input_kind,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .GetVariadicInputMinArity = arity,
    .GetVariadicInputHomogeneity = arity,
    .GetVariadicOutputMinArity = arity,
    .GetVariadicOutputHomogeneity = arity,
    .CreateKernelV2 = create,
    .KernelComputeV2 = compute,
    .GetStartVersion = start_version,
    .GetEndVersion = end_version,
};

/* deploykit::SaPE2Signatures: q, k [B, h, P + N, d], table_x, table_y [d, M] (fp32) to Zx [B, h, N,
 * W] and Zy [B, h, N, H], one (b, h) per work item (the first stage of SaPE2Bias, whose function
 * SaPE2AxisSignatures computes the same in plain ONNX). */
typedef struct {
  int64_t grid_h, grid_w, prefix, mode;
  float scale;
} SignatureKernel;

typedef struct {
  const SignatureKernel *kernel;
  const float *q, *k, *ex, *ey;
  float *zx, *zy;
  int64_t t, d, m;
  int failed;
} SignatureJob;

static void signatures_item(void *data, size_t item) {
  SignatureJob *job = data;
  const SignatureKernel *kr = job->kernel;
  const int64_t n = kr->grid_h * kr->grid_w, at = (int64_t)item;
  if (deploykit_sape2_signatures(job->q + at * job->t * job->d, job->k + at * job->t * job->d, job->ex, job->ey, job->d, job->m,
                                 kr->grid_h, kr->grid_w, kr->prefix, kr->scale, kr->mode, job->zx + at * n * kr->grid_w,
                                 job->zy + at * n * kr->grid_h))
    job->failed = 1;
}

static OrtStatus *signatures_compute(void *state, OrtKernelContext *context) {
  const SignatureKernel *kernel = state;
  const OrtValue *values[4];
  for (size_t i = 0; i < 4; ++i) TRY(API(api, KERNEL_CONTEXT_GET_INPUT, KernelContextGetInputFn)(context, i, &values[i]));
  int64_t sq[4], sk[4], sx[2], sy[2];
  TRY(shape_of(values[0], sq));
  TRY(shape_of(values[1], sk));
  TRY(shape_of_rank(values[2], sx, 2));
  TRY(shape_of_rank(values[3], sy, 2));
  const int64_t n = kernel->grid_h * kernel->grid_w;
  if (memcmp(sq, sk, sizeof(sq)) != 0 || sq[2] != kernel->prefix + n || sx[0] != sq[3] || sy[0] != sq[3] || sx[1] != sy[1] || sx[1] < 1)
    return fail(ORT_INVALID_ARGUMENT, "SaPE2Signatures: q and k must be [B, h, P + grid_h*grid_w, d] and the tables [d, M]");
  const int64_t dx[4] = {sq[0], sq[1], n, kernel->grid_w}, dy[4] = {sq[0], sq[1], n, kernel->grid_h};
  OrtValue *zx_value, *zy_value;
  TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, KernelContextGetOutputFn)(context, 0, dx, 4, &zx_value));
  TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, KernelContextGetOutputFn)(context, 1, dy, 4, &zy_value));
  void *data[6];
  for (size_t i = 0; i < 4; ++i) TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)values[i], &data[i]));
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(zx_value, &data[4]));
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(zy_value, &data[5]));
  SignatureJob job = {kernel, data[0], data[1], data[2], data[3], data[4], data[5], sq[2], sq[3], sx[1], 0};
  const int64_t bh = sq[0] * sq[1];
  if (bh == 0 || n == 0) return NULL;
  TRY(API(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, signatures_item, (size_t)bh, 0, &job));
  return job.failed ? fail(ORT_FAIL, "SaPE2Signatures: out of memory") : NULL;
}

static OrtStatus *signatures_create(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info, void **state) {
  (void)op;
  (void)table;
  SignatureKernel *kernel = malloc(sizeof(SignatureKernel));
  if (!kernel) return fail(ORT_FAIL, "SaPE2Signatures: out of memory");
  KernelInfoGetAttributeInt64Fn attribute = API(api, KERNEL_INFO_GET_ATTRIBUTE_INT64, KernelInfoGetAttributeInt64Fn);
  OrtStatus *status = attribute(info, "grid_h", &kernel->grid_h);
  if (!status) status = attribute(info, "grid_w", &kernel->grid_w);
  if (!status) status = attribute(info, "num_prefix_tokens", &kernel->prefix);
  if (!status) status = attribute(info, "mode", &kernel->mode);
  if (!status) status = API(api, KERNEL_INFO_GET_ATTRIBUTE_FLOAT, KernelInfoGetAttributeFloatFn)(info, "scale", &kernel->scale);
  if (!status && (kernel->grid_h < 1 || kernel->grid_w < 1 || kernel->prefix < 0 || kernel->mode < 0 || kernel->mode > 2))
    status = fail(ORT_INVALID_ARGUMENT, "SaPE2Signatures: grid_h, grid_w must be positive, num_prefix_tokens >= 0, mode 0, 1 or 2");
  if (status) {
    free(kernel);
    return status;
  }
  *state = kernel;
  return NULL;
}

static const char *signatures_name(const OrtCustomOp *op) { (void)op; return "SaPE2Signatures"; }
static size_t four(const OrtCustomOp *op) { (void)op; return 4; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }

static const OrtCustomOp sape2_signatures_op = {
    .version = API_VERSION,
    .GetName = signatures_name,
    .GetExecutionProviderType = provider,
    .GetInputType = float_type,
    .GetInputTypeCount = four,
    .GetOutputType = float_type,
    .GetOutputTypeCount = two,
    .KernelDestroy = destroy,
    .GetInputCharacteristic = required,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .GetVariadicInputMinArity = arity,
    .GetVariadicInputHomogeneity = arity,
    .GetVariadicOutputMinArity = arity,
    .GetVariadicOutputHomogeneity = arity,
    .CreateKernelV2 = signatures_create,
    .KernelComputeV2 = signatures_compute,
    .GetStartVersion = start_version,
    .GetEndVersion = end_version,
};

/* What ONNX Runtime calls when a session registers this library. */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  api = base->GetApi(API_VERSION);
  if (!api) return NULL; /* cannot even report: ONNX Runtime older than 1.17 (the loader refuses those first) */
  OrtCustomOpDomain *domain;
  TRY(API(api, CREATE_CUSTOM_OP_DOMAIN, CreateCustomOpDomainFn)("deploykit", &domain));
  TRY(API(api, CUSTOM_OP_DOMAIN_ADD, CustomOpDomainAddFn)(domain, &sape2_distance_op));
  TRY(API(api, CUSTOM_OP_DOMAIN_ADD, CustomOpDomainAddFn)(domain, &sape2_signatures_op));
  return API(api, ADD_CUSTOM_OP_DOMAIN, AddCustomOpDomainFn)(options, domain);
}
