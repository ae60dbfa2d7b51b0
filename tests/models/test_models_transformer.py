"""The byte-level LM's three flavours: one network, one parameter layout, the same loss and gradients."""

import dataclasses

import pytest
import torch

from revlib_xla.models import FLAVOUR_LABELS, FLAVOURS, Flavour, TransformerConfig, build_lm, lm_loss

CONFIG = TransformerConfig(width=16, depth=3, heads=2, seq_len=12)


def _loss_and_grads(flavour, state, tokens, config=CONFIG):
    model = build_lm(config, flavour).double()
    model.load_state_dict(state)
    torch.manual_seed(1)  # the same dropout masks in every flavour
    loss = lm_loss(model(tokens), tokens)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_flavours_compute_the_same_loss_and_gradients(dropout):
    """With dropout too: the checkpointed blocks run inside the reversible core's random-number scope, and their
    recomputation must draw the forward's masks (it drew others, 12 % gradient error, before recompute.checkpoint)."""
    config = dataclasses.replace(CONFIG, dropout=dropout)
    torch.manual_seed(0)
    state = build_lm(config, Flavour.NO_SAVINGS).double().state_dict()
    tokens = torch.randint(0, 256, (2, config.seq_len))
    ref_loss, ref_grads = _loss_and_grads(Flavour.NO_SAVINGS, state, tokens, config)
    for flavour in (Flavour.CHECKPOINT, Flavour.REVERSIBLE):
        loss, grads = _loss_and_grads(flavour, state, tokens, config)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-13, msg=f"{flavour}: {name}")


def test_flavour_strings_and_members_are_interchangeable():
    assert FLAVOURS == (Flavour.NO_SAVINGS, Flavour.CHECKPOINT, Flavour.REVERSIBLE)
    assert [str(f) for f in FLAVOURS] == ["no_savings", "checkpoint", "reversible"]
    assert f"{Flavour.CHECKPOINT:>12}" == "  checkpoint"
    assert FLAVOUR_LABELS["checkpoint"] == "checkpointing"  # a string finds the member's entry
    model = build_lm(CONFIG, "checkpoint")
    assert model.flavour is Flavour.CHECKPOINT and model.flavour == "checkpoint"
    assert "flavour='checkpoint'" in repr(model)


def test_unknown_flavour_names_the_choices():
    with pytest.raises(ValueError, match="unknown flavour 'rev'; expected one of no_savings, checkpoint, reversible"):
        build_lm(CONFIG, "rev")
