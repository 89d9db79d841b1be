"""Attention over a split domain: diffusers' spatial self-attention (``Attention``, in
``UNet2DModel``'s attention blocks and mid block) and MONAI's ``SpatialAttentionBlock`` (in
``DiffusionModelUNet`` and ``AutoencoderKL``) attend over every rank's points, float64
within 1e-10 of dense; attention the conversion does not know is refused, not run on the
tile's points alone."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.testing import run_distributed
from tests._domain_check import check

pytestmark = pytest.mark.timeout(900)
T = 600
TOL = 1e-10


def attention_unet():
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=16, in_channels=2, out_channels=2, layers_per_block=1,
                       block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), add_attention=True,
                       norm_num_groups=4, attention_head_dim=4)


def _timestep():
    return (torch.tensor([3, 7]),)


def _unet(sizes, steps=0):
    warnings.filterwarnings("ignore")
    # lr 0.01: at 0.1 the outputs grow ~30x a step, and two dense copies 1e-14 apart
    # (relative) differ by 3e-9 after the third
    return check(attention_unet, [2, 2, sum(sizes), 16], (-2,), (sizes,), extra=_timestep,
                 steps=steps, lr=0.01)


def _unet_tiles(hs, ws, mesh):
    warnings.filterwarnings("ignore")
    return check(attention_unet, [2, 2, sum(hs), sum(ws)], (-2, -1), (hs, ws),
                 mesh_shape=mesh, extra=_timestep)


def _unet_along_w(sizes):
    warnings.filterwarnings("ignore")
    return check(attention_unet, [2, 2, 16, sum(sizes)], (-1,), (sizes,), extra=_timestep)


def test_attention_unet_two_ranks():
    pytest.importorskip("diffusers")
    assert max(run_distributed(_unet, 2, [9, 7], timeout=T)) < TOL


def test_attention_unet_three_optimizer_steps():
    pytest.importorskip("diffusers")
    assert max(run_distributed(_unet, 2, [7, 9], 3, timeout=T)) < TOL


@pytest.mark.slow
def test_attention_unet_three_ranks_and_an_empty_tile():
    pytest.importorskip("diffusers")
    assert max(run_distributed(_unet, 3, [5, 6, 5], timeout=T)) < TOL
    assert max(run_distributed(_unet, 3, [10, 0, 6], timeout=T)) < TOL


@pytest.mark.slow
def test_attention_unet_split_along_w():
    # the flattened tile is not a contiguous piece of the sequence: attention without a
    # mask does not depend on the keys' order
    pytest.importorskip("diffusers")
    assert max(run_distributed(_unet_along_w, 2, [6, 10], timeout=T)) < TOL


@pytest.mark.slow
def test_attention_unet_two_by_two_tiles():
    pytest.importorskip("diffusers")
    assert max(run_distributed(_unet_tiles, 4, [9, 7], [6, 10], (2, 2), timeout=T)) < TOL


class _PlainAttention(nn.Module):
    """Self-attention over the image's points through ``F.scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Conv2d(2, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).flatten(2).transpose(1, 2).unsqueeze(1).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)
        return out.squeeze(1).transpose(1, 2).reshape(x.shape)


class _TorchAttention(nn.Module):
    """``nn.MultiheadAttention`` over the image's points, then over pooled features."""

    def __init__(self, on_points: bool) -> None:
        super().__init__()
        self.on_points = on_points
        self.attn = nn.MultiheadAttention(2, 1, batch_first=True)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_points:
            seq = x.flatten(2).transpose(1, 2)
            return self.attn(seq, seq, seq)[0]
        seq = self.pool(x).flatten(2).transpose(1, 2)  # replicated after the pooling
        return self.attn(seq, seq, seq)[0]


def _refused(kind):
    from tensorpar.nn import parallelize_domain
    x = torch.randn(1, 2, 4, 5)
    if kind == "pooled":  # on replicated data: runs, as dense
        torch.manual_seed(0)
        dense = _TorchAttention(False)
        model = parallelize_domain(_TorchAttention(False), dims=-2)
        model.load_state_dict(dense.state_dict())
        torch.manual_seed(1)
        full = torch.randn(1, 2, 8, 5)
        rank = torch.distributed.get_rank()
        return float((model(full[:, :, 4 * rank:4 * rank + 4]) - dense(full)).abs().max()) < 1e-6
    model = parallelize_domain(_PlainAttention() if kind == "functional"
                               else _TorchAttention(True), dims=-2)
    name = "scaled_dot_product_attention" if kind == "functional" else "multi_head_attention"
    with pytest.raises(RuntimeError, match=name):
        model(x)
    model.eval()  # nn.MultiheadAttention's fused inference path included
    with torch.no_grad(), pytest.raises(RuntimeError, match=name):
        model(x)
    return True


@pytest.mark.parametrize("kind", ["functional", "module", "pooled"])
def test_attention_not_converted_is_refused_on_tiles(kind):
    assert all(run_distributed(_refused, 2, kind, timeout=T))


