"""The SPMD cases of tests/backends/test_spmd.py, run in ONE child process with ``CPU_NUM_DEVICES=4`` (torch_xla's SPMD
needs the device count before it is imported, and SPMD mode before any XLA tensor): float64 training steps of a
small Llama over a mesh of 4 CPU devices against the same steps on the CPU, eager. Prints one JSON object.

Usage: ``CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python tests/backends/spmd_cases.py OUT_DIR``.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings

import torch

from revlib_xla import backends, sharding
from revlib_xla.models.llama import build_llama
from revlib_xla.reversible.stacks import stacks_of
from revlib_xla.train.config import load_config
from revlib_xla.train.loop import train
from revlib_xla.train.strategy import build_model, build_optimizer, language_model, lr_at, make_step, model_config

TINY = [
    "model.overrides={vocab_size: 256, dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128}",
    "data.seq_len=12",
    "data.batch_size=8",
    "optim.lr=1e-2",
]
PLAN_BUDGET = 2_400_000  # bytes of activations of the whole batch: the planner must recompute some
STEPS = 3  # the first creates the optimizer state: the compile count must stay still from the second


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (8, 12), generator=g) for _ in range(n)]


def stacked_model(cfg, device) -> torch.nn.Module:
    """The reversible LM of ``cfg`` with its layers stacked (scan), initialised as build_model does, split over the
    active mesh."""
    lm = build_llama(model_config(cfg), "reversible", scan=True)
    lm.to_empty(device=device)
    lm.init_weights(cfg.train.seed)
    lm.to(torch.float64)
    sharding.shard_model(lm, sharding.active_mesh(device))
    return lm


def layer_grads(lm: torch.nn.Module) -> dict:
    """Every parameter's gradient by its unstacked name (a stack's gradient cut into its layers')."""
    backends.sync(next(lm.parameters()).device)  # one execution for every gradient, not one per read
    grads = {n: p.grad.detach().cpu() for n, p in lm.named_parameters()}
    stacks = stacks_of(lm.layers)
    if stacks is None:
        return grads
    names = list(lm.layers._modules)
    for j, entries in enumerate(stacks.entries):
        for attr, aliases in entries:
            for t, g in enumerate(grads.pop(f"layers.{attr}").unbind(0)):
                grads[f"layers.{names[t * stacks.period + j]}.{stacks.block}.{aliases[0]}"] = g
    return grads


def run_steps(cfg, device, stacked: bool = False) -> dict:
    """Losses, final weights and gradients of the first step, and the compile count per step, of STEPS steps."""
    model = stacked_model(cfg, device) if stacked else build_model(cfg, device, torch.float64)
    lm = language_model(model)
    initial = {}
    if not stacked:  # (reading the stacks here would change the sharding the compiler gives the norm scales)
        backends.sync(device)
        initial = {n: t.detach().to("cpu", copy=True) for n, t in lm.state_dict().items()}  # before the steps
    first = model.loss(batches(1)[0].to(device))
    first.backward()
    grads = layer_grads(lm)
    model.zero_grad(set_to_none=True)
    opt = build_optimizer(cfg, model)
    step = make_step(cfg, model, opt)
    losses, compiles = [], []
    for i, batch in enumerate(batches(STEPS)):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        loss = step(batch)
        backends.sync(device)
        compiles.append(backends.compilations(device))
        losses.append(float(loss))
    weights = {n: t.detach().cpu() for n, t in lm.state_dict().items()}
    planned = getattr(model, "planned", None)
    counts = {str(k): n for k, n in planned.sequence.counts().items()} if planned is not None else {}
    return {
        "loss": float(first),
        "grads": grads,
        "losses": losses,
        "weights": weights,
        "compiles": compiles,
        "lm": lm,
        "schedule": counts,
        "initial": initial,
    }


def max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def shard_fraction(lm: torch.nn.Module, family) -> dict:
    """Per parameter kind: the elements each device holds over the whole parameter's (the largest piece)."""
    held, total = 0, 0
    for p in lm.parameters():
        shapes = family.shard_shapes(p)
        assert len(shapes) == 4, shapes
        held += max(math.prod(s) for s in shapes)
        total += p.numel()
    return held / total


