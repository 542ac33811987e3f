// Paged decode logits (docs/spec.md §5) on Hopper: a TMA producer warp and wgmma math warpgroups whose stage
// releases are mbarriers every math thread arrives on, with no CTA or warpgroup barrier in the tile loop.
//
// One persistent grid of P CTAs (MINB per SM). The key tiles (64 positions) of every request, cdiv(min(max row
// limit, cap), 64) of request b, form one global range cut into P equal contiguous pieces, one per CTA, so
// ragged lengths stay balanced; a piece may span several requests. Each CTA computes the request prefix sums
// `cum` itself (a block-wide scan in shared memory). Its NWG math warpgroups take the piece's tiles in turn
// (local tile i to warpgroup i % NWG), each fed through its own ring of STAGES slots by its own producer warp of
// the last warpgroup:
//
//   producer  warp k reads the block-table entries of its next 32 tiles at a time (one load per lane, the next
//             chunk's load issued before the current one is used) and for each tile, on lane 0, waits for the
//             ring slot's `empty` barrier and issues a 3-D TMA copy of the tile's [64][128] fp8 values (128-byte
//             swizzle, the layout wgmma reads) and a bulk copy of its 64 float32 scales onto the slot's `full`
//             barrier. Warp 0 also copies each request's next_n query tiles [next_n * H][128] (one 2-D TMA box)
//             into a QBUF-deep query ring (`qfull` / `qempty`), in request order.
//   math      per tile: wait on `full`, one wgmma chain K[64 keys, 128] x Q^T[128, next_n * H] (keys as M, every
//             token's heads as N, fp8 in, f32 accumulators), the two key scales of the thread's rows read, one
//             wait, and every thread arrives on the slot's `empty` barrier (count 128): no thread waits for
//             another in the tile loop. Then per token relu, times the head weights, the head sum (four partial
//             sums in the thread, then its quad), times the key scale, and the store of each row's cells below
//             its limit. Each math thread arrives on `qempty` when it leaves a request.
//
// With CLEAN, every thread then fills the cells at or past each row's limit with -inf (chunks of 1024 columns
// dealt round-robin over the CTAs), disjoint from the cells the tile loop writes.
//
// Values the checks would refuse (docs/spec.md §10): limits clamped into [0, cap], cap = min(W, max_blocks * 64)
// (in 64 bits); a block id outside [0, num_blocks) is copied from block num_blocks, wholly outside the tensor map,
// which TMA fills with zeros, its scales written as zeros (in-window cells 0); with HAS_IDX an entry whose index is
// outside [0, NR) has no tiles and a limit of 0.

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
#define STAGES 8
#endif
#ifndef NWG
#define NWG 4  // math warpgroups, each fed by its own producer warp
#endif
#ifndef QBUF
#define QBUF 2
#endif
#ifndef CLEAN
#define CLEAN 0
#endif
#ifndef HAS_IDX
#define HAS_IDX 0
#endif
#ifndef CL_2D
#define CL_2D 0
#endif
#ifndef MINB
#define MINB 1
#endif

#undef NT  // (the loader passes -DNT; the block size follows NWG)
#define NT (128 * (NWG + 1))
#define NW (NT / 32)
#define FULL 0xffffffffu
#define TILE_BYTES 8192  // 64 keys x 128 fp8 values
#define Q_BYTES (NEXT_N * H * 128)
#define FILL_N 1024
typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(64) Params {
    unsigned char kmap[128];     // CUtensorMap of the cache's values: [num_blocks][64 rows][128 bytes], 128B swizzle
    unsigned char qmap[128];     // CUtensorMap of q: [B * NEXT_N * H rows][128 bytes], boxes of NEXT_N * H rows
    const unsigned char* cache;  // [num_blocks, block_stride] bytes: 64 x 128 fp8 values, then 64 float32 scales
    long long block_stride;
    const float* w;              // [B * NEXT_N, H] float32
    long long stride_w;
    const int* cl;               // [B] or [B, NEXT_N] int32 (contiguous)
    long long stride_clb;
    const int* bt;               // [NR, max_blocks] int32
    long long stride_bt;
    const int* idx;              // HAS_IDX: [B] int32 block-table row of each entry
    void* out;                   // [B * NEXT_N, W] float32 or bfloat16
    long long stride_o;
    int B;
    int W;
    int cap;                     // min(W, max_blocks * 64)
    int num_blocks;
    int nr;                      // block-table rows
};

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Whether entry b reads a block-table row (HAS_IDX: its index inside [0, NR)).
__device__ __forceinline__ bool has_row(const Params& p, int b) {
#if HAS_IDX
    return (unsigned)p.idx[b] < (unsigned)p.nr;
#else
    return true;
#endif
}

