// cudampi's ipc engine: whole collectives as kernels over CUDA IPC workspaces.
//
// Compiled at run time by NVRTC (CuPy RawModule) with no headers; one instantiation per
// (kernel, element kind, op, number of ranks). Layout and protocol (see workspace.py, plan.py):
//
//   * Every rank of a node's communicator owns one workspace (cudaMalloc, IPC-exported): a
//     header with barrier slots, launch counters and an abort word, then two data buffers used
//     by alternate launches. Every rank maps every peer's workspace; `peers[r]` in the header is
//     rank r's workspace as this process sees it.
//   * Every launch of a communicator uses the same grid (G blocks of NT threads), so a pack
//     (16 bytes) of a data buffer is always written and read by the same block index on every
//     rank: a per-block barrier between rank r's block b and the peers' block b orders all the
//     data that block b exchanges (no grid-wide synchronisation, no host involvement).
//     Blocks wait on their peers' blocks, so every block of every rank must be resident at
//     once: every kernel keeps room for MIN_BLOCKS blocks a multiprocessor (64 registers a
//     thread), the place beside its own for another job's or communicator's kernels.
//   * A barrier posts, into each peer's header, this block's slot: the call's signature words
//     and the exchange directory entry meant for that peer, then the epoch with a system-scope
//     release store. The peer waits for the epoch with acquire loads, compares the signature
//     and reads the directory. A disagreement, a timeout (%globaltimer), an abort posted by a
//     peer or by the host watchdog ends the kernel and is recorded in host-mapped memory.
//   * Alternate launches use alternate data buffers: a rank writes buffer p again two launches
//     later, after every rank passed the intervening launch's first barrier, i.e. after every
//     rank finished reading it. So one-shot kernels need one barrier, two-shot kernels two a
//     round (the rounds of one two-shot launch alternate buffers the same way and advance the
//     launch count by one a round).
//   * Reductions visit ranks in rank order (0..n-1) with float16/bfloat16 accumulated in
//     float32, so every rank computes bitwise the same result.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// MAX_RANKS, MAX_BLOCKS, SIG_WORDS, NPARAM, the P_* parameter indices, the MODE_* and ERR_*
// codes and the layout offsets checked below are defined by cudampi/comm/ipc/layout.py, which
// prepends them to this file: one definition for the host and the kernels.

// ---------------------------------------------------------------- shared layout (layout.py)

struct Slot {          // 64 bytes; written by the peer whose rank indexes it
  u64 sig[SIG_WORDS];
  i64 off;             // exchange: byte offset in the writer's data buffer of what it sends me
  i64 len;             // exchange: bytes it sends me (-1: none)
  i64 expect;          // exchange: bytes it expects from me (-1: none)
  u64 epoch;           // written last (release)
};

struct HeaderHead {     // the part of the header before the registration table
  u64 peers[MAX_RANKS];  // every rank's workspace in this process's address space
  u32 abort;             // set by a rank that failed: stop waiting
  u32 claim;             // the first failing thread of this rank takes it
  u32 pad[14];
  u64 launches[MAX_BLOCKS];  // per-block launch count (local)
  u64 barriers[MAX_BLOCKS];  // per-block barrier count (local)
};

struct Post {          // 32 bytes; a point-to-point chunk's header, written by its sender
  int tag;
  int reg;             // 1 + the sender's registry entry holding the whole message (0: inbox)
  i64 nbytes;          // of the whole message
  i64 off;             // with reg: the message's byte offset in that registered buffer
  u64 seq;             // 1 + the chunk's number in the pair's stream of this block (release)
};

struct Header {
  HeaderHead h;
  u64 regs[MAX_RANKS][MAX_REGS];  // rank r's registered buffer k, mapped here (registry.py)
  Slot slots[2][MAX_BLOCKS][MAX_RANKS];
  // Point-to-point (p2p_kernel), per peer r and block: chunks this rank sent r and took from r
  // (local counters), chunks r took from this rank (written by r), and r's posted chunks.
  u64 p2p_sent[MAX_RANKS][MAX_BLOCKS];
  u64 p2p_taken[MAX_RANKS][MAX_BLOCKS];
  u64 p2p_acked[MAX_RANKS][MAX_BLOCKS];
  Post p2p_posts[MAX_RANKS][MAX_BLOCKS][P2P_SLOTS];
};

struct ErrorRecord {   // host-mapped; the first failing thread of this rank fills it
  u32 host_abort;      // written by the host watchdog (first: the host finds it at offset 0)
  u32 code;            // ERR_* (layout.py)
  u32 ready;           // 1 once every field below is written
  u32 peer;
  u32 block;
  u32 pad;
  u64 epoch;
  u64 mine[SIG_WORDS];
  u64 theirs[SIG_WORDS];
  i64 expected;
  i64 got;
};

struct Params { i64 v[NPARAM]; };

static_assert(sizeof(Slot) == 64, "Slot size differs from layout.py");
static_assert(sizeof(Post) == 32, "Post size differs from layout.py");
static_assert(sizeof(Header) == HEADER_BYTES, "Header size differs from layout.py");
static_assert(sizeof(HeaderHead) == HEADER_REGS, "Header.regs offset differs from layout.py");
static_assert(sizeof(ErrorRecord) == ERROR_BYTES, "ErrorRecord size differs from layout.py");

// ---------------------------------------------------------------- memory-model helpers

__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld_volatile32(const u32* p) {
  u32 v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------- element kinds

struct c64 { float re, im; };
struct c128 { double re, im; };

__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // round to nearest even
  return (u16)(u >> 16);
}

// A kind: storage type S, accumulator A, conversions, and the family used to pick op semantics.
#define FAM_FLOAT 0
#define FAM_SIGNED 1
#define FAM_UNSIGNED 2
#define FAM_COMPLEX 3

struct KF16 { typedef u16 S; typedef float A; enum { fam = FAM_FLOAT };
  static __device__ __forceinline__ A up(S s) { return h2f(s); }
  static __device__ __forceinline__ S down(A a) { return f2h(a); } };
