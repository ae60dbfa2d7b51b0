"""RevNet and i-RevNet: the paper's sizes, gradients equal to plain autograd, BatchNorm statistics updated once,
activation memory that does not grow with depth, exact inverses, meta builds, and clear errors."""

import copy
import math

import pytest
import torch
from conftest import max_rel_err, to_host

from revlib_xla.memory import saved_bytes
from revlib_xla.models import (
    build_irevnet,
    build_revnet,
    build_zoo,
    irevnet_config,
    irevnet_names,
    reformer_names,
    revnet_config,
    revnet_names,
    zoo_names,
)
from revlib_xla.models.irevnet import IRevNet, IRevNetConfig
from revlib_xla.models.revnet import RevNet, RevNetConfig
from revlib_xla.reversible import MemoryModes, ReversibleSequential

NO_SAVINGS = MemoryModes.no_savings

# Small RevNets with every kind of unit: a reversible first unit (CIFAR stem), a pooled-and-padded downsampling unit,
# a projected downsampling unit (ImageNet stem, bottleneck), and reversible units after each.
SMALL_REVNETS = {
    "basic": RevNetConfig(units=(2, 3), channels=(8, 8, 16), strides=(1, 2), image_size=8),
    "bottleneck": RevNetConfig(
        units=(2, 2), channels=(8, 4, 8), strides=(1, 2), bottleneck=True, imagenet_stem=True, image_size=16
    ),
}
# 12 channels after the 2x rearrangement, padded to 16 (injective); 64 after the second (bijective).
SMALL_IREVNET = IRevNetConfig(blocks=(2, 3), strides=(1, 2), channels=(8, 32), init_ds=2, image_size=8)


def _params(model):
    return sum(p.numel() for p in model.parameters())


def _same_weights(model, memory_mode, dtype, device):
    """A model of the same config in ``memory_mode`` with ``model``'s weights."""
    config = type(model.config)(**{**model.config.__dict__, "memory_mode": memory_mode})
    other = type(model)(config).to(device, dtype)
    other.load_state_dict(model.state_dict())
    return other


def _step(model, x):
    out = model(x)
    out.square().mean().backward()
    return out.detach()


def _assert_same_step(model, reference, x, rtol):
    out, ref_out = _step(model, x), _step(reference, x)
    assert max_rel_err(out, ref_out) < rtol
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert max_rel_err(p.grad, q.grad) < rtol, name
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(to_host(b), to_host(c), rtol=rtol, atol=0, msg=name)


# -- RevNet ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, paper, exact",
    [("revnet-38", 0.46, 464_890), ("revnet-110", 1.73, 1_729_194), ("revnet-164", 1.75, 1_748_778)],
)
def test_cifar_revnet_parameters_match_the_paper(name, paper, exact):
    with torch.device("meta"):
        model = build_revnet(name)
    assert round(_params(model) / 1e6, 2) == paper
    assert _params(model) == exact


def test_revnet_104_builds_on_meta_at_imagenet_size():
    with torch.device("meta"):
        model = build_revnet("revnet-104")
    assert all(p.is_meta for p in model.parameters())
    n = _params(model)
    assert n == 45_428_072 and abs(n / 45.2e6 - 1) < 0.006  # the authors' configuration; the paper's table: 45.2M
    with torch.no_grad():
        assert model(torch.empty(2, 3, 224, 224, device="meta")).shape == (2, 1000)
    assert len(model.stages) == 4 and model.downsampling == 32


@pytest.mark.parametrize("kind", sorted(SMALL_REVNETS))
def test_revnet_gradients_and_batchnorm_statistics_equal_plain_autograd(kind):
    # On the cpu only: the models add no device-dependent code to the reversible core, which is tested on each device;
    # compiling these convolution graphs for XLA takes minutes on the 2-core CI machine.
    config, device, dtype = SMALL_REVNETS[kind], torch.device("cpu"), torch.float64
    torch.manual_seed(0)
    model = RevNet(config).to(device, dtype)
    reference = _same_weights(model, NO_SAVINGS, dtype, device)
    x = torch.randn(4, 3, config.image_size, config.image_size, dtype=dtype).to(device)
    _assert_same_step(model, reference, x, 1e-10)
    counts = {int(b) for name, b in model.named_buffers() if name.endswith("num_batches_tracked")}
    assert counts == {1}  # each BatchNorm updated its running statistics once, not again in the recomputation


