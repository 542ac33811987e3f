// top_k_per_row for NVIDIA GPUs, compiled at first use by NVRTC (sparse_indexer/ops/top_k_per_row/cuda.py).
//
// Semantics: docs/spec.md section 6. One cluster of CS CTAs (NT threads each) per row; CTA rank 0 of the cluster
// (the "leader") owns the row's selection state in its shared memory, the others push into it through
// distributed shared memory (Hopper thread-block clusters; CS == 1 needs no cluster hardware).
//
// Keys: an order-preserving uint32 of the float32 value; -inf and NaN map to 0 (below every finite value), -0.0 to
// the key of +0.0. A row of len n (window [start, start + n)):
//   * n <= k: out = 0, 1, ..., n - 1, -1, ... (the logits are not read).
//   * n <= small_max (a launch argument: the candidate capacity cap, or, in a launch whose rows all fit shared
//     memory, the width, up to 32K cells): the leader loads the window's keys into shared memory (16-byte loads,
//     SU per thread in flight, the first radix histogram fused) and finds the first digit d1 (the bin of the k-th
//     largest). Then (LIST) one pass (keys read 16 bytes at a time, only the set bits of each thread's class masks
//     visited) writes the cells above d1 to the output and lists the positions of the cells in d1 (up to 2048,
//     16-bit, in the upper half of the histogram), which are radix-selected on their 21 low bits (1024-bin
//     histograms); a larger d1 bin takes the radix select over all n keys.
//   * otherwise: every CTA of the cluster computes the same threshold key T from a strided sample of the window
//     (the r-th largest of S sampled keys, r a few binomial sigmas above the expected rank of the k-th largest;
//     the sample is S / SCHUNK evenly spread runs of SCHUNK cells, one 32-byte sector each, so it reads 1/8 of
//     the sectors a sample of single cells would). Each thread issues its sample loads first, then asks L2 for
//     the first pf_bytes (a launch argument) of its CTA's share, so the sample does not queue behind the prefetch.
//     One pass over the window (each CTA its contiguous share, 16-byte loads, 16 cells per thread in flight)
//     stages cells with key > T in the CTA's own candidate buffer (cap slots) and the positions of cells with
//     key == T in its tie buffer (k slots); slots come from a warp scan of per-thread counts and one 32-bit
//     shared atomic per warp, class and 16 cells (claim; a 64-bit shared atomic add compiles to a
//     compare-and-swap loop). After a cluster barrier every CTA appends its staged cells to the leader's
//     buffers (offsets from the other CTAs' counts, read through distributed shared memory). Then the leader:
//       - gt = count(key > T) >= k and gt <= cap: radix select (11/11/10-bit digits) among the candidates;
//       - gt < k <= gt + count(key == T): all candidates plus the first k - gt ties;
//       - otherwise (the sample missed, or the candidates overflowed): radix select over the whole window in
//         global memory (slow but exact; no listed value distribution takes it).
// A radix select stops early once the selected digit's bin holds exactly the cells still needed, when the first
// digit is 0 (its bin holds key 0 only: -inf and NaN, all equal), and, for bfloat16, after the second digit (22
// bits cover its 16).
// Before the bounds arrive, each CTA may ask L2 for its share of the row's first CS x spec_bytes bytes (a launch
// argument, 0 for none: few rows whose windows start at the row's first column then find their cells in L2).
// Output positions are relative to the window start, in no particular order. The bounds are clamped first (docs/spec.md
// section 10): start to >= 0, end to <= width (the logits' columns, a launch argument); end <= start is an empty row.
//
// Compile-time parameters (-D): NT threads per CTA (a multiple of 32, 256..1024), CS CTAs per row (a cluster when
// > 1, needs sm_90+), SMAX sample cells at most, BF16 (1: the logits are bfloat16, read as raw 16-bit words and
// widened exactly to float32, so the keys and the selection are those of the values given), LIST (default 1; 0:
// small rows take the radix select over all their keys after the first digit, for measurements).

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
#ifndef BF16
#define BF16 0
#endif
#ifndef RLIM
#define RLIM 8  // the sample threshold is refined while more than RLIM / 4 x r sample keys lie at or above it
#endif
#ifndef LIST
#define LIST 1  // small rows: after the first digit, one pass writes the cells above it and lists the cells in it
#endif
#if BF16
typedef unsigned short elem_t;  // bfloat16 bits
#else
typedef float elem_t;
#endif
#define VEC (16 / (int)sizeof(elem_t))  // cells per 16-byte load
#define KPT 16  // cells per thread in flight in the filter pass
#define SU 4  // 16-byte loads per thread in flight while a small row is loaded
#define SCHUNK (32 / (int)sizeof(elem_t))  // sample cells per run (one 32-byte sector)

