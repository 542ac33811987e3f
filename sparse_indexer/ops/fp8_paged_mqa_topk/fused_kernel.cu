// Fused paged decode scoring + exact top-k (docs/spec.md §5 and §6): scores are filtered while they are computed
// and never stored, neither in global nor in shared memory.
//
// One persistent cooperative grid of one CTA per SM (NT = 128 * NWG threads: NWG warpgroups). The key tiles of
// every request that needs a selection (a row whose window is longer than topk; every request when the logits
// are also written out) form one global range of 64-key tiles cut into P equal contiguous pieces, one per CTA,
// as in the Gluon logits kernel. Each CTA lists its tiles with the request's *sample tiles* first: tiles
// floor(i * nt / S), i < S = min(nt, SAMPLE_TILES), of a request of nt tiles. Phases:
//
//   setup    the request table, the CTA's tile list, rows of at most topk cells written (0..len-1, -1...).
//            There is no grid barrier: the per-row counters live in a buffer only this kernel writes, zeroed
//            once when it is made and left at zero by each row's finisher.
//   sample   the warpgroups score the CTA's sample tiles (each its own tiles wg, wg + NWG, ... through its own
//            cp.async ring of STAGES slots, synchronizing only its 128 threads; per query token j one wgmma
//            chain K[64 keys, 128] x Q_j^T[128, H], fp8 in, f32 accumulators; then relu, times the head weights,
//            the head sum within a thread and its quad, times the key scale) and store the order-preserving
//            32-bit keys in the row's workspace (cells outside the window as 0). The rings keep prefetching the
//            tiles after the samples meanwhile.
//   tau      each CTA counts its sample tiles done per row, waits until its rows' samples are complete
//            (the row's other CTAs: every CTA scores its samples before it waits, and all are resident) and
//            computes, per row, tau = the r-th largest sample key, r = m + 4 sqrt(m) + 4 for the m = topk * s / lim
//            sample cells expected above the row's topk-th largest (s sample cells in the window): three radix
//            digits (11, 11, 10 bits) over at most 2048 keys in shared memory. Every CTA of a row computes the
//            same tau. It then files its own sample cells.
//   score    the rest of the tiles, the epilogue filing each cell with key >= tau: staged per warp in shared
//            memory (64 entries, no atomics), flushed with one atomic per row and class: cells above tau to the
//            row's list of CG keys and positions, cells equal to tau to a list of CE positions (only the first
//            CE are kept; they are all equal). Both counts keep counting past their capacity.
//   finish   each CTA adds its cells to the row's done count; the CTA that completes a row, with G cells above
//            tau and E equal to it:
//              G + E < topk (tau missed: too few cells at or above it) or G > CG (the list overflowed): the row
//                is rescored by this CTA alone, four passes of one radix digit each (exact, slow; a guard for
//                hostile values, never taken on random ones);
//              G >= topk: the topk largest of the G listed cells (three radix digits in shared memory, tickets
//                for the final key);
//              else: the G listed cells and the first topk - G of the equal ones.
//
// Hostile values (docs/spec.md section 10): every limit is clamped into [0, cap], cap = min(W, max_blocks * 64), so
// the block table is read only inside its rows; a block id outside [0, num_blocks) is copied as a zero tile
// (cp.async zero-fill, nothing read), so its cells score 0 (relu(0) * weights, times a zero scale).
//
// The cooperative launch guarantees that every CTA is resident (a CTA waits for the samples other CTAs score).
//
// Workspace row r (int32, FUSED_WORKSPACE_COLS = 16392): sample keys [2048]; keys above tau [CG]; their positions
// [CG]; positions equal to tau [CE]. Counter row r (int32 [4], Params::ctr): GT, EQ, SMP (sample tiles done),
// ARR (cells done).

#ifndef NEXT_N
#define NEXT_N 1
#endif
#ifndef H
#define H 64
#endif
#ifndef BF16
#define BF16 0
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef LG_OUT
#define LG_OUT 0
#endif
#ifndef NO_SAMPLE_FILTER
#define NO_SAMPLE_FILTER 0  // tests only: 1 makes every row take the rescoring fallback (tau from no sample)
#endif

#ifndef PROBE
#define PROBE 0  // 1 (measurements only): %globaltimer at phase marks, written to probe[pid, 0..8)
#endif
#if PROBE
#define MARK(i)                                                                            \
    if (threadIdx.x == 0) {                                                                \
        unsigned long long t_;                                                             \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                             \
        p.probe[blockIdx.x * 8 + (i)] = t_;                                                \
    }
#else
#define MARK(i)
#endif

#define WG_BAR() asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory")

#ifndef NWG
#define NWG 4  // warpgroups (2 or 4: find_digit needs NT to divide 1024)
#endif

