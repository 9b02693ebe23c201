// LogFMT-10: the optional transport format of the low-latency combine (`use_logfmt=True`).
//
// The format is DeepEP V1's (csrc/kernels/internode_ll.cu, logfmt_encode / logfmt_check_amaxmin /
// decode_and_accumulate); this is an independent implementation with its own wire layout.
//
// Per 128-channel block (one "division"):
//   meta (4 bytes, stored apart from the data): bits 0..14 = amax, bits 16..30 = amin, as BF16
//     bit patterns of max|x| / min|x| over the block (NaNs ignored; zeros count, so amin may be 0);
//     bit 15 (the always-zero sign bit of amax) = 1 when the block is log-encoded.
//   A block may be log-encoded iff amax < 1 (DeepEP: log2(amax) < 0) and amin < amax
//     (DeepEP: log_amin < log_amax). DeepEP V1 additionally ANDs this over one warp's TMA chunk,
//     8 blocks if H % 1024 == 0 else 4 (tests/gpu/logfmt_reference.deepep_decision_blocks);
//     logfmt_encode_regs takes the final decision.
//   Not log-encoded: 256 data bytes = the 128 BF16 values, unchanged (bit-exact round trip).
//   Log-encoded: 160 data bytes (the other 96 bytes of the 256-byte slot are not written):
//     log_amax = log2(amax); log_amin = amin == 0 ? log_amax - 32 : max(log2(amin), log_amax - 32)
//     step = (log_amax - log_amin) / 510
//     code(x) = 0 for x == 0 (or NaN), else floor(max(log2|x| / step + R - log_amin / step, 0))
//       clamped to 511, with R = 2 - log2((1 + 2^step) / 2) / step: rounding to the nearest
//       reconstruction in the linear domain (amin -> code 1, amax -> code 511).
//     decode: code 0 -> 0, else 2^((code - 1) * step + log_amin); the sign bit restores the sign.
//     Bytes [0, 128): byte c = the low 8 bits of code(channel c).
//     Bytes [128, 160): 16 little-endian u16 words; word g covers channels 8g..8g+7:
//       bit i = bit 8 of code(8g + i), bit 8 + i = sign bit of channel 8g + i.
//
// Arithmetic (float32, every operation IEEE round-to-nearest, never fused):
//   log2 of a BF16 magnitude = float(e) + T[j] (x = 2^e (1 + j/128), T = correctly rounded table);
//   step = (log_amax - log_amin) / 510; step_inv = 1 / step;
//   bias = (2 - det_log2((1 + det_exp2(step)) * 0.5) * step_inv) - log_amin * step_inv;
//   code = min(floor(log2|x| * step_inv + bias), 511) if that is >= 1, else 0;
//   value = det_exp2((code - 1) * step + log_amin).
// det_log2 / det_exp2 are short polynomials after exact range reduction (<= 1.8 / 1.1 ulp).
// DeepEP evaluates the same formulas with the MUFU approximations lg2.approx / ex2.approx and
// nvcc-fused multiply-adds, which no host or torch code reproduces bit for bit; this version is
// reproduced exactly by tests/gpu/logfmt_reference.py (CPU or CUDA tensors). Against DeepEP's
// own arithmetic the reconstructed values agree to ~1e-6 relative, and a code differs (by one
// step) only for channels within ~1e-5 step of a rounding boundary (~3e-5 of channels on
// randn * 0.1 data). No shared memory; the only table is 512 B in global memory (L1-resident).
//
// Work split. A half-warp (16 lanes, lane16 = lane & 15) handles one block; lane16 holds channels
// [8 * lane16, 8 * lane16 + 8) as an int4 of 8 BF16. Both half-warps of a warp may work on
// different blocks at the same time (all shuffles use the half-warp mask and width 16).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace deepep {
namespace ll {

constexpr int kLogfmtBlockChannels = 128;
constexpr int kLogfmtSlotBytes = 256;       // data bytes reserved per block (BF16 size)
constexpr int kLogfmtLogBytes = 160;        // data bytes written for a log-encoded block
constexpr int kLogfmtMetaBytes = 4;         // meta bytes per block (stored in a separate area)
constexpr int kLogfmtCodeBits = 9;          // magnitude code bits (plus one sign bit)
constexpr int kLogfmtMaxCode = 511;
constexpr uint32_t kLogfmtLogFlag = 0x8000u;  // meta bit 15: block is log-encoded
constexpr int kLogfmtStoreLanes = kLogfmtLogBytes / 16;  // lanes that store 16 B in the log form



// ------------------------------------------------------------------ deterministic scalar math
namespace logfmt_detail {

__host__ __device__ __forceinline__ float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}
__host__ __device__ __forceinline__ uint32_t f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}
// IEEE round-to-nearest operations that are never fused into FMAs (host: through a volatile, so
// a host build reproduces the device bit for bit whatever -ffp-contract says).
__host__ __device__ __forceinline__ float fmul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}
__host__ __device__ __forceinline__ float fadd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}
__host__ __device__ __forceinline__ float fsub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  volatile float r = a - b;
  return r;
