"""The elementwise steps of a decoder layer behind one small interface.

* ``add_rms_norm(h, delta, weight, eps, out_dtype=None)``: ``h += delta`` in place (when
  ``delta`` is given), returns ``rms_norm(h) * weight`` as a new tensor (in ``out_dtype``,
  default ``h``'s: the result computed in ``h``'s dtype, then rounded);
* ``silu_mul(gate_up, inter, out_dtype=None)``: SwiGLU, ``silu(gate_up[:, :inter]) *
  gate_up[:, inter:]``, in ``gate_up``'s dtype, or computed in float32 and returned in
  ``out_dtype`` when that is given (a bfloat16 matmul output in, the next one's input out);
* ``rope_store(qkv, bias, cos, sin, cache, layer, slots, heads, head_scale=None)``: a fused q|k|v
  matmul output ``[T, (heads + 2 kv_heads) * head_dim]`` (float32, or the bfloat16 sums of a
  bfloat16 matmul) widened to float32 plus ``bias`` (or none), q and k rotated with the tables of
  ``engine.rotary.RotaryEmbedding.tables`` (``[T, 1 or heads + kv_heads, head_dim]``), each head's
  cos and sin times ``head_scale [heads + kv_heads]`` where given (the attention scale folded
  into the queries), k and v stored in layer ``layer`` of the KV ``cache``
  at ``slots [T]`` (``KVCache.write``: rounded to the pools' dtype); returns q, float32
  ``[T, heads, head_dim]``.

:class:`TorchOps` is the definition (any device and dtype); on CPU float32 the model uses
``engine.native.FusedOps``, the same steps as single-pass C loops (one op instead of 3-6
small torch ops each, which at decode batch sizes cost more in dispatch than in math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache


class TorchOps:
    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if delta is not None:
            h.add_(delta)
        out = F.rms_norm(h, (h.shape[-1],), weight, eps)
        return out if out_dtype is None else out.to(out_dtype)

    def silu_mul(self, gate_up: torch.Tensor, inter: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if out_dtype is not None:
            gate_up = gate_up.float()
        out = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return out if out_dtype is None else out.to(out_dtype)

    def rope_store(self, qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache, layer: int, slots: torch.Tensor, heads: int,
                   head_scale: torch.Tensor | None = None) -> torch.Tensor:
        t = qkv.shape[0]
        kv_heads, d = cache.num_kv_heads, cache.head_dim
        if head_scale is not None:
            scale = head_scale.view(1, -1, 1)
            cos, sin = cos * scale, sin * scale
        x = qkv.to(cos.dtype) if bias is None else qkv.to(cos.dtype) + bias
        qk = self.rope(x[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
        cache.write(layer, slots, qk[:, heads:], x[:, (heads + kv_heads) * d:].view(t, kv_heads, d))
        return qk[:, :heads]

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x [T, heads, head_dim]``: ``x * cos + rotate_half(x) * sin`` (the
        sign of ``rotate_half`` is in ``sin``)."""
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