#undef NT  // (the loader passes -DNT; the block size follows NWG)
#define NT (128 * NWG)
#define NW (NT / 32)
#define FULL 0xffffffffu
#define TILE_BYTES 8192   // 64 keys x 128 fp8 values
#define BLOCK_KEYS 64
#define SAMPLE_TILES 32
#define CG 6144           // listed cells above tau per row
#define CE 2048           // listed positions equal to tau per row (>= topk)
#define WS_SAMPLE 0       // [SAMPLE_TILES * 64] sample keys
#define WS_GK 2048        // [CG] keys above tau
#define WS_GP (WS_GK + CG)  // [CG] their positions
#define WS_EP (WS_GP + CG)  // [CE] positions equal to tau
#define WS_END (WS_EP + CE)
#define C_GT 0
#define C_EQ 1
#define C_SMP 2
#define C_ARR 3
#define STG 64            // staged entries per warp
typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(64) Params {
    unsigned char tmap[128];     // CUtensorMap of the cache's values: [num_blocks][64 rows][128 bytes], 128-byte swizzle
    const unsigned char* cache;  // [num_blocks, block_stride] bytes: 64 x 128 fp8 values, then 64 float32 scales
    long long block_stride;
    const unsigned char* q;      // [B, NEXT_N, H, 128] fp8, contiguous
    const float* w;              // [B * NEXT_N, H] float32, row stride stride_w
    long long stride_w;
    const int* cl;               // [B] or [B, NEXT_N] int32
    long long stride_clb;
    const int* bt;               // [B, max_blocks] int32
    long long stride_bt;
    int* out;                    // [B * NEXT_N, topk] int32
    long long stride_o;
    int* ws;                     // [>= B * NEXT_N, WS_COLS] int32
    long long stride_ws;
    void* lg;                    // LG_OUT: [B * NEXT_N, W] float32 or bfloat16
    long long stride_lg;
    int* ctr;                    // [>= B * NEXT_N, 4] per-row counters: 0 on entry, left 0 by each row's finisher
    unsigned long long* probe;   // PROBE builds: [P, 8] %globaltimer marks per CTA (else unused)
    int B;
    int cap;                     // min(W, max_blocks * 64): limits are clamped to it
    int topk;
    int cl_2d;
    int capt;                    // tiles of the CTA's list (shared memory)
    int num_blocks;              // cache blocks: a block id outside [0, num_blocks) reads as a zero key (scores 0)
};

// ---------------------------------------------------------------- small helpers
__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ u32 fkey(float x) {
    u32 u = __float_as_uint(x);
    u32 key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    key = (x == 0.0f) ? 0x80000000u : key;
    return (x > __int_as_float(0xff800000)) ? key : 0u;  // -inf and NaN -> 0, below every finite value
}

__device__ __forceinline__ float round_cell(float x) {
#if BF16
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return x;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                  // to nearest, ties to even (torch's rounding)
    return __uint_as_float(u & 0xffff0000u);
#else
    return x;
#endif
}

// Row (b, j)'s limit clamped into [0, cap] (in 64 bits: a length near INT_MIN cannot wrap to a long window).
__device__ __forceinline__ int row_limit(const Params& p, int b, int j) {
    const long long cl = p.cl[(long long)b * p.stride_clb + (p.cl_2d ? j : 0)];
    const long long lim = p.cl_2d ? cl : cl - NEXT_N + j + 1;
    return (int)min(max(lim, 0ll), (long long)p.cap);
}

__device__ __forceinline__ int seq_max_limit(const Params& p, int b) {
    int m = 0;
#pragma unroll
    for (int j = 0; j < NEXT_N; ++j) m = max(m, row_limit(p, b, j));
    return m;
}

__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred P;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
        "@!P bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// The 64 x 128 bytes of cache block z (128-byte swizzle; a block outside the map reads as zeros).
__device__ __forceinline__ void tma_tile(u32 dst, const void* tmap, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(tmap), "r"(0), "r"(0), "r"(z), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Block-wide exclusive prefix sum of one int per thread; returns the total in *total.
__device__ int block_scan(int v, int* wsum, int* total) {
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(FULL, incl, o);
        if ((int)lane_id() >= o) incl += y;
    }
    const int w = threadIdx.x >> 5;
    if (lane_id() == 31) wsum[w] = incl;
    __syncthreads();
    if (w == 0) {
        int x = lane_id() < NW ? wsum[lane_id()] : 0;
        int xi = x;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(FULL, xi, o);
            if ((int)lane_id() >= o) xi += y;
        }
        if (lane_id() < NW) wsum[lane_id()] = xi - x;
        if (lane_id() == NW - 1) wsum[NW] = xi;
    }
    __syncthreads();
    const int r = wsum[w] + incl - v;
    *total = wsum[NW];
    __syncthreads();
    return r;
}

// Block-wide over the histogram g[0..NBINS) (shared or global memory): the bin d with count(> d) < kr <= count(>= d).
// res[0] = d, res[1] = cells above d, res[2] = cells in d.
template <int NBINS, bool SHARED>
__device__ void find_digit(const int* g, u32 kr, int* wsum, u32* res) {
    constexpr int PB = NBINS / NT;
    const int t = threadIdx.x;
    const int top = NBINS - 1 - t * PB;
    u32 v[PB];
    u32 s = 0;
#pragma unroll
    for (int j = 0; j < PB; ++j) {
        v[j] = SHARED ? (u32)g[top - j] : (u32)__ldcg(g + top - j);
        s += v[j];
    }
    int total;
    u32 acc = (u32)block_scan((int)s, wsum, &total);
#pragma unroll
    for (int j = 0; j < PB; ++j) {
        if (acc < kr && acc + v[j] >= kr) {
            res[0] = (u32)(top - j);
            res[1] = acc;
            res[2] = v[j];
        }
        acc += v[j];
    }
    __syncthreads();
}


// ---------------------------------------------------------------- wgmma
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    // K-major operand, 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

#if H == 64
#define ACC_N 32
__device__ __forceinline__ void wgmma_k32(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc));
}
#elif H == 32
#define ACC_N 16
__device__ __forceinline__ void wgmma_k32(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(acc));
}
#else
#error "H must be 32 or 64"
#endif

// One tile's scores for query token j: d (ACC_N f32 per thread) = K tile [64, 128] x Q_j^T [128, H].
__device__ __forceinline__ void mma_tile(float* d, u32 ka, u32 qa) {
    const u64 da = smem_desc(ka), db = smem_desc(qa);
#pragma unroll
    for (int k = 0; k < 4; ++k) wgmma_k32(d, da + 2 * k, db + 2 * k, k);  // 32 bytes per k-step: +2 in 16-byte units
}

