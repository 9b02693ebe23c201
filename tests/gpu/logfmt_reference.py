"""Pure-torch reference of LogFMT-10, the `use_logfmt=True` transport of the LL combine
(DeepEP V1, deepep-buffer-api.md section 6.5), bit-exact with kernels/ll_logfmt.cuh.

Per 128-channel block: meta = amax | flag << 15 | amin << 16 (BF16 bit patterns of max|x| and
min|x|, NaNs ignored). A block is log-encoded iff amax < 1 and amin < amax (and, in DeepEP V1,
every block of its 4- or 8-block decision chunk qualifies: pass `decision_blocks`). Otherwise
its 256 data bytes are the BF16 values unchanged. Log form (160 bytes):
    log_amax = log2(amax), log_amin = amin == 0 ? log_amax - 32 : max(log2(amin), log_amax - 32)
    step = (log_amax - log_amin) / 510, step_inv = 1 / step
    bias = (2 - log2((1 + 2^step) / 2) * step_inv) - log_amin * step_inv
    code = 0 if x == 0 or NaN else min(floor(max(log2|x| * step_inv + bias, 0)), 511)
    decoded = 0 if code == 0 else 2^((code - 1) * step + log_amin), with the sign of x
    bytes [0, 128): low 8 bits of each channel's code; bytes [128, 160): u16 word g (channels
    8g..8g+7) = bit i: code bit 8 of channel 8g+i, bit 8+i: sign of channel 8g+i.
log2 of a BF16 magnitude is e + table[7-bit mantissa] (correctly rounded table, one add);
log2((1 + 2^step) / 2) and 2^y are the header's IEEE-only polynomial evaluations. No fused
multiply-add anywhere; each step is one float32 torch op, so results match the device bit for
bit on CPU and on CUDA tensors.
"""
from typing import Tuple

import torch

BLOCK = 128
SLOT_BYTES = 256
LOG_BYTES = 160
META_BYTES = 4
MAX_CODE = 511
LOG_FLAG = 0x8000

# The header's constants, as exact float32 values.
_LOG2_COEFFS = [float.fromhex(h) for h in ('0x1.484b14p-2', '0x1.a61762p-2', '0x1.2776c6p-1',
                                           '0x1.ec709ep-1', '0x1.715476p+1')]
# log2(1 + j / 128), j = 0..127, correctly rounded to float32 (the header's table).
_LOG2_MANTISSA = [float.fromhex(h) for h in (
    '0x0.0p+0', '0x1.6fe50cp-7', '0x1.6e7968p-6', '0x1.11cd1ep-5',
    '0x1.6bad38p-5', '0x1.c4dfacp-5', '0x1.0eb38ap-4', '0x1.3aa2fep-4',
    '0x1.663f70p-4', '0x1.918a16p-4', '0x1.bc8424p-4', '0x1.e72ec2p-4',
    '0x1.08c588p-3', '0x1.1dcd1ap-3', '0x1.32ae9ep-3', '0x1.476aa0p-3',
    '0x1.5c01a4p-3', '0x1.70742ep-3', '0x1.84c2bep-3', '0x1.98edd0p-3',
    '0x1.acf5e2p-3', '0x1.c0db6cp-3', '0x1.d49ee4p-3', '0x1.e840bep-3',
    '0x1.fbc16cp-3', '0x1.0790aep-2', '0x1.11307ep-2', '0x1.1ac05cp-2',
    '0x1.24407ap-2', '0x1.2db110p-2', '0x1.37124cp-2', '0x1.406464p-2',
    '0x1.49a784p-2', '0x1.52dbe0p-2', '0x1.5c01a4p-2', '0x1.6518fep-2',
    '0x1.6e221cp-2', '0x1.771d2cp-2', '0x1.800a56p-2', '0x1.88e9c8p-2',
    '0x1.91bba8p-2', '0x1.9a8024p-2', '0x1.a33760p-2', '0x1.abe188p-2',
    '0x1.b47ec0p-2', '0x1.bd0f2ep-2', '0x1.c592fap-2', '0x1.ce0a4ap-2',
    '0x1.d6753ep-2', '0x1.ded3fep-2', '0x1.e726aap-2', '0x1.ef6d68p-2',
    '0x1.f7a856p-2', '0x1.ffd79ap-2', '0x1.03fda8p-1', '0x1.0809d0p-1',
    '0x1.0c1050p-1', '0x1.10113cp-1', '0x1.140ca0p-1', '0x1.18028cp-1',
    '0x1.1bf312p-1', '0x1.1fde3ep-1', '0x1.23c41ep-1', '0x1.27a4c0p-1',
    '0x1.2b8034p-1', '0x1.2f5688p-1', '0x1.3327c6p-1', '0x1.36f400p-1',
    '0x1.3abb40p-1', '0x1.3e7d94p-1', '0x1.423b08p-1', '0x1.45f3aap-1',
    '0x1.49a784p-1', '0x1.4d56a6p-1', '0x1.510118p-1', '0x1.54a6e8p-1',
    '0x1.584822p-1', '0x1.5be4d0p-1', '0x1.5f7d00p-1', '0x1.6310b8p-1',
    '0x1.66a008p-1', '0x1.6a2afap-1', '0x1.6db196p-1', '0x1.7133eap-1',
    '0x1.74b1fep-1', '0x1.782bdcp-1', '0x1.7ba190p-1', '0x1.7f1322p-1',
    '0x1.82809ep-1', '0x1.85ea0cp-1', '0x1.894f74p-1', '0x1.8cb0e4p-1',
    '0x1.900e62p-1', '0x1.9367f6p-1', '0x1.96bdaep-1', '0x1.9a0f8ep-1',
    '0x1.9d5da0p-1', '0x1.a0a7eep-1', '0x1.a3ee80p-1', '0x1.a7315ep-1',
    '0x1.aa7090p-1', '0x1.adac1ep-1', '0x1.b0e412p-1', '0x1.b41874p-1',
    '0x1.b74948p-1', '0x1.ba769cp-1', '0x1.bda072p-1', '0x1.c0c6d4p-1',
    '0x1.c3e9cap-1', '0x1.c7095ap-1', '0x1.ca258ep-1', '0x1.cd3e6ap-1',
    '0x1.d053f6p-1', '0x1.d3663cp-1', '0x1.d6753ep-1', '0x1.d98106p-1',
    '0x1.dc899ap-1', '0x1.df8f02p-1', '0x1.e29142p-1', '0x1.e59064p-1',
    '0x1.e88c6cp-1', '0x1.eb8560p-1', '0x1.ee7b48p-1', '0x1.f16e28p-1',
    '0x1.f45e08p-1', '0x1.f74af0p-1', '0x1.fa34e2p-1', '0x1.fd1be4p-1',
)]
_EXP2_COEFFS = [float.fromhex(h) for h in ('0x1.ffcbfcp-17', '0x1.430912p-13', '0x1.5d87fep-10',
                                           '0x1.3b2ab6p-7', '0x1.c6b08ep-5', '0x1.ebfbe0p-3',
                                           '0x1.62e430p-1', '0x1.0p+0')]


