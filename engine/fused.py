"""The elementwise steps of a decoder layer behind one small interface.

* ``add_rms_norm(h, delta, weight, eps, out_dtype=None)``: ``h += delta`` in place (when
  ``delta`` is given), returns ``rms_norm(h) * weight`` as a new tensor (in ``out_dtype``,
  default ``h``'s: the result computed in ``h``'s dtype, then rounded);
* ``silu_mul(gate_up, inter, out_dtype=None)``: SwiGLU, ``silu(gate_up[:, :inter]) *
  gate_up[:, inter:]``, in ``gate_up``'s dtype, or computed in float32 and returned in
  ``out_dtype`` when that is given (a bfloat16 matmul output in, the next one's input out);
* ``rope(x, cos, sin)``: rotary embedding of ``x [T, heads, head_dim]`` with the tables of
  ``engine.rotary.RotaryEmbedding.tables``; may rotate in place, returns the result.

:class:`TorchOps` is the definition (any device and dtype); on CPU float32 the model uses
``engine.native.FusedOps``, the same steps as single-pass C loops (one op instead of 3-6
small torch ops each, which at decode batch sizes cost more in dispatch than in math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
