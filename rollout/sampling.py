"""Token sampling without host syncs, and the behaviour log-probs (mu) recorded with each token.

Pipeline for one decode step over B rows (all pure tensor code, so a CUDA graph can capture it):

    x_BV       = process_logits(logits_BV, temperature_B, top_k_B, top_p_B)  # tempered log-probs
    u_B        = hashed_uniform(key_B, counter_B)       # one U(0, 1) per row (float64, 52 bits)
    tok_B, mu_B = sample(x_BV, u_B, greedy_B)           # inverse CDF of softmax(x); mu = its logp

Without top-k/top-p, `sample(logits_BV, u_B, greedy_B, temperature_B)` tempers inside its own pass
over the logits instead (one [B, V] buffer fewer per step).

**Inverse-CDF sampling.** Token i is drawn when CDF(i-1) <= u * Z < CDF(i), with CDF the running
sum of exp(x - max) and Z its total: an exact draw from softmax(x) for u ~ U(0, 1) (up to ~1e-7
relative rounding of fp32 block sums). The running sums are float64 and taken in two levels (blocks
of `BLOCK` tokens, then within the one block that holds u), so a row costs one exp pass over the
vocabulary plus small float64 work:
on CPU ~2.2x cheaper than the exponential-race (Gumbel-max) draw it replaced, which needed a hash
and two logs per (row, token). Tokens masked to -inf have no mass and are never drawn (the search
is clamped to the last token with mass, so float64 rounding at the very end cannot pick one).

**Counter-based randomness.** u is a pure hash of (key, counter): `key` comes from the request's
seed (or the engine seed and the request's arrival order) and its sample index, `counter` is the
token's index in the completion. A completion therefore does not depend on which slot it ran in,
on how many slots the engine has, or on what else was in the batch, and the hash is plain integer
arithmetic that CUDA graphs capture without RNG-state bookkeeping.

**Which distribution mu is (the trainer must match it).**
- mu is the log-prob of the sampled token under exactly the distribution it was sampled from:
  logits / temperature, truncated by top-k then top-p, renormalised (`process_logits`). The trainer
  must compute log pi with the same temperature: `log_softmax(logits / T)`.
- With top-k/top-p active, the trainer's pi is untruncated while mu is truncated. We record the
  truncated mu (what was actually sampled) and let the importance ratio pi/mu absorb the
  difference: tokens outside the truncation are never sampled, so they never appear in a ratio,
  and inside it mu >= the untruncated probability, so pi/mu < 1 there at equal weights.
- Greedy rows (or temperature 0) are a point mass, whose log-prob (0) says nothing. For them we
  record log_softmax(logits / T) of the *untruncated* distribution, with T = temperature if > 0
  else 1: the value the trainer's forward produces for that token at the same T.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_M32 = 0xFFFFFFFF
# Multipliers of the "lowbias32" integer hash (C. Wellons). The second one is applied as its
# negative 32-bit complement, so an int64 product never overflows (x < 2^32, |c| < 2^31) while the
# low 32 bits stay identical; the same code then works on Python ints and on int64 tensors.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B9


def mix32(x):
    """A 32-bit integer hash (bijective on [0, 2^32)) of a Python int or an int64 tensor."""
    x = x & _M32  # for a tensor: a fresh copy, so `_mix32_` touches no caller data
    if isinstance(x, Tensor):
        return _mix32_(x)
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _mix32_(x: Tensor) -> Tensor:
    """`mix32` in place on an int64 tensor with values in [0, 2^32). In place because on CPU the
    out-of-place version spends more time allocating than hashing."""
    x ^= x >> 16
    x.mul_(_C1).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_C2).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def stream_key(seed: int, sample_idx: int) -> int:
    """The 32-bit sampling key of sample `sample_idx` of a request seeded with `seed` (host side).
    The seed is hashed before the sample index joins it: three hashes XORed side by side gave
    seed 2j+1's sample i the key of seed 2i+1's sample j (requests seeded 1, 2, 3, ... with n > 1
    shared their random streams)."""
    seed_key = mix32(mix32(seed & _M32) ^ mix32((seed >> 32) + _GOLDEN))
    return mix32(seed_key ^ mix32(sample_idx * 2 + 1))


def hashed_uniform(key_B: Tensor, counter_B: Tensor) -> Tensor:
    """U(0, 1) [B] (float64), a pure function of (key, counter): 52 bits from two chained 32-bit
    hashes, u = (bits + 0.5) / 2^52, exact in float64 and strictly inside (0, 1)."""
    h1_B = mix32(key_B ^ mix32(counter_B * 2 + 1))
    h2_B = mix32(h1_B ^ _GOLDEN)
    bits_B = (h1_B << 20) | (h2_B >> 12)
    return (bits_B.to(torch.float64) + 0.5) * 2.0 ** -52


def process_logits(logits_BV: Tensor, temperature: float | Tensor = 1.0, top_k: int | Tensor = 0,
                   top_p: float | Tensor = 1.0) -> Tensor:
    """Log-probs [B, V] (fp32) of the distribution that is sampled from.

    logits / temperature, then top-k (keep the k largest, exactly k: tokens tied with the k-th
    are cut in sort order, where HF's warper keeps them all; 0 = off), then top-p over the
    renormalised top-k distribution (keep the smallest prefix of the sorted tokens whose mass
    reaches top_p; 1 = off), renormalised. Masked tokens get -inf. Each of temperature / top_k /
    top_p is a scalar or a per-row tensor [B]. Python scalars 0 / 1.0 skip the sort entirely.
    Example: p = [.5, .25, .15, .1], top_k=2 -> [2/3, 1/3, 0, 0]; top_p=.8 -> [.5, .25, .15, 0]/.9.
    """
    x_BV = logits_BV.float()
    if isinstance(temperature, Tensor):
        x_BV = x_BV / temperature.to(x_BV.dtype)[:, None]
    elif temperature != 1.0:
        x_BV = x_BV / temperature
    truncate_k = isinstance(top_k, Tensor) or top_k > 0
    truncate_p = isinstance(top_p, Tensor) or top_p < 1.0
    if not (truncate_k or truncate_p):
        return torch.log_softmax(x_BV, dim=-1)
    B, V = x_BV.shape
    sorted_BV, order_BV = x_BV.sort(dim=-1, descending=True)
    rank_V = torch.arange(V, device=x_BV.device)
    keep_BV = torch.ones_like(sorted_BV, dtype=torch.bool)
    if truncate_k:
        k_B1 = torch.as_tensor(top_k, device=x_BV.device).reshape(-1, 1)
        keep_BV = rank_V[None, :] < torch.where(k_B1 > 0, k_B1, V)
    if truncate_p:
        p_B1 = torch.as_tensor(top_p, device=x_BV.device, dtype=torch.float32).reshape(-1, 1)
        probs_BV = sorted_BV.masked_fill(~keep_BV, float("-inf")).softmax(dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        # top_p >= 1 must mean "off" exactly, whatever the rounding of the cumulative sum.
        keep_BV = keep_BV & ((mass_before_BV < p_B1) | (p_B1 >= 1.0))
    sorted_BV = sorted_BV.masked_fill(~keep_BV, float("-inf"))
    x_BV = torch.empty_like(x_BV).scatter_(-1, order_BV, sorted_BV)
    return torch.log_softmax(x_BV, dim=-1)


BLOCK = 64  # tokens per first-level block of the inverse-CDF search


def sample(x_BV: Tensor, u_B: Tensor | None, greedy: bool | Tensor = False,
           temperature_B: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(token ids [B], their log-probs [B] under softmax(x_BV / temperature_B)): the inverse-CDF
    draw at u_B (see the module docstring), or argmax for greedy rows (`greedy` is a bool or a
    bool tensor [B]; `u_B` may be None when every row is greedy). `x_BV` may be unnormalised and
    is not modified; `temperature_B` None means 1. No host sync."""
    m_B1 = x_BV.amax(-1, keepdim=True)
    e_BV = x_BV - m_B1  # the one [B, V] buffer: tempered, exponentiated in place
    if temperature_B is not None:
        e_BV.div_(temperature_B[:, None])
    e_BV.exp_()  # -inf (masked) -> 0
    tok_B = x_BV.argmax(-1) if (u_B is None or greedy is not False) else None
    if u_B is None or greedy is True:
        logz_B = e_BV.sum(-1, dtype=torch.float64).log()
    else:
        drawn_B, logz_B = _inverse_cdf(e_BV, u_B)
        tok_B = drawn_B if tok_B is None else torch.where(greedy, tok_B, drawn_B)
    top_B = x_BV.gather(1, tok_B[:, None])[:, 0] - m_B1[:, 0]
    if temperature_B is not None:
        top_B = top_B / temperature_B
    return tok_B, top_B - logz_B.to(x_BV.dtype)


def _inverse_cdf(e_BV: Tensor, u_B: Tensor) -> tuple[Tensor, Tensor]:
    """First index i with CDF(i) > u * Z over weights e_BV >= 0, and log Z. Two levels: block sums
    locate the block, a float64 running sum inside it locates the token; both searches are clamped
    to the last entry with mass. The block sums themselves are fp32 (a float64 copy of the whole
    [B, V] would cost more than the rest of the draw): a block's fp32 sum and its float64 running
    sum differ by ~1e-7 relative, which moves that much of the block's mass to its last token.
    A vocabulary of one block (the demo's 17 tokens) skips locating the block."""
    B, V = e_BV.shape
    nb = -(-V // BLOCK)
    if nb == 1:
        z_B1 = e_BV.sum(-1, keepdim=True).double()
        in_BV = e_BV.double().cumsum_(-1)
        t_B1 = u_B[:, None] * z_B1
        idx_B = torch.minimum((in_BV <= t_B1).sum(-1), (in_BV < in_BV[:, -1:]).sum(-1))
        return idx_B, z_B1[:, 0].log()
    if nb * BLOCK != V:
        e_BV = F.pad(e_BV, (0, nb * BLOCK - V))
    e_BNK = e_BV.view(B, nb, BLOCK)
    cdf_BN = e_BNK.sum(-1).double().cumsum_(-1)
    z_B1 = cdf_BN[:, -1:]
    t_B1 = u_B[:, None] * z_B1
    blk_B = torch.minimum((cdf_BN <= t_B1).sum(-1), (cdf_BN < z_B1).sum(-1))
    before_B1 = cdf_BN.gather(1, (blk_B - 1).clamp(min=0)[:, None]).masked_fill_(blk_B[:, None] == 0, 0.0)
    in_BK = e_BNK.gather(1, blk_B[:, None, None].expand(B, 1, BLOCK))[:, 0].double().cumsum_(-1)
    idx_B = torch.minimum((in_BK <= t_B1 - before_B1).sum(-1), (in_BK < in_BK[:, -1:]).sum(-1))
    return blk_B * BLOCK + idx_B, z_B1[:, 0].log()
