"""Work around flash-linear-attention 0.6.0's refusal to run the gated-delta-rule backward
on Hopper GPUs with Triton 3.4 <= version < 3.7.1 (fla issue #640: a Triton codegen bug
corrupts dk/dg in `chunk_bwd_kernel_dqkwg`; the GPU machine has torch 2.11 + Triton 3.6,
and neither a newer Triton nor tilelang fits in what we can carry there).

`apply("torch")` replaces that one kernel, as called by fla's chunk gated delta rule
backward, with the plain PyTorch computation below (same math, per 64-token chunk, in
fp32; everything else stays on fla's Triton kernels).  `apply("triton")` lifts the guard
and uses fla's kernel as is (only safe if `gradcheck()` says so for the shapes in use).
`gradcheck()` compares q/k/v/g/beta gradients of fla's chunk_gated_delta_rule against a
token-by-token fp32 reference of the recurrence.
"""

from __future__ import annotations

import torch


def torch_chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                          state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """PyTorch port of fla.ops.common.chunk_o.chunk_bwd_kernel_dqkwg (fla 0.6.0) for the
    gated case without varlen: returns dq, dk, dw, dg (dg per token, before fla's reverse
    chunk-local cumsum), as fla's chunk_bwd_dqkwg does."""
    if cu_seqlens is not None or g is None or g_gamma is not None:
        raise NotImplementedError("torch_chunk_bwd_dqkwg: only the gated, non-varlen case")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    if T % BT:
        raise NotImplementedError(f"torch_chunk_bwd_dqkwg: T={T} must be a multiple of {BT}")
    NT, G = T // BT, HV // H

    def rep(x):
        x = x.float()
        return x.repeat_interleave(G, dim=2) if G > 1 else x

    def ch(x):  # [B, T, HV, D] -> [B, HV, NT, BT, D]
        return x.reshape(B, NT, BT, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    def unch(x):  # inverse of ch
        return x.permute(0, 2, 3, 1, 4).reshape(B, T, HV, x.shape[-1])

    qc, kc, vc, doc = ch(rep(q)), ch(rep(k)), ch(v.float()), ch(do.float())
    gc = g.float().reshape(B, NT, BT, HV).permute(0, 3, 1, 2)  # [B, HV, NT, BT]
    hh, dhh = h.float(), dh.float()  # [B, NT, HV, K, V] ([..., V, K] if state_v_first)
    if state_v_first:
        hh, dhh = hh.transpose(-1, -2), dhh.transpose(-1, -2)
    hh, dhh = hh.permute(0, 2, 1, 3, 4), dhh.permute(0, 2, 1, 3, 4)  # [B, HV, NT, K, V]

    ds = doc @ vc.transpose(-1, -2)  # [B, HV, NT, BT, BT]
    dq = doc @ hh.transpose(-1, -2)  # [B, HV, NT, BT, K]
    dk = vc @ dhh.transpose(-1, -2)
    dw = None
    if w is not None:
        dw = unch(-(ch(dv.float()) @ hh.transpose(-1, -2))).to(w.dtype)
    dg_last = (hh * dhh).sum((-1, -2))  # [B, HV, NT]
    g_last = gc[..., -1]
    dg_last = dg_last * torch.exp2(g_last)
    dq = dq * torch.exp2(gc)[..., None] * scale
    dk = dk * torch.exp2(g_last[..., None] - gc)[..., None]
    dg_last = dg_last + (dk * kc).sum((-1, -2))
    causal = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()
    ds = torch.where(causal, ds * torch.exp2(gc[..., :, None] - gc[..., None, :]), 0.0) * scale
    dq = dq + ds @ kc
    dk = dk + ds.transpose(-1, -2) @ qc
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)  # [B, HV, NT, BT]
    dg[..., -1] += dg_last
    dq, dk = unch(dq), unch(dk)
    dg = dg.permute(0, 2, 3, 1).reshape(B, T, HV)
    if G > 1:
        dq = dq.reshape(B, T, H, G, K).sum(3)
        dk = dk.reshape(B, T, H, G, K).sum(3)
    # fla views these later: they must be contiguous (unch's reshape can return a strided view)
    dw = dw.contiguous() if dw is not None else None
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dw, dg.contiguous()


def apply(mode: str) -> str:
    """mode: 'torch' (replace the kernel), 'triton' (lift fla's guard), 'none'."""
    import fla.ops.common.chunk_o as chunk_o
    import fla.ops.gated_delta_rule.chunk as gdr_chunk

    if mode == "torch":
        gdr_chunk.chunk_bwd_dqkwg = torch_chunk_bwd_dqkwg
    elif mode == "triton":
        chunk_o.TRITON_ABOVE_3_7_1 = True
    elif mode != "none":
        raise ValueError(mode)
    return mode


def reference_gdr(q, k, v, g, beta, scale):
    """Token-by-token fp32 gated delta rule with q/k L2 norm (HF/fla semantics)."""
    q = torch.nn.functional.normalize(q.float(), dim=-1, eps=1e-6) * scale
    k = torch.nn.functional.normalize(k.float(), dim=-1, eps=1e-6)
    v, g, beta = v.float(), g.float(), beta.float()
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V)
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kv = (S * k[:, t, :, :, None]).sum(-2)
        u = (v[:, t] - kv) * beta[:, t][..., None]
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, 1)


def gradcheck(device="cuda", B=2, T=256, H=4, K=64, V=64, dtype=torch.bfloat16, seed=0) -> dict:
    """Relative L2 errors of fla's chunk_gated_delta_rule output and input gradients
    (current patch mode) against reference_gdr on the same inputs."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    g = -torch.nn.functional.softplus(rnd(B, T, H)) * 0.5
    beta = torch.sigmoid(rnd(B, T, H))
    do = rnd(B, T, H, V)
    # dtypes as in HF's Qwen3NextGatedDeltaNet under bf16 autocast: q, k, v, beta bf16; g fp32
    xs = [x.to(device=device, dtype=torch.float32 if i == 3 else dtype) for i, x in enumerate([q, k, v, g, beta])]
    xs = [x.detach().requires_grad_(True) for x in xs]
    do = do.to(device)
    scale = K ** -0.5
    o, _ = chunk_gated_delta_rule(xs[0], xs[1], xs[2], g=xs[3], beta=xs[4], scale=scale,
                                  use_qk_l2norm_in_kernel=True)
    o.float().backward(do)
    got = [o.float().detach()] + [x.grad.float() for x in xs]
    ys = [x.detach().float().requires_grad_(True) for x in xs]
    o_ref = reference_gdr(*ys, scale=scale)
    o_ref.backward(do)
    ref = [o_ref.detach()] + [y.grad for y in ys]
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    return {n: float((a - b).norm() / b.norm().clamp(min=1e-12)) for n, a, b in zip(names, got, ref)}
