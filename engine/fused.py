"""The elementwise steps of a decoder layer behind one small interface.

* ``add_rms_norm(h, delta, weight, eps)``: ``h += delta`` in place (when ``delta`` is given),
  returns ``rms_norm(h) * weight`` as a new tensor;
* ``silu_mul(gate_up, inter)``: SwiGLU, ``silu(gate_up[:, :inter]) * gate_up[:, inter:]``;
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
                     eps: float) -> torch.Tensor:
        if delta is not None:
            h.add_(delta)
        return F.rms_norm(h, (h.shape[-1],), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