#endif
}
__host__ __device__ __forceinline__ float fdiv(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  volatile float r = a / b;
  return r;
#endif
}

// log2(x) for finite x > 0 (normal or subnormal); used only for log2((1 + 2^step) / 2), the
// rounding offset (BF16 magnitudes use log2_bf16 below). x = 2^e * m with m in [sqrt(2)/2, sqrt(2)]
// (exact), s = (m - 1) / (m + 1), log2(m) = s * P(s^2), P = the atanh series (2/ln2) *
// (1 + s^2/3 + s^4/5 + s^6/7 + s^8/9), truncation < 3e-9 relative since s^2 <= 0.0295.
__host__ __device__ __forceinline__ float det_log2(float x) {
  const bool sub = x < 0x1p-126f;
  const uint32_t b = f2u(sub ? fmul(x, 0x1p24f) : x);
  int e = static_cast<int>(b >> 23) - 127 - (sub ? 24 : 0);
  const uint32_t mb = (b & 0x7fffffu) | 0x3f800000u;
  float m = u2f(mb);
  if (mb > 0x3fb504f3u) {  // m > sqrt(2): halve (exact)
    m = fmul(m, 0.5f);
    e += 1;
  }
  const float z = fsub(m, 1.0f);  // exact (Sterbenz)
  const float s = fdiv(z, fadd(m, 1.0f));
  const float s2 = fmul(s, s);
  float q = 0x1.484b14p-2f;
  q = fadd(fmul(q, s2), 0x1.a61762p-2f);
  q = fadd(fmul(q, s2), 0x1.2776c6p-1f);
  q = fadd(fmul(q, s2), 0x1.ec709ep-1f);
  q = fadd(fmul(q, s2), 0x1.715476p+1f);
  return fadd(static_cast<float>(e), fmul(s, q));
}

// 2^y for finite y <= 127. n = rint(y), f = y - n in [-1/2, 1/2] (exact), 2^f by the degree-7
// Taylor polynomial of e^(f ln 2) (truncation < 1e-8 relative), then a scale by 2^n (exact for
// normal results; a subnormal result is rounded once; 0 below 2^-150).
__host__ __device__ __forceinline__ float det_exp2(float y) {
  const float n = rintf(y);
  const float f = fsub(y, n);
  float p = 0x1.ffcbfcp-17f;
  p = fadd(fmul(p, f), 0x1.430912p-13f);
  p = fadd(fmul(p, f), 0x1.5d87fep-10f);
  p = fadd(fmul(p, f), 0x1.3b2ab6p-7f);
  p = fadd(fmul(p, f), 0x1.c6b08ep-5f);
  p = fadd(fmul(p, f), 0x1.ebfbe0p-3f);
  p = fadd(fmul(p, f), 0x1.62e430p-1f);
  p = fadd(fmul(p, f), 1.0f);
  // Branch-free scale: p * A * B, A = 1 (normal result: both products exact) or 2^-24 (subnormal
  // result: exact, then one rounding), B = 2^(n or n + 24), or 0 below 2^-150.
  const int ni = static_cast<int>(n);
  const bool low = ni < -126;
  const float a = low ? 0x1p-24f : 1.0f;
  const float b = ni < -150 ? 0.0f : u2f(static_cast<uint32_t>((low ? ni + 24 : ni) + 127) << 23);
  return fmul(fmul(p, a), b);
}