struct KBF16 { typedef u16 S; typedef float A; enum { fam = FAM_FLOAT };
  static __device__ __forceinline__ A up(S s) { return b2f(s); }
  static __device__ __forceinline__ S down(A a) { return f2b(a); } };
#define PLAIN_KIND(NAME, T, FAM) struct NAME { typedef T S; typedef T A; enum { fam = FAM }; \
  static __device__ __forceinline__ A up(S s) { return s; } \
  static __device__ __forceinline__ S down(A a) { return a; } };
PLAIN_KIND(KF32, float, FAM_FLOAT)
PLAIN_KIND(KF64, double, FAM_FLOAT)
PLAIN_KIND(KI8, signed char, FAM_SIGNED)
PLAIN_KIND(KI16, short, FAM_SIGNED)
PLAIN_KIND(KI32, int, FAM_SIGNED)
PLAIN_KIND(KI64, long long, FAM_SIGNED)
PLAIN_KIND(KU8, unsigned char, FAM_UNSIGNED)
PLAIN_KIND(KU16, unsigned short, FAM_UNSIGNED)
PLAIN_KIND(KU32, unsigned int, FAM_UNSIGNED)
PLAIN_KIND(KU64, unsigned long long, FAM_UNSIGNED)
PLAIN_KIND(KC64, c64, FAM_COMPLEX)
PLAIN_KIND(KC128, c128, FAM_COMPLEX)
// bool is KU8 with the op mapped by the host (sum/max/bor -> bor, prod/min/band -> band).

// Ops, in cudampi.names.REDUCE_OPS order.
#define OP_SUM 0
#define OP_PROD 1
#define OP_MIN 2
#define OP_MAX 3
#define OP_AVG 4
#define OP_BAND 5
#define OP_BOR 6
#define OP_BXOR 7

template <typename T> struct Unsigned { typedef T U; };
template <> struct Unsigned<signed char> { typedef unsigned char U; };
template <> struct Unsigned<short> { typedef unsigned short U; };
template <> struct Unsigned<int> { typedef unsigned int U; };
template <> struct Unsigned<long long> { typedef unsigned long long U; };

template <int OP, int FAM, typename A> struct Combine {
  static __device__ __forceinline__ A f(A a, A b) {
    typedef typename Unsigned<A>::U U;
    if (OP == OP_SUM || OP == OP_AVG) {
      if (FAM == FAM_FLOAT) return a + b;
      return (A)((U)a + (U)b);  // wrap-around, as NumPy
    }
    if (OP == OP_PROD) {
      if (FAM == FAM_FLOAT) return a * b;
      return (A)((U)a * (U)b);
    }
    if (OP == OP_MIN) {
      if (FAM == FAM_FLOAT) return (a != a) ? a : ((b != b) ? b : (b < a ? b : a));
      return b < a ? b : a;
    }
    if (OP == OP_MAX) {
      if (FAM == FAM_FLOAT) return (a != a) ? a : ((b != b) ? b : (b > a ? b : a));
      return b > a ? b : a;
    }
    return a;  // bitwise ops are specialised below for integers
  }
};
#define BITWISE(T) \
  template <int FAM> struct Combine<OP_BAND, FAM, T> { static __device__ __forceinline__ T f(T a, T b) { return a & b; } }; \
  template <int FAM> struct Combine<OP_BOR, FAM, T> { static __device__ __forceinline__ T f(T a, T b) { return a | b; } }; \
  template <int FAM> struct Combine<OP_BXOR, FAM, T> { static __device__ __forceinline__ T f(T a, T b) { return a ^ b; } };
BITWISE(signed char) BITWISE(short) BITWISE(int) BITWISE(long long)
BITWISE(unsigned char) BITWISE(unsigned short) BITWISE(unsigned int) BITWISE(unsigned long long)

template <int OP, int FAM> struct Combine<OP, FAM, c64> {
  static __device__ __forceinline__ c64 f(c64 a, c64 b) {
    c64 r;
    if (OP == OP_PROD) { r.re = a.re * b.re - a.im * b.im; r.im = a.re * b.im + a.im * b.re; }
    else { r.re = a.re + b.re; r.im = a.im + b.im; }
    return r;
  }
};
template <int OP, int FAM> struct Combine<OP, FAM, c128> {
  static __device__ __forceinline__ c128 f(c128 a, c128 b) {
    c128 r;
    if (OP == OP_PROD) { r.re = a.re * b.re - a.im * b.im; r.im = a.re * b.im + a.im * b.re; }
    else { r.re = a.re + b.re; r.im = a.im + b.im; }
    return r;
  }
};

// avg: true division for floats and complex, floor division (NumPy's) for integers.
template <int FAM, typename A> struct Finish {
  static __device__ __forceinline__ A f(A a, int n) {
    if (FAM == FAM_FLOAT) return a / (A)n;
    if (FAM == FAM_UNSIGNED) return (A)(a / (A)n);
    A q = (A)(a / (A)n);
    if ((A)(q * (A)n) != a && a < (A)0) q = (A)(q - (A)1);
    return q;
  }
};
template <int FAM> struct Finish<FAM, c64> {
  static __device__ __forceinline__ c64 f(c64 a, int n) { a.re /= n; a.im /= n; return a; }
};
template <int FAM> struct Finish<FAM, c128> {
  static __device__ __forceinline__ c128 f(c128 a, int n) { a.re /= n; a.im /= n; return a; }
};

// avg: each rank's share is divided before the sum (as NCCL's ncclAvg): the mean of values
// whose sum would overflow (3e38 and 3e38 in float32) is still the mean, as on every other path.
template <int OP, int FAM, typename A> __device__ __forceinline__ A share(A a, int n) {
  if (OP == OP_AVG) return Finish<FAM, A>::f(a, n);
  return a;
}

// ---------------------------------------------------------------- the per-block barrier

struct Ctx {
  Header* hdr;
  ErrorRecord* err;
  int rank;
  u64 deadline_ns;
  u64 timeout_ns;
};