__device__ __forceinline__ long long table_row(const Params& p, int b) {
#if HAS_IDX
    return p.idx[b];
#else
    return b;
#endif
}

// Row (b, j)'s limit clamped into [0, cap] (in 64 bits: a length near INT_MIN cannot wrap to a long window).
__device__ __forceinline__ int row_limit(const Params& p, int b, int j) {
    const long long cl = p.cl[(long long)b * p.stride_clb + (CL_2D ? j : 0)];
    const long long lim = CL_2D ? cl : cl - NEXT_N + j + 1;
    return has_row(p, b) ? (int)min(max(lim, 0ll), (long long)p.cap) : 0;
}

__device__ __forceinline__ int req_tiles(const Params& p, int b) {
    int m = 0;
#pragma unroll
    for (int j = 0; j < NEXT_N; ++j) m = max(m, row_limit(p, b, j));
    return (m + 63) >> 6;
}

// The request of global tile g: the largest b with cum[b] <= g (< cum[b + 1]).
__device__ __forceinline__ int req_of(const int* cum, int B, int g) {
    int lo = 0, hi = B;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (cum[mid] <= g) lo = mid;
        else hi = mid;
    }
    return lo;
}

// ---------------------------------------------------------------- mbarriers and copies
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred P;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
        "@!P bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_3d(u32 dst, const void* map, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(map), "r"(0), "r"(0), "r"(z), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_2d(u32 dst, const void* map, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(map), "r"(0), "r"(y), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// ---------------------------------------------------------------- wgmma
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    // K-major operand, 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// d (N / 2 f32 per thread) = A [64, 128] x B^T [128, N]: one k32 step; acc = 0 overwrites d.
template <int N> __device__ __forceinline__ void wgmma(float* d, u64 da, u64 db, int acc);
template <> __device__ __forceinline__ void wgmma<32>(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(acc));
}
template <> __device__ __forceinline__ void wgmma<64>(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc));
}
template <> __device__ __forceinline__ void wgmma<96>(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
        "}, %48, %49, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "l"(da), "l"(db), "r"(acc));
}
template <> __device__ __forceinline__ void wgmma<128>(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc));
}
template <> __device__ __forceinline__ void wgmma<192>(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
        "}, %96, %97, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(da), "l"(db), "r"(acc));
}
template <> __device__ __forceinline__ void wgmma<256>(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(acc));
}

// d (NEXT_N * H / 2 f32 per thread) = K tile [64, 128] x Q^T [128, NEXT_N * H] (all tokens' heads as N).
__device__ __forceinline__ void mma_tile(float* d, u32 ka, u32 qa) {
    const u64 da = smem_desc(ka), db = smem_desc(qa);
#pragma unroll
    for (int k = 0; k < 4; ++k) wgmma<NEXT_N * H>(d, da + 2 * k, db + 2 * k, k);  // 32 bytes a k-step: +2 x 16 B
}

__device__ __forceinline__ void store_cell(const Params& p, long long o, float v) {
#if BF16
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) <= 0x7f800000u) u += 0x7fffu + ((u >> 16) & 1u);  // to nearest, ties to even; NaN kept
    ((unsigned short*)p.out)[o] = (unsigned short)(u >> 16);
#else
    ((float*)p.out)[o] = v;
#endif
}