// ---------------------------------------------------------------- shared memory
struct Smem {
    unsigned char* vals;   // [NWG][STAGES][TILE_BYTES], 1024-aligned (after scoring: the final selects' scratch)
    unsigned char* qbuf;   // [NWG warpgroups][NEXT_N][H * 128], 1024-aligned
    float* scales;         // [NWG][STAGES][64]
    u32* hist;             // [2048]
    u32* tk;               // [SAMPLE_TILES * 64] a row's sample keys
    uint2* stg;            // [NW][STG] staged cells: key, position | j << 28
    int* wsum;             // [NW + 1] (32 words)
    u32* res;              // [4]
    u32* ctr;              // [4] the rescoring fallback's counters
    int* cum;              // [B + 1] tiles before request b
    u32* tau;              // [B * NEXT_N] thresholds of the CTA's rows
    int* lb;               // [capt] request of each list entry (sample tiles first)
    int* ltile;            // [capt] its tile within the request
    int* blk;              // [capt] its cache block (-1: outside the cache)
    unsigned long long* full;  // [NWG][STAGES] mbarriers: the slot's tile arrived
};

__device__ __forceinline__ Smem carve(unsigned char* raw, int B, int capt) {
    Smem s;
    unsigned char* p = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
    s.vals = p;
    p += NWG * STAGES * TILE_BYTES;
    s.qbuf = p;
    p += NWG * NEXT_N * H * 128;
    s.scales = (float*)p;
    p += NWG * STAGES * 64 * 4;
    s.full = (unsigned long long*)p;
    p += NWG * STAGES * 8;
    s.hist = (u32*)p;
    p += 2048 * 4;
    s.tk = (u32*)p;
    p += SAMPLE_TILES * 64 * 4;
    s.stg = (uint2*)p;
    p += NW * STG * 8;
    s.wsum = (int*)p;
    p += 32 * 4;
    s.res = (u32*)p;
    p += 4 * 4;
    s.ctr = (u32*)p;
    p += 4 * 4;
    s.cum = (int*)p;
    p += ((B + 1) * 4 + 15) / 16 * 16;
    s.tau = (u32*)p;
    p += (B * NEXT_N * 4 + 15) / 16 * 16;
    s.lb = (int*)p;
    p += (capt * 4 + 15) / 16 * 16;
    s.ltile = (int*)p;
    p += (capt * 4 + 15) / 16 * 16;
    s.blk = (int*)p;
    return s;
}

// The request of global tile g, walking forward from *b (cum ascending).
__device__ __forceinline__ int seq_of(const int* cum, int g, int b) {
    while (cum[b + 1] <= g) ++b;
    return b;
}

__device__ __forceinline__ int n_sample(int nt) { return min(nt, SAMPLE_TILES); }

// The sample index i of tile t of a request of nt tiles (t == floor(i * nt / S)), or -1.
// (32-bit: t * S < 2^25 * 32, nt < 2^25 tiles; 64-bit divisions are emulated, about 100 instructions each.)
__device__ __forceinline__ int sample_index(int t, int nt) {
    const u32 S = (u32)n_sample(nt);
    const u32 i = ((u32)t * S + (u32)nt - 1u) / (u32)nt;
    return (i < S && i * (u32)nt / S == (u32)t) ? (int)i : -1;
}

// The first tile of sample i.
__device__ __forceinline__ int sample_tile(int i, int nt) { return (int)((u32)i * (u32)nt / (u32)n_sample(nt)); }

__device__ __forceinline__ int* ws_row(const Params& p, int r) { return p.ws + (long long)r * p.stride_ws; }
__device__ __forceinline__ int* ctr_row(const Params& p, int r) { return p.ctr + 4ll * r; }

__device__ __forceinline__ int block_of(const Params& p, int b, int t) {
    const int blk = p.bt[(long long)b * p.stride_bt + t];
    return (unsigned)blk < (unsigned)p.num_blocks ? blk : -1;  // outside the cache: a zero key
}

// Warpgroup wg's ring stage s: its entry wg + NWG * s of the n tiles (the CTA's list, or with FB request fb's
// tiles 0..n), copied by the warpgroup's first thread with TMA (values) and a bulk copy (scales) onto the slot's
// mbarrier. A block outside the cache is a zero tile: values from outside the map, scales written as zeros.
template <bool FB>
__device__ __forceinline__ void load_stage(const Params& p, const Smem& sm, int wg, int wt, int s, int n, int fb) {
    const int lt = wg + NWG * s;
    if (wt == 0 && lt < n) {
        const int slot = wg * STAGES + s % STAGES;
        const u32 bar = smem_u32(sm.full + slot);
        float* scales = sm.scales + slot * 64;
        const int blk = FB ? block_of(p, fb, lt) : sm.blk[lt];
        if (blk >= 0) {
            mbar_expect(bar, TILE_BYTES + 256);
            tma_tile(smem_u32(sm.vals + slot * TILE_BYTES), p.tmap, blk, bar);
            bulk_copy(smem_u32(scales), p.cache + (long long)blk * p.block_stride + TILE_BYTES, 256, bar);
        } else {
            for (int i = 0; i < 64; ++i) scales[i] = 0.f;
            mbar_expect(bar, TILE_BYTES);
            tma_tile(smem_u32(sm.vals + slot * TILE_BYTES), p.tmap, p.num_blocks, bar);
        }
    }
}

