"""``model.scan=true`` (stacked layers) in the CLI's step: global-norm clipping scales the stacked gradients as the
unstacked run's (the norm over a ``[layers, ...]`` tensor is the norm over its layers), compared where the optimizer
reads them, with a clip far below the gradients' norm. AdamW's first steps are nearly invariant to a gradient's
scale, so equal weights after a few steps would not show a clip by each stacked tensor's own norm.

The learning rate across kill-and-resume of a scanned run is covered by tests/test_train_loop.py (bit-identical
weights after resuming at step 4 of a warmup + cosine schedule: the rate is a function of the step)."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from revlib_xla.train.checkpoint import weight_slices
from revlib_xla.train.config import load_config
from revlib_xla.train.strategy import build_model, build_optimizer, language_model, make_step

TINY = [
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 3, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
    "data.seq_len=12",
    "data.batch_size=4",
    "strategy=reversible",
    "optim.grad_clip=0.01",
]


def _clipped_grads(scan: bool) -> dict[str, torch.Tensor]:
    """One step's gradients as the optimizer reads them, by unstacked name (a stacked gradient's layer slices)."""
    cfg = load_config(None, [*TINY, f"model.scan={str(scan).lower()}"])
    torch.manual_seed(0)
    model = build_model(cfg, "cpu", torch.float64)
    optimizer = build_optimizer(cfg, model)
    seen: dict[int, torch.Tensor] = {}

    def record(opt, args, kwargs):
        seen.update({id(p): p.grad.clone() for group in opt.param_groups for p in group["params"]})

    handle = register_optimizer_step_pre_hook(record)
    try:
        make_step(cfg, model, optimizer)(torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1)))
    finally:
        handle.remove()
    return {
        name: seen[id(p)] if index is None else seen[id(p)][index]
        for name, p, index in weight_slices(language_model(model))
    }


def test_stacked_gradients_are_clipped_by_the_global_norm_as_unstacked_ones():
    stacked, unstacked = _clipped_grads(True), _clipped_grads(False)
    assert stacked.keys() == unstacked.keys()
    distinct = {id(g): g for g in unstacked.values()}.values()  # tied weights once
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in distinct]))
    assert norm == pytest.approx(0.01, rel=1e-5)  # clip_grad_norm_ divides by the norm + 1e-6 (the norm is ~1)
    for name in unstacked:
        torch.testing.assert_close(stacked[name], unstacked[name], rtol=1e-10, atol=1e-15, msg=name)