def test_revnet_activation_memory_does_not_grow_with_depth():
    def saved(units, memory_mode):
        torch.manual_seed(0)
        model = RevNet(RevNetConfig(units=units, channels=(8, 8, 16), strides=(1, 2), memory_mode=memory_mode))
        return saved_bytes(model, torch.randn(2, 3, 16, 16), exclude=list(model.parameters()))

    assert saved((2, 2), MemoryModes.autograd_function) == saved((6, 6), MemoryModes.autograd_function)
    assert saved((6, 6), NO_SAVINGS) > 2 * saved((2, 2), NO_SAVINGS)
    assert saved((6, 6), MemoryModes.autograd_function) < saved((6, 6), NO_SAVINGS) / 3


def test_revnet_bad_input_and_config_say_what_to_do():
    model = build_revnet("revnet-38", units=(1, 1, 1))
    with pytest.raises(ValueError, match=r"expects images of shape \(batch, 3, height, width\), got \(2, 1, 32, 32\)"):
        model(torch.randn(2, 1, 32, 32))
    with pytest.raises(ValueError, match=r"image size \(30, 30\) is not a multiple of 4.*e.g. 32x32"):
        model(torch.randn(2, 3, 30, 30))
    with pytest.raises(ValueError, match="split into two streams, so each must be even"):
        revnet_config("revnet-38", channels=(32, 32, 64, 113))
    with pytest.raises(ValueError, match="channels needs 4 entries"):
        revnet_config("revnet-38", channels=(32, 64))
    with pytest.raises(ValueError, match="must grow by a multiple of 4"):
        build_revnet("revnet-38", channels=(32, 32, 64, 62))
    with pytest.raises(ValueError, match="unknown RevNet model 'revnet-50'; expected one of revnet-38, revnet-110"):
        build_revnet("revnet-50")
    with pytest.raises(ValueError, match="unknown field.* depth; expected some of .*units"):
        build_revnet("revnet-38", depth=3)


# -- i-RevNet ----------------------------------------------------------------------------------------------------


def test_irevnet_inverse_reconstructs_the_input_in_float64():
    torch.manual_seed(0)
    for config in (SMALL_IREVNET, IRevNetConfig(blocks=(2, 2), strides=(1, 2), channels=(4, 16), image_size=8)):
        model = IRevNet(config).double()  # the second pads 3 image channels to 8 (the injective i-RevNet)
        x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
        for _ in range(2):  # training steps, so BatchNorm's running statistics are not the identity
            _step(model, x)
        model.eval()
        features = model.features(x)
        assert features.numel() >= x.numel()
        assert max_rel_err(model.inverse(features), x) < 1e-12


def test_irevnet_gradients_equal_plain_autograd():
    device, dtype = torch.device("cpu"), torch.float64  # cpu only, as for the RevNet
    torch.manual_seed(0)
    model = IRevNet(SMALL_IREVNET).to(device, dtype)
    reference = _same_weights(model, NO_SAVINGS, dtype, device)
    x = torch.randn(4, 3, 8, 8, dtype=dtype).to(device)
    _assert_same_step(model, reference, x, 1e-10)


def test_irevnet_activation_memory_does_not_grow_with_depth():
    def saved(blocks):
        torch.manual_seed(0)
        model = IRevNet(IRevNetConfig(blocks=blocks, strides=(1, 2), channels=(8, 32), init_ds=2, image_size=8))
        return saved_bytes(model, torch.randn(2, 3, 8, 8), exclude=list(model.parameters()))

    assert saved((2, 2)) == saved((6, 6))