def _refused_config(what):
    from diffusers.models.attention_processor import Attention, AttnProcessor

    from tensorpar.nn import parallelize_domain
    kwargs = {"cross": {"cross_attention_dim": 8}, "spatial": {"spatial_norm_dim": 4}}
    attn = Attention(32, heads=2, dim_head=4, norm_num_groups=2, **kwargs.get(what, {}))
    if what == "processor":
        attn.set_processor(AttnProcessor())
    with pytest.raises(ValueError, match="cannot convert") as err:
        parallelize_domain(nn.Sequential(nn.Conv2d(2, 32, 1), attn), dims=-2)
    return str(err.value)


@pytest.mark.parametrize("what", ["cross", "spatial", "processor"])
def test_attention_configurations_not_converted_are_refused(what):
    pytest.importorskip("diffusers")
    messages = run_distributed(_refused_config, 2, what, timeout=T)
    assert all("Attention" in m for m in messages)


def default_blocks_unet():
    """UNet2DModel's default blocks: three attention levels down and up, two layers each."""
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=32, in_channels=3, out_channels=3,
                       block_out_channels=(16, 32, 32, 32), norm_num_groups=8)


def _default_blocks(sizes):
    warnings.filterwarnings("ignore")
    return check(default_blocks_unet, [1, 3, sum(sizes), 32], (-2,), (sizes,),
                 extra=lambda: (torch.tensor([10]),), steps=2, lr=0.01)


@pytest.mark.slow
def test_unet_with_default_blocks_three_ranks():
    pytest.importorskip("diffusers")
    assert max(run_distributed(_default_blocks, 3, [11, 11, 10], timeout=T)) < TOL