#ifndef PROBE
#define PROBE 0  // 1 (measurements only): clock64() at phase marks, written over out[row, 0..8) at the end
#endif
#if PROBE
__shared__ long long probe_t[8];
#define MARK(i)                                   \
    do {                                          \
        __syncthreads();                          \
        if (threadIdx.x == 0) probe_t[i] = clock64(); \
    } while (0)
#define PROBE_OUT(orow)                                                                         \
    do {                                                                                        \
        __syncthreads();                                                                        \
        if (threadIdx.x < 8) (orow)[threadIdx.x] = (int)(probe_t[threadIdx.x] - probe_t[0]);    \
    } while (0)
#else
#define MARK(i) \
    do {        \
    } while (0)
#define PROBE_OUT(orow) \
    do {                \
    } while (0)
#endif

#define NB 2048  // histogram bins (11-bit digits)
#define NW (NT / 32)
#define FULL 0xffffffffu

// shared-memory layout (u32 words): counters, histogram, warp sums, sample, candidates (keys, positions), ties
#define OFF_CTR 0
#define OFF_HIST 16
#define OFF_WSUM (OFF_HIST + NB)
#define OFF_SAMP (OFF_WSUM + 32)
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

// The float32 value of one cell (a bfloat16 widens exactly: its bits are the float's upper half).
__device__ __forceinline__ float widen(elem_t x) {
#if BF16
    return __uint_as_float((u32)x << 16);
#else
    return x;
#endif
}
__device__ __forceinline__ float ld_cell(const elem_t* p) { return widen(__ldg(p)); }

// The VEC keys of one 16-byte vector (cells in memory order).
__device__ __forceinline__ void vec_keys(const uint4& v, u32* key) {
#if BF16
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        key[2 * c] = fkey(__uint_as_float(w[c] << 16));
        key[2 * c + 1] = fkey(__uint_as_float(w[c] & 0xffff0000u));
    }
#else
    key[0] = fkey(__uint_as_float(v.x));
    key[1] = fkey(__uint_as_float(v.y));
    key[2] = fkey(__uint_as_float(v.z));
    key[3] = fkey(__uint_as_float(v.w));
#endif
}

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31; }

// ---- distributed shared memory (clusters); CS == 1 needs none of it
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

#if CS > 1
__device__ __forceinline__ u32 map_rank(const void* p, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
    return r;
}
__device__ __forceinline__ u32 remote_ld(u32 addr) {
    u32 v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
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
__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
__device__ __forceinline__ u32 cluster_rank() { return 0; }
#endif

// Block-wide: the digit d with count(digit > d) < kr <= count(digit >= d) of hist[0..NBINS); results in ctr.
template <int NBINS = NB>
__device__ void find_digit(const u32* hist, u32 kr, u32* wsum, u32* ctr) {
    constexpr int B = NBINS / NT;
    const int t = threadIdx.x;
    const int top = NBINS - 1 - t * B;  // this thread's bins: top, top - 1, ..., top - B + 1 (thread 0: highest)
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

// Block-wide: hist[(key >> shift) & dmask] += 1 for the keys load(0..m) with (key & mask) == prefix. (Adding a
// warp's keys of one bin by one atomic, found by __reduce_min/max_sync, measured slower on the H200 for every
// distribution, few distinct values included: docs/benchmarks.md.)
template <class Load>
__device__ __forceinline__ void hist_pass(Load load, int m, u32 mask, u32 prefix, int shift, u32 dmask, u32* hist) {
    for (int i = threadIdx.x; i < m; i += NT) {
        const u32 key = load(i);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & dmask], 1u);
    }
}