__host__ __device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return u2f(bits16 << 16); }

// log2(1 + j / 128), j = 0..127, each correctly rounded to float32 (checked against a 60-digit
// evaluation). Every BF16 magnitude is 2^e * (1 + j / 128), so its log2 is e + this table.
#define DEEPEP_LL_LOGFMT_LOG2_TABLE \
    0x0.0p+0f, 0x1.6fe50cp-7f, 0x1.6e7968p-6f, 0x1.11cd1ep-5f, \
    0x1.6bad38p-5f, 0x1.c4dfacp-5f, 0x1.0eb38ap-4f, 0x1.3aa2fep-4f, \
    0x1.663f70p-4f, 0x1.918a16p-4f, 0x1.bc8424p-4f, 0x1.e72ec2p-4f, \
    0x1.08c588p-3f, 0x1.1dcd1ap-3f, 0x1.32ae9ep-3f, 0x1.476aa0p-3f, \
    0x1.5c01a4p-3f, 0x1.70742ep-3f, 0x1.84c2bep-3f, 0x1.98edd0p-3f, \
    0x1.acf5e2p-3f, 0x1.c0db6cp-3f, 0x1.d49ee4p-3f, 0x1.e840bep-3f, \
    0x1.fbc16cp-3f, 0x1.0790aep-2f, 0x1.11307ep-2f, 0x1.1ac05cp-2f, \
    0x1.24407ap-2f, 0x1.2db110p-2f, 0x1.37124cp-2f, 0x1.406464p-2f, \
    0x1.49a784p-2f, 0x1.52dbe0p-2f, 0x1.5c01a4p-2f, 0x1.6518fep-2f, \
    0x1.6e221cp-2f, 0x1.771d2cp-2f, 0x1.800a56p-2f, 0x1.88e9c8p-2f, \
    0x1.91bba8p-2f, 0x1.9a8024p-2f, 0x1.a33760p-2f, 0x1.abe188p-2f, \
    0x1.b47ec0p-2f, 0x1.bd0f2ep-2f, 0x1.c592fap-2f, 0x1.ce0a4ap-2f, \
    0x1.d6753ep-2f, 0x1.ded3fep-2f, 0x1.e726aap-2f, 0x1.ef6d68p-2f, \
    0x1.f7a856p-2f, 0x1.ffd79ap-2f, 0x1.03fda8p-1f, 0x1.0809d0p-1f, \
    0x1.0c1050p-1f, 0x1.10113cp-1f, 0x1.140ca0p-1f, 0x1.18028cp-1f, \
    0x1.1bf312p-1f, 0x1.1fde3ep-1f, 0x1.23c41ep-1f, 0x1.27a4c0p-1f, \
    0x1.2b8034p-1f, 0x1.2f5688p-1f, 0x1.3327c6p-1f, 0x1.36f400p-1f, \
    0x1.3abb40p-1f, 0x1.3e7d94p-1f, 0x1.423b08p-1f, 0x1.45f3aap-1f, \
    0x1.49a784p-1f, 0x1.4d56a6p-1f, 0x1.510118p-1f, 0x1.54a6e8p-1f, \
    0x1.584822p-1f, 0x1.5be4d0p-1f, 0x1.5f7d00p-1f, 0x1.6310b8p-1f, \
    0x1.66a008p-1f, 0x1.6a2afap-1f, 0x1.6db196p-1f, 0x1.7133eap-1f, \
    0x1.74b1fep-1f, 0x1.782bdcp-1f, 0x1.7ba190p-1f, 0x1.7f1322p-1f, \
    0x1.82809ep-1f, 0x1.85ea0cp-1f, 0x1.894f74p-1f, 0x1.8cb0e4p-1f, \
    0x1.900e62p-1f, 0x1.9367f6p-1f, 0x1.96bdaep-1f, 0x1.9a0f8ep-1f, \
    0x1.9d5da0p-1f, 0x1.a0a7eep-1f, 0x1.a3ee80p-1f, 0x1.a7315ep-1f, \
    0x1.aa7090p-1f, 0x1.adac1ep-1f, 0x1.b0e412p-1f, 0x1.b41874p-1f, \
    0x1.b74948p-1f, 0x1.ba769cp-1f, 0x1.bda072p-1f, 0x1.c0c6d4p-1f, \
    0x1.c3e9cap-1f, 0x1.c7095ap-1f, 0x1.ca258ep-1f, 0x1.cd3e6ap-1f, \
    0x1.d053f6p-1f, 0x1.d3663cp-1f, 0x1.d6753ep-1f, 0x1.d98106p-1f, \
    0x1.dc899ap-1f, 0x1.df8f02p-1f, 0x1.e29142p-1f, 0x1.e59064p-1f, \
    0x1.e88c6cp-1f, 0x1.eb8560p-1f, 0x1.ee7b48p-1f, 0x1.f16e28p-1f, \
    0x1.f45e08p-1f, 0x1.f74af0p-1f, 0x1.fa34e2p-1f, 0x1.fd1be4p-1f
