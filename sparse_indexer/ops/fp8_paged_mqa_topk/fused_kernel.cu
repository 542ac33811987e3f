// Fused paged decode scoring + exact top-k (docs/spec.md §5 and §6): the logits never leave shared memory.
//
// One persistent cooperative grid of one CTA per SM (NT = 128 * NWG threads: NWG warpgroups). The key tiles of
// every request that needs a selection (a row whose window is longer than topk; every request when the logits
// are also written out) form one global range of 64-key tiles cut into P equal contiguous pieces, one per CTA,
// as in the Gluon logits kernel. Phases:
//
//   score    each warpgroup streams its own tiles (wg, wg + NWG, ...) through its own cp.async ring of STAGES
//            slots (the tile's 64 x 128 fp8 values stored with the 128-byte swizzle wgmma reads, and its 64
//            float32 scales), synchronizing only its 128 threads: per query token j one wgmma chain
//            K[64 keys, 128] x Q_j^T[128, H] (fp8 in, f32 accumulators), then relu, times the head weights, the
//            head sum (within a thread and its quad), times the key scale. Each logit's order-preserving 32-bit
//            key is stored in the CTA's shared memory (rows of next_n x 64 keys per tile); with LG_OUT the logit
//            also goes to global memory (the test mode).
//   barrier  (every workspace row zeroed)
//   round 0  per row piece of the CTA: a shared-memory histogram of the top 11 key bits, added to the row's
//            global histogram (workspace).
//   barrier
//   select   per row piece: the row's histogram gives the bin d0 of the topk-th largest key. Cells above d0 are
//            written to out (slots claimed by one global atomic per CTA and piece, offsets from a block scan).
//            The cells in d0 (at most LIST_CAP of them) are appended to the row's list in the workspace, and the
//            CTA whose cells complete the row (a per-row count of the cells done) selects the ones still needed
//            from the list in shared memory (two more digits, then tickets for the final key). A bin of equal
//            keys (key 0: -inf and NaN) or of exactly the cells needed is taken directly, first come first
//            served. A bin of more than LIST_CAP cells (few distinct values) is finished by the row's CTAs in
//            three rounds of one digit each, with a row barrier between rounds (a per-row count of the cells
//            done: every CTA takes its pieces in row order, so this never deadlocks).
//
// Hostile values (docs/spec.md section 10): every limit is clamped into [0, cap], cap = min(W, max_blocks * 64), so
// the block table is read only inside its rows; a block id outside [0, num_blocks) is copied as a zero tile
// (cp.async zero-fill, nothing read), so its cells score 0 (relu(0) * weights, times a zero scale).
//
// Rows of at most topk cells are written 0..len-1, -1... without any selection (their requests are not even
// scored unless LG_OUT). The grid barrier is a self-resetting counter (bar[0], back to 0 after each barrier) and
// a generation word (bar[1]) in a small per-device state buffer only this kernel writes; the cooperative launch
// guarantees that every CTA is resident.
//
// Workspace row r (int32, FUSED_WORKSPACE_COLS = 10248): histogram H0 [2048]; then either H1 [2048] and H2
// [1024] (rows finished by rounds) or, over the same columns, the list (LIST_CAP keys, then LIST_CAP
// positions); then counters at 10240: SEL (output slots taken), TIE (tickets), CNT (list entries), ARR (cells
// done). Only H0-H2 and the counters are zeroed at the start of a call.

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

#ifndef DIAG
#define DIAG 0  // measurements only: 1 the ring's stages consumed unread (the copy stream alone), 2 no copies
#endif
#ifndef CTA_BARRIERS
#define CTA_BARRIERS 0  // racecheck triage only: each warpgroup barrier of the scoring loop made CTA-wide
#endif
#if CTA_BARRIERS
#define WG_BAR() __syncthreads()
#else
#define WG_BAR() asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory")
#endif

#ifndef NWG
#define NWG 2  // warpgroups (2 or 4: find_digit needs NT to divide 1024)
#endif