// (Re)initializes warpgroup wg's ring barriers (phase 0); `again` after an earlier use, with no copy in flight.
__device__ __forceinline__ void ring_init(const Smem& sm, int wg, int wt, bool again) {
    if (wt == 0) {
        for (int st = 0; st < STAGES; ++st) {
            const u32 b = smem_u32(sm.full + wg * STAGES + st);
            if (again) asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(b) : "memory");
            mbar_init(b);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
}

// ---------------------------------------------------------------- selection helpers
// Adds n (warp-uniform) to a counter from lane 0 and returns the old value to every lane.
__device__ __forceinline__ u32 warp_reserve(int* ctr, u32 n) {
    u32 base = 0;
    if (lane_id() == 0) base = (u32)atomicAdd(ctr, (int)n);
    return __shfl_sync(FULL, base, 0);
}

__device__ __forceinline__ u32 lanes_below() { return (1u << lane_id()) - 1u; }

// Warp-collective: files cells (key >= tau of their row, request b) into the rows' lists. gt / eq per lane.
__device__ __forceinline__ void file_cell(int* ws, int* ctr, bool gt, bool eq, u32 key, int pos) {
    const u32 bg = __ballot_sync(FULL, gt), be = __ballot_sync(FULL, eq);
    if (bg) {
        const u32 base = warp_reserve(ctr + C_GT, __popc(bg));
        const u32 i = base + __popc(bg & lanes_below());
        if (gt && i < CG) {
            ws[WS_GK + i] = (int)key;
            ws[WS_GP + i] = pos;
        }
    }
    if (be) {
        const u32 base = warp_reserve(ctr + C_EQ, __popc(be));
        const u32 i = base + __popc(be & lanes_below());
        if (eq && i < CE) ws[WS_EP + i] = pos;
    }
}

// Warp-collective: the warp's cnt staged cells of request b filed, row by row.
__device__ __forceinline__ void flush_stage(const Params& p, const Smem& sm, const uint2* st, int cnt, int b) {
    __syncwarp();
    const int l = lane_id();
    const uint2 e0 = l < cnt ? st[l] : make_uint2(0u, 0xffffffffu);
    const uint2 e1 = l + 32 < cnt ? st[l + 32] : make_uint2(0u, 0xffffffffu);
#pragma unroll
    for (int j = 0; j < NEXT_N; ++j) {
        const u32 t = sm.tau[b * NEXT_N + j];
        int* ws = ws_row(p, b * NEXT_N + j);
        int* ctr = ctr_row(p, b * NEXT_N + j);
        const bool m0 = (e0.y >> 28) == (u32)j, m1 = (e1.y >> 28) == (u32)j;
        file_cell(ws, ctr, m0 && e0.x > t, m0 && e0.x == t, e0.x, (int)(e0.y & 0x0fffffffu));
        file_cell(ws, ctr, m1 && e1.x > t, m1 && e1.x == t, e1.x, (int)(e1.y & 0x0fffffffu));
    }
    __syncwarp();
}

// Warp-collective: adds each lane's bin (where on) to the shared histogram h, one atomic per distinct bin of the
// warp (the keys of a sample or of a row's list share their top bits: plain atomics would queue on a few bins).
__device__ __forceinline__ void hist_add(u32* h, u32 bin, bool on) {
    const u32 act = __ballot_sync(FULL, on);
    if (on) {
        const u32 peers = __match_any_sync(act, bin);
        if (lane_id() == (u32)(__ffs(peers) - 1)) atomicAdd(&h[bin], (u32)__popc(peers));
    }
}

// The r-th largest (1-based, r <= cnt) of keys[0..cnt) in shared memory: three radix digits (11, 11, 10 bits).
__device__ u32 rank_key(const Smem& sm, const u32* keys, int cnt, u32 r) {
    u32 prefix = 0, mask = 0;
#pragma unroll
    for (int d = 0; d < 3; ++d) {
        const int shift = d == 0 ? 21 : (d == 1 ? 10 : 0);
        const u32 bins = d == 2 ? 1024u : 2048u;
        for (int i0 = 0; i0 < cnt; i0 += NT) {  // (warp-uniform trips: hist_add is warp-collective)
            const int i = i0 + threadIdx.x;
            const u32 k = i < cnt ? keys[i] : 0u;
            hist_add(sm.hist, (k >> shift) & (bins - 1), i < cnt && ((k ^ prefix) & mask) == 0);
        }
        __syncthreads();
        if (d == 2) find_digit<1024, true>((const int*)sm.hist, r, sm.wsum, sm.res);
        else find_digit<2048, true>((const int*)sm.hist, r, sm.wsum, sm.res);
        prefix |= sm.res[0] << shift;
        r -= sm.res[1];
        mask |= (bins - 1) << shift;
        for (int i = threadIdx.x; i < 2048; i += NT) sm.hist[i] = 0;
        __syncthreads();
    }
    return prefix;
}

// The need (<= cnt <= CG) largest of cnt listed cells (keys gk, positions gp in global memory) to out[0..need):
// three radix digits in shared memory, then the first cells of the final key still needed.
__device__ void select_top(const Smem& sm, const int* gk, const int* gp, int cnt, u32 need, int* out) {
    u32* keys = (u32*)sm.vals;  // the ring is idle after scoring: [CG] keys, [CG] positions
    int* pos = (int*)(keys + CG);
    const int tid = threadIdx.x;
    const int c4 = (cnt + 3) / 4;  // 16-byte loads (the list's columns are 16-byte aligned)
    for (int i = tid; i < c4; i += NT) {
        ((int4*)keys)[i] = __ldcg((const int4*)gk + i);
        ((int4*)pos)[i] = __ldcg((const int4*)gp + i);
    }
    __syncthreads();
    u32 dg[3] = {0, 0, 0};
    int full = 3;  // the first digit whose bin is taken whole (3: none)
    u32 prefix = 0, mask = 0;
#pragma unroll
    for (int d = 0; d < 3; ++d) {
        if (full == 3) {
            const int shift = d == 0 ? 21 : (d == 1 ? 10 : 0);
            const u32 bins = d == 2 ? 1024u : 2048u;
            for (int i0 = 0; i0 < cnt; i0 += NT) {
                const int i = i0 + tid;
                const u32 k = i < cnt ? keys[i] : 0u;
                hist_add(sm.hist, (k >> shift) & (bins - 1), i < cnt && ((k ^ prefix) & mask) == 0);
            }
            __syncthreads();
            if (d == 2) find_digit<1024, true>((const int*)sm.hist, need, sm.wsum, sm.res);
            else find_digit<2048, true>((const int*)sm.hist, need, sm.wsum, sm.res);
            dg[d] = sm.res[0];
            need -= sm.res[1];
            if (sm.res[2] == need) full = d;
            prefix |= dg[d] << shift;
            mask |= (bins - 1) << shift;
            for (int i = tid; i < 2048; i += NT) sm.hist[i] = 0;
            __syncthreads();
        }
    }
    // 1: selected, 2: a cell of the final key (taken while still needed)
    auto cls = [&](u32 k) -> int {
        const u32 kd[3] = {k >> 21, (k >> 10) & 2047u, k & 1023u};
#pragma unroll
        for (int d = 0; d < 3; ++d) {
            if (kd[d] != dg[d]) return kd[d] > dg[d] ? 1 : 0;
            if (full == d) return 1;
        }
        return 2;
    };
    const int per = (cnt + NT - 1) / NT, lo = min(cnt, tid * per), hi = min(cnt, lo + per);
    u32 na = 0, nt = 0;
    for (int i = lo; i < hi; ++i) {
        const int c = cls(keys[i]);
        na += c == 1;
        nt += c == 2;
    }
    int tot;
    const int pre = block_scan((int)((na << 16) | nt), sm.wsum, &tot);
    u32 ia = (u32)pre >> 16, it = (u32)pre & 0xffffu;
    const u32 na_tot = (u32)tot >> 16;
    for (int i = lo; i < hi; ++i) {
        const int c = cls(keys[i]);
        if (c == 1) out[ia++] = pos[i];
        else if (c == 2) {
            if (it < need) out[na_tot + it] = pos[i];
            ++it;
        }
    }
    __syncthreads();
}

// A cell's class in a rescoring round: 1 selected, 2 a tie of the final round (kept while tickets last), 0
// neither; the cells in the round's open bin are counted in hist by the next digit. Round 4: the first digit's
// bin is all equal or all needed (its cells are tickets).
__device__ __forceinline__ int classify(u32 key, int round, u32 d0, u32 d1, u32 d2, u32 full1, u32* hist) {
    const u32 k0 = key >> 21, k1 = (key >> 10) & 2047u, k2 = key & 1023u;
    if (round == 0) {
        atomicAdd(&hist[k0], 1u);
        return 0;
    }
    if (k0 != d0) return ((round == 1 || round == 4) && k0 > d0) ? 1 : 0;
    if (round == 4) return 2;
    if (round == 1) {
        atomicAdd(&hist[k1], 1u);
        return 0;
    }
    if (k1 != d1) return (round == 2 && k1 > d1) ? 1 : 0;
    if (round == 2) {
        if (full1) return 1;
        atomicAdd(&hist[k2], 1u);
        return 0;
    }
    return k2 > d2 ? 1 : (k2 == d2 ? 2 : 0);
}

struct Fallback {
    int b, j, lim, round, base;  // base: the first output slot of the tickets (topk - need of the final key)
    u32 d0, d1, d2, full1, need;
    int* out;
};

// ---------------------------------------------------------------- scoring
__device__ void sample_done(const Params& p, const Smem& sm, int start, int end, int ns);

// Scores the n tiles (the CTA's list; with FB request fb.b's tiles 0..n) warpgroup by warpgroup. Without FB: list
// entries [0, ns) are sample tiles (keys to the workspace), then sample_done, then the rest are filtered.
template <bool FB>
__device__ void score(const Params& p, const Smem& sm, int n, int ns, int start, int end, const Fallback& fb) {
    const int tid = threadIdx.x;
    const int wg = tid >> 7;           // warpgroup
    const int wt = tid & 127;          // thread in the warpgroup
    const int warp = tid >> 5, lane = lane_id();
    const int m0 = 16 * (wt >> 5) + (lane >> 2), c = lane & 3;
    ring_init(sm, wg, wt, FB);  // (the fallback's rings were used by the scoring before)
    for (int s = 0; s < STAGES - 1; ++s) load_stage<FB>(p, sm, wg, wt, s, n, fb.b);
    int qseq = -1;                      // request whose queries and weights are loaded
    float wreg[NEXT_N][H / 4];
    int lims[NEXT_N];
    unsigned char* qb = sm.qbuf + wg * NEXT_N * H * 128;
    uint2* st = sm.stg + warp * STG;
    int scnt = 0, sreq = 0;             // this warp's staged cells, of request sreq
    const int mine = n > wg ? (n - wg + NWG - 1) / NWG : 0;  // this warpgroup's tiles
    const int s_sw = FB ? -1 : (ns > wg ? (ns - wg + NWG - 1) / NWG : 0);  // its sample tiles
    for (int s = 0; s <= mine; ++s) {
        if (!FB && s == s_sw) sample_done(p, sm, start, end, ns);
        if (s == mine) break;
        const int lt = wg + NWG * s;
        const int slot = wg * STAGES + s % STAGES;
        WG_BAR();  // every thread is done with the slot refilled next
        load_stage<FB>(p, sm, wg, wt, s + STAGES - 1, n, fb.b);
        mbar_wait(smem_u32(sm.full + slot), (u32)(s / STAGES) & 1u);
        const unsigned char* vals = sm.vals + slot * TILE_BYTES;
        const float* scales = sm.scales + slot * 64;
        const int cb = FB ? fb.b : sm.lb[lt];
        const int tile = FB ? lt : sm.ltile[lt];
        const bool sample = !FB && lt < ns;
        const int si = sample ? sample_index(tile, sm.cum[cb + 1] - sm.cum[cb]) : 0;
        if (cb != qseq) {  // this warpgroup's queries and weights of request cb
            if (!FB && scnt) {
                flush_stage(p, sm, st, scnt, sreq);
                scnt = 0;
            }
            sreq = cb;
            qseq = cb;
            const uint4* qsrc = (const uint4*)(p.q + (long long)cb * NEXT_N * H * 128);
            for (int i = wt; i < NEXT_N * H * 8; i += 128) {
                const int row = i >> 3, col = i & 7;
                *(uint4*)(qb + row * 128 + ((col ^ (row & 7)) << 4)) = qsrc[i];
            }
#pragma unroll
            for (int j = 0; j < NEXT_N; ++j) {
                const float* wr = p.w + (long long)(cb * NEXT_N + j) * p.stride_w;
#pragma unroll
                for (int i = 0; i < H / 8; ++i) {
                    wreg[j][2 * i] = wr[8 * i + 2 * c];
                    wreg[j][2 * i + 1] = wr[8 * i + 2 * c + 1];
                }
                lims[j] = row_limit(p, cb, j);
            }
            fence_async_smem();
            WG_BAR();
        }
#pragma unroll
        for (int j = 0; j < NEXT_N; ++j) {
            if (FB && j != fb.j) continue;
            float d[ACC_N];
#pragma unroll
            for (int i = 0; i < ACC_N; ++i) d[i] = 0.f;
            wg_fence();
            mma_tile(d, smem_u32(vals), smem_u32(qb + j * H * 128));
            wg_commit();
            wg_wait0();
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int i = 0; i < ACC_N / 4; ++i) {
                s0 += fmaxf(d[4 * i], 0.f) * wreg[j][2 * i] + fmaxf(d[4 * i + 1], 0.f) * wreg[j][2 * i + 1];
                s1 += fmaxf(d[4 * i + 2], 0.f) * wreg[j][2 * i] + fmaxf(d[4 * i + 3], 0.f) * wreg[j][2 * i + 1];
            }
            s0 += __shfl_xor_sync(FULL, s0, 1);
            s1 += __shfl_xor_sync(FULL, s1, 1);
            s0 += __shfl_xor_sync(FULL, s0, 2);
            s1 += __shfl_xor_sync(FULL, s1, 2);
            const int m = m0 + 8 * (c & 1);
            const float v = round_cell((c & 1 ? s1 : s0) * scales[m]);
            const u32 key = fkey(v);
            const int pos = tile * BLOCK_KEYS + m;
            const bool has = c < 2, inside = has && pos < lims[j], active = lims[j] > p.topk;
            if (FB) {
                if (inside) {
                    const int cl = classify(key, fb.round, fb.d0, fb.d1, fb.d2, fb.full1, sm.hist);
                    if (cl == 1) {
                        fb.out[atomicAdd(&sm.ctr[0], 1u)] = pos;
                    } else if (cl == 2) {
                        const u32 t = atomicAdd(&sm.ctr[1], 1u);
                        if (t < fb.need) fb.out[fb.base + t] = pos;
                    }
                }
            } else {
#if LG_OUT
                if (inside) {
                    const long long o = (long long)(cb * NEXT_N + j) * p.stride_lg + pos;
#if BF16
                    ((unsigned short*)p.lg)[o] = (unsigned short)(__float_as_uint(v) >> 16);
#else
                    ((float*)p.lg)[o] = v;
#endif
                }
#endif
                if (sample) {
                    if (has && active) ws_row(p, cb * NEXT_N + j)[WS_SAMPLE + si * 64 + m] = inside ? (int)key : 0;
                } else {
                    const bool sel = inside && active && key >= sm.tau[cb * NEXT_N + j];
                    const u32 bm = __ballot_sync(FULL, sel);
                    if (bm) {
                        if (scnt + __popc(bm) > STG) {
                            flush_stage(p, sm, st, scnt, sreq);
                            scnt = 0;
                        }
                        if (sel) st[scnt + __popc(bm & lanes_below())] = make_uint2(key, (u32)pos | ((u32)j << 28));
                        scnt += __popc(bm);
                    }
                }
            }
        }
    }
    if (!FB && scnt) flush_stage(p, sm, st, scnt, sreq);
    __syncthreads();
}

