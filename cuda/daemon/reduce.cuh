// Block-wide copy and reduction: dsts[*] = op(srcs[0], ..., srcs[n-1]) [/ div].
//
// One entry point, reduce_copy(), dispatches on (dtype, op) at run time so that
// one daemon kernel serves every collective (no template per collective).
// Integers wrap like their storage type (sums and products are done in
// unsigned arithmetic); float16/bfloat16 accumulate in float32 across the
// sources of one call and round once.
#pragma once

#include "arch.cuh"
#include "dfccl/layout.h"

namespace dfccl {

template <int S> struct unsigned_of;
template <> struct unsigned_of<1> { using type = uint8_t; };
template <> struct unsigned_of<2> { using type = uint16_t; };
template <> struct unsigned_of<4> { using type = uint32_t; };
template <> struct unsigned_of<8> { using type = uint64_t; };

// ---- element traits: T storage, A accumulator ---------------------------------
template <typename T_>
struct IntTraits {
  using T = T_;
  using A = T_;
  using U = typename unsigned_of<sizeof(T_)>::type;
  DFCCL_DEV static A load(T v) { return v; }
  DFCCL_DEV static T store(A v) { return v; }
  DFCCL_DEV static A add(A x, A y) { return (A)(U)((U)x + (U)y); }
  DFCCL_DEV static A mul(A x, A y) {
    // Through unsigned long long: 8-bit operands would otherwise promote to a
    // signed int whose product can overflow.
    return (A)(U)((unsigned long long)(U)x * (unsigned long long)(U)y);
  }
  DFCCL_DEV static A div(A x, uint32_t n) { return (A)(x / (A)n); }
};

template <typename T_>
struct FloatTraits {
  using T = T_;
  using A = T_;
  DFCCL_DEV static A load(T v) { return v; }
  DFCCL_DEV static T store(A v) { return v; }
  DFCCL_DEV static A add(A x, A y) { return x + y; }
  DFCCL_DEV static A mul(A x, A y) { return x * y; }
  DFCCL_DEV static A div(A x, uint32_t n) { return x / (A)n; }
};

// float16 / bfloat16 bit conversions.  The GPU uses the cvt instructions; the
// simulator the same round-to-nearest-even in integer arithmetic.
DFCCL_DEV float half_to_float(uint16_t h) {
#if DFCCL_GPU
  float f;
  asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
  return f;
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

DFCCL_DEV uint16_t float_to_half(float f) {
#if DFCCL_GPU
  uint16_t h;
  asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
  return h;
#else
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to inf
  if (absx < 0x38800000u) {                                     // subnormal or zero
    if (absx < 0x33000000u) return (uint16_t)sign;              // below half of min subnormal
    uint32_t e = absx >> 23;
    uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // 14 + (113 - e) ... places the value in units of 2^-24
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return (uint16_t)(sign | q);
  }
  uint32_t q = ((absx >> 13) - (112u << 10));
  uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
  return (uint16_t)(sign | q);
#endif
}

DFCCL_DEV float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
#if DFCCL_GPU
  f = __uint_as_float(bits);
#else
  memcpy(&f, &bits, 4);
#endif
  return f;
}

DFCCL_DEV uint16_t float_to_bf16(float f) {
#if DFCCL_GPU && __CUDA_ARCH__ >= 800
  uint16_t h;
  asm("{ .reg .b16 t; cvt.rn.bf16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
  return h;
#else
  uint32_t x;
#if DFCCL_GPU
  x = __float_as_uint(f);
#else
  memcpy(&x, &f, 4);
#endif
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
#endif
}

struct HalfTraits {
  using T = uint16_t;
  using A = float;
  DFCCL_DEV static A load(T v) { return half_to_float(v); }
  DFCCL_DEV static T store(A v) { return float_to_half(v); }
  DFCCL_DEV static A add(A x, A y) { return x + y; }
  DFCCL_DEV static A mul(A x, A y) { return x * y; }
  DFCCL_DEV static A div(A x, uint32_t n) { return x / (A)n; }
};

struct BFloatTraits {
  using T = uint16_t;
  using A = float;
  DFCCL_DEV static A load(T v) { return bf16_to_float(v); }
  DFCCL_DEV static T store(A v) { return float_to_bf16(v); }
  DFCCL_DEV static A add(A x, A y) { return x + y; }
  DFCCL_DEV static A mul(A x, A y) { return x * y; }
  DFCCL_DEV static A div(A x, uint32_t n) { return x / (A)n; }
};

template <class Tr, int OP>
DFCCL_DEV typename Tr::A combine(typename Tr::A x, typename Tr::A y) {
  if constexpr (OP == DFCCL_SUM || OP == DFCCL_AVG) {
    return Tr::add(x, y);
  } else if constexpr (OP == DFCCL_PROD) {
    return Tr::mul(x, y);
  } else if constexpr (OP == DFCCL_MIN) {
    return y < x ? y : x;
  } else {
    return y > x ? y : x;
  }
}

// ---- the block-wide loop -------------------------------------------------------
// Arguments of one reduce_copy call.  srcs/dsts hold addresses; on the GPU the
// arrays sit in shared memory so that every thread of the block reads them.
struct ReduceCopyArgs {
  const uint64_t *srcs;
  const uint64_t *dsts;
  uint32_t nsrcs;    // 1 = plain copy
  uint32_t ndsts;    // 1 or 2 (ring steps write the output and the next FIFO)
  uint64_t nelem;
  uint32_t postdiv;  // >1: divide the result by it (AVG)
};

// Packs in flight per thread: four, fewer for narrow types so that the
// accumulators stay within ~32 registers.
template <int N>
struct Unroll {
  static constexpr int value = N <= 8 ? 4 : 2;
};

// U packs of every source in flight per thread, accumulated in registers,
// written to every destination.
template <class Tr, int OP, int U>
DFCCL_DEV void reduce_packs(const ReduceCopyArgs &a, uint64_t i, uint64_t stride) {
  using T = typename Tr::T;
  using A = typename Tr::A;
  constexpr int N = 16 / sizeof(T);
  union P {
    pack16 p;
    T e[N];
  };
  A acc[U][N];
  {
    P v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u].p = load_pack(ptr<const pack16>(a.srcs[0]) + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < N; ++k) acc[u][k] = Tr::load(v[u].e[k]);
  }
  for (uint32_t s = 1; s < a.nsrcs; ++s) {
    P v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u].p = load_pack(ptr<const pack16>(a.srcs[s]) + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < N; ++k) acc[u][k] = combine<Tr, OP>(acc[u][k], Tr::load(v[u].e[k]));
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    P out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      A r = acc[u][k];
      if (OP == DFCCL_AVG && a.postdiv > 1) r = Tr::div(r, a.postdiv);
      out.e[k] = Tr::store(r);
    }
    for (uint32_t d = 0; d < a.ndsts; ++d) store_pack(ptr<pack16>(a.dsts[d]) + i + u * stride, out.p);
  }
}

