// The two-level indexer's kernels for NVIDIA GPUs (docs/spec.md section 6a), compiled at first use by NVRTC
// (sparse_indexer/ops/select_candidate_blocks/cuda.py):
//   si_select_candidate_blocks: per row, the ids of the K_b blocks of b positions with the largest maxima;
//   si_candidate_topk: per row, the topk largest cells inside the row's candidate blocks.
//
// One CTA of NT threads per row. Each kernel first turns its row into uint32 keys, one per block (select) or one
// per candidate cell (top-k), in shared memory (select: in the global workspace when the row's blocks do not fit),
// building the histogram of the keys' top 11 bits with shared atomics; key 0 is never taken. An exact radix
// select (digits of 11, 11 and 10 bits, each digit found by a block-wide suffix scan of the histogram) gives the
// key T of the k-th largest; one pass writes every index with key > T and the first k - count(key > T) with key
// == T (slots from shared atomic counters: the order is unspecified, as the contract allows), then -1.
//
// Keys: select: 0 = a block of -inf cells only (never a candidate), 1 = a block holding a NaN, the
// order-preserving key of its maximum otherwise, 0xFFFFFFFF = the newest block. Top-k: 0 = not eligible, 1 =
// an eligible -inf or NaN, the order-preserving key otherwise.
//
// Both clamp the window first (docs/spec.md section 10): start to >= 0, end to <= width (the logits' columns);
// end <= start is an empty row. Candidate ids below 0 or whose cells lie past the window select nothing.
//
// Compile-time parameters (-D): NT threads per CTA (a multiple of 32, <= 1024), BF16 (1: bfloat16 logits, read
// as 16-bit words and widened exactly).

typedef unsigned int u32;

#ifndef NT
#define NT 1024
#endif
#ifndef BF16
#define BF16 0
#endif
#ifndef HIST_MATCH
#define HIST_MATCH 0  // 1: one histogram atomic per distinct bin of a warp (__match_any_sync); 0: one per key
// (H200, 64 x 64K, 2048 x 8 candidates, graph replays: 0 gives select 14.0 / top-k 19.5 us, 1 gives 14.7 / 30.1;
// even all-equal logits, one address for every atomic, take 17.7 us with 0)
#endif
#ifndef STOP
#define STOP 0  // measurements only: 1 returns after the keys, 2 after the radix select
#endif
#if BF16
typedef unsigned short elem_t;
#else
typedef float elem_t;
#endif

#ifndef UB
#define UB 8  // blocks per thread in flight (select)
#endif
#ifndef UC
#define UC 16  // candidate cells per thread in flight (top-k)
#endif
#define NB 2048
#define NW (NT / 32)
#define FULL 0xffffffffu
// shared layout (u32 words): histogram, counters, warp sums, then the kernel's arrays
#define OFF_MISC NB
#define OFF_WSUM (NB + 16)
#define OFF_DATA (NB + 16 + 32)
#define M_NZ 0
#define M_DIG 1
#define M_KREM 2
#define M_GT 3
#define M_EQ 4

__device__ __forceinline__ float widen(elem_t v) {
#if BF16
    return __uint_as_float(((u32)v) << 16);
#else
    return v;
#endif
}

__device__ __forceinline__ u32 fkey(float x) {
    u32 u = __float_as_uint(x);
    u32 key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    key = (x == 0.0f) ? 0x80000000u : key;
    return (x > __int_as_float(0xff800000)) ? key : 0u;  // -inf and NaN -> 0
}

// Exclusive prefix sum of v over the CTA's threads in thread order; every thread calls it.
__device__ __forceinline__ int block_excl_scan(int v, u32* wsum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int t = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += t;
    }
    __syncthreads();  // wsum may still be read from an earlier call
    if (lane == 31) wsum[warp] = (u32)incl;
    __syncthreads();
    if (warp == 0) {
        int s = lane < NW ? (int)wsum[lane] : 0;
        int si = s;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int t = __shfl_up_sync(FULL, si, o);
            if (lane >= o) si += t;
        }
        if (lane < NW) wsum[lane] = (u32)(si - s);  // exclusive sums of the warps
    }
    __syncthreads();
    return (int)wsum[warp] + incl - v;
}

// The digit d (of a histogram of nbins <= NB) holding the krem-th largest key, and krem minus the keys of larger
// digits: misc[M_DIG], misc[M_KREM]. Thread t owns bins [t * per, (t + 1) * per); suffix sums run from the top.
__device__ void find_digit(u32* hist, u32* misc, u32* wsum, int nbins, int krem) {
    const int per = nbins / NT;  // nbins is a multiple of NT (host check: NT <= 1024)
    const int t = NT - 1 - (int)threadIdx.x;  // thread 0 owns the top chunk
    const int lo = t * per;
    int sum = 0;
    for (int i = 0; i < per; i++) sum += (int)hist[lo + i];
    int above = block_excl_scan(sum, wsum);  // keys in the chunks above this one
    int run = above;
    for (int i = per - 1; i >= 0; i--) {
        int h = (int)hist[lo + i];
        if (run < krem && run + h >= krem) {
            misc[M_DIG] = (u32)(lo + i);
            misc[M_KREM] = (u32)(krem - run);
        }
        run += h;
    }
    __syncthreads();
}