// Between the sample tiles and the rest (every thread once): the sample tiles counted per request, the CTA's
// requests' samples awaited, every row's tau computed, the CTA's own sample cells filed.
__device__ void sample_done(const Params& p, const Smem& sm, int start, int end, int ns) {
    const int tid = threadIdx.x;
    __threadfence();
    __syncthreads();
    MARK(3);
    for (int e = tid; e < ns; e += NT) {  // each sample tile counted on its request's rows that select
        const int b = sm.lb[e];
        for (int j = 0; j < NEXT_N; ++j)
            if (row_limit(p, b, j) > p.topk) atomicAdd(ctr_row(p, b * NEXT_N + j) + C_SMP, 1);
    }
    const int n = end - start;
    const int b0 = n > 0 ? seq_of(sm.cum, start, 0) : 0;
    int b1 = b0;  // one past the CTA's last request
    while (n > 0 && b1 < p.B && sm.cum[b1] < end) ++b1;
    for (int r = b0 * NEXT_N + tid; r < b1 * NEXT_N; r += NT) {
        const int b = r / NEXT_N;
        const u32 want = (u32)n_sample(sm.cum[b + 1] - sm.cum[b]);
        if (want && row_limit(p, b, r % NEXT_N) > p.topk) {
            while (ld_acquire((const u32*)(ctr_row(p, r) + C_SMP)) < want) {
            }
        }
    }
    __threadfence();
    __syncthreads();
    MARK(4);
    for (int b = b0; b < b1; ++b) {
        const int nt = sm.cum[b + 1] - sm.cum[b];
        if (nt == 0) continue;
        const int S = n_sample(nt);
        for (int j = 0; j < NEXT_N; ++j) {
            const int lim = row_limit(p, b, j);
            if (lim <= p.topk) continue;
            const int* src = ws_row(p, b * NEXT_N + j) + WS_SAMPLE;
            for (int i = tid; i < S * 64; i += NT) sm.tk[i] = (u32)__ldcg(src + i);
            // sample cells inside the window (lane i of every warp: sample i)
            int s_in = (int)lane_id() < S ? max(0, min(BLOCK_KEYS, lim - sample_tile(lane_id(), nt) * BLOCK_KEYS)) : 0;
#pragma unroll
            for (int o = 16; o; o >>= 1) s_in += __shfl_xor_sync(FULL, s_in, o);
            const float m = (float)p.topk * (float)s_in / (float)lim;
            const u32 r = (u32)min(max((int)ceilf(m + 4.f * sqrtf(m) + 4.f), 1), s_in);
            __syncthreads();
            const u32 t = NO_SAMPLE_FILTER ? 0xffffffffu : rank_key(sm, sm.tk, S * 64, r);
            if (tid == 0) sm.tau[b * NEXT_N + j] = t;
            __syncthreads();
        }
    }
    MARK(7);
    // the CTA's own sample cells: warp w takes entries w, w + NW, ... (64 cells of each row, two per lane)
    const int warp = tid >> 5, lane = lane_id();
    for (int e = warp; e < ns; e += NW) {
        const int b = sm.lb[e], tile = sm.ltile[e];
        const int si = sample_index(tile, sm.cum[b + 1] - sm.cum[b]);
#pragma unroll
        for (int j = 0; j < NEXT_N; ++j) {
            const int lim = row_limit(p, b, j);
            if (lim <= p.topk) continue;
            int* ws = ws_row(p, b * NEXT_N + j);
            int* ctr = ctr_row(p, b * NEXT_N + j);
            const u32 t = sm.tau[b * NEXT_N + j];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = lane + 32 * h, pos = tile * BLOCK_KEYS + m;
                const u32 key = (u32)__ldcg(ws + WS_SAMPLE + si * 64 + m);
                const bool in = pos < lim;
                file_cell(ws, ctr, in && key > t, in && key == t, key, pos);
            }
        }
    }
    __syncthreads();
}