template <class Tr, int OP>
DFCCL_NOINLINE void reduce_copy_typed(const ReduceCopyArgs &a) {
  using T = typename Tr::T;
  using A = typename Tr::A;
  constexpr int N = 16 / sizeof(T);
  constexpr int U = Unroll<N>::value;
  const uint64_t tid = (uint64_t)mover_index();
  const uint64_t nth = (uint64_t)mover_count();

  bool aligned = true;
  for (uint32_t s = 0; s < a.nsrcs; ++s) aligned &= (a.srcs[s] & 15u) == 0;
  for (uint32_t d = 0; d < a.ndsts; ++d) aligned &= (a.dsts[d] & 15u) == 0;

  uint64_t done = 0;
  if (aligned) {
    const uint64_t npacks = a.nelem / N;
    uint64_t i = tid;
    for (; i + (U - 1) * nth < npacks; i += U * nth) reduce_packs<Tr, OP, U>(a, i, nth);
    for (; i < npacks; i += nth) reduce_packs<Tr, OP, 1>(a, i, nth);
    done = npacks * N;
  }
  // Unaligned buffers and the tail: one element per thread per iteration.
  for (uint64_t i = done + tid; i < a.nelem; i += nth) {
    A acc = Tr::load(load_elem(ptr<const T>(a.srcs[0]) + i));
    for (uint32_t s = 1; s < a.nsrcs; ++s) acc = combine<Tr, OP>(acc, Tr::load(load_elem(ptr<const T>(a.srcs[s]) + i)));
    if (OP == DFCCL_AVG && a.postdiv > 1) acc = Tr::div(acc, a.postdiv);
    T out = Tr::store(acc);
    for (uint32_t d = 0; d < a.ndsts; ++d) ptr<T>(a.dsts[d])[i] = out;
  }
}

