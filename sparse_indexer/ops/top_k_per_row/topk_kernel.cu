// top_k_per_row for NVIDIA GPUs, compiled at first use by NVRTC (sparse_indexer/ops/top_k_per_row/cuda.py).
//
// Semantics: docs/spec.md section 6. One cluster of CS CTAs (NT threads each) per row; CTA rank 0 of the cluster
// (the "leader") owns the row's selection state in its shared memory, the others push into it through
// distributed shared memory (Hopper thread-block clusters; CS == 1 needs no cluster hardware).
//
// Keys: an order-preserving uint32 of the float32 value; -inf and NaN map to 0 (below every finite value), -0.0 to
// the key of +0.0. A row of len n (window [start, start + n)):
//   * n <= k: out = 0, 1, ..., n - 1, -1, ... (the logits are not read).
//   * n <= cap: the leader loads the window's keys into shared memory and radix-selects among them.
//   * otherwise: every CTA of the cluster computes the same threshold key T from a strided sample of the window
//     (the r-th largest of S sampled keys, r a few binomial sigmas above the expected rank of the k-th largest).
//     One pass over the window (each CTA its contiguous share, 16-byte loads) appends cells with key > T to the
//     leader's candidate buffer (cap slots) and the positions of cells with key == T to its tie buffer (k slots),
//     slots reserved by one warp-aggregated atomic per warp and element slot. Then the leader:
//       - gt = count(key > T) >= k and gt <= cap: radix select (11/11/10-bit digits) among the candidates;
//       - gt < k <= gt + count(key == T): all candidates plus the first k - gt ties;
//       - otherwise (the sample missed, or the candidates overflowed): radix select over the whole window in
//         global memory (slow but exact; no listed value distribution takes it).
// A radix select stops early once the selected digit's bin holds exactly the cells still needed.
// Output positions are relative to the window start, in no particular order.
//
// Compile-time parameters (-D): NT threads per CTA (a multiple of 32, 256..1024), CS CTAs per row (a cluster when
// > 1, needs sm_90+), SMAX sample cells at most.

typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef NT
#define NT 1024
#endif
#ifndef CS
#define CS 1
#endif
#ifndef SMAX
#define SMAX 4096
#endif
#ifndef MINB
#define MINB 1  // CTAs per SM the register budget is sized for
#endif

#define NB 2048  // histogram bins (11-bit digits)
#define NW (NT / 32)
#define FULL 0xffffffffu

// shared-memory layout (u32 words): counters, histogram, warp sums, sample, candidates (keys, positions), ties
#define OFF_CTR 0
#define OFF_HIST 16
#define OFF_WSUM (OFF_HIST + NB)
#define OFF_SAMP (OFF_WSUM + 32)
#define OFF_CKEY (OFF_SAMP + SMAX)
// counters
#define C_GT 0    // cells with key > T (candidates, may exceed cap)
#define C_EQ 1    // cells with key == T (ties, may exceed k)
#define C_OG 2    // output slots taken by the "above" class
#define C_OE 3    // output slots taken by the "equal" class
#define C_D 8     // find_digit results: digit, cells above it, cells in it
#define C_ABOVE 9
#define C_CNT 10

__device__ __forceinline__ u32 fkey(float x) {
    u32 u = __float_as_uint(x);
    u32 key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    key = (x == 0.0f) ? 0x80000000u : key;
    return (x > __int_as_float(0xff800000)) ? key : 0u;  // -inf and NaN (every compare false) -> 0
}

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31; }