// ---------------------------------------------------------------- finishing a row
// A CTA's piece of one row: local tiles [la, le) of request b, row j of its next_n.
struct Piece {
    int b, j, lim, la, le, t0;  // t0: the piece's first tile within request b
    int* ws;                    // the row's workspace
    int* out;                   // the row's output
};

// f(piece) for every piece of this CTA with a row longer than topk (uniform over the CTA: f may synchronize).
template <class F>
__device__ __forceinline__ void for_pieces(const Params& p, const Smem& sm, int start, int end, int n, F&& f) {
    if (n <= 0) return;
    for (int b = seq_of(sm.cum, start, 0); b < p.B && sm.cum[b] < end; ++b) {
        const int la = max(sm.cum[b], start) - start;
        const int le = min(sm.cum[b + 1], end) - start;
        if (le <= la) continue;
        for (int j = 0; j < NEXT_N; ++j) {
            const int lim = row_limit(p, b, j);
            if (lim <= p.topk) continue;
            const int r = b * NEXT_N + j;
            const Piece pc{b, j, lim, la, le, la + start - sm.cum[b], ws_row(p, r),
                           p.out + (long long)r * p.stride_o};
            f(pc);
        }
    }
}

// The piece's cells inside the row's window.
__device__ __forceinline__ int piece_cells(const Piece& pc) {
    return max(0, min(pc.lim, (pc.t0 + pc.le - pc.la) * BLOCK_KEYS) - pc.t0 * BLOCK_KEYS);
}