#undef NT  // (the loader passes -DNT; the block size follows NWG)
#define NT (128 * NWG)
#define NW (NT / 32)
#define FULL 0xffffffffu
#define TILE_BYTES 8192   // 64 keys x 128 fp8 values
#define BLOCK_KEYS 64
#define WS_H0 0        // [2048] the row's histogram of the top 11 key bits
#define WS_H1 2048     // [2048] rounds only: of the next 11 bits
#define WS_H2 4096     // [1024] rounds only: of the last 10
#define WS_LIST 2048   // one-pass rows (over H1 and H2): [LIST_CAP] keys, then [LIST_CAP] positions
#define LIST_CAP 4096
#define WS_SEL 10240   // output slots taken
#define WS_TIE 10241   // tickets of a tie class
#define WS_CNT 10242   // list entries taken
#define WS_ARR 10243   // cells whose pieces are done (the one-pass rows' completion count)
#define WS_COLS 10248
#define MODE_TIES 0    // the bin's cells are all equal or all needed: the first ones still needed are taken
#define MODE_LIST 1    // the bin's cells fit the row's list: the CTA that completes the row selects from it
#define MODE_ROUNDS 2  // more than LIST_CAP: three more grid rounds, one digit each

typedef unsigned int u32;
typedef unsigned long long u64;

struct Params {
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
    u32* bar;                    // grid barrier state: [0] arrivals (0 between barriers), [1] generation
    unsigned long long* probe;   // PROBE builds: [P, 8] %globaltimer marks per CTA (else unused)
    int B;
    int cap;                     // min(W, max_blocks * 64): limits are clamped to it
    int topk;
    int cl_2d;
    int capt;                    // tiles of shared memory per CTA
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

// 16 bytes from src, of which the first `bytes` (16 or 0: zero-filled, nothing read) are read.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every CTA of the (cooperative, so co-resident) grid; bar[0] is 0 on entry and on exit.
__device__ void grid_barrier(u32* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 gen = ld_acquire(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (ld_acquire(bar + 1) == gen) {
        }
        }
    }
    __syncthreads();
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

// Adds the shared histogram h[0..NBINS) to the global one and clears it.
template <int NBINS>
__device__ void flush_hist(u32* h, int* g) {
    __syncthreads();
    for (int i = threadIdx.x; i < NBINS; i += NT) {
        const u32 c = h[i];
        if (c) atomicAdd(g + i, (int)c);
        h[i] = 0;
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
    int* wsum;             // [NW + 1] (32 words)
    u32* res;              // [4]
    int* cum;              // [B + 1] tiles before request b
    int* blk;              // [capt] cache block of each local tile
    u32* lg;               // [capt][NEXT_N][64] keys
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
    s.hist = (u32*)p;
    p += 2048 * 4;
    s.wsum = (int*)p;
    p += 32 * 4;
    s.res = (u32*)p;
    p += 4 * 4;
    s.cum = (int*)p;
    p += ((B + 1) * 4 + 15) / 16 * 16;
    s.blk = (int*)p;
    p += (capt * 4 + 15) / 16 * 16;
    s.lg = (u32*)p;
    return s;
}

// The request of global tile g, walking forward from *b (cum ascending).
__device__ __forceinline__ int seq_of(const int* cum, int g, int b) {
    while (cum[b + 1] <= g) ++b;
    return b;
}

// Issues the cp.async copies of warpgroup wg's ring stage s: its local tile wg + NWG * s of this CTA's n tiles
// (each warpgroup streams its own tiles into its own STAGES slots; only its 128 threads copy and wait).
__device__ __forceinline__ void load_stage(const Params& p, const Smem& sm, int wg, int wt, int s, int n) {
    const int lt = wg + NWG * s;
    if (lt < n && DIAG != 2) {
        const int slot = wg * STAGES + s % STAGES;
        unsigned char* vals = sm.vals + slot * TILE_BYTES;
        float* scales = sm.scales + slot * 64;
        const int blk = sm.blk[lt];  // -1: outside the cache, a zero tile (values and scales 0, nothing read)
        const u32 bytes = blk >= 0 ? 16u : 0u;
        const unsigned char* src = p.cache + (long long)max(blk, 0) * p.block_stride;
#pragma unroll
        for (int c = wt; c < 512; c += 128) {  // values: 16-byte chunk c & 7 of row c >> 3
            const int row = c >> 3, col = c & 7;
            cp_async16(smem_u32(vals + row * 128 + ((col ^ (row & 7)) << 4)), src + row * 128 + col * 16, bytes);
        }
        if (wt < 16) cp_async16(smem_u32(scales + wt * 4), src + TILE_BYTES + wt * 16, bytes);
    }
    cp_commit();
}

// ---------------------------------------------------------------- selection
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
            const Piece pc{b, j, lim, la, le, la + start - sm.cum[b], p.ws + (long long)r * p.stride_ws,
                           p.out + (long long)r * p.stride_o};
            f(pc);
        }
    }
}