__device__ void record_error(const Ctx& c, u32 code, u32 peer, u64 epoch, const u64* mine,
                             const u64* theirs, i64 expected, i64 got) {
  if (atomicCAS(&c.hdr->h.claim, 0u, 1u) == 0u) {
    c.err->code = code;
    c.err->peer = peer;
    c.err->block = blockIdx.x;
    c.err->epoch = epoch;
    for (int i = 0; i < SIG_WORDS; i++) {
      c.err->mine[i] = mine ? mine[i] : 0;
      c.err->theirs[i] = theirs ? theirs[i] : 0;
    }
    c.err->expected = expected;
    c.err->got = got;
    __threadfence_system();
    *(volatile u32*)&c.err->ready = 1u;
  }
  // Tell every rank (this one included) to stop waiting.
  for (int r = 0; r < MAX_RANKS; r++) {
    const u64 p = c.hdr->h.peers[r];
    if (p) *(volatile u32*)&((Header*)p)->h.abort = 1u;
  }
  __threadfence_system();
}

// Returns false (for the whole block) when the call failed; the kernel must then return.
// `send_off/send_len/expect` (thread-local, for the peer `threadIdx.x`) are posted with the
// slot; what the peers post for this rank lands in sh_off/sh_len/sh_exp.
template <int N>
__device__ bool barrier(const Ctx& c, const u64* sig, i64 send_off, i64 send_len, i64 expect,
                        i64* sh_off, i64* sh_len, i64* sh_exp) {
  __shared__ u64 sh_epoch;
  __shared__ int sh_fail;
  __syncthreads();
  if (threadIdx.x == 0) {
    sh_epoch = ++c.hdr->h.barriers[blockIdx.x];
    sh_fail = 0;
  }
  __syncthreads();
  const u64 e = sh_epoch;
  const int par = (int)(e & 1);
  if (threadIdx.x < N) {
    const int r = threadIdx.x;
    Header* peer = (Header*)c.hdr->h.peers[r];
    Slot* out = &peer->slots[par][blockIdx.x][c.rank];
    for (int i = 0; i < SIG_WORDS; i++) out->sig[i] = sig[i];
    out->off = send_off;
    out->len = send_len;
    out->expect = expect;
    st_release(&out->epoch, e);
    Slot* in = &c.hdr->slots[par][blockIdx.x][r];
    u32 spins = 0;
    bool ok = true;
    if (ld_volatile32(&c.hdr->h.abort)) {  // an earlier call of this communicator failed
      record_error(c, ERR_ABORTED, r, e, sig, 0, 0, 0);
      ok = false;
    }
    while (ok && ld_acquire(&in->epoch) != e) {
      if (ld_volatile32(&c.hdr->h.abort)) {
        record_error(c, ERR_ABORTED, r, e, sig, 0, 0, 0);
        ok = false;
        break;
      }
      if ((++spins & 255u) == 0) {
        if (*(volatile u32*)&c.err->host_abort) {
          record_error(c, ERR_HOST, r, e, sig, 0, 0, 0);
          ok = false;
          break;
        }
        if (globaltimer() > c.deadline_ns) {
          record_error(c, ERR_TIMEOUT, r, e, sig, 0, (i64)(c.timeout_ns), 0);
          ok = false;
          break;
        }
      }
    }
    if (ok) {
      u64 theirs[SIG_WORDS];
      bool same = true;
      for (int i = 0; i < SIG_WORDS; i++) {
        theirs[i] = in->sig[i];
        same = same && theirs[i] == sig[i];
      }
      if (!same) {
        record_error(c, ERR_MISMATCH, r, e, sig, theirs, 0, 0);
        ok = false;
      } else {
        sh_off[r] = in->off;
        sh_len[r] = in->len;
        sh_exp[r] = in->expect;
      }
    }
    if (!ok) sh_fail = 1;
  }
  __syncthreads();
  return sh_fail == 0;
}

template <typename PARAMS>
__device__ __forceinline__ Ctx make_ctx(const PARAMS& p) {
  Ctx c;
  c.hdr = (Header*)p.v[P_WS];
  c.err = (ErrorRecord*)p.v[P_ERR];
  c.rank = (int)p.v[P_RANK];
  c.timeout_ns = (u64)p.v[P_TIMEOUT];
  c.deadline_ns = globaltimer() + c.timeout_ns;
  return c;
}

// The data buffer this launch uses, in rank r's workspace (this process's mapping).
__device__ __forceinline__ char* data_of(const Ctx& c, const Params& p, int r, int par) {
  return (char*)c.hdr->h.peers[r] + p.v[P_DATA] + (i64)par * p.v[P_CAP];
}

// The call's signature (what every rank posts at its barriers), from the launch's parameters.
__device__ __forceinline__ void read_sig(const Params& p, u64* sig) {
  for (int i = 0; i < SIG_WORDS; i++) sig[i] = (u64)p.v[P_SIG + i];
}

__device__ __forceinline__ int next_parity(const Ctx& c) {
  __shared__ u64 sh_launch;
  if (threadIdx.x == 0) sh_launch = ++c.hdr->h.launches[blockIdx.x];
  __syncthreads();
  return (int)(sh_launch & 1);
}

// ---------------------------------------------------------------- byte movement

// Copy `n` (<= 16) bytes; the widest access the alignment of both sides allows.
__device__ __forceinline__ void copy_small(char* dst, const char* src, int n) {
  const u64 a = (u64)dst | (u64)src | (u64)n;
  if (n == 16 && (a & 15) == 0) { *(uint4*)dst = *(const uint4*)src; return; }
  if ((a & 7) == 0) { for (int i = 0; i < n; i += 8) *(u64*)(dst + i) = *(const u64*)(src + i); return; }
  if ((a & 3) == 0) { for (int i = 0; i < n; i += 4) *(u32*)(dst + i) = *(const u32*)(src + i); return; }
  if ((a & 1) == 0) { for (int i = 0; i < n; i += 2) *(u16*)(dst + i) = *(const u16*)(src + i); return; }
  for (int i = 0; i < n; i++) dst[i] = src[i];
}