// Block-wide radix select of the kr-th largest (1 <= kr <= m) of the keys load(0..m). Result: every key > hi is
// among the kr largest, and *krem of the keys in [lo, hi] complete them (lo == hi unless the select stopped early
// because a digit bin held exactly the keys still needed, then krem is that bin's full count).
// first_done: the caller already built the first pass's histogram (top 11 bits of every key) in hist.
// pass0 > 0: the first pass0 digits are already resolved (prefix0 under mask0, kr counted within them).
template <class Load>
__device__ void radix_select(Load load, int m, u32 kr, u32* hist, u32* wsum, u32* ctr, u32* lo, u32* hi,
                             u32* krem, bool first_done = false, int pass0 = 0, u32 prefix0 = 0, u32 mask0 = 0) {
    u32 prefix = prefix0, mask = mask0;
#pragma unroll 1
    for (int pass = pass0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const u32 dmask = pass < 2 ? 0x7ffu : 0x3ffu;
        if (pass > 0 || !first_done) {
            for (int i = threadIdx.x; i < NB; i += NT) hist[i] = 0;
            __syncthreads();
            hist_pass(load, m, mask, prefix, shift, dmask, hist);
            __syncthreads();
        }
        find_digit(hist, kr, wsum, ctr);
        const u32 d = ctr[C_D], above = ctr[C_ABOVE], cnt = ctr[C_CNT];
        kr -= above;
        prefix |= d << shift;
        mask |= dmask << shift;
        if (cnt == kr) break;  // the whole bin is taken
        if (pass == 0 && d == 0) break;  // first digit 0 holds key 0 only (-inf, NaN): its cells are all equal
        if (BF16 && pass == 1) break;  // 22 bits resolved: bfloat16 keys have nothing below bit 16 (all equal)
    }
    *lo = prefix;
    *hi = prefix | ~mask;
    *krem = kr;
}

// Block-wide: a threshold key T with at least r of the m sample keys samp[0..m) at or above it: the lower edge of
// the digit bin that holds the r-th largest, refined by the next digit only while more than rlimit sample keys
// lie at or above that edge (so one 11-bit pass usually suffices).
__device__ u32 sample_threshold(const u32* samp, int m, u32 r, u32 rlimit, u32* hist, u32* wsum, u32* ctr) {
    u32 prefix = 0, mask = 0, kr = r, at = 0;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const u32 dmask = pass < 2 ? 0x7ffu : 0x3ffu;
        for (int i = threadIdx.x; i < NB; i += NT) hist[i] = 0;
        __syncthreads();
        hist_pass([&](int i) { return samp[i]; }, m, mask, prefix, shift, dmask, hist);
        __syncthreads();
        find_digit(hist, kr, wsum, ctr);
        const u32 d = ctr[C_D], above = ctr[C_ABOVE], cnt = ctr[C_CNT];
        kr -= above;
        at += above;
        prefix |= d << shift;
        mask |= dmask << shift;
        if (at + cnt <= rlimit || cnt == kr) break;
    }
    return prefix;
}

// Warp-uniform call: slots for this thread's cells of two classes (bit j of ma / mb: its cell j is of class A /
// B): a warp scan of the packed per-thread counts and one shared atomic add per warp and class on the counters
// ctr2[0] (class A), ctr2[1] (class B). Returns false (slots untouched) when the warp has no cell of either
// class. (One atomic per warp and batch of cells: one per warp and cell, all on one address, serialized the
// output passes.)
__device__ __forceinline__ bool claim(u32 ma, u32 mb, u32* ctr2, u32& oa, u32& ob) {
    const u32 cnt = (u32)__popc(ma) | ((u32)__popc(mb) << 16);  // <= 32 each: no carry in a warp sum
    if (__ballot_sync(FULL, cnt != 0) == 0) return false;
    u32 incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u32 y = __shfl_up_sync(FULL, incl, o);
        if ((int)lane_id() >= o) incl += y;
    }
    u32 ba = 0, bb = 0;
    if (lane_id() == 31) {  // two 32-bit adds: a 64-bit shared atomic add is a compare-and-swap loop in SASS
        if (incl & 0xffffu) ba = atomicAdd(&ctr2[0], incl & 0xffffu);
        if (incl >> 16) bb = atomicAdd(&ctr2[1], incl >> 16);
    }
    ba = __shfl_sync(FULL, ba, 31);
    bb = __shfl_sync(FULL, bb, 31);
    const u32 excl = incl - cnt;
    oa = ba + (excl & 0xffffu);
    ob = bb + (excl >> 16);
    return true;
}

