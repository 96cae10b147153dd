// tumble's fixed CUDA kernels, compiled once per device by NVRTC when the device opens.
// Generated kernels (row programs) are compiled per program by the runtime.

#define BM 64
#define BN 64
#define BK 16

// C[m, n] (+)= sum_k A[m, k] * W[n, k]: nn.dense's X · Wᵀ with W as the model stores it (N × K),
// every operand row-major with its own row stride. 256 threads, a 64 × 64 tile each, each
// thread 4 × 4 outputs spread by 16 so that loads and stores are coalesced.
extern "C" __global__ void __launch_bounds__(256)
gemm_nt(const float* __restrict__ A, int lda, const float* __restrict__ W, int ldw,
        float* __restrict__ C, int ldc, int M, int N, int K, int accumulate)
{
    __shared__ float As[BK][BM + 1];
    __shared__ float Ws[BK][BN + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int e = threadIdx.x; e < BM * BK; e += 256) {
            const int r = e / BK, c = e % BK;
            const int gk = k0 + c;
            const int gm = m0 + r, gn = n0 + r;
            As[c][r] = (gm < M && gk < K) ? A[(size_t)gm * lda + gk] : 0.f;
            Ws[c][r] = (gn < N && gk < K) ? W[(size_t)gn * ldw + gk] : 0.f;
        }
        __syncthreads();
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
        __syncthreads();
    }
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