// hist[bin] += 1 for every lane with bin < NB, one shared atomic per distinct bin of the warp (logits cluster in a
// few exponent bins: per-lane atomics on one address serialise). Every lane of the warp must call it.
__device__ __forceinline__ void warp_hist_add(u32* hist, u32 bin) {
#if HIST_MATCH
    const unsigned peers = __match_any_sync(FULL, bin);
    if (bin < NB && (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1)) atomicAdd(&hist[bin], (u32)__popc(peers));
#else
    if (bin < NB) atomicAdd(&hist[bin], 1u);
#endif
}

// A slot of the counter misc[c] for every lane with take: one shared atomic per warp. Every lane must call it.
__device__ __forceinline__ int warp_slot(u32* misc, int c, bool take) {
    const unsigned m = __ballot_sync(FULL, take);
    if (!m) return -1;
    const int lane = threadIdx.x & 31;
    const int leader = __ffs(m) - 1;
    u32 base = 0;
    if (lane == leader) base = atomicAdd(&misc[c], (u32)__popc(m));
    base = __shfl_sync(FULL, base, leader);
    return take ? (int)(base + __popc(m & ((1u << lane) - 1u))) : -1;
}

__device__ __forceinline__ void zero_hist(u32* hist) {
    for (int i = threadIdx.x; i < NB; i += NT) hist[i] = 0;
}

// The radix select over keys[0, n) (shared or global) of the k largest (k <= count of nonzero keys): returns
// (T, the keys equal to T to take). k == count of nonzero keys: T = 0 (every nonzero key), none equal.
__device__ void radix(const u32* keys, int n, int k, int nz, u32* hist, u32* misc, u32* wsum, u32* thr_out,
                      int* need_out) {
    if (nz <= k) {
        *thr_out = 0u;
        *need_out = 0;
        return;
    }
    find_digit(hist, misc, wsum, NB, k);
    u32 prefix = misc[M_DIG] << 21;
    int krem = (int)misc[M_KREM];
    __syncthreads();
    zero_hist(hist);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += NT) {
        u32 key = keys[i];
        if ((key >> 21) == (prefix >> 21)) atomicAdd(&hist[(key >> 10) & 2047u], 1u);
    }
    __syncthreads();
    find_digit(hist, misc, wsum, NB, krem);
    prefix |= misc[M_DIG] << 10;
    krem = (int)misc[M_KREM];
    __syncthreads();
    zero_hist(hist);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += NT) {
        u32 key = keys[i];
        if ((key >> 10) == (prefix >> 10)) atomicAdd(&hist[key & 1023u], 1u);
    }
    __syncthreads();
    find_digit(hist, misc, wsum, 1024, krem);
    *thr_out = prefix | misc[M_DIG];
    *need_out = (int)misc[M_KREM];
}

__device__ __forceinline__ int count_nonzero(int local, u32* misc) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(FULL, local, o);
    if ((threadIdx.x & 31) == 0 && local) atomicAdd(&misc[M_NZ], (u32)local);
    __syncthreads();
    return (int)misc[M_NZ];
}