#ifndef CB
#define CB 8  // cells per thread and batch in collect
#endif
#ifndef LB
#define LB 16  // cells per thread and batch in the small-row list pass
#endif

// Block-wide: write the positions of the kr largest of the keys load(0..m) to orow (classes from radix_select):
// keys > hi at orow[ctr[C_OG]++], krem of the keys in [lo, hi] at orow[k - krem + ctr[C_OE]++].
template <class Load, class Pos>
__device__ void collect(Load load, Pos pos, int m, int k, u32 lo, u32 hi, u32 krem, u32* ctr, int* orow) {
    const u32 n_above = (u32)k - krem;
    for (int i0 = 0; i0 < m; i0 += CB * NT) {  // warp-uniform trip count (warp scans below)
        u32 key[CB];
#pragma unroll
        for (int j = 0; j < CB; ++j) {
            const int i = i0 + j * NT + (int)threadIdx.x;
            key[j] = i < m ? load(i) : 0u;
        }
        u32 mg = 0, me = 0;
#pragma unroll
        for (int j = 0; j < CB; ++j) {
            const bool in = i0 + j * NT + (int)threadIdx.x < m;
            mg |= (u32)(in && key[j] > hi) << j;
            me |= (u32)(in && key[j] >= lo && key[j] <= hi) << j;
        }
        u32 og, oe;
        if (!claim(mg, me, ctr + C_OG, og, oe)) continue;
        const int it = i0 + (int)threadIdx.x;
        while (mg) {  // the set bits only (a few cells per thread)
            orow[og++] = pos(it + (__ffs(mg) - 1) * NT);
            mg &= mg - 1u;
        }
        while (me && oe < krem) {
            orow[n_above + oe++] = pos(it + (__ffs(me) - 1) * NT);
            me &= me - 1u;
        }
    }
}

// Warp-uniform call: stage this thread's NC cells (keys, positions, validity bits) in the CTA's own buffers:
// key > t -> candidate (key, position), key == t -> tie (position). Slots: claim() on the (candidates, ties)
// counter ctr[0..1].
template <int NC, class PosF>
__device__ __forceinline__ void stage(const u32 (&key)[NC], PosF pos, u32 valid, u32 t, u32* ctr, u32* ckey,
                                      u32* cpos, u32* tpos, u32 cap, u32 k) {
    u32 mg = 0, me = 0;
#pragma unroll
    for (int j = 0; j < NC; ++j) {
        bool v = (valid >> j) & 1u;
        mg |= (u32)(v && key[j] > t) << j;
        me |= (u32)(v && key[j] == t) << j;
    }
    u32 og, oe;
    if (!claim(mg, me, ctr, og, oe)) return;
#pragma unroll
    for (int j = 0; j < NC; ++j) {
        if ((mg >> j) & 1u) {
            if (og < cap) {
                ckey[og] = key[j];
                cpos[og] = (u32)pos(j);
            }
            ++og;
        }
        if ((me >> j) & 1u) {
            if (oe < k) tpos[oe] = (u32)pos(j);
            ++oe;
        }
    }
}