def main(out_dir: str) -> None:
    # SPMD before the runtime starts; the runtime before the first backward (the autograd engine counts devices then)
    assert sharding.apply_mesh(load_config(None, [*TINY, "train.device=xla"])) is not None
    start = time.perf_counter()
    xla = backends.device_for("xla")
    family = backends.backend_for(xla)
    results: dict = {"devices": family.spmd_device_count(xla), "cases": {}}
    cases = {
        "plain data x fsdp x tensor": (["strategy=none"], {"data": 1, "fsdp": 2, "tensor": 2}),
        "reversible data x fsdp": (["strategy=reversible"], {"data": 2, "fsdp": 2}),
        "checkpoint + offloaded optimizer fsdp": (
            ["strategy=checkpoint", "strategy.offload.optimizer=true"],
            {"fsdp": -1},
        ),
        # the planner measures the whole batch, each device holds a quarter of it: a quarter of the CPU's budget
        "plan fsdp": (["strategy=plan", f"strategy.budget={PLAN_BUDGET // 4}"], {"fsdp": -1}),
        "scan fsdp x tensor": (["strategy=reversible", "optim.weight_decay=0"], {"fsdp": 2, "tensor": 2}),
    }
    reference_overrides = {"plan fsdp": ["strategy=plan", f"strategy.budget={PLAN_BUDGET}"]}
    configs = {}
    for name, (overrides, axes) in cases.items():
        mesh_overrides = [f"mesh.{a}={n}" for a, n in {"data": 1, "fsdp": 1, "tensor": 1, **axes}.items()]
        configs[name] = load_config(None, [*TINY, *overrides, *mesh_overrides])
    # the references first, on the CPU, before any mesh is active
    references = {
        name: run_steps(load_config(None, [*TINY, *reference_overrides.get(name, overrides)]), "cpu")
        for name, (overrides, _) in cases.items()
    }
    sent: list[list[int]] = []  # per weight initialised piece by piece: the elements each device received
    whole_pieces = family.from_host_pieces

    def counted(pieces, mesh, spec):
        sent.append([piece.numel() for piece in pieces])
        return whole_pieces(pieces, mesh, spec)

    family.from_host_pieces = counted
    for name, cfg in configs.items():
        reference = references[name]
        mesh = sharding.apply_mesh(cfg, xla)
        assert mesh is not None
        sent.clear()
        stacked = name.startswith("scan")
        got = run_steps(cfg, xla, stacked=stacked)
        results["cases"][name] = {
            "mesh": str(mesh.shape),
            "loss": [got["loss"], reference["loss"]],
            "grad_rel_err": max_rel(got["grads"], reference["grads"]),
            "losses": [got["losses"], reference["losses"]],
            "weight_rel_err": max_rel(got["weights"], reference["weights"]),
            "compiles": got["compiles"],
            "fraction": shard_fraction(got["lm"], family),
            "specs": {n: family_spec(p) for n, p in got["lm"].named_parameters()},
            "schedule": [got["schedule"], reference["schedule"]],
            # the initial weights, bit for bit those of the unsplit init (drawn in the same order on the host)
            "initial_equal": None
            if stacked
            else sorted(got["initial"]) == sorted(reference["initial"])
            and all(torch.equal(got["initial"][k], reference["initial"][k]) for k in reference["initial"]),
            "sent": list(sent),  # the pieces each device received, per weight
            "whole": sorted(p.numel() for p in got["lm"].parameters() if p.dim() == 2),
        }
        summary = {k: v for k, v in results["cases"][name].items() if k not in ("specs", "sent", "whole")}
        print(name, f"{time.perf_counter() - start:.1f} s", json.dumps(summary), file=sys.stderr, flush=True)
    # revlib-xla train's loop over the mesh: no compile after the warm-up steps
    cfg = load_config(
        None,
        [
            *TINY,
            "train.device=xla",
            "train.steps=4",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.progress=false",
            f"train.out_dir={out_dir}/run",
            "strategy=reversible",
        ],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(cfg)
    results["train"] = {
        "recompilations": result.recompilations,
        "losses": list(result.losses.values()),
        "warnings": [str(w.message) for w in caught if "compiled" in str(w.message)],
        "fraction": shard_fraction(language_model(result.model), family),
    }
    # parameters streamed from host memory cannot be split over the mesh
    try:
        sharding.apply_mesh(load_config(None, [*TINY, "strategy.offload.params=true"]), xla)
        results["offload_params"] = "no error"
    except sharding.ShardingError as exc:
        results["offload_params"] = str(exc)
    # a batch that does not split, at the point of use
    try:
        sharding.shard_batch(torch.zeros(6, 12, dtype=torch.long).to(xla))
        results["odd_batch"] = "no error"
    except sharding.ShardingError as exc:
        results["odd_batch"] = str(exc)
    print(json.dumps(results))


def family_spec(p: torch.Tensor) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(p)


if __name__ == "__main__":
    main(sys.argv[1])