static __device__ const float kLog2MantissaDev[128] = {DEEPEP_LL_LOGFMT_LOG2_TABLE};
static const float kLog2MantissaHost[128] = {DEEPEP_LL_LOGFMT_LOG2_TABLE};
#undef DEEPEP_LL_LOGFMT_LOG2_TABLE

__host__ __device__ __forceinline__ float log2_mantissa(uint32_t j) {
#ifdef __CUDA_ARCH__
  return __ldg(&kLog2MantissaDev[j]);
#else
  return kLog2MantissaHost[j];
#endif
}

// log2 of a finite non-zero BF16 magnitude (bits 0x0001..0x7f7f): e + log2(1 + j / 128), one
// rounding (<= 1 ulp, absolute error <= 2^-24 + ulp/2). Branch-free: a subnormal (j * 2^-133) is
// first scaled by 2^64 (exact, normal, its 7 significant bits land in mantissa bits 22..16).
__host__ __device__ __forceinline__ float log2_bf16(uint32_t abs_bits16) {
  const bool sub = abs_bits16 < 0x80u;
  const float x = u2f(abs_bits16 << 16);
  const uint32_t b = f2u(sub ? fmul(x, 0x1p64f) : x);
  const int e = static_cast<int>(b >> 23) - (sub ? 127 + 64 : 127);
  return fadd(static_cast<float>(e), log2_mantissa((b >> 16) & 0x7fu));
}

}  // namespace logfmt_detail

// ------------------------------------------------------------------ per-block parameters
// `amaxmin` = meta without the flag: amax BF16 bits in [0, 15), amin BF16 bits in [16, 31).
__host__ __device__ __forceinline__ uint32_t logfmt_amax_bits(uint32_t meta) { return meta & 0x7fffu; }
__host__ __device__ __forceinline__ uint32_t logfmt_amin_bits(uint32_t meta) { return (meta >> 16) & 0x7fffu; }
__host__ __device__ __forceinline__ bool logfmt_meta_is_log(uint32_t meta) { return (meta & kLogfmtLogFlag) != 0; }

// DeepEP's per-block condition: log2(amax) < 0 and log_amin < log_amax, i.e. amax < 1 and
// amin < amax (positive BF16 bit patterns order like their values).
__host__ __device__ __forceinline__ bool logfmt_eligible(uint32_t amaxmin) {
  const uint32_t amax = logfmt_amax_bits(amaxmin), amin = logfmt_amin_bits(amaxmin);
  return amax < 0x3f80u && amin < amax;
}

// What sender and receiver both derive from (amax, amin). Valid for eligible blocks only.
struct LogfmtScale {
  float log_amin;
  float step;
};
__host__ __device__ __forceinline__ LogfmtScale logfmt_scale(uint32_t amaxmin) {
  using namespace logfmt_detail;
  const uint32_t amin_bits = logfmt_amin_bits(amaxmin);
  const float log_amax = log2_bf16(logfmt_amax_bits(amaxmin));
  const float clip = fsub(log_amax, 32.0f);  // DeepEP kMinClip: at most 2^32 of dynamic range
  const float log_amin = amin_bits == 0 ? clip : fmaxf(log2_bf16(amin_bits), clip);
  LogfmtScale s;
  s.log_amin = log_amin;
  s.step = fdiv(fsub(log_amax, log_amin), static_cast<float>(kLogfmtMaxCode - 1));
  return s;
}