// The first 16-byte pack index >= k0 that this thread owns (pack k belongs to thread
// k mod (grid size), the same thread index on every rank).
__device__ __forceinline__ i64 first_pack(i64 k0) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  return k0 + ((tid - k0 % stride) % stride + stride) % stride;
}

// Visit this thread's packs of the buffer bytes [lo, lo + n): f(a, b) for each piece [a, b).
#define FOR_PACKS(lo, n, a, b, ...)                                              \
  {                                                                             \
    const i64 lo_ = (lo), hi_ = (lo) + (n);                                     \
    const i64 stride_ = (i64)gridDim.x * blockDim.x;                            \
    if (hi_ > lo_)                                                              \
      for (i64 k_ = first_pack(lo_ >> 4); k_ < ((hi_ + 15) >> 4); k_ += stride_) { \
        const i64 a = (k_ << 4) > lo_ ? (k_ << 4) : lo_;                        \
        const i64 b = ((k_ + 1) << 4) < hi_ ? ((k_ + 1) << 4) : hi_;            \
        __VA_ARGS__                                                             \
      }                                                                         \
  }

// Stage n bytes of src at buffer offset w (by buffer packs, so peers read what they expect).
__device__ __forceinline__ void stage_at(char* buf, i64 w, const char* src, i64 n) {
  FOR_PACKS(w, n, a, b, { copy_small(buf + a, src + (a - w), (int)(b - a)); })
}

// Copy n bytes at buffer offset w of a peer's buffer to dst.
__device__ __forceinline__ void fetch_at(char* dst, const char* buf, i64 w, i64 n) {
  FOR_PACKS(w, n, a, b, { copy_small(dst + (a - w), buf + a, (int)(b - a)); })
}

// ---------------------------------------------------------------- reductions

// Reduce one slice of `cnt` elements at buffer offset `w` (bytes): src[r] + w is rank r's data
// (this rank's own `in`, a peer's staged buffer or its registered input). Ranks are visited in
// order; the result goes to `out`, to every non-null push[r] + (a - w) (a peer's registered
// output) and, when `keep` is set, to keep + w for the peers to gather.
template <typename K, int OP, int N>
__device__ __forceinline__ void reduce_slice(const char* const* src, char* out, char* const* push, char* keep,
                             i64 w, i64 cnt, bool aligned) {
  typedef typename K::S S;
  typedef typename K::A A;
  const i64 es = sizeof(S);
  FOR_PACKS(w, cnt * es, a, b, {
    if (aligned && b - a == 16) {
      const int E = 16 / (int)sizeof(S);
      uint4 raw[N];
_Pragma("unroll")
      for (int r = 0; r < N; r++) raw[r] = *(const uint4*)(src[r] + a);
      uint4 res;
_Pragma("unroll")
      for (int i = 0; i < E; i++) {
        A acc = share<OP, K::fam, A>(K::up(((const S*)&raw[0])[i]), N);
_Pragma("unroll")
        for (int r = 1; r < N; r++)
          acc = Combine<OP, K::fam, A>::f(acc, share<OP, K::fam, A>(K::up(((const S*)&raw[r])[i]), N));
        ((S*)&res)[i] = K::down(acc);
      }
      *(uint4*)(out + (a - w)) = res;
      if (keep) *(uint4*)(keep + a) = res;
_Pragma("unroll")
      for (int r = 0; r < N; r++)
        if (push[r]) *(uint4*)(push[r] + (a - w)) = res;
    } else {
_Pragma("unroll 1")
      for (i64 x = a; x < b; x += es) {
        A acc = share<OP, K::fam, A>(K::up(*(const S*)(src[0] + x)), N);
_Pragma("unroll 1")
        for (int r = 1; r < N; r++)
          acc = Combine<OP, K::fam, A>::f(acc, share<OP, K::fam, A>(K::up(*(const S*)(src[r] + x)), N));
        const S res = K::down(acc);
        *(S*)(out + (x - w)) = res;
        if (keep) *(S*)(keep + x) = res;
_Pragma("unroll 1")
        for (int r = 0; r < N; r++)
          if (push[r]) *(S*)(push[r] + (x - w)) = res;
      }
    }
  })
}

// Slice q of `n` elements cut in N pack-aligned slices of `pe`-element packs: [*lo, *hi) (the
// same cut as plan._slices).
__device__ __forceinline__ void slice_of(i64 n, int nranks, i64 pe, int q, i64* lo, i64* hi) {
  const i64 top = (n + pe - 1) / pe * pe;
  const i64 per = ((top / pe) + nranks - 1) / nranks * pe;
  *lo = min((i64)q * per, top);
  *hi = max(*lo, min(n, (i64)(q + 1) * per));
}

