#!/usr/bin/env python3
"""Independent from-scratch check of the golden fixtures (no `transformers` import).

Re-implements the Qwen3-Next / Qwen3.5 text forward in ~200 lines of plain torch,
reading only the fixture folder (config.json + *.safetensors), and compares with
golden.safetensors.  It deliberately uses a *different* algorithm from HF's reference
path -- the GatedDeltaNet prefill runs token by token (the recurrent form) instead of
HF's chunked WY form -- so agreement shows that the fixtures mean what
tools/README-golden.md says (weight layouts, K-major state, conv-state layout, RoPE,
gating, routing).  It doubles as an executable spec for the Rust implementation.

    /work/pyenv/hf/bin/python tools/check_golden.py            # all fixture folders
    /work/pyenv/hf/bin/python tools/check_golden.py qwen3_5    # one of them
    /work/pyenv/hf/bin/python tools/check_golden.py --f64      # reference in float64
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent / "dataplane" / "tests" / "fixtures" / "golden"
F32 = torch.float32


def rms_zc(x, w, eps):  # zero-centred RMSNorm: x / rms(x) * (1 + w)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def l2n(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class Model:
    def __init__(self, folder: Path, dtype: torch.dtype = F32):
        self.dt = dtype
        cfg = json.loads((folder / "config.json").read_text())
        self.name = folder.name
        self.c = cfg.get("text_config", cfg)
        w = {}
        for fn in sorted(folder.glob("model*.safetensors")):
            w.update({k: v.to(dtype) for k, v in load_file(str(fn)).items()})
        self.prefix = "model.language_model." if "text_config" in cfg else "model."
        self.w = w
        c = self.c
        self.types = c["layer_types"]
        self.eps = c["rms_norm_eps"]
        self.Hk, self.Hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.K = c["linear_conv_kernel_dim"]
        self.H, self.Hkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        rp = c.get("rope_parameters") or {}
        self.rot = int(self.hd * rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
        theta = rp.get("rope_theta", c.get("rope_theta"))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.rot, 2, dtype=dtype) / self.rot))
        self.mlp_only = set(c.get("mlp_only_layers", []) or [])
        self.num_experts = c.get("num_experts", 0)
        self.topk = c.get("num_experts_per_tok", 0)
        self.norm_topk = c.get("norm_topk_prob", True)  # qwen3_5_moe: always renormalised

    def p(self, name):
        return self.w[self.prefix + name]

    # ---- state: per linear layer (conv [conv_dim, K], S [Hv, dk, dv]); per full layer (k, v [Hkv, T, hd])
    def new_state(self):
        st = {}
        cd = 2 * self.Hk * self.dk + self.Hv * self.dv
        for i, t in enumerate(self.types):
            if t == "linear_attention":
                st[i] = {"conv": torch.zeros(cd, self.K, dtype=self.dt), "S": torch.zeros(self.Hv, self.dk, self.dv, dtype=self.dt)}
            else:
                st[i] = {"k": torch.zeros(self.Hkv, 0, self.hd, dtype=self.dt), "v": torch.zeros(self.Hkv, 0, self.hd, dtype=self.dt)}
        return st

    def gdn(self, i, x, st):  # x [hidden] one token
        pre = f"layers.{i}.linear_attn."
        r = self.Hv // self.Hk
        if self.prefix == "model.":  # Qwen3-Next fused, grouped per key head
            qkvz = (self.p(pre + "in_proj_qkvz.weight") @ x).view(self.Hk, 2 * self.dk + 2 * r * self.dv)
            q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            ba = (self.p(pre + "in_proj_ba.weight") @ x).view(self.Hk, 2 * r)
            b, a = ba[:, :r].reshape(self.Hv), ba[:, r:].reshape(self.Hv)
            mixed = torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
            z = z.reshape(self.Hv, self.dv)
        else:  # Qwen3.5 split, contiguous
            mixed = self.p(pre + "in_proj_qkv.weight") @ x
            z = (self.p(pre + "in_proj_z.weight") @ x).view(self.Hv, self.dv)
            b = self.p(pre + "in_proj_b.weight") @ x
            a = self.p(pre + "in_proj_a.weight") @ x
        # depthwise causal conv over time; the state holds the last K inputs, oldest first
        conv = torch.cat([st["conv"][:, 1:], mixed[:, None]], dim=1)
        st["conv"] = conv
        cw = self.p(pre + "conv1d.weight")[:, 0, :]  # [conv_dim, K]
        y = F.silu((conv * cw).sum(-1))
        kd = self.Hk * self.dk
        q = y[:kd].view(self.Hk, self.dk).repeat_interleave(r, 0)  # value head j uses key head j // r
        k = y[kd : 2 * kd].view(self.Hk, self.dk).repeat_interleave(r, 0)
        v = y[2 * kd :].view(self.Hv, self.dv)
        q, k = l2n(q) * self.dk**-0.5, l2n(k)
        beta = torch.sigmoid(b)
        g = -self.p(pre + "A_log").exp() * F.softplus(a + self.p(pre + "dt_bias"))
        S = st["S"] * g.exp()[:, None, None]  # [Hv, dk, dv], K-major
        kv_mem = torch.einsum("hkv,hk->hv", S, k)
        S = S + k[:, :, None] * ((v - kv_mem) * beta[:, None])[:, None, :]
        st["S"] = S
        o = torch.einsum("hkv,hk->hv", S, q)  # read after write
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.p(pre + "norm.weight") * F.silu(z)
        return self.p(pre + "out_proj.weight") @ o.reshape(-1)

    def rope(self, x, pos):  # x [heads, hd]; neox rotate_half on the first `rot` dims
        f = pos * self.inv_freq
        cos, sin = torch.cat([f, f]).cos(), torch.cat([f, f]).sin()
        xr, xp = x[:, : self.rot], x[:, self.rot :]
        h = self.rot // 2
        rot = torch.cat([-xr[:, h:], xr[:, :h]], dim=-1)
        return torch.cat([xr * cos + rot * sin, xp], dim=-1)

    def attn(self, i, x, st, pos):
        pre = f"layers.{i}.self_attn."
        qg = (self.p(pre + "q_proj.weight") @ x).view(self.H, 2 * self.hd)  # per head [q | gate]
        q, gate = qg[:, : self.hd], qg[:, self.hd :].reshape(-1)
        k = (self.p(pre + "k_proj.weight") @ x).view(self.Hkv, self.hd)
        v = (self.p(pre + "v_proj.weight") @ x).view(self.Hkv, self.hd)
        q = self.rope(rms_zc(q, self.p(pre + "q_norm.weight"), self.eps), pos)
        k = self.rope(rms_zc(k, self.p(pre + "k_norm.weight"), self.eps), pos)
        st["k"] = torch.cat([st["k"], k[:, None]], dim=1)
        st["v"] = torch.cat([st["v"], v[:, None]], dim=1)
        rep = self.H // self.Hkv
        K, V = st["k"].repeat_interleave(rep, 0), st["v"].repeat_interleave(rep, 0)
        att = torch.softmax(torch.einsum("hd,htd->ht", q, K) * self.hd**-0.5, dim=-1)
        o = torch.einsum("ht,htd->hd", att, V).reshape(-1) * torch.sigmoid(gate)
        return self.p(pre + "o_proj.weight") @ o

    def swiglu(self, g, u, d, x):
        return d @ (F.silu(g @ x) * (u @ x))

    def mlp(self, i, x):
        pre = f"layers.{i}.mlp."
        if self.num_experts == 0 or i in self.mlp_only:
            return self.swiglu(self.p(pre + "gate_proj.weight"), self.p(pre + "up_proj.weight"), self.p(pre + "down_proj.weight"), x)
        probs = torch.softmax(self.p(pre + "gate.weight") @ x, -1)
        top, idx = probs.topk(self.topk)
        if self.norm_topk:
            top = top / top.sum()
        out = torch.zeros_like(x)
        for wgt, e in zip(top.tolist(), idx.tolist()):
            if self.prefix + pre + "experts.gate_up_proj" in self.w:  # fused [E, 2I, H], gate first
                gu, dn = self.p(pre + "experts.gate_up_proj")[e], self.p(pre + "experts.down_proj")[e]
                inter = gu.shape[0] // 2
                out += wgt * self.swiglu(gu[:inter], gu[inter:], dn, x)
            else:  # per-expert
                ep = pre + f"experts.{e}."
                out += wgt * self.swiglu(self.p(ep + "gate_proj.weight"), self.p(ep + "up_proj.weight"), self.p(ep + "down_proj.weight"), x)
        sh = self.swiglu(self.p(pre + "shared_expert.gate_proj.weight"), self.p(pre + "shared_expert.up_proj.weight"), self.p(pre + "shared_expert.down_proj.weight"), x)
        return out + torch.sigmoid(self.p(pre + "shared_expert_gate.weight") @ x) * sh

    def step(self, tok, pos, st):
        x = self.p("embed_tokens.weight")[tok]
        for i, t in enumerate(self.types):
            h = rms_zc(x, self.p(f"layers.{i}.input_layernorm.weight"), self.eps)
            x = x + (self.gdn(i, h, st[i]) if t == "linear_attention" else self.attn(i, h, st[i], pos))
            x = x + self.mlp(i, rms_zc(x, self.p(f"layers.{i}.post_attention_layernorm.weight"), self.eps))
        x = rms_zc(x, self.p("norm.weight"), self.eps)
        return self.w["lm_head.weight"] @ x

    @torch.no_grad()
    def prefill_logits(self, ids: list[int]) -> torch.Tensor:
        st = self.new_state()
        return torch.stack([self.step(t, p, st) for p, t in enumerate(ids)])


@torch.no_grad()
def check(folder: Path, dtype: torch.dtype = F32) -> bool:
    m = Model(folder, dtype)
    gold = load_file(str(folder / "golden.safetensors"))
    meta = json.loads((folder / "golden.json").read_text())
    ok = True
    worst = {}

    def cmp(key, got, tol):
        nonlocal ok
        d = float((got.double() - gold[key].double()).abs().max())
        kind = key.split(".", 1)[1].split(".")[-1] if key.count(".") else key
        worst[kind] = max(worst.get(kind, 0.0), d)
        if d > tol:
            ok = False
            print(f"  MISMATCH {key}: max abs diff {d:.3e} > {tol}")

    for L in meta["prompt_lens"]:
        ids = gold[f"p{L}.ids"].tolist()
        st = m.new_state()
        logits = torch.stack([m.step(t, p, st) for p, t in enumerate(ids)])
        cmp(f"p{L}.logits", logits, 2e-3)
        for i in meta["linear_attention_layers"]:
            cmp(f"p{L}.layer{i}.recurrent", st[i]["S"], 2e-3)
            cmp(f"p{L}.layer{i}.conv", st[i]["conv"], 1e-4)
        for i in meta["full_attention_layers"]:
            cmp(f"p{L}.layer{i}.k", st[i]["k"], 1e-3)
            cmp(f"p{L}.layer{i}.v", st[i]["v"], 1e-3)
        out, lg, tok = [], [logits[-1]], int(logits[-1].argmax())
        for n in range(meta["greedy_len"]):
            out.append(tok)
            if n + 1 < meta["greedy_len"]:
                lg.append(m.step(tok, L + n, st))
                tok = int(lg[-1].argmax())
        if out != gold[f"p{L}.greedy"].tolist():
            ok = False
            print(f"  MISMATCH p{L}.greedy: {out} vs {gold[f'p{L}.greedy'].tolist()}")
        cmp(f"p{L}.greedy_logits", torch.stack(lg), 2e-3)
    print(f"{folder.name} ({str(dtype).replace('torch.', '')} reference): {'OK' if ok else 'FAILED'}; worst abs diffs: " + ", ".join(f"{k}={v:.1e}" for k, v in sorted(worst.items())))
    return ok


def main(argv):
    dtype = F32
    if "--f64" in argv:  # same check with the reference in float64
        argv = [a for a in argv if a != "--f64"]
        dtype = torch.float64
    names = argv or sorted(p.name for p in ROOT.iterdir() if (p / "golden.safetensors").exists())
    torch.set_num_threads(1)
    return 0 if all([check(ROOT / n, dtype) for n in names]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