// Sender-only constants: code = floor(log2|x| * step_inv + bias).
struct LogfmtEncodeParams {
  float step_inv;
  float bias;
};
__host__ __device__ __forceinline__ LogfmtEncodeParams logfmt_encode_params(const LogfmtScale& s) {
  using namespace logfmt_detail;
  LogfmtEncodeParams p;
  p.step_inv = fdiv(1.0f, s.step);
  const float mid = fmul(fadd(1.0f, det_exp2(s.step)), 0.5f);
  const float rounding = fsub(2.0f, fmul(det_log2(mid), p.step_inv));
  p.bias = fsub(rounding, fmul(s.log_amin, p.step_inv));
  return p;
}

// 9-bit magnitude code of one BF16 magnitude (sign already stripped). Zero and NaN give 0
// (DeepEP: fmaxf(NaN, 0) = 0). Branch-free.
__host__ __device__ __forceinline__ uint32_t logfmt_code(uint32_t abs_bits16, const LogfmtEncodeParams& p) {
  using namespace logfmt_detail;
  const float v = fadd(fmul(log2_bf16(abs_bits16), p.step_inv), p.bias);
  const bool valid = (abs_bits16 - 1u) < 0x7f80u && v >= 1.0f;  // x != 0, not NaN, code >= 1
#ifdef __CUDA_ARCH__
  const uint32_t c = min(__float2uint_rd(v), static_cast<uint32_t>(kLogfmtMaxCode));  // saturating F2I
#else
  const uint32_t c = !(v < static_cast<float>(kLogfmtMaxCode)) ? static_cast<uint32_t>(kLogfmtMaxCode)
                                                               : static_cast<uint32_t>(floorf(v < 0.0f ? 0.0f : v));
#endif
  return valid ? c : 0u;
}

// The value the receiver reconstructs (before the top-k weight).
__host__ __device__ __forceinline__ float logfmt_decode_value(uint32_t code, uint32_t sign, const LogfmtScale& s) {
  using namespace logfmt_detail;
  // Computed for every code (code - 1 is exact in float) and selected: no divergent branch.
  const float mag = det_exp2(fadd(fmul(fsub(static_cast<float>(code), 1.0f), s.step), s.log_amin));
  const float v = code == 0 ? 0.0f : mag;
  return sign ? -v : v;
}

// ------------------------------------------------------------------ per-lane pack / unpack
// One lane's 8 channels: lo = low code bytes (byte i of {lo.x, lo.y} little-endian = channel i),
// hi16 = bit i: code bit 8 of channel i, bit 8 + i: sign of channel i.
__host__ __device__ __forceinline__ void logfmt_pack_lane(const int4& v, const LogfmtEncodeParams& p, uint2& lo,
                                                          uint32_t& hi16) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
  uint32_t lo_w[2] = {0u, 0u}, hi = 0u;
  for (int i = 0; i < 8; ++i) {
    const uint32_t bits = (w[i >> 1] >> ((i & 1) * 16)) & 0xffffu;
    const uint32_t code = logfmt_code(bits & 0x7fffu, p);
    lo_w[i >> 2] |= (code & 0xffu) << ((i & 3) * 8);
    hi |= ((code >> 8) & 1u) << i;
    hi |= ((bits >> 15) & 1u) << (8 + i);
  }
  lo = make_uint2(lo_w[0], lo_w[1]);
  hi16 = hi;
}

__host__ __device__ __forceinline__ void logfmt_unpack_lane(const uint2& lo, uint32_t hi16, const LogfmtScale& s,
                                                            float (&out)[8]) {
  for (int i = 0; i < 8; ++i) {
    const uint32_t code = (((i < 4 ? lo.x : lo.y) >> ((i & 3) * 8)) & 0xffu) | (((hi16 >> i) & 1u) << 8);
    out[i] = logfmt_decode_value(code, (hi16 >> (8 + i)) & 1u, s);
  }
}