__device__ __forceinline__ u32 lanemask_lt() {
    u32 m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// ---- the leader's shared memory as seen from any CTA of the cluster (32-bit shared-window addresses)
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

#if CS > 1
__device__ __forceinline__ u32 leader_addr(const void* p) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(r) : "r"(smem_addr(p)));
    return r;
}
__device__ __forceinline__ u32 remote_add(u32 addr, u32 v) {
    u32 old;
    asm volatile("atom.relaxed.cluster.shared::cluster.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v)
                 : "memory");
    return old;
}
__device__ __forceinline__ void remote_st(u32 addr, u32 v) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
#else
__device__ __forceinline__ u32 leader_addr(const void* p) { return smem_addr(p); }
__device__ __forceinline__ u32 remote_add(u32 addr, u32 v) {
    u32 old;
    asm volatile("atom.shared.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ void remote_st(u32 addr, u32 v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
__device__ __forceinline__ u32 cluster_rank() { return 0; }
#endif

// Block-wide: the digit d with count(digit > d) < kr <= count(digit >= d) of hist[0..NB); results in ctr.
__device__ void find_digit(const u32* hist, u32 kr, u32* wsum, u32* ctr) {
    constexpr int B = NB / NT;
    const int t = threadIdx.x;
    const int top = NB - 1 - t * B;  // this thread's bins: top, top - 1, ..., top - B + 1 (thread 0: highest)
    u32 v[B];
    u32 s = 0;
#pragma unroll
    for (int j = 0; j < B; ++j) {
        v[j] = hist[top - j];
        s += v[j];
    }
    u32 incl = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u32 y = __shfl_up_sync(FULL, incl, o);
        if ((int)lane_id() >= o) incl += y;
    }
    const int w = t >> 5;
    if (lane_id() == 31) wsum[w] = incl;
    __syncthreads();
    if (w == 0) {
        u32 x = lane_id() < NW ? wsum[lane_id()] : 0u;
        u32 xi = x;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            u32 y = __shfl_up_sync(FULL, xi, o);
            if ((int)lane_id() >= o) xi += y;
        }
        __syncwarp();
        if (lane_id() < NW) wsum[lane_id()] = xi - x;  // exclusive
    }
    __syncthreads();
    u32 acc = wsum[w] + incl - s;  // cells in bins above this thread's
#pragma unroll
    for (int j = 0; j < B; ++j) {
        if (acc < kr && acc + v[j] >= kr) {
            ctr[C_D] = (u32)(top - j);
            ctr[C_ABOVE] = acc;
            ctr[C_CNT] = v[j];
        }
        acc += v[j];
    }
    __syncthreads();
}

// Block-wide radix select of the kr-th largest (1 <= kr <= m) of the keys load(0..m). Result: every key > hi is
// among the kr largest, and *krem of the keys in [lo, hi] complete them (lo == hi unless the select stopped early
// because a digit bin held exactly the keys still needed, then krem is that bin's full count).
template <class Load>
__device__ void radix_select(Load load, int m, u32 kr, u32* hist, u32* wsum, u32* ctr, u32* lo, u32* hi,
                             u32* krem) {
    u32 prefix = 0, mask = 0;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const u32 dmask = pass < 2 ? 0x7ffu : 0x3ffu;
        for (int i = threadIdx.x; i < NB; i += NT) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < m; i += NT) {
            u32 key = load(i);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & dmask], 1u);
        }
        __syncthreads();
        find_digit(hist, kr, wsum, ctr);
        const u32 d = ctr[C_D], above = ctr[C_ABOVE], cnt = ctr[C_CNT];
        kr -= above;
        prefix |= d << shift;
        mask |= dmask << shift;
        if (cnt == kr) break;  // the whole bin is taken
    }
    *lo = prefix;
    *hi = prefix | ~mask;
    *krem = kr;
}

// Block-wide: write the positions of the kr largest of the keys load(0..m) to orow (classes from radix_select).
template <class Load, class Pos>
__device__ void collect(Load load, Pos pos, int m, int k, u32 lo, u32 hi, u32 krem, u32* ctr, int* orow) {
    const u32 n_above = (u32)k - krem;
    for (int i0 = 0; i0 < m; i0 += NT) {  // warp-uniform trip count (ballots below)
        const int i = i0 + threadIdx.x;
        u32 key = i < m ? load(i) : 0u;
        bool gt = i < m && key > hi;
        bool eq = i < m && key >= lo && key <= hi;
        u32 bg = __ballot_sync(FULL, gt), be = __ballot_sync(FULL, eq);
        if (bg) {
            u32 base = 0;
            if (lane_id() == 0) base = atomicAdd(&ctr[C_OG], (u32)__popc(bg));
            base = __shfl_sync(FULL, base, 0);
            if (gt) orow[base + __popc(bg & lanemask_lt())] = pos(i);
        }
        if (be) {
            u32 base = 0;
            if (lane_id() == 0) base = atomicAdd(&ctr[C_OE], (u32)__popc(be));
            base = __shfl_sync(FULL, base, 0);
            u32 slot = base + __popc(be & lanemask_lt());
            if (eq && slot < krem) orow[n_above + slot] = pos(i);
        }
    }
}

