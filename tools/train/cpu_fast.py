"""CPU-only speed patches for HF Qwen3-Next training with the PyTorch fallbacks (used by
train.py --device cpu, i.e. the CPU pilot runs; never on the GPU, where fla runs).

- The causal depthwise conv1d (kernel 4) as a sum of shifted products: the same function
  as HF's `causal_conv1d_fn` fallback (checked by `check()`), but its backward pass does
  not go through the slow CPU depthwise `convolution_backward`.
- The chunked gated delta rule (HF's `torch_chunk_gated_delta_rule`, same math) with a
  scan over chunks that autograd handles cheaply (unbind and stack instead of indexed
  in-place writes, whose backward allocates a full-size tensor per chunk).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _conv_shift(hidden_states, weight, bias=None, activation=None, **kwargs):
    from transformers.activations import ACT2FN

    B, C, T = hidden_states.shape
    K = weight.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (K - 1, 0))
    out = sum(weight[:, j].view(1, C, 1) * x[:, :, j: j + T] for j in range(K))
    if bias is not None:
        out = out + bias.view(1, C, 1)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def _chunk_gdr(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
    dt = query.dtype
    B, T, _, Dk = key.shape
    H, Dv = value.shape[-2:]
    q, k, v, beta, decay = [x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * Dk ** -0.5
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    n = (T + pad) // chunk_size
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(B, H, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    decay = decay.reshape(B, H, n, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool).triu(1)
    cum = decay.cumsum(-1)
    pw = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pw
    intra = (q @ k.transpose(-1, -2)) * pw
    dkb = k_beta * cum.exp().unsqueeze(-1)
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cd = torch.linalg.solve_triangular(ut, dkb, upper=False, unitriangular=True)
    S = torch.zeros(B, H, Dk, Dv) if initial_state is None else initial_state.float()
    qd = q * cum.exp().unsqueeze(-1)
    kd = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    cdec = cum[..., -1].exp()[..., None, None]
    outs = []
    for nv, kc, qq, ia, kk, cd in zip(new_v.unbind(2), k_cd.unbind(2), qd.unbind(2), intra.unbind(2),
                                      kd.unbind(2), cdec.unbind(2)):
        vn = nv - kc @ S
        outs.append(qq @ S + ia @ vn)
        S = S * cd + kk.transpose(-1, -2) @ vn
    o = torch.stack(outs, 2).reshape(B, H, -1, Dv)[:, :, :T]
    return o.transpose(1, 2).to(dt).contiguous(), (S if output_final_state else None)


def apply(chunk_size: int = 64) -> None:
    import transformers.models.qwen3_next.modeling_qwen3_next as m

    if getattr(m, "_cpu_fast_applied", False):
        return
    m._orig_conv = m.causal_conv1d_fn
    m._orig_chunk = m.torch_chunk_gated_delta_rule
    m.causal_conv1d_fn = _conv_shift
    m.torch_chunk_gated_delta_rule = functools.partial(_chunk_gdr, chunk_size=chunk_size)
    m._cpu_fast_applied = True


def check() -> float:
    """Max abs difference of the patched conv and chunk rule against HF's fallbacks."""
    import transformers.models.qwen3_next.modeling_qwen3_next as m

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 8, 50, generator=g), torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    d1 = (_conv_shift(x, w, b, "silu") - m._orig_conv(x, w, b, "silu")).abs().max().item()
    q, k, v = (torch.randn(2, 100, 2, 16, generator=g) for _ in range(3))
    gg = -F.softplus(torch.randn(2, 100, 2, generator=g))
    beta = torch.sigmoid(torch.randn(2, 100, 2, generator=g))
    o1, s1 = m.torch_chunk_gated_delta_rule(q, k, v, g=gg, beta=beta, use_qk_l2norm_in_kernel=True,
                                            output_final_state=True)
    o2, s2 = m._orig_chunk(q, k, v, g=gg, beta=beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
    return max(d1, (o1 - o2).abs().max().item(), (s1 - s2).abs().max().item())