// Runs Kernel<Traits, OP>::run(arg) for the run-time (dtype, op): the one
// place where a reduction's types are chosen.  (A class template rather
// than a generic lambda: closures passed by reference cost stack frames.)
template <template <class, int> class Kernel, class Tr, class Arg>
DFCCL_DEV void dispatch_op(int op, Arg arg) {
  switch (op) {
    case DFCCL_SUM: Kernel<Tr, DFCCL_SUM>::run(arg); break;
    case DFCCL_PROD: Kernel<Tr, DFCCL_PROD>::run(arg); break;
    case DFCCL_MIN: Kernel<Tr, DFCCL_MIN>::run(arg); break;
    case DFCCL_MAX: Kernel<Tr, DFCCL_MAX>::run(arg); break;
    default: Kernel<Tr, DFCCL_AVG>::run(arg); break;
  }
}

template <template <class, int> class Kernel, class Arg>
DFCCL_DEV void dispatch_reduce(int dtype, int op, Arg arg) {
  switch (dtype) {
    case DFCCL_INT8: dispatch_op<Kernel, IntTraits<int8_t>>(op, arg); break;
    case DFCCL_UINT8: dispatch_op<Kernel, IntTraits<uint8_t>>(op, arg); break;
    case DFCCL_INT32: dispatch_op<Kernel, IntTraits<int32_t>>(op, arg); break;
    case DFCCL_UINT32: dispatch_op<Kernel, IntTraits<uint32_t>>(op, arg); break;
    case DFCCL_INT64: dispatch_op<Kernel, IntTraits<int64_t>>(op, arg); break;
    case DFCCL_UINT64: dispatch_op<Kernel, IntTraits<uint64_t>>(op, arg); break;
    case DFCCL_FLOAT16: dispatch_op<Kernel, HalfTraits>(op, arg); break;
    case DFCCL_FLOAT32: dispatch_op<Kernel, FloatTraits<float>>(op, arg); break;
    case DFCCL_FLOAT64: dispatch_op<Kernel, FloatTraits<double>>(op, arg); break;
    default: dispatch_op<Kernel, BFloatTraits>(op, arg); break;
  }
}

// Copies are type-agnostic byte moves: 16-byte packs, kCopyUnroll in flight
// per thread, to one or two destinations.
constexpr int kCopyUnroll = 8;

template <int U>
DFCCL_DEV void copy_packs(const ReduceCopyArgs &a, uint64_t i, uint64_t stride) {
  pack16 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = load_pack(ptr<const pack16>(a.srcs[0]) + i + u * stride);
  for (uint32_t d = 0; d < a.ndsts; ++d)
#pragma unroll
    for (int u = 0; u < U; ++u) store_pack(ptr<pack16>(a.dsts[d]) + i + u * stride, v[u]);
}

DFCCL_NOINLINE void block_copy(const ReduceCopyArgs &a) {
  const uint64_t tid = (uint64_t)mover_index();
  const uint64_t nth = (uint64_t)mover_count();
  const uint64_t src = a.srcs[0];
  bool aligned = (src & 15u) == 0;
  for (uint32_t d = 0; d < a.ndsts; ++d) aligned &= (a.dsts[d] & 15u) == 0;
  uint64_t done = 0;
  if (aligned) {
    const uint64_t npacks = a.nelem / 16;
    uint64_t i = tid;
    for (; i + (kCopyUnroll - 1) * nth < npacks; i += kCopyUnroll * nth) copy_packs<kCopyUnroll>(a, i, nth);
    for (; i < npacks; i += nth) copy_packs<1>(a, i, nth);
    done = npacks * 16;
  }
  for (uint64_t i = done + tid; i < a.nelem; i += nth) {
    uint8_t b = load_elem(ptr<const uint8_t>(src) + i);
    for (uint32_t d = 0; d < a.ndsts; ++d) ptr<uint8_t>(a.dsts[d])[i] = b;
  }
}

template <class Tr, int OP>
struct ReduceCopyKernel {
  DFCCL_DEV static void run(const ReduceCopyArgs *a) { reduce_copy_typed<Tr, OP>(*a); }
};

DFCCL_DEV uint32_t dtype_size(int dtype) { return dfccl_dtype_size(dtype); }

// dsts = op(srcs) over nelem elements of dtype; a single source with nothing
// to divide is a byte copy.  Run by the mover threads of a block.
DFCCL_DEV void reduce_copy(int dtype, int op, const ReduceCopyArgs &a) {
  if (a.nsrcs == 1 && a.postdiv <= 1) {
    ReduceCopyArgs b = a;
    b.nelem = a.nelem * dtype_size(dtype);
    block_copy(b);
    return;
  }
  dispatch_reduce<ReduceCopyKernel>(dtype, op, &a);
}

}  // namespace dfccl