#if LIST
// Block-wide, small rows (keys ckey[0..n) in shared memory, n < 65536; the first digit d1 found: kr1 of its
// cnt1 <= NB cells complete the k - kr1 cells above it). One pass writes the cells above d1 to orow and lists the
// positions of the cells in d1 (16-bit) in hist[NB / 2..NB); the list is radix-selected on the 21 bits left
// (digits of 10, 10 and 1 bits, 1024-bin histograms in hist[0..NB / 2)) and its selected cells written after them.
__device__ void small_list_select(int n, int k, u32 d1, u32 kr1, u32 cnt1, const u32* ckey, u32* hist, u32* wsum,
                                  u32* ctr, int* orow) {
    unsigned short* lst = reinterpret_cast<unsigned short*>(hist + NB / 2);
    // cells of a batch: thread t's bit j is cell i0 + 4 (NT (j / 4) + t) + j % 4 (16-byte shared loads; the
    // key slots are a multiple of 4)
    for (int i0 = 0; i0 < n; i0 += LB * NT) {  // warp-uniform trip count (warp scans below)
        u32 mg = 0, me = 0;
#pragma unroll
        for (int q = 0; q < LB / 4; ++q) {
            const int b = i0 + 4 * (q * NT + (int)threadIdx.x);
            const uint4 v = b < n ? *reinterpret_cast<const uint4*>(ckey + b) : make_uint4(0u, 0u, 0u, 0u);
            const u32 kv[4] = {v.x >> 21, v.y >> 21, v.z >> 21, v.w >> 21};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                mg |= (u32)(b + c < n && kv[c] > d1) << (4 * q + c);
                me |= (u32)(b + c < n && kv[c] == d1) << (4 * q + c);
            }
        }
        u32 og, ol;  // the list's slots count in C_OE during this pass
        if (!claim(mg, me, ctr + C_OG, og, ol)) continue;
        const int it = i0 + 4 * (int)threadIdx.x;
        while (mg) {  // the set bits only (a few cells per thread)
            const int j = __ffs(mg) - 1;
            orow[og++] = it + 4 * NT * (j >> 2) + (j & 3);
            mg &= mg - 1u;
        }
        while (me) {
            const int j = __ffs(me) - 1;
            lst[ol++] = (unsigned short)(it + 4 * NT * (j >> 2) + (j & 3));
            me &= me - 1u;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) ctr[C_OE] = 0;  // (the list's count; collect counts its "equal" class there)
    MARK(4);
    auto ldl = [&](int j) { return ckey[lst[j]]; };
    u32 prefix = d1 << 21, mask = 0x7ffu << 21, kr = kr1;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 11 : (pass == 1 ? 1 : 0);
        const u32 dmask = pass < 2 ? 0x3ffu : 0x1u;
        for (int i = threadIdx.x; i < NB / 2; i += NT) hist[i] = 0;
        __syncthreads();  // (the first: also every list entry written)
        hist_pass(ldl, (int)cnt1, mask, prefix, shift, dmask, hist);
        __syncthreads();
        find_digit<NB / 2>(hist, kr, wsum, ctr);
        const u32 d = ctr[C_D], above = ctr[C_ABOVE], cnt = ctr[C_CNT];
        kr -= above;
        prefix |= d << shift;
        mask |= dmask << shift;
        if (cnt == kr) break;
        if (BF16 && pass == 0) break;  // bits 20..11 resolved: a bfloat16 key's bits below 16 are all equal
    }
    MARK(5);
    collect(ldl, [&](int j) { return (int)lst[j]; }, (int)cnt1, k, prefix, prefix | ~mask, kr, ctr, orow);
    MARK(6);
}
#endif

extern "C" __global__ void __launch_bounds__(NT, MINB)
si_top_k_per_row(const elem_t* __restrict__ logits, long long stride_l, const int* __restrict__ starts,
                 const int* __restrict__ ends, int* __restrict__ out, long long stride_o, int k, int cap,
                 int samp_words, int small_max, int vec_ok, int stop, int pf_bytes, int spec_bytes, int width) {
    extern __shared__ __align__(16) u32 sm[];
    u32* ctr = sm + OFF_CTR;
    u32* hist = sm + OFF_HIST;
    u32* wsum = sm + OFF_WSUM;
    u32* samp = sm + OFF_SAMP;
    u32* ckey = samp + samp_words;  // samp_words = 0 when every window of the launch fits in cap
    u32* cpos = ckey + cap;
    u32* tpos = cpos + cap;

    const int row = blockIdx.x / CS;
    const u32 rank = cluster_rank();
    const int start = max(starts[row], 0);  // the window clamped into [0, width): hostile bounds never move a read
    const int end = min(ends[row], width);    // outside the row, and end - start cannot overflow
    if (spec_bytes > 0) {  // while the bounds load: ask L2 for this CTA's share of the row's first cells
        const char* p0 = reinterpret_cast<const char*>(logits + (long long)row * stride_l) +
                         (long long)rank * spec_bytes;
        for (int off = 128 * (int)threadIdx.x; off < spec_bytes; off += 128 * NT)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p0 + off) : "memory");
    }
    const int n = end > start ? end - start : 0;
    int* orow = out + (long long)row * stride_o;
    const elem_t* base = logits + (long long)row * stride_l + start;  // window cell i at base[i]

    if (stop == 3) {  // (timing) the bounds read, nothing written
        if (start == 2147483647 && end == -2147483647 - 1) orow[0] = 0;
        return;
    }