// f(key, position) for this thread's cells of the piece inside the row's window, in the same order every time
// (4 consecutive keys per 16-byte load).
template <class F>
__device__ __forceinline__ void for_cells(const Smem& sm, const Piece& pc, F&& f) {
    const int groups = (pc.le - pc.la) * (BLOCK_KEYS / 4);
    for (int gi = threadIdx.x; gi < groups; gi += NT) {
        const int i = gi * 4;
        const int tile = pc.la + i / BLOCK_KEYS, m = i % BLOCK_KEYS;
        const int pos = (pc.t0 + i / BLOCK_KEYS) * BLOCK_KEYS + m;
        if (pos >= pc.lim) break;
        const uint4 kv = *(const uint4*)(sm.lg + (tile * NEXT_N + pc.j) * 64 + m);
        const u32 keys[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (pos + e < pc.lim) f(keys[e], pos + e);
    }
}

// The piece's cells inside the row's window.
__device__ __forceinline__ int piece_cells(const Piece& pc) {
    return max(0, min(pc.lim, (pc.t0 + pc.le - pc.la) * BLOCK_KEYS) - pc.t0 * BLOCK_KEYS);
}

// How a row is finished, from its first digit's bin d0 (in cells in it, need of them wanted); key 0 (-inf,
// NaN) is one value, so its bin's cells are all equal.
__device__ __forceinline__ int row_mode(u32 d0, u32 in, u32 need) {
    if (in == need || d0 == 0) return MODE_TIES;
    return in <= LIST_CAP ? MODE_LIST : MODE_ROUNDS;
}

// The need largest of a row's cnt listed cells (keys that share their top 11 bits) written to out[0..need):
// two shared-memory digits (11 and 10 bits), then the first cells of the final key still needed.
__device__ void select_list(const Smem& sm, const int* lkeys, const int* lpos, int cnt, u32 need, int* out) {
    u32* keys = (u32*)sm.vals;  // the ring is idle after scoring: [LIST_CAP] keys, [LIST_CAP] positions
    int* pos = (int*)(keys + LIST_CAP);
    const int tid = threadIdx.x;
    const int c4 = (cnt + 3) / 4;  // 16-byte loads, all issued before any store (the list's rows are aligned)
#pragma unroll 2
    for (int i = tid; i < c4; i += NT) {
        const int4 kv = __ldcg((const int4*)lkeys + i);
        const int4 pv = __ldcg((const int4*)lpos + i);
        ((int4*)keys)[i] = kv;
        ((int4*)pos)[i] = pv;
    }
    __syncthreads();
    for (int i = tid; i < cnt; i += NT) atomicAdd(&sm.hist[(keys[i] >> 10) & 2047u], 1u);
    __syncthreads();
    find_digit<2048, true>((const int*)sm.hist, need, sm.wsum, sm.res);
    const u32 d1 = sm.res[0], need1 = need - sm.res[1], full1 = sm.res[2] == need1;
    for (int i = tid; i < 2048; i += NT) sm.hist[i] = 0;
    __syncthreads();
    u32 d2 = 0, need2 = need1;
    if (!full1) {
        for (int i = tid; i < cnt; i += NT)
            if (((keys[i] >> 10) & 2047u) == d1) atomicAdd(&sm.hist[keys[i] & 1023u], 1u);
        __syncthreads();
        find_digit<1024, true>((const int*)sm.hist, need1, sm.wsum, sm.res);
        d2 = sm.res[0];
        need2 = need1 - sm.res[1];
        for (int i = tid; i < 1024; i += NT) sm.hist[i] = 0;
        __syncthreads();
    }
    // 1: selected, 2: a cell of the final key (taken while still needed)
    auto cls = [&](u32 k) -> int {
        const u32 k1 = (k >> 10) & 2047u, k2 = k & 1023u;
        if (k1 != d1) return k1 > d1 ? 1 : 0;
        if (full1) return 1;
        return k2 > d2 ? 1 : (k2 == d2 ? 2 : 0);
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
            if (it < need2) out[na_tot + it] = pos[i];
            ++it;
        }
    }
    __syncthreads();
}