// Two-shot allreduce of P_COUNT elements (one launch, whatever the size; a kernel of its own, so
// its registers do not weigh on the other reductions'): rank q reduces slice
// q and every rank gathers the others' slices. With registered buffers (P_REGIN / P_REGOUT: 1 +
// the registry entry, 0: none; the byte offsets of `in` / `out` in them in P_INOFF / P_OUTOFF)
// the peers read this rank's input where it lies instead of a staged copy, and write their
// reduced slices straight into its output instead of this rank fetching them. Each rank posts
// its choice at the first barrier. Where every rank registered both, the whole message is one
// round: no data buffer is used, so its size does not matter. Otherwise the message goes in
// rounds of P_CHUNK elements (one data buffer), the buffers alternating between rounds as
// between launches; a round past the first begins with a barrier of its own.
template <typename K, int OP, int N>
__global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS) twoshot_kernel(const Params p) {
  typedef typename K::S S;
  __shared__ i64 sh_off[MAX_RANKS], sh_len[MAX_RANKS], sh_exp[MAX_RANKS];
  const Ctx c = make_ctx(p);
  const int par = next_parity(c);
  u64 sig[SIG_WORDS];
  read_sig(p, sig);
  const i64 es = sizeof(S), pe = PACK / es;
  const int rank = c.rank;
  const char* in = (const char*)p.v[P_IN];
  char* out = (char*)p.v[P_OUT];
  const i64 count = p.v[P_COUNT], chunk = p.v[P_CHUNK];
  const i64 regin = p.v[P_REGIN], regout = p.v[P_REGOUT];
  const i64 rounds = count > chunk ? (count + chunk - 1) / chunk : 1;
  // Round 0's staging goes before the first barrier (a rank that did not register its input
  // stages it in any case): every slice but the one this rank reduces itself.
  if (regin == 0) {
    const i64 n = count < chunk ? count : chunk;
    char* mine = data_of(c, p, rank, par);
    for (int q = 0; q < N; q++) {
      i64 lo, hi;
      slice_of(n, N, pe, q, &lo, &hi);
      if (q != rank) stage_at(mine, lo * es, in + lo * es, (hi - lo) * es);
    }
  }
  if (!barrier<N>(c, sig, (regin << 32) | regout, p.v[P_INOFF], p.v[P_OUTOFF], sh_off, sh_len,
                  sh_exp))
    return;
  // Where each peer's input is, and whether it wants its slice pushed.
  const char* peer_in[N];
  char* peer_out[N];
  bool keep_needed = false, whole = regin > 0 && regout > 0;
_Pragma("unroll")
  for (int r = 0; r < N; r++) {
    const i64 ri = sh_off[r] >> 32, ro = sh_off[r] & 0xffffffff;
    peer_in[r] = (r != rank && ri > 0) ? (const char*)(c.hdr->regs[r][ri - 1] + sh_len[r]) : 0;
    peer_out[r] = (r != rank && ro > 0) ? (char*)(c.hdr->regs[r][ro - 1] + sh_exp[r]) : 0;
    keep_needed = keep_needed || (r != rank && ro == 0);
    whole = whole && (r == rank || (ri > 0 && ro > 0));
  }
  const i64 step = whole ? count : chunk, nr = whole ? 1 : rounds;
  for (i64 j = 0; j < nr; j++) {
    const i64 c0 = j * step, n = count - c0 < step ? count - c0 : step;
    const int pj = par ^ (int)(j & 1);
    char* bufs[N];
_Pragma("unroll")
    for (int r = 0; r < N; r++) bufs[r] = data_of(c, p, r, pj);
    if (j > 0) {
      if (regin == 0) {
        for (int q = 0; q < N; q++) {
          i64 lo, hi;
          slice_of(n, N, pe, q, &lo, &hi);
          if (q != rank) stage_at(bufs[rank], lo * es, in + (c0 + lo) * es, (hi - lo) * es);
        }
      }
      if (!barrier<N>(c, sig, 0, -1, -1, sh_off, sh_len, sh_exp)) return;
    }
    i64 lo, hi;
    slice_of(n, N, pe, rank, &lo, &hi);
    const i64 w = lo * es;
    const char* own = in + (c0 + lo) * es;
    char* dst = out + (c0 + lo) * es;
    const char* src[N];
    char* push[N];
_Pragma("unroll")
    for (int r = 0; r < N; r++) {
      src[r] = (r == rank) ? own - w : peer_in[r] ? peer_in[r] + (c0 + lo) * es - w : bufs[r];
      push[r] = peer_out[r] ? peer_out[r] + (c0 + lo) * es : 0;
    }
    reduce_slice<K, OP, N>(src, dst, push, keep_needed ? bufs[rank] : 0, w, hi - lo,
                           (((u64)own | (u64)dst) & 15) == 0);
    if (!barrier<N>(c, sig, 0, -1, -1, sh_off, sh_len, sh_exp)) return;
    if (regout > 0) continue;  // every peer pushed its slice into `out`
    for (int q = 0; q < N; q++) {
      if (q == rank) continue;
      slice_of(n, N, pe, q, &lo, &hi);
      fetch_at(out + (c0 + lo) * es, bufs[q], lo * es, (hi - lo) * es);
    }
  }
  // the next launch takes the buffer this launch's last round did not
  if (nr > 1 && threadIdx.x == 0) c.hdr->h.launches[blockIdx.x] += (u64)(nr - 1);
}

// allreduce one-shot (MODE_ONESHOT; two-shot: twoshot_kernel above), reduce_scatter(v)
// (MODE_SCATTER) and reduce (MODE_ROOT). The launch covers N slices; slice q: P_A[q] element offset in `in`, P_B[q]
// elements, P_C[q] element offset in the data buffers (pack-aligned), P_D[q] element offset in
// `out`.
template <typename K, int OP, int N>
__global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS) reduce_kernel(const Params p) {
  typedef typename K::S S;
  __shared__ i64 sh_off[MAX_RANKS], sh_len[MAX_RANKS], sh_exp[MAX_RANKS];
  const Ctx c = make_ctx(p);
  const int par = next_parity(c);
  const int rank = c.rank, mode = (int)p.v[P_MODE], root = (int)p.v[P_ROOT];
  u64 sig[SIG_WORDS];
  read_sig(p, sig);
  const char* in = (const char*)p.v[P_IN];
  char* out = (char*)p.v[P_OUT];
  const i64 es = sizeof(S);
  char* bufs[N];
_Pragma("unroll")
  for (int r = 0; r < N; r++) bufs[r] = data_of(c, p, r, par);
  // Stage what the peers will read: every slice, or every slice but the one this rank reduces
  // itself (it reads its own contribution from `in`).
  if (!(mode == MODE_ROOT && rank == root)) {
    for (int q = 0; q < N; q++)
      if (!(mode == MODE_SCATTER && q == rank))
        stage_at(bufs[rank], p.v[P_C + q] * es, in + p.v[P_A + q] * es, p.v[P_B + q] * es);
  }
  if (!barrier<N>(c, sig, 0, -1, -1, sh_off, sh_len, sh_exp)) return;
  char* none[N];
_Pragma("unroll")
  for (int r = 0; r < N; r++) none[r] = 0;
  for (int q = 0; q < N; q++) {
    if (!(mode == MODE_ONESHOT || (mode == MODE_ROOT && rank == root) ||
          (mode == MODE_SCATTER && q == rank)))
      continue;
    const i64 w = p.v[P_C + q] * es;
    const char* own = in + p.v[P_A + q] * es;
    char* dst = out + p.v[P_D + q] * es;
    const char* src[N];
_Pragma("unroll")
    for (int r = 0; r < N; r++) src[r] = (r == rank) ? own - w : bufs[r];
    reduce_slice<K, OP, N>(src, dst, none, 0, w, p.v[P_B + q], (((u64)own | (u64)dst) & 15) == 0);
  }
}