def test_named_irevnets_have_the_papers_and_revlibs_shapes():
    with torch.device("meta"):
        assert _params(build_irevnet("irevnet-301")) == 125_120_356
        models = {name: build_irevnet(name, blocks=(1,) * len(irevnet_config(name).blocks)) for name in irevnet_names()}
    with torch.no_grad():  # the shapes do not depend on the number of blocks per stage
        image = torch.empty(1, 3, 224, 224, device="meta")
        features = models["irevnet-301"].features(image)
        assert features.shape == (1, 3072, 7, 7) and features.numel() == image.numel()  # bijective
        assert models["irevnet-301"](image).shape == (1, 1000)
        revlib = models["irevnet-revlib"]  # RevLib's README example: (1, 3, 224, 224) -> (1, 1000, 224, 224)
        assert revlib.features(image).shape == (1, 128, 224, 224) and revlib(image).shape == (1, 1000, 224, 224)
        assert models["irevnet-cifar"](torch.empty(2, 3, 32, 32, device="meta")).shape == (2, 10)


def test_irevnet_errors_say_what_to_do():
    model = IRevNet(SMALL_IREVNET)
    with pytest.raises(ValueError, match=r"image size \(6, 6\) is not a multiple of 4"):
        model(torch.randn(1, 3, 6, 6))
    with pytest.raises(RuntimeError, match=r"call model.eval\(\) first"):
        model.inverse(torch.randn(1, 64, 2, 2))
    with pytest.raises(ValueError, match=r"stage 1 has 64 channels .* make channels\[1\] at least 32"):
        IRevNetConfig(blocks=(1, 1), strides=(1, 2), channels=(8, 12), init_ds=2)
    with pytest.raises(ValueError, match=r"channels\[1\]=34 must be divisible by strides\[1\]\^2=4"):
        IRevNetConfig(blocks=(1, 1), strides=(1, 2), channels=(8, 34))
    with pytest.raises(ValueError, match="unknown i-RevNet model"):
        build_irevnet("irevnet-18")


# -- the earlier models, by name ---------------------------------------------------------------------------------


def test_the_earlier_models_are_built_by_name():
    assert zoo_names() == ["byte-lm", "gpt", "resnet18", "resnet50", "resnet101"]
    with torch.device("meta"):
        lm = build_zoo("byte-lm", width=32, depth=2, flavour="no_savings")
        assert lm.flavour == "no_savings" and lm.config.width == 32
        assert len(build_zoo("gpt", depth=2, reversible=True)) == len(build_zoo("gpt", depth=2)) + 2
        assert math.isclose(_params(build_zoo("resnet50")), 25_557_032)
        assert copy.deepcopy(build_zoo("resnet18", num_classes=10))[-1].out_features == 10
    with pytest.raises(ValueError, match="unknown reference model 'vit'; expected one of byte-lm, gpt"):
        build_zoo("vit")
    with pytest.raises(ValueError, match="reference model 'gpt': .*unexpected keyword argument 'wdith'"):
        build_zoo("gpt", wdith=3)


def test_every_named_vision_model_builds_on_meta():
    with torch.device("meta"):
        for name in revnet_names():
            assert all(p.is_meta for p in build_revnet(name).parameters())
        for name in irevnet_names():
            assert all(p.is_meta for p in build_irevnet(name).parameters())


def test_every_family_is_built_by_name_through_the_registry() -> None:
    from revlib_xla.models import registry

    names = registry.model_names()
    for family in (revnet_names(), irevnet_names(), reformer_names(), zoo_names()):
        assert set(family) <= set(names)
    with torch.device("meta"):
        plain = registry.build_model("revnet-38", form="plain")
        reversible = registry.build_model("revnet-38")
        reformer = registry.build_model("reformer-tiny", form="checkpoint")
    modes = {m.memory_mode for m in plain.modules() if isinstance(m, ReversibleSequential)}
    assert modes == {MemoryModes.no_savings}
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in reversible.parameters())
    assert reformer.flavour == "checkpoint"
    with pytest.raises(ValueError, match="has no form 'momentum'; expected one of plain, reversible"):
        registry.build_model("irevnet-revlib", form="momentum")