// A cell's class in a round: 1 selected, 2 a tie of the final round (kept while tickets last), 0 neither; with
// hist, the cells in the round's open bin are counted there by the next digit.
__device__ __forceinline__ int classify(u32 key, int round, u32 d0, u32 d1, u32 d2, u32 full1, u32* hist) {
    const u32 k0 = key >> 21, k1 = (key >> 10) & 2047u, k2 = key & 1023u;
    if (k0 != d0) return (round == 1 && k0 > d0) ? 1 : 0;
    if (round == 1) {
        if (hist) atomicAdd(&hist[k1], 1u);
        return 0;
    }
    if (k1 != d1) return (round == 2 && k1 > d1) ? 1 : 0;
    if (round == 2) {
        if (full1) return 1;
        if (hist) atomicAdd(&hist[k2], 1u);
        return 0;
    }
    return k2 > d2 ? 1 : (k2 == d2 ? 2 : 0);
}

// Round 1, 2 or 3 of a row whose first bin d0 (need of its cells wanted) overflows the list (MODE_ROUNDS), run by
// each of the row's CTAs with a row barrier between rounds: round 1 writes the cells above d0 and histograms the
// cells in it by the next 11 bits, round 2 the same one digit lower, round 3 the last 10 bits, with tickets for
// the final key's cells. The later digits are recomputed from the global histograms (no per-row state is kept).
__device__ void slow_round(const Smem& sm, const Piece& pc, int round, u32 d0, u32 need) {
    u32 d1 = 0, d2 = 0, full1 = 0;
    if (round >= 2) {
        find_digit<2048, false>(pc.ws + WS_H1, need, sm.wsum, sm.res);
        d1 = sm.res[0];
        need -= sm.res[1];
        full1 = sm.res[2] == need;
        if (round == 3 && full1) return;
    }
    if (round == 3) {
        find_digit<1024, false>(pc.ws + WS_H2, need, sm.wsum, sm.res);
        d2 = sm.res[0];
        need -= sm.res[1];
    }
    u32 na = 0, nt = 0;
    for_cells(sm, pc, [&](u32 key, int) {
        const int c = classify(key, round, d0, d1, d2, full1, sm.hist);
        na += c == 1;
        nt += c == 2;
    });
    int tot;  // one block scan of both counts (each below 2^16: a CTA holds fewer than 65536 cells)
    const int pre = block_scan((int)((na << 16) | nt), sm.wsum, &tot);
    const u32 na_tot = (u32)tot >> 16, nt_tot = (u32)tot & 0xffffu;
    if (na_tot + nt_tot) {
        if (threadIdx.x == 0) {
            const u32 tie0 = nt_tot ? (u32)atomicAdd(pc.ws + WS_TIE, (int)nt_tot) : 0u;
            const u32 taken = tie0 >= need ? 0u : min(nt_tot, need - tie0);
            sm.res[0] = (u32)atomicAdd(pc.ws + WS_SEL, (int)(na_tot + taken));
            sm.res[1] = tie0;
        }
        __syncthreads();
        const u32 base = sm.res[0], tie0 = sm.res[1];
        u32 ia = base + ((u32)pre >> 16), it = (u32)pre & 0xffffu;
        if (na || nt) {
            for_cells(sm, pc, [&](u32 key, int pos) {
                const int c = classify(key, round, d0, d1, d2, full1, nullptr);
                if (c == 1) {
                    pc.out[ia++] = pos;
                } else if (c == 2) {
                    if (tie0 + it < need) pc.out[base + na_tot + it] = pos;
                    ++it;
                }
            });
        }
    }
    if (round == 1) flush_hist<2048>(sm.hist, pc.ws + WS_H1);
    else if (round == 2 && !full1) flush_hist<1024>(sm.hist, pc.ws + WS_H2);
    __syncthreads();
}

// The row's CTAs (each adds its cells; they total lim per round) wait for each other after round `round`. Every
// CTA takes its pieces in row order, so the lowest row not yet done always has all its CTAs at its barrier.
__device__ void row_barrier(const Piece& pc, int round) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(pc.ws + WS_ARR, piece_cells(pc));
        const u32 target = (u32)round * (u32)pc.lim;
        while (ld_acquire((const u32*)(pc.ws + WS_ARR)) < target) {
        }
        __threadfence();
    }
    __syncthreads();
}