// The exact top-k of row (b, j) by rescoring it in this CTA alone: four passes of one radix digit each.
__device__ void rescore_row(const Params& p, const Smem& sm, const Piece& pc) {
    const int tid = threadIdx.x;
    const int n = (pc.lim + BLOCK_KEYS - 1) / BLOCK_KEYS;
    const u32 topk = (u32)p.topk;
    Fallback fb{pc.b, pc.j, pc.lim, 0, 0, 0, 0, 0, 0, 0, pc.out};
    for (int i = tid; i < 2048; i += NT) sm.hist[i] = 0;
    if (tid < 4) sm.ctr[tid] = 0;
    __syncthreads();
    score<true>(p, sm, n, 0, 0, 0, fb);  // round 0: the first digit's histogram
    find_digit<2048, true>((const int*)sm.hist, topk, sm.wsum, sm.res);
    fb.d0 = sm.res[0];
    fb.need = topk - sm.res[1];
    const bool ties = sm.res[2] == fb.need || fb.d0 == 0;  // all of the bin needed, or all equal (key 0)
    for (int i = tid; i < 2048; i += NT) sm.hist[i] = 0;
    __syncthreads();
    if (ties) {
        fb.round = 4;
        fb.base = (int)(topk - fb.need);
        score<true>(p, sm, n, 0, 0, 0, fb);
        return;
    }
    fb.round = 1;
    score<true>(p, sm, n, 0, 0, 0, fb);
    find_digit<2048, true>((const int*)sm.hist, fb.need, sm.wsum, sm.res);
    fb.d1 = sm.res[0];
    fb.need -= sm.res[1];
    fb.full1 = sm.res[2] == fb.need;
    for (int i = tid; i < 2048; i += NT) sm.hist[i] = 0;
    __syncthreads();
    fb.round = 2;
    score<true>(p, sm, n, 0, 0, 0, fb);
    if (fb.full1) return;
    find_digit<1024, true>((const int*)sm.hist, fb.need, sm.wsum, sm.res);
    fb.d2 = sm.res[0];
    fb.need -= sm.res[1];
    for (int i = tid; i < 2048; i += NT) sm.hist[i] = 0;
    __syncthreads();
    fb.round = 3;
    fb.base = (int)(topk - fb.need);
    score<true>(p, sm, n, 0, 0, 0, fb);
}

