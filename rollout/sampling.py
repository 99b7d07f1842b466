"""Token sampling without host syncs, and the behaviour log-probs (mu) recorded with each token.

Pipeline for one decode step over B rows (all pure tensor code, so a CUDA graph can capture it):

    logp_BV  = process_logits(logits_BV, temperature_B, top_k_B, top_p_B)
    noise_BV = hashed_exponential_noise(key_B, counter_B, V)     # q ~ Exp(1), one per (row, token)
    tok_B    = sample(logp_BV, noise_BV, greedy_B)               # argmax(logp - log q)
    mu_B     = logp_BV.gather(1, tok_B[:, None])[:, 0]

**Exponential-noise sampling** (gpt-fast style): argmax_i p_i / q_i with q_i ~ Exp(1) is an exact
draw from p (it is the Gumbel-max trick, -log q_i being Gumbel), and needs neither a cumulative sum
nor `torch.multinomial`, so nothing waits for the host. Tokens masked to -inf are never chosen.

**Counter-based noise.** The noise is a pure hash of (key, counter, token id): `key` comes from the
request's seed (or the engine seed and the request's arrival order) and its sample index, `counter`
is the token's index in the completion. A completion therefore does not depend on which slot it
ran in, on how many slots the engine has, or on what else was in the batch, and the hash is plain
integer arithmetic that CUDA graphs capture without RNG-state bookkeeping.
`exponential_noise(shape, generator)` is the ordinary `torch.Generator` alternative.

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


def _mix32_i32_(x: Tensor) -> Tensor:
    """`mix32` in place on the bits of an int32 tensor (two's complement: multiplication wraps
    mod 2^32; arithmetic shifts are masked into logical ones). For the [B, V] noise, where int64
    would cost ~3x: CPUs have no fast vector 64-bit multiply."""
    x ^= (x >> 16) & 0xFFFF
    x.mul_(_C1)
    x ^= (x >> 15) & 0x1FFFF
    x.mul_(_C2)
    x ^= (x >> 16) & 0xFFFF
    return x


def _as_i32(x: Tensor) -> Tensor:
    """int64 values in [0, 2^32) -> int32 with the same bits (no out-of-range conversion)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def stream_key(seed: int, sample_idx: int) -> int:
    """The 32-bit noise key of sample `sample_idx` of a request seeded with `seed` (host side)."""
    return mix32(mix32(seed & _M32) ^ mix32((seed >> 32) + _GOLDEN) ^ mix32(sample_idx * 2 + 1))


def hashed_exponential_noise(key_B: Tensor, counter_B: Tensor, vocab: int) -> Tensor:
    """Exp(1) noise [B, vocab] (fp32), a pure function of (key, counter, token id):
    q = -log(u), u from the 32-bit hash mix32(row(key, counter) ^ col(token id)).

    23 random bits per entry: u = (i + 0.5) / 2^23 is exact in fp32 and lies strictly inside (0, 1),
    so q is finite and positive (q in [6e-8, 16.6]).
    """
    row_B = _as_i32(mix32(key_B ^ mix32(counter_B * 2 + 1)))
    # times the multiplier's negative complement: the same low 32 bits, and a constant that fits
    # in int32 (inductor turns arange * c into index arithmetic, which Triton refuses past 2^31)
    ids_V = torch.arange(vocab, device=key_B.device, dtype=torch.int64)
    col_V = _as_i32(mix32(ids_V * (_GOLDEN - (1 << 32))))
    bits_BV = _mix32_i32_(row_B[:, None] ^ col_V[None, :])
    bits_BV = (bits_BV >> 9) & 0x7FFFFF
    u_BV = bits_BV.to(torch.float32).add_(0.5).mul_(2.0 ** -23)
    return u_BV.log_().neg_()


def exponential_noise(shape, generator: torch.Generator | None = None, device=None) -> Tensor:
    """Exp(1) noise from a torch.Generator (the non-hashed alternative)."""
    return torch.empty(shape, device=device, dtype=torch.float32).exponential_(1, generator=generator)


def process_logits(logits_BV: Tensor, temperature: float | Tensor = 1.0, top_k: int | Tensor = 0,
                   top_p: float | Tensor = 1.0) -> Tensor:
    """Log-probs [B, V] (fp32) of the distribution that is sampled from.

    logits / temperature, then top-k (keep the k largest; 0 = off), then top-p over the
    renormalised top-k distribution (keep the smallest prefix of the sorted tokens whose mass
    reaches top_p; 1 = off), renormalised. Masked tokens get -inf. Each of temperature / top_k /
    top_p is a scalar or a per-row tensor [B]. Python scalars 0 / 1.0 skip the sort entirely.
    Example: p = [.5, .25, .15, .1], top_k=2 -> [2/3, 1/3, 0, 0]; top_p=.8 -> [.5, .25, .15, 0]/.9.
    """
    x_BV = logits_BV.float()
    if isinstance(temperature, Tensor):
        temperature = temperature.to(x_BV.dtype)[:, None]
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


def sample(logp_BV: Tensor, noise_BV: Tensor | None, greedy: bool | Tensor = False) -> Tensor:
    """Token ids [B]: argmax(logp - log q) with q ~ Exp(1) (i.e. argmax p / q), or argmax(logp) for
    greedy rows (`greedy` is a bool or a bool tensor [B]; `noise_BV` may be None when all rows are
    greedy). No host sync."""
    if noise_BV is None or greedy is True:
        return logp_BV.argmax(dim=-1)
    drawn_B = (logp_BV - noise_BV.log()).argmax(dim=-1)
    if greedy is False:
        return drawn_B
    return torch.where(greedy, logp_BV.argmax(dim=-1), drawn_B)