// ---------------------------------------------------------------- the kernel
extern "C" __global__ void __launch_bounds__(NT, 1) si_paged_mqa_topk(const Params p) {
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
    // The cache block of every local tile (one round of independent loads instead of one per ring stage).
    for (int lt = tid; lt < n; lt += NT) {
        const int g = start + lt;
        int lo = 0, hi = p.B - 1;  // the last request with cum <= g (never an empty one: g < total)
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (sm.cum[mid] <= g) lo = mid;
            else hi = mid - 1;
        }
        const int blk = p.bt[(long long)lo * p.stride_bt + (g - sm.cum[lo])];
        sm.blk[lt] = (unsigned)blk < (unsigned)p.num_blocks ? blk : -1;  // outside the cache: a zero key
    }

    // Rows of at most topk cells: 0..len-1, then -1. Longer rows: their workspace row zeroed.
    for (int r = pid; r < rows; r += P) {
        const int lim = row_limit(p, r / NEXT_N, r % NEXT_N);
        if (lim <= p.topk) {
            for (int i = tid; i < p.topk; i += NT) p.out[(long long)r * p.stride_o + i] = i < lim ? i : -1;
        } else {
            int4* wr = (int4*)(p.ws + (long long)r * p.stride_ws);  // the histograms and the counters
            for (int i = tid; i < WS_H2 / 4 + 256 + 2; i += NT)
                wr[i < WS_H2 / 4 + 256 ? i : WS_SEL / 4 + i - (WS_H2 / 4 + 256)] = make_int4(0, 0, 0, 0);
        }
    }

    __syncthreads();
    MARK(1);

    // ---- score: each warpgroup streams its own tiles wg, wg + NWG, ... through its own ring
    {
        const int wg = tid >> 7;           // warpgroup
        const int wt = tid & 127;          // thread in the warpgroup
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) load_stage(p, sm, wg, wt, s, n);
        const int warp = wt >> 5, lane = lane_id();
        const int m0 = 16 * warp + (lane >> 2), c = lane & 3;
        int cb = 0;                         // this warpgroup's walk over requests
        int qseq = -1;                      // request whose queries and weights are loaded
        float wreg[NEXT_N][H / 4];
        int lims[NEXT_N];
        unsigned char* qb = sm.qbuf + wg * NEXT_N * H * 128;
        const int mine = n > wg ? (n - wg + NWG - 1) / NWG : 0;  // this warpgroup's tiles
        const int trips = CTA_BARRIERS ? (n + NWG - 1) / NWG : mine;  // (CTA-wide barriers: equal trip counts)
        for (int s = 0; s < trips; ++s) {
            cp_wait<STAGES - 2>();
            fence_async_smem();
            WG_BAR();
            load_stage(p, sm, wg, wt, s + STAGES - 1, n);
            if (s >= mine) {  // (CTA_BARRIERS only)
                WG_BAR();
                continue;
            }
            const int lt = wg + NWG * s;
            const int slot = wg * STAGES + s % STAGES;
            const unsigned char* vals = sm.vals + slot * TILE_BYTES;
            const float* scales = sm.scales + slot * 64;
            const int g = start + lt;
            cb = seq_of(sm.cum, g, cb);
            const bool newq = cb != qseq;
            if (newq) {  // this warpgroup's queries and weights of request cb
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
            }
            if (newq || CTA_BARRIERS) WG_BAR();
            const int tile = g - sm.cum[cb];  // the tile's index within request cb
#pragma unroll
            for (int j = 0; j < NEXT_N; ++j) {
                float d[ACC_N];
#pragma unroll
                for (int i = 0; i < ACC_N; ++i) d[i] = 0.f;
                if (DIAG != 1) {
                    wg_fence();
                    mma_tile(d, smem_u32(vals), smem_u32(qb + j * H * 128));
                    wg_commit();
                    wg_wait0();
                }
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
                if (c < 2) {
                    const int m = m0 + 8 * c;
                    const float v = round_cell((c ? s1 : s0) * scales[m]);
                    sm.lg[(lt * NEXT_N + j) * 64 + m] = fkey(v);
#if LG_OUT
                    const int pos = tile * BLOCK_KEYS + m;
                    if (pos < lims[j]) {
                        const long long o = (long long)(cb * NEXT_N + j) * p.stride_lg + pos;
#if BF16
                        ((unsigned short*)p.lg)[o] = (unsigned short)(__float_as_uint(v) >> 16);
#else
                        ((float*)p.lg)[o] = v;
#endif
                    }
#endif
                }
            }
            (void)tile;
            (void)lims;
        }
        cp_wait<0>();
    }
    MARK(2);
    grid_barrier(p.bar);  // every workspace row zeroed
    MARK(3);

    // ---- round 0: the row pieces' histograms of the top 11 key bits, into the rows' global histograms
    for_pieces(p, sm, start, end, n, [&](const Piece& pc) {
        for_cells(sm, pc, [&](u32 key, int) { atomicAdd(&sm.hist[key >> 21], 1u); });
        flush_hist<2048>(sm.hist, pc.ws + WS_H0);
    });
    grid_barrier(p.bar);
    MARK(4);

    // ---- the one-pass select: a row's histogram gives the bin of its topk-th largest key
    for_pieces(p, sm, start, end, n, [&](const Piece& pc) {
        find_digit<2048, false>(pc.ws + WS_H0, (u32)p.topk, sm.wsum, sm.res);
        const u32 d0 = sm.res[0], above = sm.res[1], in = sm.res[2], need = (u32)p.topk - above;
        const int mode = row_mode(d0, in, need);
        if (mode == MODE_ROUNDS) {  // (a piece of no cells in the window takes no part)
            if (piece_cells(pc) > 0) {
                for (int round = 1; round < 4; ++round) {
                    slow_round(sm, pc, round, d0, need);
                    if (round < 3) row_barrier(pc, round);
                }
            }
            return;
        }
        u32 na = 0, nb = 0;  // this thread's cells above the bin and in it
        for_cells(sm, pc, [&](u32 key, int) {
            na += (key >> 21) > d0;
            nb += (key >> 21) == d0;
        });
        int tot;
        const int pre = block_scan((int)((na << 16) | nb), sm.wsum, &tot);
        const u32 na_tot = (u32)tot >> 16, nb_tot = (u32)tot & 0xffffu;
        if (tid == 0) {
            u32 b0 = 0, taken = 0;
            if (mode == MODE_TIES) {  // the bin's cells are all equal (or all needed): the first ones taken
                b0 = nb_tot ? (u32)atomicAdd(pc.ws + WS_TIE, (int)nb_tot) : 0u;
                taken = b0 >= need ? 0u : min(nb_tot, need - b0);
            } else if (nb_tot) {  // MODE_LIST: the bin's cells go to the row's candidate list
                b0 = (u32)atomicAdd(pc.ws + WS_CNT, (int)nb_tot);
            }
            sm.res[0] = (na_tot + taken) ? (u32)atomicAdd(pc.ws + WS_SEL, (int)(na_tot + taken)) : 0u;
            sm.res[1] = b0;
        }
        __syncthreads();
        const u32 base = sm.res[0], b0 = sm.res[1];
        u32 ia = base + ((u32)pre >> 16), ib = (u32)pre & 0xffffu;
        int* lkeys = pc.ws + WS_LIST;
        int* lpos = lkeys + LIST_CAP;
        if (na || nb) {
            for_cells(sm, pc, [&](u32 key, int pos) {
                const u32 k0 = key >> 21;
                if (k0 > d0) {
                    pc.out[ia++] = pos;
                } else if (k0 == d0) {
                    if (mode == MODE_TIES) {
                        if (b0 + ib < need) pc.out[base + na_tot + ib] = pos;
                    } else {
                        lkeys[b0 + ib] = (int)key;
                        lpos[b0 + ib] = pos;
                    }
                    ++ib;
                }
            });
        }
        if (mode == MODE_LIST) {  // the CTA whose cells complete the row selects need of its list
            __syncthreads();
            if (tid == 0) {
                __threadfence();
                const int cells = piece_cells(pc);
                const int old = atomicAdd(pc.ws + WS_ARR, cells);
                sm.res[2] = cells > 0 && old + cells == pc.lim;
            }
            __syncthreads();
            if (sm.res[2]) {
                __threadfence();
                select_list(sm, lkeys, lpos, (int)in, need, pc.out + above);
            }
        }
        __syncthreads();
    });
    MARK(5);
    MARK(7);
}