__host__ __device__ __forceinline__ void logfmt_bf16_lane_to_float(const int4& raw, float (&out)[8]) {
  const uint32_t w[4] = {static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y), static_cast<uint32_t>(raw.z),
                         static_cast<uint32_t>(raw.w)};
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = logfmt_detail::u2f(w[i] << 16);
    out[2 * i + 1] = logfmt_detail::u2f(w[i] & 0xffff0000u);
  }
}

// The 160-byte gather as 4 shuffle rounds: in round k (= 32-bit word k of the 16-byte chunk a
// lane stores) lane L offers logfmt_round_offer(L, k, ...) and lane j (< 10) takes the word of
// lane logfmt_round_src(j, k). hiw = hi16(2P) | hi16(2P + 1) << 16 for the lane's pair P.
//   chunk j < 8 = {lo.x, lo.y}(2j), {lo.x, lo.y}(2j + 1)  -> bytes [16j, 16j + 16) = low code bytes
//   chunk 8, 9  = hiw of pairs 0..3, 4..7                 -> bytes [128, 160)
__host__ __device__ __forceinline__ uint32_t logfmt_round_offer(int lane16, int k, const uint2& lo, uint32_t hiw) {
  return ((lane16 & 1) == (k >> 1)) ? ((k & 1) ? lo.y : lo.x) : hiw;
}
__host__ __device__ __forceinline__ int logfmt_round_src(int j, int k) {
  return j < 8 ? 2 * j + (k >> 1) : 2 * (((j - 8) & 1) * 4 + k) + ((k >> 1) ^ 1);
}

// ------------------------------------------------------------------ device: half-warp encode
__device__ __forceinline__ uint32_t logfmt_half_mask() {
  uint32_t lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return 0xffffu << (lane & 16u);
}

// max |x| and min |x| of the block (NaNs ignored), reduced over the half-warp; returns the
// unflagged meta word. All 16 lanes of the half-warp must call it.
__device__ __forceinline__ uint32_t logfmt_block_amaxmin(const int4& v, int lane16) {
  (void)lane16;
  const uint32_t mask = logfmt_half_mask();
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
  uint32_t mx = 0u, mn = 0x7f807f80u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t a = w[i] & 0x7fff7fffu;
    const uint32_t nan = __vcmpgtu2(a, 0x7f807f80u);  // 0xffff per NaN half
    mx = __vmaxu2(mx, a & ~nan);                       // NaN -> 0 (neutral for max)
    mn = __vminu2(mn, (a & ~nan) | (0x7f807f80u & nan));  // NaN -> +inf (neutral for min)
  }
  const uint32_t amax = max(mx & 0xffffu, mx >> 16);
  const uint32_t amin = min(mn & 0xffffu, mn >> 16);
  // One max-reduction over both: amax in the low half, 0xffff - amin in the high half.
  uint32_t key = amax | ((0xffffu - amin) << 16);
#pragma unroll
  for (int off = 8; off >= 1; off >>= 1) key = __vmaxu2(key, __shfl_xor_sync(mask, key, off, 16));
  return (key & 0xffffu) | ((0xffffu - (key >> 16)) << 16);
}

// The encoded block in registers: every lane with `store` set writes `data` (16 B) at
// dst_data + 16 * lane16 (16 lanes for BF16, lanes 0..9 for the log form); one lane writes `meta`.
struct LogfmtBlockOut {
  int4 data;
  uint32_t meta;
  bool store;
  bool is_log;
};