#if PROBE
    if (threadIdx.x < 8) probe_t[threadIdx.x] = 0;
#endif
    MARK(0);
    if (n <= k) {  // short row: 0..n-1, -1...
        if (rank == 0)
            for (int i = threadIdx.x; i < k; i += NT) orow[i] = i < n ? i : -1;
        return;
    }
    MARK(1);
    if (n <= small_max) {  // small row (small_max <= cap): the leader selects among all its cells in shared memory
        if (rank != 0) return;
        if (threadIdx.x < 16) ctr[threadIdx.x] = 0;
        for (int i = threadIdx.x; i < NB; i += NT) hist[i] = 0;
        __syncthreads();
        {  // keys to shared memory, with the first radix histogram: 16-byte loads over the VEC-aligned middle
            // [a0, a1) of the window, SU of them per thread in flight, then the (< 2 VEC) edge cells
            const long long abs0 = (long long)row * stride_l + start;
            int a0 = vec_ok ? (int)((VEC - (abs0 & (VEC - 1))) & (VEC - 1)) : n;
            if (a0 > n) a0 = n;
            const int a1 = vec_ok ? a0 + ((n - a0) & ~(VEC - 1)) : n;
            const int nq = (a1 - a0) / VEC;
            const uint4* qb = reinterpret_cast<const uint4*>(base + a0);
            for (int qi = 0; qi < nq; qi += NT * SU) {
                uint4 v[SU];
#pragma unroll
                for (int u = 0; u < SU; ++u) {
                    const int q = qi + u * NT + (int)threadIdx.x;
                    v[u] = q < nq ? __ldg(qb + q) : make_uint4(0u, 0u, 0u, 0u);
                }
#pragma unroll
                for (int u = 0; u < SU; ++u) {
                    const int q = qi + u * NT + (int)threadIdx.x;
                    if (q < nq) {
                        u32 key[VEC];
                        vec_keys(v[u], key);
                        if ((a0 & 3) == 0) {  // 16-byte shared stores (fewer bank conflicts)
                            uint4* dst = reinterpret_cast<uint4*>(ckey + a0 + VEC * q);
#pragma unroll
                            for (int c = 0; c < VEC / 4; ++c)
                                dst[c] = make_uint4(key[4 * c], key[4 * c + 1], key[4 * c + 2], key[4 * c + 3]);
                        } else {
#pragma unroll
                            for (int c = 0; c < VEC; ++c) ckey[a0 + VEC * q + c] = key[c];
                        }
#pragma unroll
                        for (int c = 0; c < VEC; ++c) atomicAdd(&hist[key[c] >> 21], 1u);
                    }
                }
            }
            const int ne = a0 + (n - a1);
            for (int e = threadIdx.x; e < ne; e += NT) {
                const int i = e < a0 ? e : a1 + (e - a0);
                const u32 key = fkey(ld_cell(base + i));
                ckey[i] = key;
                atomicAdd(&hist[key >> 21], 1u);
            }
        }
        __syncthreads();
        if (stop == 4) return;  // (timing) keys loaded, first histogram built
        MARK(2);
        u32 lo, hi, krem;
        auto ld = [&](int i) { return ckey[i]; };
#if LIST
        find_digit(hist, (u32)k, wsum, ctr);
        const u32 d1 = ctr[C_D], cnt1 = ctr[C_CNT], kr1 = (u32)k - ctr[C_ABOVE];
        if (stop == 1) return;  // (timing) first digit found
        if (cnt1 != kr1 && d1 != 0 && cnt1 <= NB) {
            MARK(3);
            small_list_select(n, k, d1, kr1, cnt1, ckey, hist, wsum, ctr, orow);
            PROBE_OUT(orow);
            return;
        }
        if (cnt1 == kr1 || d1 == 0) {  // the first digit's whole bin is taken, or its cells are all equal (key 0)
            lo = d1 << 21;
            hi = lo | 0x1fffffu;
            krem = kr1;
        } else {
            radix_select(ld, n, kr1, hist, wsum, ctr, &lo, &hi, &krem, false, 1, d1 << 21, 0x7ffu << 21);
        }
#else
        radix_select(ld, n, (u32)k, hist, wsum, ctr, &lo, &hi, &krem, true);
#endif
        collect(ld, [](int i) { return i; }, n, k, lo, hi, krem, ctr, orow);
        PROBE_OUT(orow);
        return;
    }

    // 16-byte loads over the VEC-aligned middle [a0, a1) of the window (cell indices, relative to start); this
    // CTA reads vectors ("quads") [q0, q1) of it
    const long long abs0 = (long long)row * stride_l + start;  // element offset of cell 0
    int a0 = vec_ok ? (int)((VEC - (abs0 & (VEC - 1))) & (VEC - 1)) : n;
    if (a0 > n) a0 = n;
    const int a1 = vec_ok ? a0 + ((n - a0) & ~(VEC - 1)) : n;
    const int nq = (a1 - a0) / VEC;  // vectors in the middle
    const int qper = (nq + CS - 1) / CS;
    const int q0 = (int)rank * qper;
    const int q1 = q0 + qper < nq ? q0 + qper : nq;

    // ---- threshold from a sample (identical in every CTA of the cluster): S / SCHUNK runs of SCHUNK consecutive
    // cells, each run spread evenly and aligned to its 32-byte sector. The sample's loads are issued first, then
    // this CTA asks L2 for the first pf_bytes of its share (so the sample does not queue behind the prefetch).
    if (threadIdx.x < 16) ctr[threadIdx.x] = 0;
    int S = n <= 65536 ? (SMAX < 2048 ? SMAX : 2048) : SMAX;
    S = S < samp_words ? S : samp_words;  // (the launch's sample slots)
    {
        constexpr int C = SCHUNK;
        constexpr int G = 4;  // sample loads per thread in flight
        const int runs = S / C;
#pragma unroll 1
        for (int j0 = 0; j0 < S; j0 += G * NT) {
            elem_t sv[G];
#pragma unroll
            for (int i = 0; i < G; ++i) {
                const int j = j0 + (int)threadIdx.x + i * NT;
                if (j < S) {
                    int p = (int)(((long long)(j / C) * n) / runs);
                    p = (int)(((abs0 + p) & ~(long long)(C - 1)) - abs0);
                    p = (p < 0 ? 0 : p) + j % C;
                    sv[i] = __ldg(base + (p < n ? p : n - 1));
                }
            }
            if (j0 == 0 && pf_bytes > 0) {
                const char* p0 = reinterpret_cast<const char*>(base + a0 + VEC * q0);
                long long bytes = 16LL * (q1 > q0 ? q1 - q0 : 0);
                bytes = bytes < pf_bytes ? bytes : pf_bytes;
                for (long long off = 128LL * threadIdx.x; off < bytes; off += 128LL * NT)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(p0 + off) : "memory");
            }
#pragma unroll
            for (int i = 0; i < G; ++i) {
                const int j = j0 + (int)threadIdx.x + i * NT;
                if (j < S) samp[j] = fkey(widen(sv[i]));
            }
        }
    }
    __syncthreads();
    if (stop == 4) return;
    MARK(2);
    const float kk = (float)k * (float)S / (float)n;
    int r = (int)ceilf(kk + 3.0f * sqrtf(kk) + 3.0f);
    r = r < 1 ? 1 : (r > S ? S : r);
    const u32 T = sample_threshold(samp, S, (u32)r, (u32)(RLIM * r) / 4u, hist, wsum, ctr);
    MARK(3);
    if (stop == 1) return;

    // ---- filter: this CTA's share of the window, staged in its own buffers
    const u32 ucap = (u32)cap, uk = (u32)k;
    const uint4* qb = reinterpret_cast<const uint4*>(base + a0);
    constexpr int U = KPT / VEC;  // vectors in flight per thread
    constexpr u32 VMASK = (1u << VEC) - 1u;
    for (int qi = q0; qi < q1; qi += NT * U) {  // warp-uniform
        uint4 v[U];
        u32 valid = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int q = qi + u * NT + threadIdx.x;
            v[u] = q < q1 ? __ldg(qb + q) : make_uint4(0u, 0u, 0u, 0u);
            valid |= (q < q1 ? VMASK : 0u) << (VEC * u);
        }
        u32 key[KPT];
