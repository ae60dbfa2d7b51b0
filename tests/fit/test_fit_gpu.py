"""``revlib-xla memory --gpu NAME``: the step ``revlib-xla train`` runs, sized for a GPU without one and without
torch_xla, libtpu or jax (this file runs in the torch 2.13 environment too, which has none of them), for every
strategy, ``--max-batch`` included; the estimate (fake tensors) against the same steps run on real host tensors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from revlib_xla.fit.chips import Chip, chip
from revlib_xla.fit.gpu import estimate_step, for_gpu, gpu_max_batch
from revlib_xla.fit.strategies import GPU_COMPARISON, STRATEGIES, load
from revlib_xla.units import parse_bytes

ROOT = Path(__file__).resolve().parents[2]
SMOKE = "tpu_configs/cpu-smoke.yaml"
TINY = [
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
    "data.seq_len=16",
    "data.batch_size=2",
]
# bfloat16 at TINY's width: the host's bfloat16 kernels allocate 74 KB outside dispatch (14 % of that step): sized
# where the step's tensors dominate
WIDER = [
    "model.overrides={vocab_size: 4096, dim: 256, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 768, "
    "tie_embeddings: false}",
    "data.seq_len=64",
    "data.batch_size=2",
]
NAMES = ["config", *GPU_COMPARISON]
STREAM = "reversible+offload+bf16+stream"


def _units(cell: str) -> float:
    return 0.0 if cell.split()[0] == "0" else parse_bytes(cell.replace(" ", ""))


def test_memory_gpu_sizes_every_strategy(capsys):
    """Every strategy's row (plan included, which crashed on fake tensors), its parts adding up to its total, an
    offloaded optimizer's state in the host column. In the torch 2.13 environment (``make test-newer``) this runs
    without torch_xla, libtpu or jax installed."""
    from revlib_xla.cli import main

    code = main(["memory", "--gpu", "h100", "--config", SMOKE, *TINY])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert "on one h100 (80.00 GiB); an eager estimate on FakeTensors" in lines[0]
    header = next(line for line in lines if line.startswith("strategy "))
    columns = [c.strip() for c in header.split("  ") if c.strip()]
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if cells and cells[0] in NAMES:
            rows[cells[0]] = dict(zip(columns, cells))
    assert set(rows) == set(NAMES)
    for name, row in rows.items():
        parts = ("parameters", "optimizer state", "inputs+other", "gradients+activations+temporaries")
        assert sum(_units(row[p]) for p in parts) == pytest.approx(_units(row["total"]), rel=1e-3), name
        assert row["fits"] == "yes (80.00 GiB)", name
        offloaded = "strategy.offload.optimizer=true" in STRATEGIES[name].overrides
        assert (_units(row["optimizer state"]) == 0) == offloaded and (_units(row["host"]) > 0) == offloaded, name


@pytest.mark.slow
def test_memory_gpu_imports_neither_torch_xla_libtpu_nor_jax():
    """In a fresh interpreter (torch_xla installed or not): the GPU path imports none of them."""
    script = (
        "import json, sys\n"
        "from revlib_xla.cli import main\n"
        f"code = main(['memory', '--gpu', 'h100', '--strategies', 'plan', '--config', {SMOKE!r}, *{TINY!r}])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch_xla', 'jax', 'jaxlib', 'libtpu'})\n"
        "print(json.dumps({'code': code, 'heavy': heavy}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 0, "heavy": []}


@pytest.mark.parametrize(
    "name, size", [("plan", TINY), ("plan+fewbit+offload", TINY), ("none", TINY), (STREAM, WIDER)], ids=str
)
def test_the_estimate_is_the_steps_storage_peak_and_near_its_allocator_peak(name, size):
    """The fake-tensor estimate against the same two steps run on real host tensors: the same storage peak
    exactly (the fake step is the real one, counted the same way), and the host allocator's peak of a third step
    (its own events: what was really allocated) within 10 %. (The storage count may read a little above the
    allocator: a view or an in-place result of a tensor made before the count and never named to it, a cached
    FewBit table say, counts as new.) Each phase's peak is the same within 64 KB: where a phase starts, what the
    last one left is freed when Python frees it, not always at the same point with and without fake tensors."""
    cfg = for_gpu(load(SMOKE, size, STRATEGIES[name]), chip("h100"))
    estimated = estimate_step(cfg)
    ran = estimate_step(cfg, fake=False)
    assert dataclasses.replace(ran, allocated=None, phases=()) == dataclasses.replace(estimated, phases=())
    assert [n for n, _ in ran.phases] == [n for n, _ in estimated.phases] == ["forward", "backward", "optimizer step"]
    for (_, a), (_, b) in zip(ran.phases, estimated.phases):
        assert abs(a - b) <= 64 * 1024
    assert ran.allocated is not None
    assert abs(ran.allocated - estimated.peak) <= 0.1 * estimated.peak, (estimated, ran.allocated)


def test_max_batch_on_a_gpu_is_the_largest_estimated_batch_that_fits():
    """gpu_max_batch on a GPU exactly as large as batch 5's estimate: the batch found (5 or more) fits, the next
    one does not (both estimated)."""

    def config_at(batch):
        return load(SMOKE, TINY, STRATEGIES["none"], batch)

    small = Chip("gpu-small", "gpu", estimate_step(for_gpu(config_at(5), chip("h100"))).peak, 1e12)
    found = gpu_max_batch(config_at, small, "none", limit=64)
    assert found.best >= 5 and not found.capped
    assert found.reports[found.best].fits and not found.reports[found.best + 1].fits


def test_memory_gpu_max_batch_prints_each_strategys_largest_batch(capsys):
    from revlib_xla.cli import main

    argv = ["memory", "--gpu", "t4", "--max-batch", "--limit", "2", "--strategies", "reversible"]
    code = main([*argv, "--config", SMOKE, *TINY])
    out = capsys.readouterr().out
    assert code == 0
    assert any(line.split()[:4] == ["reversible", "largest", "batch", "2:"] for line in out.splitlines()), out
    assert "(the search stopped at --limit 2)" in out and "yes (16.00 GiB)" in out


def test_a_plan_row_says_what_the_planner_chose():
    """A ``plan`` row equal to ``none``'s is not left without a reason: its note says the budget holds every
    activation, so nothing is recomputed; with a budget that forces recomputation, the note counts the forwards run
    again and gives the planned bytes against keeping everything (at this size the optimizer's step, not the
    activations, makes the peak: the row is no larger than ``none``'s)."""
    from revlib_xla.fit.report import format_table

    gpu = chip("h100")
    roomy = estimate_step(for_gpu(load(SMOKE, TINY, STRATEGIES["plan"]), gpu)).report(gpu, "plan", 2)
    assert len(roomy.notes) == 1 and "keeps every activation of its" in roomy.notes[0], roomy.notes
    assert "nothing is recomputed" in roomy.notes[0]
    plain = estimate_step(for_gpu(load(SMOKE, TINY, STRATEGIES["none"]), gpu)).report(gpu, "none", 2)
    assert plain.notes == () and plain.total == roomy.total

    tight_cfg = load(SMOKE, [*TINY, "strategy.activations=plan", "strategy.budget=200KiB"], STRATEGIES["config"])
    tight = estimate_step(for_gpu(tight_cfg, gpu)).report(gpu, "plan", 2)
    assert len(tight.notes) == 1 and "stage forwards again in the backward" in tight.notes[0], tight.notes
    assert "within the budget of 200.00 KiB" in tight.notes[0] and "to keep them all" in tight.notes[0]
    assert tight.total is not None and plain.total is not None and tight.total <= plain.total
    table = format_table([plain, roomy, tight])
    assert f"plan: {roomy.notes[0]}" in table and f"plan: {tight.notes[0]}" in table


def test_each_phase_has_its_peak_and_the_optimizer_step_makes_no_second_set_of_gradients():
    """The estimate names each phase's peak (forward, backward, optimizer step; the total is the largest). AdamW's
    ``foreach`` step (torch's default on cuda) holds temporaries the size of every gradient at once beside the
    gradients and state; the fused kernel (``optim.implementation=auto`` on cuda) none: its optimizer-step peak
    is the weights, gradients and state, about one float32 set of gradients below foreach's."""
    fused = estimate_step(for_gpu(load(SMOKE, TINY, STRATEGIES["none"]), chip("h100")))
    foreach = estimate_step(
        for_gpu(load(SMOKE, [*TINY, "optim.implementation=foreach"], STRATEGIES["none"]), chip("h100"))
    )
    for step in (fused, foreach):
        phases = dict(step.phases)
        assert list(phases) == ["forward", "backward", "optimizer step"]
        assert max(phases.values()) == step.peak
    grads = fused.parameters  # float32 weights: their gradients are as large
    held = fused.parameters + fused.optimizer + grads + fused.buffers + fused.inputs
    assert dict(fused.phases)["optimizer step"] <= held + 64 * 1024
    assert dict(foreach.phases)["optimizer step"] >= held + grads - 64 * 1024


def test_the_composed_config_fits_llama_8b_at_2048_tokens_on_a_24_gib_gpu_in_under_20_gib(capsys):
    """``revlib-xla memory --gpu l4 --config gpu_configs/llama-8b-24gb.yaml`` at Llama-3-8B's full size (32 layers,
    vocabulary 128256), batch 1 x 2048, bfloat16: the reversible layers with bfloat16 weights on the device, each
    gradient streamed to the host and AdamW's float32 masters and moments there: at most 20 GiB on the device, its
    peak in the backward. The same config keeping every activation (strategy none: the reversible layers' part)
    does not fit. Fake tensors: nothing is allocated (a few seconds per row)."""
    from revlib_xla.cli import main

    config = str(ROOT / "gpu_configs" / "llama-8b-24gb.yaml")
    code = main(["memory", "--gpu", "l4", "--config", config, "--strategies", "config,none"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("llama-8b, seq_len 2048, precision bf16, on one l4 (24.00 GiB)")
    rows = {}
    header = next(line for line in out.splitlines() if line.startswith("strategy "))
    columns = [c.strip() for c in header.split("  ") if c.strip()]
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if cells and cells[0] in ("config", "none"):
            rows[cells[0]] = dict(zip(columns, cells))
    composed, plain = rows["config"], rows["none"]
    assert _units(composed["total"]) <= 20 * 2**30 and composed["fits"] == "yes (24.00 GiB)"
    assert composed["peak in"].startswith("backward (forward ")
    assert _units(composed["parameters"]) == pytest.approx(8.03e9 * 2, rel=0.01)  # bfloat16 weights
    # on the host: float32 masters and two moments (12 bytes a weight) and, for the global norm (optim.grad_clip
    # 1.0), every bfloat16 gradient until the step
    assert _units(composed["host"]) == pytest.approx(8.03e9 * 14, rel=0.02)
    assert _units(plain["total"]) > 24 * 2**30 and plain["fits"] == "NO (24.00 GiB)"