struct Sink {
    u32 ctr, ckey, cpos, tpos;  // the leader's shared-window addresses
    u32 cap, k;
};

// One cell (warp-uniform call): key > T -> candidate, key == T -> tie (slots in the leader's buffers).
__device__ __forceinline__ void push(const Sink& s, bool valid, u32 key, u32 t, int pos) {
    bool ge = valid && key >= t;
    u32 b = __ballot_sync(FULL, ge);
    if (b == 0) return;
    bool gt = ge && key > t;
    bool eq = ge && key == t;
    u32 bg = __ballot_sync(FULL, gt), be = b & ~bg;
    u32 lt = lanemask_lt();
    if (bg) {
        u32 base = 0;
        if (lane_id() == 0) base = remote_add(s.ctr + 4 * C_GT, (u32)__popc(bg));
        base = __shfl_sync(FULL, base, 0);
        u32 slot = base + __popc(bg & lt);
        if (gt && slot < s.cap) {
            remote_st(s.ckey + 4 * slot, key);
            remote_st(s.cpos + 4 * slot, (u32)pos);
        }
    }
    if (be) {
        u32 base = 0;
        if (lane_id() == 0) base = remote_add(s.ctr + 4 * C_EQ, (u32)__popc(be));
        base = __shfl_sync(FULL, base, 0);
        u32 slot = base + __popc(be & lt);
        if (eq && slot < s.k) remote_st(s.tpos + 4 * slot, (u32)pos);
    }
}

