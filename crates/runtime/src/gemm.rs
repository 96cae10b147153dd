//! A portable f32 matrix product for dense stages, until the SIMD kernels crate is wired in:
//! C (rows, n) = A (rows, k) · Wᵀ, W (n, k) row-major. Four rows at a time share each weight row
//! load; the inner dot products use independent accumulators so they vectorize.

pub fn dense(a: &[f32], rows: usize, k: usize, w: &[f32], n: usize, c: &mut [f32]) {
    let mut r = 0;
    while r + 4 <= rows {
        let a0 = &a[r * k..(r + 1) * k];
        let a1 = &a[(r + 1) * k..(r + 2) * k];
        let a2 = &a[(r + 2) * k..(r + 3) * k];
        let a3 = &a[(r + 3) * k..(r + 4) * k];
        for j in 0..n {
            let wj = &w[j * k..(j + 1) * k];
            let (mut s0, mut s1, mut s2, mut s3) = ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
            let chunks = k / 8;
            for c8 in 0..chunks {
                let o = c8 * 8;
                for l in 0..8 {
                    let wv = wj[o + l];
                    s0[l] += a0[o + l] * wv;
                    s1[l] += a1[o + l] * wv;
                    s2[l] += a2[o + l] * wv;
                    s3[l] += a3[o + l] * wv;
                }
            }
            let mut t = [
                s0.iter().sum::<f32>(),
                s1.iter().sum::<f32>(),
                s2.iter().sum::<f32>(),
                s3.iter().sum::<f32>(),
            ];
            for o in chunks * 8..k {
                let wv = wj[o];
                t[0] += a0[o] * wv;
                t[1] += a1[o] * wv;
                t[2] += a2[o] * wv;
                t[3] += a3[o] * wv;
            }
            for (q, v) in t.iter().enumerate() {
                c[(r + q) * n + j] = *v;
            }
        }
        r += 4;
    }
    while r < rows {
        let ar = &a[r * k..(r + 1) * k];
        for j in 0..n {
            let wj = &w[j * k..(j + 1) * k];
            let mut s = [0f32; 8];
            let chunks = k / 8;
            for c8 in 0..chunks {
                let o = c8 * 8;
                for l in 0..8 {
                    s[l] += ar[o + l] * wj[o + l];
                }
            }
            let mut t: f32 = s.iter().sum();
            for o in chunks * 8..k {
                t += ar[o] * wj[o];
            }
            c[r * n + j] = t;
        }
        r += 1;
    }
}