// ---------------------------------------------------------------- the kernel
extern "C" __global__ void __launch_bounds__(NT, MINB) si_paged_mqa_logits(const __grid_constant__ Params p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);  // (still shared)
    unsigned char* vals = base;                                  // [NWG][STAGES][TILE_BYTES]
    unsigned char* qbuf = vals + NWG * STAGES * TILE_BYTES;      // [QBUF][Q_BYTES]
    float* scales = (float*)(qbuf + QBUF * Q_BYTES);             // [NWG][STAGES][64]
    u64* full = (u64*)(scales + NWG * STAGES * 64);              // [NWG][STAGES]
    u64* empty = full + NWG * STAGES;                            // [NWG][STAGES]
    u64* qfull = empty + NWG * STAGES;                           // [QBUF]
    u64* qempty = qfull + QBUF;                                  // [QBUF]
    int* wsum = (int*)(qempty + QBUF);                           // [32]
    int* cum = wsum + 32;                                        // [B + 1]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int P = gridDim.x, pid = blockIdx.x;

    // tiles before each request: a block-wide exclusive scan, NT requests at a time
    int carry = 0;
    for (int b0 = 0; b0 < p.B; b0 += NT) {
        const int b = b0 + tid;
        const int v = b < p.B ? req_tiles(p, b) : 0;
        int incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(FULL, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) wsum[warp] = incl;
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < NW; ++w) {
            const int s = wsum[w];
            before += w < warp ? s : 0;
            total += s;
        }
        if (b < p.B) cum[b] = carry + before + incl - v;
        carry += total;
        __syncthreads();
    }
    if (tid == 0) {
        cum[p.B] = carry;
        for (int s = 0; s < NWG * STAGES; ++s) {
            mbar_init(smem_u32(full + s), 1);
            mbar_init(smem_u32(empty + s), 128);
        }
        for (int s = 0; s < QBUF; ++s) {
            mbar_init(smem_u32(qfull + s), 1);
            mbar_init(smem_u32(qempty + s), 128 * NWG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int T = cum[p.B];
    const int start = (int)((long long)pid * T / P), end = (int)((long long)(pid + 1) * T / P);
    const int n = end - start;
    const int first = n > 0 ? req_of(cum, p.B, start) : 0;

    if (warp >= 4 * NWG) {
        // ------------------------------------------------ producer warps: warp k feeds math warpgroup k
        const int k = warp - 4 * NWG;
        if (k < NWG && n > 0) {
            u64* kfull = full + k * STAGES;
            u64* kempty = empty + k * STAGES;
            unsigned char* kvals = vals + k * STAGES * TILE_BYTES;
            float* kscales = scales + k * STAGES * 64;
            const int mine = n > k ? (n - k + NWG - 1) / NWG : 0;  // local tiles k, k + NWG, ...
            // lane l's entry of chunk u0: the request and cache block of the producer's tile u0 + l
            auto entry = [&](int u0, int& rb, int& blk) {
                const int u = u0 + lane;
                rb = -1;
                blk = -1;
                if (u < mine) {
                    const int g = start + k + NWG * u;
                    rb = req_of(cum, p.B, g);
                    const int id = p.bt[table_row(p, rb) * p.stride_bt + (g - cum[rb])];
                    blk = (unsigned)id < (unsigned)p.num_blocks ? id : -1;
                }
            };
            // warp 0 also copies each request's queries (in request order, before the request's first tile it
            // feeds, and those of requests it feeds none of when it passes them)
            int qb = first, qseg = 0;
            auto queries_through = [&](int last) {
                for (; qb <= last; ++qb) {
                    if (min(cum[qb + 1], end) <= max(cum[qb], start)) continue;  // no tile in the piece
                    const int qs = qseg % QBUF;
                    if (qseg >= QBUF) mbar_wait(smem_u32(qempty + qs), (u32)(qseg / QBUF - 1) & 1u);
                    if (lane == 0) {
                        const u32 bar = smem_u32(qfull + qs);
                        mbar_expect(bar, Q_BYTES);
                        tma_2d(smem_u32(qbuf + qs * Q_BYTES), p.qmap, qb * NEXT_N * H, bar);
                    }
                    ++qseg;
                }
            };
            int nrb, nblk, slot = 0;
            u32 phase = 0;
            entry(0, nrb, nblk);
            for (int u0 = 0; u0 < mine; u0 += 32) {
                const int crb = nrb, cblk = nblk;
                if (u0 + 32 < mine) entry(u0 + 32, nrb, nblk);
                const int kn = min(32, mine - u0);
                for (int e = 0; e < kn; ++e) {
                    const int rb = __shfl_sync(FULL, crb, e), blk = __shfl_sync(FULL, cblk, e);
                    const int u = u0 + e;
                    if (k == 0) queries_through(rb);
                    const int s = slot;
                    if (u >= STAGES) mbar_wait(smem_u32(kempty + s), phase ^ 1u);
                    if (++slot == STAGES) {
                        slot = 0;
                        phase ^= 1u;
                    }
                    if (lane == 0) {
                        const u32 bar = smem_u32(kfull + s);
                        float* sc = kscales + s * 64;
                        if (blk >= 0) {
                            mbar_expect(bar, TILE_BYTES + 256);
                            tma_3d(smem_u32(kvals + s * TILE_BYTES), p.kmap, blk, bar);
                            bulk_copy(smem_u32(sc), p.cache + (long long)blk * p.block_stride + TILE_BYTES, 256, bar);
                        } else {  // a zero key: values from outside the map, zero scales
                            for (int m = 0; m < 64; ++m) sc[m] = 0.f;
                            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (before a later copy)
                            mbar_expect(bar, TILE_BYTES);
                            tma_3d(smem_u32(kvals + s * TILE_BYTES), p.kmap, p.num_blocks, bar);
                        }
                    }
                    __syncwarp();
                }
            }
            if (k == 0) queries_through(req_of(cum, p.B, end - 1));
        }
    } else if (n > 0) {
        // ------------------------------------------------ math warpgroup c: local tiles c, c + NWG, ...
        const int c = tid >> 7, wt = tid & 127;
        const int m0 = 16 * (wt >> 5) + (lane >> 2), cq = lane & 3;
        const u64* cfull = full + c * STAGES;
        u64* cempty = empty + c * STAGES;
        const unsigned char* cvals = vals + c * STAGES * TILE_BYTES;
        const float* cscales = scales + c * STAGES * 64;
        float d[NEXT_N * H / 2];
#pragma unroll
        for (int i = 0; i < NEXT_N * H / 2; ++i) d[i] = 0.f;
        int seg = 0, slot = 0;  // the request count and the ring position (slot, phase) of the next tile
        u32 phase = 0;
        for (int b = first; b < p.B && cum[b] < end; ++b) {
            const int la = max(cum[b], start) - start, le = min(cum[b + 1], end) - start;
            if (le <= la) continue;
            float wreg[NEXT_N][H / 4];
            int lims[NEXT_N];
#pragma unroll
            for (int j = 0; j < NEXT_N; ++j) {
                const float* wr = p.w + (long long)(b * NEXT_N + j) * p.stride_w;
#pragma unroll
                for (int i = 0; i < H / 8; ++i) {
                    const float2 w2 = *(const float2*)(wr + 8 * i + 2 * cq);
                    wreg[j][2 * i] = w2.x;
                    wreg[j][2 * i + 1] = w2.y;
                }
                lims[j] = row_limit(p, b, j);
            }
            const int qs = seg % QBUF;
            mbar_wait(smem_u32(qfull + qs), (u32)(seg / QBUF) & 1u);
            const u32 qa = smem_u32(qbuf + qs * Q_BYTES);
            const int t0 = start - cum[b];  // tile of local entry i: t0 + i
            for (int i = la + ((c - la) % NWG + NWG) % NWG; i < le; i += NWG) {
                mbar_wait(smem_u32(cfull + slot), phase);
                wg_fence();
                mma_tile(d, smem_u32(cvals + slot * TILE_BYTES), qa);
                wg_commit();
                const float sc0 = cscales[slot * 64 + m0], sc1 = cscales[slot * 64 + m0 + 8];
                wg_wait0();
                mbar_arrive(smem_u32(cempty + slot));
                if (++slot == STAGES) {
                    slot = 0;
                    phase ^= 1u;
                }
                const int pos = (t0 + i) * 64 + m0 + 8 * (cq & 1);
#pragma unroll
                for (int j = 0; j < NEXT_N; ++j) {
                    const float* dj = d + j * (H / 2);
                    float sum[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) sum[e] = fmaxf(dj[e], 0.f) * wreg[j][e & 1];
#pragma unroll
                    for (int h = 1; h < H / 8; ++h)
#pragma unroll
                        for (int e = 0; e < 4; ++e) sum[e] += fmaxf(dj[4 * h + e], 0.f) * wreg[j][2 * h + (e & 1)];
                    float v0 = (sum[0] + sum[1]) * sc0, v1 = (sum[2] + sum[3]) * sc1;
                    v0 += __shfl_xor_sync(FULL, v0, 1);
                    v1 += __shfl_xor_sync(FULL, v1, 1);
                    v0 += __shfl_xor_sync(FULL, v0, 2);
                    v1 += __shfl_xor_sync(FULL, v1, 2);
                    if (cq < 2 && pos < lims[j])
                        store_cell(p, (long long)(b * NEXT_N + j) * p.stride_o + pos, cq ? v1 : v0);
                }
            }
            mbar_arrive(smem_u32(qempty + qs));
            ++seg;
        }
    }
#if CLEAN
    // -inf at and past each row's limit, chunks of FILL_N columns round-robin over the CTAs
    const int cpr = (p.W + FILL_N - 1) / FILL_N;
    const long long chunks = (long long)p.B * NEXT_N * cpr;
    for (long long g = pid; g < chunks; g += P) {
        const int r = (int)(g / cpr), c0 = (int)(g % cpr) * FILL_N;
        const int lim = row_limit(p, r / NEXT_N, r % NEXT_N);
        const int hi = min(c0 + FILL_N, p.W);
        for (int col = max(c0, lim) + tid; col < hi; col += NT)
            store_cell(p, (long long)r * p.stride_o + col, __int_as_float(0xff800000));
    }
#endif
}