// Data movement (allgatherv, gatherv, scatterv, alltoallv, broadcast). Staging: with
// P_MODE == XMODE_SHARED the P_STAGE bytes at in + P_STAGEOFF go to buffer offset 0 (every
// destination reads the same bytes); with XMODE_EACH destination d's P_B[d] bytes at
// in + P_E[d] go to buffer offset P_A[d]. Each rank posts (P_A[d], P_B[d]) to d and expects
// P_D[s] bytes from s, which it copies to out + P_C[s]. All offsets in bytes.
template <int N>
__global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS) exchange_kernel(const Params p) {
  __shared__ i64 sh_off[MAX_RANKS], sh_len[MAX_RANKS], sh_exp[MAX_RANKS];
  __shared__ int sh_bad;
  const Ctx c = make_ctx(p);
  const int par = next_parity(c);
  const char* in = (const char*)p.v[P_IN];
  char* out = (char*)p.v[P_OUT];
  char* mine = data_of(c, p, c.rank, par);
  if (p.v[P_MODE] == XMODE_SHARED) {
    stage_at(mine, 0, in + p.v[P_STAGEOFF], p.v[P_STAGE]);
  } else {
    for (int d = 0; d < N; d++)
      if (p.v[P_B + d] > 0) stage_at(mine, p.v[P_A + d], in + p.v[P_E + d], p.v[P_B + d]);
  }
  u64 sig[SIG_WORDS];
  read_sig(p, sig);
  i64 send_off = 0, send_len = -1, expect = -1;
  if (threadIdx.x < N) {
    send_off = p.v[P_A + threadIdx.x];
    send_len = p.v[P_B + threadIdx.x];
    expect = p.v[P_D + threadIdx.x];
  }
  if (!barrier<N>(c, sig, send_off, send_len, expect, sh_off, sh_len, sh_exp)) return;
  // Both ends of every pair compare what one sends with what the other expects, in every
  // block, so both ranks of a disagreeing pair stop, in all their blocks.
  if (threadIdx.x == 0) sh_bad = 0;
  __syncthreads();
  if (threadIdx.x < N) {
    const int s = threadIdx.x;
    const i64 got = sh_len[s] > 0 ? sh_len[s] : 0, want = expect > 0 ? expect : 0;
    const i64 sent = send_len > 0 ? send_len : 0, taken = sh_exp[s] > 0 ? sh_exp[s] : 0;
    if (got != want || sent != taken) {
      if (blockIdx.x == 0) {
        if (got != want) record_error(c, ERR_RECV, s, 0, sig, 0, want, got);
        else record_error(c, ERR_SEND, s, 0, sig, 0, taken, sent);
      }
      sh_bad = 1;
    }
  }
  __syncthreads();
  if (sh_bad) return;
  for (int s = 0; s < N; s++) {
    const i64 len = p.v[P_D + s];
    if (len > 0) fetch_at(out + p.v[P_C + s], data_of(c, p, s, par), sh_off[s], len);
  }
}

// ---------------------------------------------------------------- point-to-point

// Messages between two ranks run through the receiver's inbox for the sender: P2P_SLOTS slots
// of P2P_CHUNK_AT bytes in the receiver's workspace at P2P_INBOX_AT. A message is cut in chunks
// (one chunk when empty); each block moves its own packs of each chunk (the same block index on
// both ranks, as the collectives do) and keeps its own stream of chunks per peer and direction:
// the sender posts its g-th chunk in slot g % P2P_SLOTS with a release store of seq = g + 1
// (after the tag and size), once the receiver acknowledged chunk g - P2P_SLOTS; the receiver
// waits for that seq, checks the tag and size on the message's first chunk, copies the chunk
// out and acknowledges g + 1 into the sender's header. So up to P2P_SLOTS chunks are sent before
// the receiver arrives, and the messages between two ranks match in the order sent.
//
// A send larger than that whose buffer the receiver has mapped (registry.py; the host decides,
// plan.p2p refuses it for smaller messages) goes in place instead: each of its blocks posts one
// chunk that names the registration and offset instead of carrying bytes, the receiver's blocks
// copy the whole message straight from the sender's buffer (each byte crosses memory once) and
// acknowledge it, and the send ends only then (the sender's buffer is read until that ack). The
// receiver learns which way a message comes from its first post, so it needs no notice.
//
// One launch runs a group of up to P2P_MAX_OPS sends and receives (op i: P2P_OPS_AT + 3 i:
// peer | direction << 8 | registration << 16 | tag << 32, then the pointer, or with a
// registration the byte offset in it, then the bytes) and moves whichever is ready, so a group
// that sends to and receives from the same peers (sendrecv, a batch of isend/irecv) cannot
// deadlock on the slots. The ops of one peer and direction (a lane) run in the order given.

struct P2PParams { i64 v[P2P_NPARAM]; };

// Chunks of a message of `nbytes` in which block `blk` takes part: block 0 in every chunk (it
// carries the empty message's header), the others in those whose bytes reach their first pack.
__device__ __forceinline__ i64 block_chunks(i64 nbytes, i64 chunk, int blk) {
  const i64 n = nbytes > 0 ? (nbytes + chunk - 1) / chunk : 1;
  if (blk == 0) return n;
  const i64 first = (i64)blk * blockDim.x * PACK;
  if (first >= chunk) return 0;
  const i64 last = nbytes - (n - 1) * chunk;
  return last > first ? n : n - 1;
}

// The blocks that take part in a message read in place: those that take part in a message of
// more than one chunk (their first pack lies in the chunk).
__device__ __forceinline__ int inplace_blocks(i64 chunk) {
  const i64 per = (i64)blockDim.x * PACK;
  return (int)min((i64)gridDim.x, (chunk + per - 1) / per);
}