#pragma unroll
        for (int u = 0; u < U; ++u) vec_keys(v[u], key + VEC * u);
        const int p0 = a0 + VEC * (qi + (int)threadIdx.x);  // cell VEC u + c sits at p0 + VEC NT u + c
        stage<KPT>(key, [&](int j) { return p0 + VEC * NT * (j / VEC) + (j % VEC); }, valid, T, ctr, ckey, cpos,
                   tpos, ucap, uk);
    }
    {  // scalar cells: the (<= 2 (VEC - 1)) edges of the aligned middle, or the whole window (split by rank) without it
        const int ne = a0 + (n - a1);
        const int per = vec_ok ? ne : (ne + CS - 1) / CS;
        const int e0 = vec_ok ? (rank == CS - 1 ? 0 : ne) : (int)rank * per;
        const int e1 = e0 + per < ne ? e0 + per : ne;
        for (int e = e0; e < e1; e += NT) {  // warp-uniform
            const int i = e + threadIdx.x;
            const int p = i < a0 ? i : a1 + (i - a0);
            const bool ok = i < e1;
            u32 kk1[1] = {ok ? fkey(ld_cell(base + p)) : 0u};
            stage<1>(kk1, [&](int) { return p; }, ok ? 1u : 0u, T, ctr, ckey, cpos, tpos, ucap, uk);
        }
    }
    __syncthreads();
    if (stop == 5) return;
    MARK(4);
    u32 gt = ctr[C_GT], eq = ctr[C_EQ];