extern "C" __global__ void __launch_bounds__(NT, 1)
si_select_candidate_blocks(const elem_t* __restrict__ logits, long long stride_l, const int* __restrict__ starts,
                           const int* __restrict__ ends, int* __restrict__ out, long long stride_o, int kb,
                           u32* __restrict__ ws, long long stride_w, int bs, int vec_ok, int width) {
    extern __shared__ u32 smem[];
    u32* hist = smem;
    u32* misc = smem + OFF_MISC;
    u32* wsum = smem + OFF_WSUM;
    const int row = blockIdx.x;
    const int s = max(starts[row], 0);  // the window clamped into [0, width): nv <= ceil(W / b) keys (their slots)
    const int n = max(min(ends[row], width) - s, 0);
    const int nv = (n + bs - 1) / bs;
    const int newest = (n - 1) / bs;
    u32* keys = ws != nullptr ? ws + row * stride_w : smem + OFF_DATA;
    const elem_t* base = logits + row * stride_l + s;
    int* orow = out + row * stride_o;
    zero_hist(hist);
    if (threadIdx.x < 16) misc[threadIdx.x] = 0;
    __syncthreads();
    // the 16-byte path: blocks of 4 (float32) or 8 (bfloat16) cells, each block's first cell 16-byte aligned
    const int vec = 16 / (int)sizeof(elem_t);
    const bool v4 = vec_ok && (bs % vec == 0) && ((((unsigned long long)base) & 15) == 0);
    int nzl = 0;
    // UB blocks per thread in flight: their loads first, then their keys (uniform trip counts: every lane of a
    // warp reaches the warp-wide histogram update)
    for (int j0 = 0; j0 < nv; j0 += NT * UB) {
        float m[UB];
        bool nan[UB];
#pragma unroll
        for (int u = 0; u < UB; u++) {
            const int j = j0 + u * NT + threadIdx.x;
            const int c0 = j * bs;
            const int c1 = min(c0 + bs, n);
            m[u] = __int_as_float(0xff800000);
            nan[u] = false;
            if (j >= nv) continue;
            if (v4 && c1 - c0 == bs) {
                for (int c = c0; c < c1; c += vec) {
                    uint4 w = *reinterpret_cast<const uint4*>(base + c);
                    const elem_t* e = reinterpret_cast<const elem_t*>(&w);
#pragma unroll
                    for (int i = 0; i < vec; i++) {
                        float x = widen(e[i]);
                        nan[u] |= x != x;
                        m[u] = fmaxf(m[u], x);
                    }
                }
            } else {
                for (int c = c0; c < c1; c++) {
                    float x = widen(base[c]);
                    nan[u] |= x != x;
                    m[u] = fmaxf(m[u], x);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UB; u++) {
            const int j = j0 + u * NT + threadIdx.x;
            u32 key = nan[u] ? 1u : fkey(m[u]);
            if (j == newest) key = 0xffffffffu;
            if (j < nv) keys[j] = key;
            const bool counted = j < nv && key;
            warp_hist_add(hist, counted ? key >> 21 : NB);
            nzl += counted;
        }
    }
    const int nz = count_nonzero(nzl, misc);
#if STOP == 1
    return;
#endif
    const int k = min(kb, nz);
    u32 thr;
    int need;
    radix(keys, nv, kb, nz, hist, misc, wsum, &thr, &need);
#if STOP == 2
    return;
#endif
    const int n_gt = k - need;
    __syncthreads();
    for (int j0 = 0; j0 < nv; j0 += NT) {
        const int j = j0 + threadIdx.x;
        const u32 key = j < nv ? keys[j] : 0u;
        const int g = warp_slot(misc, M_GT, key > thr);
        const int e = warp_slot(misc, M_EQ, need && key == thr);
        if (g >= 0) orow[g] = j;
        if (e >= 0 && e < need) orow[n_gt + e] = j;
    }
    for (int c = k + threadIdx.x; c < kb; c += NT) orow[c] = -1;
}

extern "C" __global__ void __launch_bounds__(NT, 1)
si_candidate_topk(const elem_t* __restrict__ logits, long long stride_l, const int* __restrict__ starts,
                  const int* __restrict__ ends, const int* __restrict__ cand, long long stride_c, int kb, int bs,
                  int* __restrict__ out, long long stride_o, int topk, int width) {
    extern __shared__ u32 smem[];
    u32* hist = smem;
    u32* misc = smem + OFF_MISC;
    u32* wsum = smem + OFF_WSUM;
    int* ids = reinterpret_cast<int*>(smem + OFF_DATA);
    u32* keys = smem + OFF_DATA + kb;
    const int row = blockIdx.x;
    const int s = max(starts[row], 0);  // the window clamped into [0, width)
    const int n = max(min(ends[row], width) - s, 0);
    const elem_t* base = logits + row * stride_l + s;
    const int* crow = cand + row * stride_c;
    int* orow = out + row * stride_o;
    zero_hist(hist);
    if (threadIdx.x < 16) misc[threadIdx.x] = 0;
    for (int j = threadIdx.x; j < kb; j += NT) ids[j] = crow[j];
    __syncthreads();
    const int total = kb * bs;
    int nel = 0;
    for (int v0 = 0; v0 < total; v0 += NT * UC) {  // UC cells per thread in flight
        float x[UC];
        bool ok[UC];
#pragma unroll
        for (int u = 0; u < UC; u++) {
            const int v = v0 + u * NT + threadIdx.x;
            ok[u] = false;
            x[u] = 0.0f;
            if (v < total) {
                const int j = v / bs;
                const int id = ids[j];
                const long long col = (long long)id * bs + (v - j * bs);
                if (id >= 0 && col < n) {
                    x[u] = widen(base[col]);
                    ok[u] = true;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UC; u++) {
            const int v = v0 + u * NT + threadIdx.x;
            u32 key = 0u;
            if (ok[u]) {
                key = fkey(x[u]);
                key = key ? key : 1u;
            }
            if (v < total) keys[v] = key;
            warp_hist_add(hist, key ? key >> 21 : NB);
            nel += key != 0u;
        }
    }
    const int ne = count_nonzero(nel, misc);
#if STOP == 1
    return;
#endif
    const int k = min(topk, ne);
    u32 thr;
    int need;
    radix(keys, total, topk, ne, hist, misc, wsum, &thr, &need);
#if STOP == 2
    return;
#endif
    const int n_gt = k - need;
    __syncthreads();
    for (int v0 = 0; v0 < total; v0 += NT) {
        const int v = v0 + threadIdx.x;
        const u32 key = v < total ? keys[v] : 0u;
        const int g = warp_slot(misc, M_GT, key > thr);
        int e = warp_slot(misc, M_EQ, need && key == thr);
        const int slot = g >= 0 ? g : (e >= 0 && e < need ? n_gt + e : -1);
        if (slot >= 0) {
            const int j = v / bs;
            orow[slot] = ids[j] * bs + (v - j * bs);
        }
    }
    for (int c = k + threadIdx.x; c < topk; c += NT) orow[c] = -1;
}