class _Conditioned(nn.Module):
    """Attention over conditioning tokens (not the image's points), added to the tiles."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.functional:
            q = tokens.unsqueeze(1)
            context = F.scaled_dot_product_attention(q, q, q).squeeze(1)
        else:  # its out_proj's parameters are used without out_proj's forward
            context = self.attn(tokens, tokens, tokens)[0]
        return self.conv(x) + context.mean(1)[:, :, None, None]


def _conditioned(functional):
    return check(lambda: _Conditioned(functional), [2, 2, 7, 5], (-2,), ([4, 3],),
                 extra=lambda: (torch.randn(2, 3, 4, dtype=torch.float64),), steps=2)


@pytest.mark.parametrize("functional", [True, False])
def test_attention_over_conditioning_tokens_runs_as_dense(functional):
    assert max(run_distributed(_conditioned, 2, functional, timeout=T)) < TOL


class _AttentionAfterPooling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.conv(x)
        summary = self.pool(f)
        seq = f.flatten(2).transpose(1, 2).unsqueeze(1)  # the tile's points
        return F.scaled_dot_product_attention(seq, seq, seq), summary


def _after_pooling():
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(_AttentionAfterPooling(), dims=-2)
    with pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
        model(torch.randn(1, 2, 4, 5))
    return True


def test_attention_on_tiles_after_a_global_pooling_is_refused():
    assert all(run_distributed(_after_pooling, 2, timeout=T))


class _AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from diffusers.models.attention_processor import Attention
        self.inp, self.out = nn.Conv2d(2, 8, 3, padding=1), nn.Conv2d(8, 2, 3, padding=1)
        self.attn = Attention(8, heads=2, dim_head=4, norm_num_groups=2,
                              residual_connection=True, rescale_output_factor=2.0,
                              _from_deprecated_attn_block=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(self.inp(x)))


def _penalty(sizes):
    """A gradient penalty through the attention (``double_backward=True``) against dense."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tensorpar.nn import parallelize_domain
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    dense = _AttentionNet().double()
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    par = parallelize_domain(copy.deepcopy(dense), dims=-2, double_backward=True)
    with sdpa_kernel(SDPBackend.MATH):  # torch's fused CPU kernel is differentiable once
        xd = x.clone().requires_grad_()
        (gd,) = torch.autograd.grad(dense(xd).square().sum(), xd, create_graph=True)
        gd.square().sum().backward()
        tile = x.narrow(2, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
        (g,) = torch.autograd.grad(par(tile).square().sum(), tile, create_graph=True)
        g.square().sum().backward()
    worst = (g - gd.narrow(2, sum(sizes[:rank]), sizes[rank])).abs().max().item()
    for p, q in zip(par.parameters(), dense.parameters(), strict=True):
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def test_gradient_penalty_through_attention_on_strips():
    pytest.importorskip("diffusers")
    assert max(run_distributed(_penalty, 2, [4, 3], timeout=T)) < TOL


class _Checkpointed(_AttentionNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        return self.out(checkpoint(self.attn, self.inp(x), use_reentrant=False))


def _checkpointed():
    from tensorpar.nn import parallelize_domain
    model = parallelize_domain(_Checkpointed(), dims=-2)
    out = model(torch.randn(1, 2, 4, 6))
    with pytest.raises(RuntimeError, match="outside the forward"):
        out.sum().backward()
    return True


def test_checkpointed_attention_is_refused_at_its_recompute():
    pytest.importorskip("diffusers")
    assert all(run_distributed(_checkpointed, 2, timeout=T))


def autoencoder():
    """diffusers' AutoencoderKL: encoder and decoder, each with a mid-block attention."""
    from diffusers import AutoencoderKL
    return AutoencoderKL(in_channels=2, out_channels=2, block_out_channels=(8, 16),
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                         latent_channels=2, norm_num_groups=4, sample_size=16)


def _autoencoder(splits, dims, mesh):
    warnings.filterwarnings("ignore")
    shape = [1, 2, 12, 12]
    return check(autoencoder, shape, dims, splits, mesh_shape=mesh, steps=2, lr=0.01)


@pytest.mark.slow
def test_autoencoder_strips_and_tiles():
    pytest.importorskip("diffusers")
    assert max(run_distributed(_autoencoder, 3, ([7, 0, 5],), (-1,), None, timeout=T)) < TOL
    assert max(run_distributed(_autoencoder, 4, ([5, 7], [8, 4]), (-2, -1), (2, 2),
                               timeout=T)) < TOL


def monai_diffusion_unet(spatial_dims=2):
    from monai.networks.nets import DiffusionModelUNet
    return DiffusionModelUNet(spatial_dims=spatial_dims, in_channels=1, out_channels=1,
                              num_res_blocks=1, channels=(8, 16), attention_levels=(False, True),
                              norm_num_groups=4, num_head_channels=8)


class _Reconstruct(nn.Module):
    """MONAI's AutoencoderKL through its mean latent (its sampled one draws noise)."""

    def __init__(self) -> None:
        super().__init__()
        from monai.networks.nets import AutoencoderKL
        self.vae = AutoencoderKL(spatial_dims=2, in_channels=1, out_channels=1,
                                 num_res_blocks=(1, 1), channels=(8, 16),
                                 attention_levels=(False, True), norm_num_groups=4,
                                 latent_channels=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vae.reconstruct(x)  # type: ignore[no-any-return]


def _monai(name, shape, dims, splits, mesh, steps):
    warnings.filterwarnings("ignore")
    if name == "autoencoder":
        return check(_Reconstruct, shape, dims, splits, mesh_shape=mesh, steps=steps, lr=0.01)
    return check(lambda: monai_diffusion_unet(len(shape) - 2), shape, dims, splits,
                 mesh_shape=mesh, extra=_timestep, steps=steps, lr=0.01)


def test_monai_diffusion_unet_with_attention_two_ranks():
    pytest.importorskip("monai")
    assert max(run_distributed(_monai, 2, "unet", [2, 1, 16, 12], (-2,), ([9, 7],), None, 2,
                               timeout=T)) < TOL


@pytest.mark.slow
def test_monai_diffusion_unet_3d_three_ranks_and_an_empty_tile():
    pytest.importorskip("monai")
    assert max(run_distributed(_monai, 3, "unet", [2, 1, 8, 6, 6], (-3,), ([5, 0, 3],), None,
                               0, timeout=T)) < TOL


@pytest.mark.slow
def test_monai_autoencoder_strips_and_tiles():
    pytest.importorskip("monai")
    assert max(run_distributed(_monai, 2, "autoencoder", [2, 1, 12, 16], (-1,), ([7, 9],),
                               None, 2, timeout=T)) < TOL
    assert max(run_distributed(_monai, 4, "autoencoder", [2, 1, 12, 16], (-2, -1),
                               ([5, 7], [9, 7]), (2, 2), 0, timeout=T)) < TOL


class _Tokens(nn.Module):
    """MONAI's SABlock on the tile's points, outside a SpatialAttentionBlock."""

    def __init__(self) -> None:
        super().__init__()
        from monai.networks.blocks import SABlock
        self.attn = SABlock(hidden_size=4, num_heads=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x.flatten(2).transpose(1, 2))  # type: ignore[no-any-return]


def _monai_refused(what):
    from tensorpar.nn import parallelize_domain
    if what == "tokens":
        model: nn.Module = _Tokens()
    else:
        model = monai_diffusion_unet()
        for m in model.modules():
            if type(m).__name__ == "SABlock" and what == "saved_attention":
                m.save_attn = True
            elif type(m).__name__ == "SABlock":  # as another MONAI version might have it
                del m.input_rearrange
    match = {"tokens": "SABlock", "saved_attention": "save_attn",
             "other_version": "another MONAI version"}[what]
    with pytest.raises(ValueError, match=match):
        parallelize_domain(model, dims=-2)
    return True


@pytest.mark.parametrize("what", ["tokens", "saved_attention", "other_version"])
def test_monai_attention_not_converted_is_refused(what):
    pytest.importorskip("monai")
    assert all(run_distributed(_monai_refused, 2, what, timeout=T))