// Copy n bytes with the threads of the grid's first `nb` blocks, 16-byte packs strided over
// them, four loads in flight a thread where both sides are 16-byte aligned.
__device__ void copy_spread(char* dst, const char* src, i64 n, int nb) {
  if ((int)blockIdx.x >= nb) return;
  const i64 stride = (i64)nb * blockDim.x, t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 packs = n >> 4;
  if (((u64)dst | (u64)src) % 16 == 0) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    i64 k = t;
    for (; k + 3 * stride < packs; k += 4 * stride) {
      const uint4 a = s[k], b = s[k + stride], e = s[k + 2 * stride], f = s[k + 3 * stride];
      d[k] = a;
      d[k + stride] = b;
      d[k + 2 * stride] = e;
      d[k + 3 * stride] = f;
    }
    for (; k < packs; k += stride) d[k] = s[k];
  } else {
    for (i64 k = t; k < packs; k += stride) copy_small(dst + 16 * k, src + 16 * k, 16);
  }
  if ((n & 15) && t == packs % stride) copy_small(dst + 16 * packs, src + 16 * packs, (int)(n & 15));
}

struct Op {
  int peer, dir, lane, reg;
  i64 tag, ptr, nbytes;  // with reg (a send read in place), ptr is the offset in the registration
};

__device__ __forceinline__ Op op_at(const P2PParams& p, int i) {
  const u64 w = (u64)p.v[P2P_OPS_AT + 3 * i];
  Op o;
  o.peer = (int)(w & 0xff);
  o.dir = (int)((w >> 8) & 0xff);
  o.reg = (int)((w >> 16) & 0xffff);
  o.lane = o.peer * 2 + (o.dir == P2P_SEND);
  o.tag = (i64)(int)(u32)(w >> 32);
  o.ptr = p.v[P2P_OPS_AT + 3 * i + 1];
  o.nbytes = p.v[P2P_OPS_AT + 3 * i + 2];
  return o;
}

// The signature words of an op, for the error record (plan.describe reads them).
__device__ void op_sig(const Op& o, u64* sig) {
  sig[0] = ((u64)(o.dir == P2P_SEND ? CALL_SEND : CALL_RECV) << 56) | (u64)((o.peer + 1) & 0xffff);
  sig[1] = (u64)o.nbytes;
  sig[2] = (u64)o.tag;
  sig[3] = 0;
}

#define OP_NEW -2   // sh_total: the op has not started in this block
#define OP_OPEN -1  // sh_total: a receive whose first chunk (which says how it comes) is awaited

