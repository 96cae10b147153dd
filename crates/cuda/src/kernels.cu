// tumble's fixed CUDA kernels, compiled once per device by NVRTC when the device opens.
// Generated kernels (row programs) are compiled per program by the runtime.

#define BM 64
#define BN 64
#define BK 16

// One depth slice of a 64 × 64 tile from shared memory: each thread's 4 × 4 outputs, rows and
// columns spread by 16 so that loads and stores are coalesced.
__device__ __forceinline__ void multiply_slice(const float (*As)[BM + 1], const float (*Ws)[BN + 1],
                                               float acc[4][4])
{
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
        float a[4], w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = Ws[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], w[j], acc[i][j]);
    }
}

// A thread's share of the depth slice [k0, k0 + BK) of a tile's A and W rows (4 floats of each
// 64 × 16), zero past M, N or kend, into registers.
__device__ __forceinline__ void load_slice(const float* __restrict__ A, int lda,
                                           const float* __restrict__ W, int ldw, int M, int N,
                                           int m0, int n0, int k0, int kend, float ra[4],
                                           float rw[4])
{
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int e = threadIdx.x + 256 * i, r = e / BK, gk = k0 + e % BK;
        ra[i] = (m0 + r < M && gk < kend) ? A[(size_t)(m0 + r) * lda + gk] : 0.f;
        rw[i] = (n0 + r < N && gk < kend) ? W[(size_t)(n0 + r) * ldw + gk] : 0.f;
    }
}

// The 64 × 64 tile of C (+)= A · Wᵀ over depths [kbeg, kend) into acc: each thread 4 × 4 outputs
// spread by 16, so that loads and stores are coalesced. The next depth slice is loaded into
// registers while the current one is multiplied from shared memory, so a block waits on global
// memory once per slice less (at small M a launch has few blocks and the loop's latency is its
// time).
__device__ __forceinline__ void tile_nt(const float* __restrict__ A, int lda,
                                        const float* __restrict__ W, int ldw, int M, int N,
                                        int m0, int n0, int kbeg, int kend, float acc[4][4])
{
    __shared__ float As[BK][BM + 1];
    __shared__ float Ws[BK][BN + 1];
    float ra[4], rw[4];
    load_slice(A, lda, W, ldw, M, N, m0, n0, kbeg, kend, ra, rw);
    for (int k0 = kbeg; k0 < kend; k0 += BK) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int e = threadIdx.x + 256 * i;
            As[e % BK][e / BK] = ra[i];
            Ws[e % BK][e / BK] = rw[i];
        }
        __syncthreads();
        if (k0 + BK < kend) load_slice(A, lda, W, ldw, M, N, m0, n0, k0 + BK, kend, ra, rw);
        multiply_slice(As, Ws, acc);
        __syncthreads();
    }
}

// Stores a tile: C[m, n] = acc (accumulate: C[m, n] += acc).
__device__ __forceinline__ void store_tile(float* __restrict__ C, int ldc, int M, int N, int m0,
                                           int n0, const float acc[4][4], int accumulate)
{
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = m0 + ty + 16 * i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx + 16 * j;
            if (n >= N) continue;
            float* c = &C[(size_t)m * ldc + n];
            *c = accumulate ? *c + acc[i][j] : acc[i][j];
        }
    }
}

// C[m, n] (+)= sum_k A[m, k] * W[n, k]: nn.dense's X · Wᵀ with W as the model stores it (N × K),
// every operand row-major with its own row stride. 256 threads, a 64 × 64 tile each.
extern "C" __global__ void __launch_bounds__(256)
gemm_nt(const float* __restrict__ A, int lda, const float* __restrict__ W, int ldw,
        float* __restrict__ C, int ldc, int M, int N, int K, int accumulate)
{
    float acc[4][4] = {};
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    tile_nt(A, lda, W, ldw, M, N, m0, n0, 0, K, acc);
    store_tile(C, ldc, M, N, m0, n0, acc, accumulate);
}

// Split depth: block z multiplies depths [z · kc, (z + 1) · kc) into P + z · M · N (M × N, row
// stride N). A product of few tiles (a small launch) otherwise leaves most of the GPU idle while
// each block walks the whole depth; sum_parts adds the parts in order, so results do not depend
// on timing.
extern "C" __global__ void __launch_bounds__(256)
gemm_nt_part(const float* __restrict__ A, int lda, const float* __restrict__ W, int ldw,
             float* __restrict__ P, int M, int N, int K, int kc)
{
    float acc[4][4] = {};
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int kbeg = blockIdx.z * kc, kend = min(K, kbeg + kc);
    tile_nt(A, lda, W, ldw, M, N, m0, n0, kbeg, kend, acc);
    store_tile(P + (size_t)blockIdx.z * M * N, N, M, N, m0, n0, acc, 0);
}

// C[m, n] (+)= P[0][m, n] + P[1][m, n] + ... + P[parts - 1][m, n], in that order.
extern "C" __global__ void sum_parts(const float* __restrict__ P, int parts, float* __restrict__ C,
                                     int ldc, int M, int N, int accumulate)
{
    const size_t total = (size_t)M * N;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        float s = P[e];
        for (int z = 1; z < parts; ++z) s += P[(size_t)z * total + e];
        float* c = &C[(e / N) * ldc + e % N];
        *c = accumulate ? *c + s : s;
    }
}

// The first kernel, kept for comparison (TUMBLE_GPU_GEMM=plain): the same tile without the
// next slice's loads overlapping the multiplications.
extern "C" __global__ void __launch_bounds__(256)
gemm_nt_plain(const float* __restrict__ A, int lda, const float* __restrict__ W, int ldw,
        float* __restrict__ C, int ldc, int M, int N, int K, int accumulate)
{
    __shared__ float As[BK][BM + 1];
    __shared__ float Ws[BK][BN + 1];
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int e = threadIdx.x; e < BM * BK; e += 256) {
            const int r = e / BK, c = e % BK;
            const int gk = k0 + c;
            const int gm = m0 + r, gn = n0 + r;
            As[c][r] = (gm < M && gk < K) ? A[(size_t)gm * lda + gk] : 0.f;
            Ws[c][r] = (gn < N && gk < K) ? W[(size_t)gn * ldw + gk] : 0.f;
        }
        __syncthreads();
        multiply_slice(As, Ws, acc);
        __syncthreads();
    }
    store_tile(C, ldc, M, N, m0, n0, acc, accumulate);
}

// dst[r, c] = src[r, c] (add: dst[r, c] += src[r, c]) for r < rows, c < width: a part of a
// GEMM's K copied into place, a column block of a fused product, a bias added (lds = 0: one row,
// broadcast to every row).
extern "C" __global__ void copy_rows(const float* __restrict__ src, int lds,
                                     float* __restrict__ dst, int ldd, int rows, int width, int add)
{
    const size_t total = (size_t)rows * width;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / width, c = e % width;
        const float x = src[r * lds + c];
        dst[r * ldd + c] = add ? dst[r * ldd + c] + x : x;
    }
}

// dst[b * stride + e] = src[b][e] for b < n, e < len: blocks of floats that lie anywhere on the
// device (an earlier launch's rows, a table's rows) copied side by side. `src` is a table of n
// device addresses.
extern "C" __global__ void gather_blocks(const unsigned long long* __restrict__ src, int n, int len,
                                         float* __restrict__ dst, long long stride)
{
    for (int b = blockIdx.x; b < n; b += gridDim.x) {
        const float* s = (const float*)src[b];
        float* d = dst + b * stride;
        for (int e = threadIdx.x; e < len; e += blockDim.x) d[e] = s[e];
    }
}
