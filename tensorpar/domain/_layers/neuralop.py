"""neuraloperator's FNO layers over a split domain (matched by class name: no import).

- ``SpectralConv`` (2-D, split along H): its FFT covers the whole domain through
  `distributed_rfft2_apply`: the real FFT along W on the tile, keeping the retained
  columns only; one all-to-all gathers H and splits those columns; the FFT along H, the
  fftshift, mode selection and weight contraction run on the rank's columns; the inverse
  path mirrors it. The weight's gradient on a rank covers its columns (summed over the
  domain like every parameter's).
- ``GridEmbeddingND`` / ``GridEmbedding2D``: the tile's rows of the dense grid.
- ``ChannelMLP`` / ``Flattened1dConv`` (1x1 convolutions over the flattened tile) run as
  they are; an empty tile skips their ``reshape(..., -1)``, which 0 elements leave ambiguous.

What cannot be converted is refused by `refusal` with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorpar.context.fft import distributed_rfft2_apply
from tensorpar.domain._layers.window import EmptyOut
from tensorpar.domain._tiles.layout import DomainContext

__all__ = ["CONVERT", "REFUSE", "refusal"]

_P = "neuralop.layers."
SPECTRAL = _P + "spectral_convolution.SpectralConv"


def spectral_conv_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``SpectralConv.forward`` (real data, full precision, no resampling) on a tile of H."""
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    where = "SpectralConv (domain-parallel)"
    if x.dim() != 4 or ctx.dims != (-2,):
        raise ValueError(f"{where}: expected a (B, C, H, W) tile split along H (dim -2), got "
                         f"shape {tuple(x.shape)} split along {ctx.dims}")
    rows = ctx.sizes_of(0, x.shape[-2], where, x.device)
    h, w = sum(rows), x.shape[-1]
    weight = _weight(module, [h, w // 2 + 1])  # (C_in[, C_out], kh, kw)
    kh, kw = weight.shape[-2:]
    lo = h // 2 - kh // 2  # the kept rows of the fftshifted H frequencies

    def contract(spec: torch.Tensor, start: int) -> torch.Tensor:
        # spec: (B, C_in, H, c), kept columns [start, start + c) (past kw: padding)
        c, stop = spec.shape[-1], min(start + spec.shape[-1], kw)
        sel = torch.fft.fftshift(spec, dim=-2)[..., lo:lo + kh, :max(stop - start, 0)]
        wt = weight[..., start:stop]
        out = sel * wt if module.separable else torch.einsum("bixy,ioxy->boxy", sel, wt)
        full = out.new_zeros(out.shape[0], out.shape[1], h, c)
        full[..., lo:lo + kh, :out.shape[-1]] = out  # zeros elsewhere, as dense
        back: torch.Tensor = torch.fft.fftshift(full, dim=-2)  # neuraloperator: not ifftshift
        return back

    y = distributed_rfft2_apply(x, contract, split_dim=-2, other_dim=-1, columns=kw,
                                sizes=rows, group=ctx.groups[0], norm=module.fft_norm)
    if module.bias is not None:
        y = y + module.bias
    return y


def _weight(module: Any, fft_size: list[int]) -> torch.Tensor:
    """The dense spectral weight, cut to the modes ``SpectralConv.forward`` uses."""
    w = module.weight
    full = w if torch.is_tensor(w) else w.to_tensor()  # tltorch: Dense, or reconstructed
    starts = [m - min(size, n) for size, n, m in
              zip(fft_size, module.n_modes, module.max_n_modes, strict=False)]
    cut = [slice(None)] * (1 if module.separable else 2)
    cut += [slice(s // 2, -s // 2) if s else slice(None) for s in starts[:-1]]
    cut += [slice(None, -starts[-1]) if starts[-1] else slice(None)]
    out: torch.Tensor = full[tuple(cut)]
    return out


def grid_embedding_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``GridEmbeddingND`` / ``GridEmbedding2D``: the dense grid's rows of this tile."""
    if ctx.dense:
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    where = f"{type(module).__name__} (domain-parallel)"
    spatial = list(x.shape[2:])
    owned = []
    for i, d in enumerate(ctx.dims):
        sizes = ctx.sizes_of(i, x.shape[d], where, x.device)
        spatial[len(spatial) + d] = sum(sizes)
        owned.append(ctx.owned(i, sizes))
    grids = module.grid(torch.Size(spatial), x.device, x.dtype)  # (1, 1, *spatial) each
    tiles = []
    for t in grids:
        for d, (start, stop) in zip(ctx.dims, owned, strict=False):
            t = t.narrow(t.dim() + d, start, stop - start)
        tiles.append(t.expand(x.shape[0], *t.shape[1:]))
    return torch.cat((x, *tiles), dim=1)


def flattening_forward(module: Any, ctx: DomainContext, x: torch.Tensor) -> torch.Tensor:
    """``ChannelMLP`` / ``Flattened1dConv`` as they are; an empty tile gives an empty output."""
    if x.numel():
        return type(module).forward(module, x)  # type: ignore[no-any-return]
    out = module.out_channels if hasattr(module, "out_channels") else module.conv.out_channels
    empty: torch.Tensor = EmptyOut.apply(  # type: ignore[no-untyped-call]
        (x.shape[0], out, *x.shape[2:]), x, *module.parameters())
    return empty


CONVERT: dict[str, tuple[Any, tuple[str, ...]]] = {
    SPECTRAL: (spectral_conv_forward, ("output_shape",)),
    _P + "embeddings.GridEmbeddingND": (grid_embedding_forward, ()),
    _P + "embeddings.GridEmbedding2D": (grid_embedding_forward, ()),
    _P + "channel_mlp.ChannelMLP": (flattening_forward, ()),
    _P + "skip_connections.Flattened1dConv": (flattening_forward, ()),
}
"""Class name -> (domain-parallel forward, keyword arguments accepted when ``None``)."""

REFUSE = {
    _P + "padding.DomainPadding": "FNO's domain_padding pads the whole domain with F.pad "
                                  "(its pad()/unpad() are not converted); build the FNO with "
                                  "domain_padding=None",
    _P + "normalization_layers.AdaIN": "F.group_norm over the tile (not the domain)",
    _P + "normalization_layers.InstanceNorm": "F.instance_norm over the tile (not the "
                                              "domain); norm='group_norm' converts",
}
"""Class name -> why it cannot be converted."""


def refusal(module: Any, name: str, dims: tuple[int, ...]) -> str | None:
    """Why a neuraloperator layer cannot be converted (``None``: it can)."""
    if name in REFUSE:
        return REFUSE[name]
    if name != SPECTRAL:
        return None
    if module.complex_data:
        return "complex_data=True (only real data: rfft along W)"
    if module.fno_block_precision != "full":
        return f"fno_block_precision={module.fno_block_precision!r} (only 'full')"
    if module.resolution_scaling_factor is not None:
        return "resolution_scaling_factor is set (the output would be resampled)"
    if module.order != 2:
        return f"a {module.order}-D spectral convolution (only 2-D, split along H)"
    if dims not in ((-2,), (2,)):
        return f"dims={dims}: a 2-D spectral convolution splits H only (dims=-2)"
    return None