def deepep_decision_blocks(hidden: int) -> int:
    """Blocks per "log or BF16" decision in DeepEP V1 (one warp's TMA chunk in its combine send:
    32 lanes x kNumSendUnrolls int4, kNumSendUnrolls = 4 if hidden % 1024 == 0 else 2)."""
    return 8 if hidden % 1024 == 0 else 4


# ---------------------------------------------------------------- deterministic float32 math
def _c(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for int32 k (clamped to the normal range; callers mask the rest)."""
    return ((k.clamp(-126, 127) + 127) << 23).to(torch.int32).view(torch.float32)


def det_log2(x: torch.Tensor) -> torch.Tensor:
    """The header's det_log2 for float32 x > 0 (other inputs give unspecified values)."""
    x = x.to(torch.float32).contiguous()
    sub = x < 2.0 ** -126
    xs = torch.where(sub, x * _c(2.0 ** 24, x), x).contiguous()
    b = xs.view(torch.int32)
    e = (b >> 23) - 127 - sub.to(torch.int32) * 24
    mb = (b & 0x7fffff) | 0x3f800000
    big = mb > 0x3fb504f3
    m = mb.view(torch.float32)
    m = torch.where(big, m * _c(0.5, x), m)
    e = e + big.to(torch.int32)
    one = _c(1.0, x)
    z = m - one
    s = z / (m + one)
    s2 = s * s
    q = torch.full_like(s, _LOG2_COEFFS[0])
    for c in _LOG2_COEFFS[1:]:
        q = q * s2
        q = q + _c(c, x)
    return e.to(torch.float32) + s * q


def det_exp2(y: torch.Tensor) -> torch.Tensor:
    """The header's det_exp2 for finite float32 y <= 127."""
    y = y.to(torch.float32)
    n = torch.round(y)  # half to even, as rintf
    f = y - n
    p = torch.full_like(f, _EXP2_COEFFS[0])
    for c in _EXP2_COEFFS[1:]:
        p = p * f
        p = p + _c(c, y)
    ni = n.to(torch.int32)
    low = ni < -126
    a = torch.where(low, _c(2.0 ** -24, y), _c(1.0, y))
    b = torch.where(ni < -150, torch.zeros_like(p), _pow2(torch.where(low, ni + 24, ni)))
    return (p * a) * b


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def log2_bf16(abs_bits: torch.Tensor) -> torch.Tensor:
    """The header's log2_bf16 for BF16 magnitude bit patterns 0x0001..0x7f7f (int tensor):
    float(e) + table[j], one float32 rounding; subnormals scaled by 2^64 first (exact)."""
    b16 = abs_bits.to(torch.int32)
    sub = b16 < 0x80
    x = (b16 << 16).view(torch.float32)
    b = torch.where(sub, x * _c(2.0 ** 64, x), x).contiguous().view(torch.int32)
    e = (b >> 23) - torch.where(sub, torch.full_like(b, 127 + 64), torch.full_like(b, 127))
    table = torch.tensor(_LOG2_MANTISSA, dtype=torch.float32, device=b.device)
    return e.to(torch.float32) + table[((b >> 16) & 0x7f).long()]


def _scale(amax_bits: torch.Tensor, amin_bits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log_amin, step) per block, as logfmt_scale (meaningful for eligible blocks)."""
    log_amax = log2_bf16(amax_bits)  # amax == 0 (ineligible) gives a finite unused value
    clip = log_amax - _c(32.0, log_amax)
    log_amin = torch.where(amin_bits == 0, clip, torch.maximum(log2_bf16(amin_bits), clip))
    step = (log_amax - log_amin) / _c(float(MAX_CODE - 1), log_amax)
    return log_amin, step


def _encode_params(log_amin: torch.Tensor, step: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(step_inv, bias) per block, as logfmt_encode_params."""
    step_inv = _c(1.0, step) / step
    mid = (_c(1.0, step) + det_exp2(step)) * _c(0.5, step)
    rounding = _c(2.0, step) - det_log2(mid) * step_inv
    bias = rounding - log_amin * step_inv
    return step_inv, bias


def _decode_values(code: torch.Tensor, sign: torch.Tensor, log_amin: torch.Tensor,
                   step: torch.Tensor) -> torch.Tensor:
    y = (code - 1).to(torch.float32) * step + log_amin
    mag = torch.where(code == 0, torch.zeros_like(y), det_exp2(y))
    return torch.where(sign != 0, -mag, mag)


# ---------------------------------------------------------------- encode / decode
def _blocks_bits(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype == torch.bfloat16, 'LogFMT input must be BF16'
    hidden = x.size(-1)
    assert hidden % BLOCK == 0, 'hidden must be a multiple of 128'
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xffff
    return bits.reshape(*x.shape[:-1], hidden // BLOCK, BLOCK)


def _decide(eligible: torch.Tensor, decision_blocks: int) -> torch.Tensor:
    """AND the per-block condition over consecutive groups of `decision_blocks` blocks."""
    if decision_blocks <= 1:
        return eligible
    nb = eligible.size(-1)
    ng = -(-nb // decision_blocks)
    pad = ng * decision_blocks - nb
    padded = torch.cat([eligible, eligible.new_ones(*eligible.shape[:-1], pad)], dim=-1)
    group_ok = padded.reshape(*eligible.shape[:-1], ng, decision_blocks).all(dim=-1)
    return group_ok.repeat_interleave(decision_blocks, dim=-1)[..., :nb]


def logfmt_encode(x: torch.Tensor, decision_blocks: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """BF16 [..., H] -> (data uint8 [..., H/128, 256], meta uint8 [..., H/128, 4]), the wire form.

    decision_blocks=1 decides per block, as logfmt_encode_block(..., allow_log=true);
    deepep_decision_blocks(H) reproduces DeepEP V1. Bytes [160, 256) of a log-encoded slot are
    never sent; they are zero here."""
    bits = _blocks_bits(x)
    sign = bits >> 15
    abs_bits = bits & 0x7fff
    nan = abs_bits > 0x7f80
    amax_bits = torch.where(nan, torch.zeros_like(abs_bits), abs_bits).amax(dim=-1)
    amin_bits = torch.where(nan, torch.full_like(abs_bits, 0x7f80), abs_bits).amin(dim=-1)
    eligible = (amax_bits < 0x3f80) & (amin_bits < amax_bits)
    is_log = _decide(eligible, decision_blocks)

    log_amin, step = _scale(amax_bits, amin_bits)
    step = torch.where(is_log, step, torch.ones_like(step))  # keep unused blocks finite
    step_inv, bias = _encode_params(log_amin, step)
    v = log2_bf16(abs_bits) * step_inv[..., None] + bias[..., None]
    code = torch.where(v >= 1.0, torch.floor(v), torch.zeros_like(v)).clamp(max=MAX_CODE).to(torch.int32)
    code = torch.where((abs_bits == 0) | nan, torch.zeros_like(code), code)

    lo = (code & 0xff).to(torch.uint8)                                     # [..., nb, 128]
    lane_shape = (*code.shape[:-1], 16, 8)
    shifts = torch.arange(8, device=x.device, dtype=torch.int32)
    hi16 = ((((code >> 8) & 1).reshape(lane_shape) << shifts) |
            ((sign.reshape(lane_shape)) << (shifts + 8))).sum(dim=-1)       # [..., nb, 16]
    hi_bytes = torch.stack([hi16 & 0xff, hi16 >> 8], dim=-1).reshape(*code.shape[:-1], 32).to(torch.uint8)
    log_data = torch.cat([lo, hi_bytes, lo.new_zeros(*code.shape[:-1], SLOT_BYTES - LOG_BYTES)], dim=-1)
    raw = x.contiguous().view(torch.uint8).reshape(*code.shape[:-1], SLOT_BYTES)
    data = torch.where(is_log[..., None], log_data, raw)

    meta_word = amax_bits | (is_log.to(torch.int32) << 15) | (amin_bits << 16)
    meta = torch.stack([(meta_word >> (8 * i)) & 0xff for i in range(4)], dim=-1).to(torch.uint8)
    return data, meta


def logfmt_decode(data: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """(data uint8 [..., nb, 256], meta uint8 [..., nb, 4]) -> float32 [..., nb * 128]: what
    logfmt_decode_block gives (before the top-k weight)."""
    assert data.dtype == torch.uint8 and meta.dtype == torch.uint8
    lead, nb = data.shape[:-2], data.size(-2)
    m = meta.to(torch.int64)
    meta_word = m[..., 0] | (m[..., 1] << 8) | (m[..., 2] << 16) | (m[..., 3] << 24)
    is_log = ((meta_word >> 15) & 1) != 0
    amax_bits = (meta_word & 0x7fff).to(torch.int32)
    amin_bits = ((meta_word >> 16) & 0x7fff).to(torch.int32)

    raw = data.contiguous().view(torch.int16).to(torch.int32) & 0xffff       # [..., nb, 128]
    bf16_vals = _bf16_bits_to_float(raw)

    eligible = (amax_bits < 0x3f80) & (amin_bits < amax_bits)
    log_amin, step = _scale(amax_bits, amin_bits)
    step = torch.where(is_log & eligible, step, torch.ones_like(step))
    d = data.to(torch.int32)
    hi16 = (d[..., 128:160:2] | (d[..., 129:160:2] << 8))                   # [..., nb, 16]
    shifts = torch.arange(8, device=data.device, dtype=torch.int32)
    hi_bit = ((hi16[..., None] >> shifts) & 1).reshape(*lead, nb, BLOCK)
    sign = ((hi16[..., None] >> (shifts + 8)) & 1).reshape(*lead, nb, BLOCK)
    code = d[..., :128] | (hi_bit << 8)
    log_vals = _decode_values(code, sign, log_amin[..., None], step[..., None])
    out = torch.where(is_log[..., None], log_vals, bf16_vals)
    return out.reshape(*lead, nb * BLOCK)


def logfmt_roundtrip(x: torch.Tensor, decision_blocks: int = 1) -> torch.Tensor:
    """BF16 [..., H] -> float32 [..., H]: the receiver's reconstruction of every channel,
    bit-exact with logfmt_decode_block(logfmt_encode_block(x)) (decision_blocks=1) or with a
    kernel that ANDs the per-block condition over `decision_blocks` blocks (DeepEP V1:
    deepep_decision_blocks(H))."""
    data, meta = logfmt_encode(x, decision_blocks)
    return logfmt_decode(data, meta).reshape(x.shape)


def logfmt_is_log(x: torch.Tensor, decision_blocks: int = 1) -> torch.Tensor:
    """bool [..., H/128]: which blocks travel in the 160-byte log form."""
    _, meta = logfmt_encode(x, decision_blocks)
    return (meta[..., 1].to(torch.int32) & 0x80) != 0


def logfmt_wire_bytes(x: torch.Tensor, decision_blocks: int = 1) -> int:
    """Data + meta bytes the rows of x put on the wire (log blocks 160 B, others 256 B)."""
    is_log = logfmt_is_log(x, decision_blocks)
    n_log = int(is_log.sum().item())
    return n_log * LOG_BYTES + (is_log.numel() - n_log) * SLOT_BYTES + is_log.numel() * META_BYTES


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's tests/utils.calc_diff."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    sim = 2 * (x * y).sum() / denominator
    return (1 - sim).item()


__all__ = ['logfmt_encode', 'logfmt_decode', 'logfmt_roundtrip', 'logfmt_is_log', 'logfmt_wire_bytes',
           'deepep_decision_blocks', 'log2_bf16', 'det_log2', 'det_exp2', 'calc_diff']