__global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS) p2p_kernel(const P2PParams p) {
  __shared__ i64 sh_base[P2P_MAX_OPS];  // this block's chunk number of the op's first chunk
  __shared__ int sh_done[P2P_MAX_OPS], sh_total[P2P_MAX_OPS];
  __shared__ unsigned char sh_fin[P2P_MAX_OPS];  // finished (a send in place: read, acked)
  __shared__ unsigned char sh_inplace[P2P_MAX_OPS];  // a receive read from the sender's buffer
  __shared__ i64 sh_next[2 * MAX_RANKS];  // per lane: the chunk number of its next op
  __shared__ short sh_go[P2P_MAX_OPS];  // the ops whose next chunks move now
  __shared__ short sh_cnt[P2P_MAX_OPS];  // how many chunks each moves (all its slots allow)
  __shared__ const char* sh_src[P2P_MAX_OPS];  // per go: the sender's buffer of a read in place
  __shared__ int sh_ngo, sh_first;
  __shared__ int sh_state;  // 0: chunks to move, 1: every op finished, 2: failed
  const Ctx c = make_ctx(p);
  const int nops = (int)p.v[P2P_NOPS_AT], blk = blockIdx.x;
  const i64 chunk = p.v[P2P_CHUNK_AT], inbox = p.v[P2P_INBOX_AT];
  if (threadIdx.x == 0) {
    for (int l = 0; l < 2 * MAX_RANKS; l++)
      sh_next[l] = (i64)((l & 1) ? c.hdr->p2p_sent[l >> 1][blk] : c.hdr->p2p_taken[l >> 1][blk]);
    for (int i = 0; i < nops; i++) {
      sh_done[i] = 0;
      sh_total[i] = OP_NEW;
      sh_fin[i] = 0;
      sh_inplace[i] = 0;
    }
    sh_first = 0;
  }
  __syncthreads();
  u32 spins = 0;
  for (;;) {
    if (threadIdx.x == 0) {
      int state = 0, ngo = 0;
      for (;;) {
        u32 seen = 0;  // lanes whose first unfinished op was met
        int waiting = -1;
        bool moved = false;  // a send in place finished: its lane may go on at once
        while (sh_first < nops && sh_fin[sh_first]) sh_first++;
        for (int i = sh_first; i < nops; i++) {
          if (sh_fin[i]) continue;
          const Op o = op_at(p, i);
          if (seen & (1u << o.lane)) continue;
          if (sh_total[i] == OP_NEW) {  // the lane's first unfinished op starts at its next chunk
            const i64 bc = block_chunks(o.nbytes, chunk, blk);
            sh_base[i] = sh_next[o.lane];
            sh_total[i] = o.dir == P2P_SEND ? (int)(o.reg ? (bc > 0) : bc) : (bc > 0 ? OP_OPEN : 0);
            if (sh_total[i] >= 0) sh_next[o.lane] += sh_total[i];
            if (sh_total[i] == 0) {
              sh_fin[i] = 1;
              continue;
            }
          }
          seen |= 1u << o.lane;
          if (waiting < 0) waiting = i;
          const u64 g = (u64)(sh_base[i] + sh_done[i]);
          if (o.dir == P2P_SEND) {
            const u64 acked = ld_acquire(&c.hdr->p2p_acked[o.peer][blk]);
            if (sh_done[i] >= sh_total[i]) {  // posted in place: done once the receiver read it
              if (acked >= g) {
                sh_fin[i] = 1;
                moved = true;
                seen &= ~(1u << o.lane);
                if (waiting == i) waiting = -1;
              }
              continue;
            }
            const i64 room = (i64)(acked + P2P_SLOTS - g);
            if (room > 0) {
              sh_cnt[ngo] = (short)min(room, (i64)min(P2P_SLOTS, sh_total[i] - sh_done[i]));
              sh_go[ngo++] = (short)i;
            }
            continue;
          }
          const Post* post = &c.hdr->p2p_posts[o.peer][blk][g % P2P_SLOTS];
          if (ld_acquire(&post->seq) != g + 1) continue;
          if (sh_done[i] == 0) {
            const i64 got_tag = post->tag, got = post->nbytes;
            if (got != o.nbytes || (o.tag >= 0 && got_tag != o.tag)) {
              u64 mine[SIG_WORDS], theirs[SIG_WORDS] = {0, 0, 0, 0};
              op_sig(o, mine);
              theirs[0] = ((u64)CALL_SEND << 56) | (u64)((c.rank + 1) & 0xffff);
              theirs[1] = (u64)got;
              theirs[2] = (u64)got_tag;
              record_error(c, ERR_MESSAGE, o.peer, g, mine, theirs, o.nbytes, got);
              state = 2;
              break;
            }
            if (sh_total[i] == OP_OPEN) {  // the first post says how the message comes
              sh_inplace[i] = post->reg > 0;
              sh_total[i] = sh_inplace[i] ? 1 : (int)block_chunks(o.nbytes, chunk, blk);
              sh_next[o.lane] += sh_total[i];
            }
          }
          i64 n = 1;  // the chunks after the first that are posted too
          if (sh_inplace[i]) {
            sh_src[ngo] = (const char*)c.hdr->regs[o.peer][post->reg - 1] + post->off;
          } else {
            const i64 most = min((i64)P2P_SLOTS, (i64)(sh_total[i] - sh_done[i]));
            while (n < most && ld_acquire(&c.hdr->p2p_posts[o.peer][blk][(g + n) % P2P_SLOTS].seq) == g + n + 1)
              n++;
          }
          sh_cnt[ngo] = (short)n;
          sh_go[ngo++] = (short)i;
        }
        if (state != 0 || ngo > 0) break;
        if (moved) continue;
        if (waiting < 0) { state = 1; break; }
        u64 sig[SIG_WORDS];
        const Op w = op_at(p, waiting);
        op_sig(w, sig);
        if (ld_volatile32(&c.hdr->h.abort)) {
          record_error(c, ERR_ABORTED, w.peer, 0, sig, 0, 0, 0);
          state = 2;
          break;
        }
        if ((++spins & 255u) == 0) {
          if (*(volatile u32*)&c.err->host_abort) {
            record_error(c, ERR_HOST, w.peer, 0, sig, 0, 0, 0);
            state = 2;
            break;
          }
          if (globaltimer() > c.deadline_ns) {
            record_error(c, ERR_TIMEOUT, w.peer, 0, sig, 0, (i64)c.timeout_ns, 0);
            state = 2;
            break;
          }
        }
      }
      sh_state = state;
      sh_ngo = ngo;
    }
    __syncthreads();
    if (sh_state != 0) break;
    for (int k = 0; k < sh_ngo; k++) {
      const int i = sh_go[k];
      const Op o = op_at(p, i);
      if (o.dir == P2P_SEND && o.reg) continue;  // posted only: the receiver reads it in place
      if (o.dir == P2P_RECV && sh_inplace[i]) {
        copy_spread((char*)o.ptr, sh_src[k], o.nbytes, inplace_blocks(chunk));
        continue;
      }
      for (int j = 0; j < sh_cnt[k]; j++) {
        const i64 lo = (i64)(sh_done[i] + j) * chunk, rest = o.nbytes - lo;
        const i64 cb = rest < chunk ? (rest > 0 ? rest : 0) : chunk;
        const i64 slot = (i64)((u64)(sh_base[i] + sh_done[i] + j) % P2P_SLOTS);
        if (o.dir == P2P_SEND) {
          char* box = (char*)c.hdr->h.peers[o.peer] + inbox + ((i64)c.rank * P2P_SLOTS + slot) * chunk;
          const char* src = (const char*)o.ptr + lo;
          FOR_PACKS(0, cb, a, b, { copy_small(box + a, src + a, (int)(b - a)); })
        } else {
          const char* box = (const char*)c.hdr + inbox + ((i64)o.peer * P2P_SLOTS + slot) * chunk;
          char* dst = (char*)o.ptr + lo;
          FOR_PACKS(0, cb, a, b, { copy_small(dst + a, box + a, (int)(b - a)); })
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 0; k < sh_ngo; k++) {
        const int i = sh_go[k];
        const Op o = op_at(p, i);
        const u64 g = (u64)(sh_base[i] + sh_done[i]);
        const int n = sh_cnt[k];
        Header* ph = (Header*)c.hdr->h.peers[o.peer];
        if (o.dir == P2P_SEND) {
          for (int j = 0; j < n; j++) {
            Post* post = &ph->p2p_posts[c.rank][blk][(g + j) % P2P_SLOTS];
            post->tag = (int)o.tag;
            post->reg = o.reg;
            post->nbytes = o.nbytes;
            post->off = o.reg ? o.ptr : 0;
            st_release(&post->seq, g + j + 1);
          }
        } else {
          st_release(&ph->p2p_acked[c.rank][blk], g + n);
        }
        sh_done[i] += n;
        // a send in place stays open until its receiver acknowledges the read
        if (sh_done[i] >= sh_total[i] && !(o.dir == P2P_SEND && o.reg)) sh_fin[i] = 1;
      }
    }
  }
  if (sh_state == 1 && threadIdx.x == 0) {
    for (int l = 0; l < 2 * MAX_RANKS; l++) {
      if (l & 1) c.hdr->p2p_sent[l >> 1][blk] = (u64)sh_next[l];
      else c.hdr->p2p_taken[l >> 1][blk] = (u64)sh_next[l];
    }
  }
}
