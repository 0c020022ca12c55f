/* deploykit::SaPE2Distance for ONNX Runtime's CPU provider: a custom-op library.
 *
 * out[b, h, P + i, P + j] = |Zx_i - Zx_j| + |Zy_i - Zy_j|  (SaPE² Eq. 15, the direct form), prefix
 * rows and columns 0, from Zx [B, h, N, W] and Zy [B, h, N, H] (fp32, tokens row-major).
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

#define LANES 16
#define TILE 32 /* rows and columns of a tile: 2 vectors of columns, rows in groups of ROWS */
#define ROWS 4
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

typedef struct {
  const float *zx, *zy; /* [BH, N, W], [BH, N, H] */
  float *zt;            /* per (b, h): Zx^T [W, Npad] then Zy^T [H, Npad], zero past N */
  float *out;           /* [BH, T, T] */
  int64_t bh, n, w, h, p, npad, tiles;
} Job;

/* Squared distances of ROWS rows (i0..) to TILE columns (j0..) along one axis, added to acc. */
static inline void axis_tile(const float *zt, int64_t dims, int64_t npad, int64_t i0, int64_t j0, vec acc[ROWS][2]) {
  for (int64_t k = 0; k < dims; ++k) {
    const float *row = zt + k * npad;
    vec c0, c1;
    memcpy(&c0, row + j0, sizeof(vec));
    memcpy(&c1, row + j0 + LANES, sizeof(vec));
    for (int r = 0; r < ROWS; ++r) {
      const float v = row[i0 + r];
      vec d0 = c0 - v, d1 = c1 - v;
      acc[r][0] += d0 * d0;
      acc[r][1] += d1 * d1;
    }
  }
}

/* One tile: rows I..I+TILE, columns J..J+TILE of one (b, h); written at (i, j) and, off the
 * diagonal, at (j, i). */
static void tile(const Job *job, int64_t bh, int64_t I, int64_t J) {
  const int64_t n = job->n, npad = job->npad, t = job->p + n;
  const float *zx = job->zt + bh * npad * (job->w + job->h), *zy = zx + npad * job->w;
  float *out = job->out + bh * t * t;
  float block[TILE][TILE];
  for (int64_t i0 = 0; i0 < TILE; i0 += ROWS) {
    vec ax[ROWS][2] = {{{0}}}, ay[ROWS][2] = {{{0}}};
    axis_tile(zx, job->w, npad, I + i0, J, ax);
    axis_tile(zy, job->h, npad, I + i0, J, ay);
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 2; ++c)
        for (int l = 0; l < LANES; ++l) block[i0 + r][c * LANES + l] = sqrtf(ax[r][c][l]) + sqrtf(ay[r][c][l]);
  }
  const int64_t rows = n - I < TILE ? n - I : TILE, cols = n - J < TILE ? n - J : TILE;
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
    for (int64_t k = 0; k < job->w; ++k) xt[k * npad + i] = zx[i * job->w + k];
    for (int64_t k = 0; k < job->h; ++k) yt[k * npad + i] = zy[i * job->h + k];
  }
  float *out = job->out + bh * (job->p + n) * (job->p + n);
  if (job->p) { /* prefix rows, and the prefix columns of the patch rows */
    memset(out, 0, sizeof(float) * job->p * (job->p + n));
    for (int64_t i = 0; i < n; ++i) memset(out + (job->p + i) * (job->p + n), 0, sizeof(float) * job->p);
  }
}

/* Work item: one (b, h) and one row of tiles, from the diagonal tile to the last. */
static void tile_row(void *data, size_t item) {
  const Job *job = data;
  const int64_t bh = (int64_t)item / job->tiles, I = ((int64_t)item % job->tiles) * TILE;
  for (int64_t J = I; J < job->n; J += TILE) tile(job, bh, I, J);
}

/* Serial stand-in for ParallelFor (tests, and a context-free call). */
static void serial_for(void (*fn)(void *, size_t), size_t total, void *data) {
  for (size_t i = 0; i < total; ++i) fn(data, i);
}

/* The whole op on plain buffers: what the kernel runs, and what tests call through ctypes. */
int deploykit_sape2_distance(const float *zx, const float *zy, int64_t bh, int64_t n, int64_t w, int64_t h, int64_t p,
                             float *out) {
  Job job = {zx, zy, NULL, out, bh, n, w, h, p, (n + TILE - 1) / TILE * TILE, (n + TILE - 1) / TILE};
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

int deploykit_sape2_distance_threads(const float *zx, const float *zy, int64_t bh, int64_t n, int64_t w, int64_t h, int64_t p,
                                     float *out, int threads) {
  Job job = {zx, zy, NULL, out, bh, n, w, h, p, (n + TILE - 1) / TILE * TILE, (n + TILE - 1) / TILE};
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

static OrtStatus *shape_of(const OrtValue *value, int64_t dims[4]) {
  OrtTensorTypeAndShapeInfo *info;
  TRY(API(api, GET_TENSOR_TYPE_AND_SHAPE, GetTensorTypeAndShapeFn)(value, &info));
  size_t count = 0;
  int type = 0;
  OrtStatus *status = API(api, GET_DIMENSIONS_COUNT, GetDimensionsCountFn)(info, &count);
  if (!status) status = API(api, GET_TENSOR_ELEMENT_TYPE, GetTensorElementTypeFn)(info, &type);
  if (!status && (count != 4 || type != ELEMENT_FLOAT))
    status = fail(ORT_INVALID_ARGUMENT, "SaPE2Distance: signatures must be float32 of rank 4 [B, h, N, L]");
  if (!status) status = API(api, GET_DIMENSIONS, GetDimensionsFn)(info, dims, 4);
  API(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseFn)(info);
  return status;
}

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
  OrtValue *out_value;
  TRY(API(api, KERNEL_CONTEXT_GET_OUTPUT, KernelContextGetOutputFn)(context, 0, dims, 4, &out_value));
  void *zx, *zy, *out;
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)zx_value, &zx));
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)((OrtValue *)zy_value, &zy));
  TRY(API(api, GET_TENSOR_MUTABLE_DATA, GetTensorMutableDataFn)(out_value, &out));
  const int64_t bh = sx[0] * sx[1];
  if (bh == 0 || n == 0) return NULL;
  Job job = {zx, zy, NULL, out, bh, n, kernel->grid_w, kernel->grid_h, kernel->prefix, (n + TILE - 1) / TILE * TILE,
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
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int arity(const OrtCustomOp *op) { (void)op; return 1; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return 1 << 30; }

static const OrtCustomOp sape2_distance_op = {
    .version = API_VERSION,
    .GetName = name,
    .GetExecutionProviderType = provider,
    .GetInputType = float_type,
    .GetInputTypeCount = two,
    .GetOutputType = float_type,
    .GetOutputTypeCount = one,
    .KernelDestroy = destroy,
    .GetInputCharacteristic = required,
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

/* What ONNX Runtime calls when a session registers this library. */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  api = base->GetApi(API_VERSION);
  if (!api) return NULL; /* cannot even report: ONNX Runtime older than 1.17 (the loader refuses those first) */
  OrtCustomOpDomain *domain;
  TRY(API(api, CREATE_CUSTOM_OP_DOMAIN, CreateCustomOpDomainFn)("deploykit", &domain));
  TRY(API(api, CUSTOM_OP_DOMAIN_ADD, CustomOpDomainAddFn)(domain, &sape2_distance_op));
  return API(api, ADD_CUSTOM_OP_DOMAIN, AddCustomOpDomainFn)(options, domain);
}