#if CS > 1
    cluster_sync();  // A: every CTA's staged counts are final
    if (threadIdx.x < 32) {  // this CTA's offsets in the leader's buffers, and the totals (lane c: rank c)
        const u32 c = threadIdx.x;
        u32 g = 0, e = 0;
        if (c < CS) {
            g = remote_ld(map_rank(&ctr[C_GT], c));
            e = remote_ld(map_rank(&ctr[C_EQ], c));
        }
        u32 bg = c < rank ? g : 0u, be = c < rank ? e : 0u, tg = g, te = e;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            bg += __shfl_xor_sync(FULL, bg, o);
            be += __shfl_xor_sync(FULL, be, o);
            tg += __shfl_xor_sync(FULL, tg, o);
            te += __shfl_xor_sync(FULL, te, o);
        }
        if (c == 0) {
            ctr[4] = bg;
            ctr[5] = be;
            ctr[6] = tg;
            ctr[7] = te;
        }
    }
    __syncthreads();
    if (rank != 0) {  // append to the leader (rank 0 staged in place)
        const u32 bg = ctr[4], be = ctr[5];
        const u32 ng = gt < ucap ? gt : ucap, ne2 = eq < uk ? eq : uk;
        const u32 rk = map_rank(ckey, 0), rp = map_rank(cpos, 0), rt = map_rank(tpos, 0);
        for (u32 i = threadIdx.x; i < ng && bg + i < ucap; i += NT) {
            remote_st(rk + 4 * (bg + i), ckey[i]);
            remote_st(rp + 4 * (bg + i), cpos[i]);
        }
        for (u32 i = threadIdx.x; i < ne2 && be + i < uk; i += NT) remote_st(rt + 4 * (be + i), tpos[i]);
    }
    gt = ctr[6];
    eq = ctr[7];
    cluster_sync();  // B: every append has landed in the leader
#endif
    MARK(5);
    if (stop == 2 || rank != 0) return;

    // ---- the leader: exact selection
    u32 lo, hi, krem;
    if (gt >= (u32)k && gt <= (u32)cap) {
        auto ld = [&](int i) { return ckey[i]; };
        radix_select(ld, (int)gt, (u32)k, hist, wsum, ctr, &lo, &hi, &krem);
        MARK(6);
        collect(ld, [&](int i) { return (int)cpos[i]; }, (int)gt, k, lo, hi, krem, ctr, orow);
        MARK(7);
        PROBE_OUT(orow);
    } else if (gt < (u32)k && gt + eq >= (u32)k) {
        for (int i = threadIdx.x; i < (int)gt; i += NT) orow[i] = (int)cpos[i];
        for (int i = threadIdx.x; i < k - (int)gt; i += NT) orow[gt + i] = (int)tpos[i];
    } else {  // the sample missed or the candidates overflowed: select over the whole window
        auto ld = [&](int i) { return fkey(ld_cell(base + i)); };
        radix_select(ld, n, (u32)k, hist, wsum, ctr, &lo, &hi, &krem);
        collect(ld, [](int i) { return i; }, n, k, lo, hi, krem, ctr, orow);
    }
}