// `use_log` must be uniform over the half-warp and may only be true when
// logfmt_eligible(amaxmin); amaxmin from logfmt_block_amaxmin. All 16 lanes must call it.
// Cost of the log form: 5 shuffles (+4 in logfmt_block_amaxmin), no shared memory.
__device__ __forceinline__ LogfmtBlockOut logfmt_encode_regs(const int4& v, int lane16, uint32_t amaxmin,
                                                             bool use_log) {
  LogfmtBlockOut out;
  out.meta = amaxmin | (use_log ? kLogfmtLogFlag : 0u);
  out.is_log = use_log;
  if (!use_log) {
    out.data = v;
    out.store = true;
    return out;
  }
  const uint32_t mask = logfmt_half_mask();
  const LogfmtEncodeParams p = logfmt_encode_params(logfmt_scale(amaxmin));
  uint2 lo;
  uint32_t hi16;
  logfmt_pack_lane(v, p, lo, hi16);
  const uint32_t partner = __shfl_xor_sync(mask, hi16, 1, 16);
  const uint32_t hiw = (lane16 & 1) ? (partner | (hi16 << 16)) : (hi16 | (partner << 16));
  uint32_t word[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    word[k] = __shfl_sync(mask, logfmt_round_offer(lane16, k, lo, hiw), logfmt_round_src(lane16, k), 16);
  out.data = make_int4(static_cast<int>(word[0]), static_cast<int>(word[1]), static_cast<int>(word[2]),
                       static_cast<int>(word[3]));
  out.store = lane16 < kLogfmtStoreLanes;
  return out;
}

// Plain (generic) stores: one 16-byte store per storing lane, one 4-byte meta store by lane 0
// (skipped when dst_meta is null, e.g. when the caller batches the meta words itself).
// dst_data: 16-byte aligned, local or NVLink-peer global memory.
__device__ __forceinline__ void logfmt_store_block(const LogfmtBlockOut& o, int lane16, uint8_t* dst_data,
                                                   uint8_t* dst_meta) {
  if (o.store) *reinterpret_cast<int4*>(dst_data + 16 * lane16) = o.data;
  if (dst_meta != nullptr && lane16 == 0) *reinterpret_cast<uint32_t*>(dst_meta) = o.meta;
}

// Encode one block with an explicit decision (DeepEP-style chunk decisions: AND
// logfmt_eligible(logfmt_block_amaxmin(...)) over the chunk first). Returns the meta word.
__device__ __forceinline__ uint32_t logfmt_encode_block_decided(const int4& bf16x8, int lane16, uint8_t* dst_data,
                                                                uint8_t* dst_meta, uint32_t amaxmin, bool use_log) {
  const LogfmtBlockOut o = logfmt_encode_regs(bf16x8, lane16, amaxmin, use_log);
  logfmt_store_block(o, lane16, dst_data, dst_meta);
  return o.meta;
}

// Encode one block, deciding per block (log form iff the block qualifies and allow_log, which
// must be uniform over the half-warp). Returns the meta word (flag = bit 15).
__device__ __forceinline__ uint32_t logfmt_encode_block(const int4& bf16x8, int lane16, uint8_t* dst_data,
                                                        uint8_t* dst_meta, bool allow_log = true) {
  const uint32_t amaxmin = logfmt_block_amaxmin(bf16x8, lane16);
  return logfmt_encode_block_decided(bf16x8, lane16, dst_data, dst_meta, amaxmin,
                                     allow_log && logfmt_eligible(amaxmin));
}

// ------------------------------------------------------------------ device: decode
// Per lane, no shuffles: lanes may call it independently. Log form: one 8-byte and one 2-byte
// load; BF16 form: one 16-byte load. `meta` may come from the caller (e.g. a batched load).
// src_data / src_meta: global memory written by peers during the kernel, so the loads are
// ld.global.cg (L2, never a stale L1 line). Callers holding the bytes elsewhere (shared memory,
// registers) use logfmt_scale + logfmt_unpack_lane / logfmt_bf16_lane_to_float directly.
__device__ __forceinline__ void logfmt_decode_lane(const uint8_t* src_data, uint32_t meta, int lane16,
                                                   float (&out)[8]) {
  if (logfmt_meta_is_log(meta)) {
    const uint2 lo = __ldcg(reinterpret_cast<const uint2*>(src_data + 8 * lane16));
    const uint32_t hi16 = __ldcg(reinterpret_cast<const unsigned short*>(src_data + 128 + 2 * lane16));
    logfmt_unpack_lane(lo, hi16, logfmt_scale(meta & ~kLogfmtLogFlag), out);
  } else {
    logfmt_bf16_lane_to_float(__ldcg(reinterpret_cast<const int4*>(src_data + 16 * lane16)), out);
  }
}

__device__ __forceinline__ void logfmt_decode_block(const uint8_t* src_data, const uint8_t* src_meta, int lane16,
                                                    float (&out)[8]) {
  logfmt_decode_lane(src_data, __ldcg(reinterpret_cast<const unsigned int*>(src_meta)), lane16, out);
}

}  // namespace ll
}  // namespace deepep