extern "C" __global__ void __launch_bounds__(NT, MINB)
si_top_k_per_row(const float* __restrict__ logits, long long stride_l, const int* __restrict__ starts,
                 const int* __restrict__ ends, int* __restrict__ out, long long stride_o, int k, int cap,
                 int vec_ok) {
    extern __shared__ __align__(16) u32 sm[];
    u32* ctr = sm + OFF_CTR;
    u32* hist = sm + OFF_HIST;
    u32* wsum = sm + OFF_WSUM;
    u32* samp = sm + OFF_SAMP;
    u32* ckey = sm + OFF_CKEY;
    u32* cpos = ckey + cap;
    u32* tpos = cpos + cap;

    const int row = blockIdx.x / CS;
    const u32 rank = cluster_rank();
    const int start = starts[row];
    const int end = ends[row];
    const int n = end > start ? end - start : 0;
    int* orow = out + (long long)row * stride_o;
    const float* base = logits + (long long)row * stride_l + start;  // window cell i at base[i]

    if (n <= k) {  // short row: 0..n-1, -1...
        if (rank == 0)
            for (int i = threadIdx.x; i < k; i += NT) orow[i] = i < n ? i : -1;
        return;
    }
    if (n <= cap) {  // small row: the leader selects among all its cells in shared memory
        if (rank != 0) return;
        if (threadIdx.x < 16) ctr[threadIdx.x] = 0;
        for (int i = threadIdx.x; i < n; i += NT) ckey[i] = fkey(__ldg(base + i));
        __syncthreads();
        u32 lo, hi, krem;
        auto ld = [&](int i) { return ckey[i]; };
        radix_select(ld, n, (u32)k, hist, wsum, ctr, &lo, &hi, &krem);
        collect(ld, [](int i) { return i; }, n, k, lo, hi, krem, ctr, orow);
        return;
    }

    // ---- threshold from a strided sample (identical in every CTA of the cluster)
    if (rank == 0 && threadIdx.x < 16) ctr[threadIdx.x] = 0;
    const int S = n <= 65536 ? (SMAX < 2048 ? SMAX : 2048) : SMAX;
    for (int j = threadIdx.x; j < S; j += NT) samp[j] = fkey(__ldg(base + (int)(((long long)j * n) / S)));
    __syncthreads();
    const float kk = (float)k * (float)S / (float)n;
    int r = (int)ceilf(kk + 3.5f * sqrtf(kk) + 4.0f);
    r = r < 1 ? 1 : (r > S ? S : r);
    u32 t_lo, t_hi, t_rem;
    radix_select([&](int i) { return samp[i]; }, S, (u32)r, hist, wsum, ctr, &t_lo, &t_hi, &t_rem);
    const u32 T = t_lo;
    cluster_sync();  // the leader's counters are zeroed before anyone adds to them

    // ---- filter: this CTA's share of the window into the leader's candidate / tie buffers
    Sink s;
    s.ctr = leader_addr(ctr);
    s.ckey = leader_addr(ckey);
    s.cpos = leader_addr(cpos);
    s.tpos = leader_addr(tpos);
    s.cap = (u32)cap;
    s.k = (u32)k;
    // 16-byte loads over the 4-aligned middle [a0, a1) of the window (cell indices, relative to start)
    const long long abs0 = (long long)row * stride_l + start;  // element offset of cell 0
    int a0 = vec_ok ? (int)((4 - (abs0 & 3)) & 3) : n;
    if (a0 > n) a0 = n;
    int a1 = vec_ok ? a0 + ((n - a0) & ~3) : n;
    const int nq = (a1 - a0) >> 2;  // quads in the middle
    const int qper = (nq + CS - 1) / CS;
    const int q0 = (int)rank * qper;
    const int q1 = q0 + qper < nq ? q0 + qper : nq;
    const float4* qb = reinterpret_cast<const float4*>(base + a0);
    constexpr int U = 4;  // quads in flight per thread
    for (int qi = q0; qi < q1; qi += NT * U) {  // warp-uniform
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int q = qi + u * NT + threadIdx.x;
            v[u] = q < q1 ? __ldg(qb + q) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int q = qi + u * NT + threadIdx.x;
            bool ok = q < q1;
            int p = a0 + 4 * q;
            push(s, ok, fkey(v[u].x), T, p);
            push(s, ok, fkey(v[u].y), T, p + 1);
            push(s, ok, fkey(v[u].z), T, p + 2);
            push(s, ok, fkey(v[u].w), T, p + 3);
        }
    }
    if (rank == CS - 1) {  // edge cells: [0, a0) and [a1, n) (all cells when vec_ok == 0)
        const int ne = a0 + (n - a1);
        for (int e0 = 0; e0 < ne; e0 += NT) {  // warp-uniform
            int e = e0 + threadIdx.x;
            int p = e < a0 ? e : a1 + (e - a0);
            bool ok = e < ne;
            push(s, ok, ok ? fkey(__ldg(base + p)) : 0u, T, p);
        }
    }
    cluster_sync();  // every push has landed in the leader
    if (rank != 0) return;

    // ---- the leader: exact selection
    const u32 gt = ctr[C_GT], eq = ctr[C_EQ];
    u32 lo, hi, krem;
    if (gt >= (u32)k && gt <= (u32)cap) {
        auto ld = [&](int i) { return ckey[i]; };
        radix_select(ld, (int)gt, (u32)k, hist, wsum, ctr, &lo, &hi, &krem);
        collect(ld, [&](int i) { return (int)cpos[i]; }, (int)gt, k, lo, hi, krem, ctr, orow);
    } else if (gt < (u32)k && gt + eq >= (u32)k) {
        for (int i = threadIdx.x; i < (int)gt; i += NT) orow[i] = (int)cpos[i];
        for (int i = threadIdx.x; i < k - (int)gt; i += NT) orow[gt + i] = (int)tpos[i];
    } else {  // the sample missed or the candidates overflowed: select over the whole window
        auto ld = [&](int i) { return fkey(__ldg(base + i)); };
        radix_select(ld, n, (u32)k, hist, wsum, ctr, &lo, &hi, &krem);
        collect(ld, [](int i) { return i; }, n, k, lo, hi, krem, ctr, orow);
    }
}
