"""Deliberately naive float64 formulations written straight from SPEC sections 1-2.

Loops over heads and rotary pairs, no shared code with ``difftx.attention``: an independent
oracle for the modules and kernels.
"""

from __future__ import annotations

import math

import torch


def naive_rope(x, positions, theta):
    """x (B, T, d) one head; GPT-J pairs (2i, 2i+1) at frequency theta^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        ang = positions.double() * theta ** (-2 * i / d)  # (B, T)
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * c - b * s
        out[..., 2 * i + 1] = a * s + b * c
    return out


def naive_allowed(B, T, causal=True, key_valid=None, doc_ids=None):
    allowed = torch.ones(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            for j in range(T):
                ok = (j <= i) if causal else True
                if key_valid is not None:
                    ok = ok and bool(key_valid[b, j])
                if doc_ids is not None:
                    ok = ok and bool(doc_ids[b, i] == doc_ids[b, j])
                allowed[b, i, j] = ok or i == j
    return allowed


def _softmax_rows(scores, allowed):
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def naive_diff_attention(m, x, positions=None, allowed=None, lam_init=None, out_scale=None):
    """DiffAttention V1 per SPEC section 1, head by head. x (B, T, D) float64. ``lam_init``: a constant instead of
    the depth schedule; ``out_scale``: each head's scale instead of ``1 - lam_init`` (the regime map's arms)."""
    B, T, D = x.shape
    H, Hkv, d = m.n_heads, m.n_kv_heads, m.head_dim
    n_rep = H // Hkv
    pos = torch.arange(T)[None].expand(B, T) if positions is None else positions
    allowed = naive_allowed(B, T) if allowed is None else allowed
    q = x @ m.q_proj.weight.T  # (B, T, 2H*d)
    k = x @ m.k_proj.weight.T  # (B, T, 2Hkv*d)
    v = x @ m.v_proj.weight.T  # (B, T, Hkv*2d)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * m.layer_idx) if lam_init is None else lam_init
    out_scale = 1 - lam_init if out_scale is None else out_scale
    lam = (torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2).sum()) + lam_init)
    heads = []
    for h in range(H):
        g = h // n_rep
        q1 = naive_rope(q[..., (2 * h) * d:(2 * h + 1) * d], pos, m.rope_theta)
        q2 = naive_rope(q[..., (2 * h + 1) * d:(2 * h + 2) * d], pos, m.rope_theta)
        k1 = naive_rope(k[..., (2 * g) * d:(2 * g + 1) * d], pos, m.rope_theta)
        k2 = naive_rope(k[..., (2 * g + 1) * d:(2 * g + 2) * d], pos, m.rope_theta)
        vg = v[..., g * 2 * d:(g + 1) * 2 * d]
        a1 = _softmax_rows(q1 @ k1.transpose(-1, -2) / math.sqrt(d), allowed)
        a2 = _softmax_rows(q2 @ k2.transpose(-1, -2) / math.sqrt(d), allowed)
        o = a1 @ vg - lam * (a2 @ vg)  # (B, T, 2d)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + m.norm_eps) * m.subln.weight
        heads.append(out_scale * o)
    return torch.cat(heads, dim=-1) @ m.out_proj.weight.T


def naive_standard_attention(m, x, positions=None, allowed=None):
    return torch.cat(naive_standard_heads(m, x, positions, allowed), dim=-1) @ m.out_proj.weight.T


def naive_diff_v2(m, x, positions=None, allowed=None):
    """DIFF V2 per SPEC section 2: 2H query heads, pairs (2j, 2j+1) in one kv group."""
    B, T, D = x.shape
    H, Hkv, d = m.n_heads, m.n_kv_heads, m.head_dim
    per_group = 2 * H // Hkv
    pos = torch.arange(T)[None].expand(B, T) if positions is None else positions
    allowed = naive_allowed(B, T) if allowed is None else allowed
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    lam = torch.sigmoid(x @ m.lambda_proj.weight.T)  # (B, T, H)
    att = []
    for i in range(2 * H):
        g = i // per_group
        qi = naive_rope(q[..., i * d:(i + 1) * d], pos, m.rope_theta)
        kg = naive_rope(k[..., g * d:(g + 1) * d], pos, m.rope_theta)
        a = _softmax_rows(qi @ kg.transpose(-1, -2) / math.sqrt(d), allowed)
        att.append(a @ v[..., g * d:(g + 1) * d])
    heads = [att[2 * j] - lam[..., j:j + 1] * att[2 * j + 1] for j in range(H)]
    return torch.cat(heads, dim=-1) @ m.out_proj.weight.T


def _naive_rms(o, gain, eps):
    """RMSNorm over the last dimension, written out: o / sqrt(mean(o^2) + eps) * gain."""
    return o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * gain


def naive_standard_heads(m, x, positions=None, allowed=None):
    """The per-head outputs softmax(Q_h K_g^T / sqrt(d)) V_g of standard (GQA) attention, a list of
    H tensors (B, T, d), before anything is applied to them and before the output projection."""
    B, T, D = x.shape
    H, Hkv, d = m.n_heads, m.n_kv_heads, m.head_dim
    n_rep = H // Hkv
    pos = torch.arange(T)[None].expand(B, T) if positions is None else positions
    allowed = naive_allowed(B, T) if allowed is None else allowed
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    heads = []
    for h in range(H):
        g = h // n_rep
        qh = naive_rope(q[..., h * d:(h + 1) * d], pos, m.rope_theta)
        kh = naive_rope(k[..., g * d:(g + 1) * d], pos, m.rope_theta)
        a = _softmax_rows(qh @ kh.transpose(-1, -2) / math.sqrt(d), allowed)
        heads.append(a @ v[..., g * d:(g + 1) * d])
    return heads


def naive_gated_attention(m, x, positions=None, allowed=None):
    """Output-gated attention (Qiu et al. 2025): Y_h * sigmoid(x W_g), per head, then the output
    projection. ``m.gate == "elementwise"``: W_g (H*d, D), gate channels h*d..(h+1)*d of head h;
    ``"headwise"``: W_g (H, D), gate h of head h, the same for all d channels."""
    d = m.head_dim
    gates = torch.sigmoid(x @ m.gate_proj.weight.T)  # (B, T, H*d) or (B, T, H)
    out = []
    for h, y in enumerate(naive_standard_heads(m, x, positions, allowed)):
        g = gates[..., h * d:(h + 1) * d] if m.gate == "elementwise" else gates[..., h:h + 1]
        out.append(y * g)
    return torch.cat(out, dim=-1) @ m.out_proj.weight.T


def naive_standard_head_norm(m, x, positions=None, allowed=None):
    """Standard attention with a per-head RMSNorm over each d-wide head (gain ``subln.weight``,
    shared by heads), then the output projection (paper Table 6, "Transformer + per-head norm")."""
    heads = [_naive_rms(y, m.subln.weight, m.norm_eps) for y in naive_standard_heads(m, x, positions, allowed)]
    return torch.cat(heads, dim=-1) @ m.out_proj.weight.T


def naive_no_subtraction(m, x, positions=None, allowed=None, lambda_init=None):
    """DIFF V1's no-subtraction control: lambda = 0, so per head h only the first map counts,
    O_h = (1 - lambda_init) * RMSNorm_2d(A1 V_g) (or without the norm when ``m.subln`` is None).
    The second components Q2, K2 are never formed. ``lambda_init``: the depth schedule by default."""
    B, T, D = x.shape
    H, Hkv, d = m.n_heads, m.n_kv_heads, m.head_dim
    n_rep = H // Hkv
    pos = torch.arange(T)[None].expand(B, T) if positions is None else positions
    allowed = naive_allowed(B, T) if allowed is None else allowed
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * m.layer_idx) if lambda_init is None else lambda_init
    heads = []
    for h in range(H):
        g = h // n_rep
        q1 = naive_rope(q[..., (2 * h) * d:(2 * h + 1) * d], pos, m.rope_theta)
        k1 = naive_rope(k[..., (2 * g) * d:(2 * g + 1) * d], pos, m.rope_theta)
        a1 = _softmax_rows(q1 @ k1.transpose(-1, -2) / math.sqrt(d), allowed)
        o = a1 @ v[..., g * 2 * d:(g + 1) * 2 * d]  # (B, T, 2d)
        if m.subln is not None:
            o = _naive_rms(o, m.subln.weight, m.norm_eps)
        heads.append((1 - lam_init) * o)
    return torch.cat(heads, dim=-1) @ m.out_proj.weight.T


def naive_standard_scaled(m, x, scale, norm, positions=None, allowed=None):
    """Standard attention whose heads (each normalised by its own RMSNorm with gain ``subln.weight`` when ``norm``)
    are multiplied by the constant ``scale`` before the output projection: the regime map's baseline controls."""
    heads = naive_standard_heads(m, x, positions, allowed)
    if norm:
        heads = [_naive_rms(y, m.subln.weight, m.norm_eps) for y in heads]
    return torch.cat([scale * y for y in heads], dim=-1) @ m.out_proj.weight.T