// The row's selection by the CTA that completed it (see the header).
__device__ void finish_row(const Params& p, const Smem& sm, const Piece& pc) {
    const int tid = threadIdx.x;
    if (tid == 0) {
        int* ctr = ctr_row(p, pc.b * NEXT_N + pc.j);
        sm.res[0] = ld_acquire((const u32*)(ctr + C_GT));
        sm.res[1] = ld_acquire((const u32*)(ctr + C_EQ));
        *(int4*)ctr = make_int4(0, 0, 0, 0);  // nothing counts on this row again in this call
    }
    __syncthreads();
    const u32 g = sm.res[0], e = sm.res[1], k = (u32)p.topk;
    __syncthreads();
    MARK(2);
    if (g > CG || g + e < k) {
        rescore_row(p, sm, pc);
    } else if (g >= k) {
        select_top(sm, pc.ws + WS_GK, pc.ws + WS_GP, (int)g, k, pc.out);
    } else {
        for (u32 i = tid; i < k; i += NT) pc.out[i] = __ldcg(i < g ? pc.ws + WS_GP + i : pc.ws + WS_EP + (i - g));
    }
    __syncthreads();
}

// ---------------------------------------------------------------- the kernel
extern "C" __global__ void __launch_bounds__(NT, 1) si_paged_mqa_topk(const __grid_constant__ Params p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Smem sm = carve(smem_raw, p.B, p.capt);
    MARK(0);
    const int tid = threadIdx.x;
    const int P = gridDim.x, pid = blockIdx.x;
    const int rows = p.B * NEXT_N;

    // Tiles per request (only requests with a row longer than topk, unless every logit is written out).
    {
        const int per = (p.B + NT - 1) / NT;
        int s = 0;
        for (int i = 0; i < per; ++i) {
            const int b = tid * per + i;
            if (b < p.B) {
                const int m = seq_max_limit(p, b);
                s += (LG_OUT || m > p.topk) ? (m + BLOCK_KEYS - 1) / BLOCK_KEYS : 0;
            }
        }
        int total;
        int run = block_scan(s, sm.wsum, &total);
        for (int i = 0; i < per; ++i) {
            const int b = tid * per + i;
            if (b < p.B) {
                sm.cum[b] = run;
                const int m = seq_max_limit(p, b);
                run += (LG_OUT || m > p.topk) ? (m + BLOCK_KEYS - 1) / BLOCK_KEYS : 0;
            }
        }
        if (tid == 0) sm.cum[p.B] = total;
        for (int i = tid; i < 2048; i += NT) sm.hist[i] = 0;
        __syncthreads();
    }
    const int total = sm.cum[p.B];
    const int start = (int)((long long)pid * total / P);
    const int end = (int)((long long)(pid + 1) * total / P);
    const int n = end - start;
    if (n > p.capt) __trap();  // the host sizes capt for the worst case; never taken
    // The CTA's list: its sample tiles first, then the others, each in tile order (contiguous chunks per thread).
    int ns;
    {
        const int per = (n + NT - 1) / NT, lo = min(n, tid * per), hi = min(n, lo + per);
        int b = 0, cnt = 0;
        if (lo < hi) {
            int l = 0, h = p.B - 1;  // the last request with cum <= g (never an empty one: g < total)
            const int g = start + lo;
            while (l < h) {
                const int mid = (l + h + 1) >> 1;
                if (sm.cum[mid] <= g) l = mid;
                else h = mid - 1;
            }
            b = l;
        }
        const int bfirst = b;
        for (int lt = lo; lt < hi; ++lt) {
            b = seq_of(sm.cum, start + lt, b);
            cnt += sample_index(start + lt - sm.cum[b], sm.cum[b + 1] - sm.cum[b]) >= 0;
        }
        int pre = block_scan(cnt, sm.wsum, &ns);
        int other = ns + lo - pre;
        b = bfirst;
        for (int lt = lo; lt < hi; ++lt) {
            b = seq_of(sm.cum, start + lt, b);
            const int t = start + lt - sm.cum[b];
            const int idx = sample_index(t, sm.cum[b + 1] - sm.cum[b]) >= 0 ? pre++ : other++;
            sm.lb[idx] = b;
            sm.ltile[idx] = t;
            sm.blk[idx] = block_of(p, b, t);
        }
    }

    // Rows of at most topk cells: 0..len-1, then -1.
    for (int r = pid; r < rows; r += P) {
        const int lim = row_limit(p, r / NEXT_N, r % NEXT_N);
        if (lim <= p.topk)
            for (int i = tid; i < p.topk; i += NT) p.out[(long long)r * p.stride_o + i] = i < lim ? i : -1;
    }
    __syncthreads();  // the list complete
    const Fallback none{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, nullptr};
    MARK(1);
    score<false>(p, sm, n, ns, start, end, none);
    __threadfence();
    __syncthreads();
    MARK(5);

    // ---- finish: the CTA whose cells complete a row selects it
    for_pieces(p, sm, start, end, n, [&](const Piece& pc) {
        if (tid == 0) {
            const int cells = piece_cells(pc);
            const int old = cells > 0 ? atomicAdd(ctr_row(p, pc.b * NEXT_N + pc.j) + C_ARR, cells) : -1;
            sm.res[3] = cells > 0 && old + cells == pc.lim;
        }
        __syncthreads();
        const bool mine = sm.res[3];
        __syncthreads();
        if (mine) {
            __threadfence();
            finish_row(p, sm, pc);
        }
    });
    MARK(6);
}
