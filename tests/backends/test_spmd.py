"""TPU pods through SPMD (revlib_xla.sharding): the mesh from config, the sharding rules, bad input named at the
point of use, training over 4 CPU SPMD devices against the CPU (one child process runs every SPMD case), and the
per-chip HBM of a slice from a sharded deviceless compile."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from revlib_xla import backends, sharding
from revlib_xla.sharding import MeshShape, ShardingError, hlo_sharding, parameter_spec, resolve_mesh
from revlib_xla.train.config import ConfigError, load_config

HERE = Path(__file__).resolve().parent
needs_xla = pytest.mark.skipif(not backends.xla_available(), reason="torch_xla is not installed")
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")

# ----------------------------------------------------------------------------------------------------------------
# The mesh and the rules (no devices needed)


def test_mesh_axes_fill_and_multiply_to_the_devices():
    assert resolve_mesh({"fsdp": -1, "tensor": 1, "data": 1}, 8) == MeshShape(1, 8, 1)
    assert resolve_mesh({"data": 2, "fsdp": -1}, 8) == MeshShape(2, 4, 1)
    assert resolve_mesh({"fsdp": 2, "tensor": -1}, 8) == MeshShape(1, 2, 4)
    assert resolve_mesh({"fsdp": -1}, 1).size == 1
    assert str(MeshShape(2, 4, 1)) == "data=2 x fsdp=4 x tensor=1"


@pytest.mark.parametrize(
    ("axes", "devices", "message"),
    [
        ({"fdsp": 4}, 4, "mesh: unknown axis 'fdsp'; the axes are data, fsdp, tensor"),
        ({"fsdp": 3}, 4, "mesh.data=1, mesh.fsdp=3, mesh.tensor=1 multiplies to 3 devices but the run drives 4"),
        ({"data": 3, "fsdp": -1}, 8, "the fixed axes multiply to 3, which does not divide the 8 device(s)"),
        ({"data": -1, "fsdp": -1}, 8, "only one axis may be -1"),
        ({"fsdp": 0}, 8, "mesh: fsdp=0: an axis is a number of devices"),
    ],
)
def test_bad_meshes_are_named(axes, devices, message):
    with pytest.raises(ShardingError) as info:
        resolve_mesh(axes, devices)
    assert message in str(info.value)


def test_a_mesh_on_a_backend_without_spmd_points_to_torchrun():
    assert sharding.make_mesh({"fsdp": -1}, "cpu") is None  # one device: nothing to shard
    with pytest.raises(ShardingError) as info:
        sharding.make_mesh({"fsdp": 2}, "cpu")
    message = str(info.value)
    assert "multiplies to 2 devices but the 'cpu' backend drives 1" in message
    assert "FSDP2 or DDP under torchrun" in message
    cpu = backends.backend_for("cpu")
    assert cpu.spmd_device_count(torch.device("cpu")) == 1
    with pytest.raises(NotImplementedError, match="no SPMD partitioner.*torchrun"):
        cpu.enable_spmd()
    assert backends.default_device_type() == backends.default_device().type  # asked without starting a runtime


def test_the_config_has_a_mesh_section_and_names_bad_keys():
    assert load_config(None, []).mesh.axes() == {"data": 1, "fsdp": -1, "tensor": 1}
    assert load_config(None, ["mesh.data=2", "mesh.fsdp=4"]).mesh.axes() == {"data": 2, "fsdp": 4, "tensor": 1}
    for overrides, message in (
        (["mesh.model=2"], "unknown key 'mesh.model'"),
        (["mesh.fsdp=0"], "mesh.fsdp=0: a mesh axis is a number of devices"),
        (["mesh.data=-1"], "mesh: only one axis may be -1"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_parameters_split_megatron_on_tensor_and_fsdp_on_the_other_dimension():
    mesh = MeshShape(1, 4, 2)
    assert parameter_spec("layers.0.attn.self_attn.q_proj.weight", (64, 32), mesh) == ("tensor", "fsdp")
    assert parameter_spec("layers.0-1.wrapped_module.mlp.down_proj.weight", (32, 128), mesh) == ("fsdp", "tensor")
    assert parameter_spec("embed.weight", (256, 32), mesh) == ("tensor", "fsdp")
    assert parameter_spec("norm.weight", (32,), mesh) == (None,)
    fsdp = MeshShape(1, 4, 1)
    assert parameter_spec("layers.0.attn.self_attn.q_proj.weight", (64, 32), fsdp) == (None, "fsdp")
    assert parameter_spec("conv.weight", (6, 40, 3, 3), fsdp) == (None, "fsdp", None, None)  # largest that divides
    assert parameter_spec("odd.weight", (6, 10), fsdp) == (None, None)  # nothing divides: whole on every device


def test_stacked_layers_keep_the_layer_dimension_whole_and_split_each_layer_as_unstacked():
    from revlib_xla.models.llama import LlamaConfig, build_llama
    from revlib_xla.reversible.stacks import stacks_of

    config = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    with torch.device("meta"):
        plain = dict(build_llama(config, "reversible").named_parameters())
        lm = build_llama(config, "reversible", scan=True)
    stacked, stacks, layers = dict(lm.named_parameters()), stacks_of(lm.layers), list(lm.layers._modules)
    mesh = MeshShape(1, 2, 2)
    # each stack holds position j's parameter of every layer group: it gets layer j's spec, one dimension on
    checked = 0
    for j, entries in enumerate(stacks.entries):
        for attr, (alias, *_) in entries:
            name, first = f"layers.{attr}", f"layers.{layers[j]}.{stacks.block}.{alias}"
            assert stacked[name].shape[1:] == plain[first].shape
            want = (None, *parameter_spec(first, plain[first].shape, mesh))
            assert parameter_spec(name, stacked[name].shape, mesh) == want, name
            checked += 1
    assert checked == 9
    assert parameter_spec("layers.stacked_0_0_self_attn_q_proj_weight", (2, 64, 64), mesh) == (None, "tensor", "fsdp")
    assert parameter_spec("layers.stacked_0_1_mlp_down_proj_weight", (2, 64, 128), mesh) == (None, "fsdp", "tensor")
    assert parameter_spec("layers.stacked_0_1_post_attention_layernorm_weight", (2, 64), mesh) == (None, None)
    # the generic rule on a stack, too: never the layer dimension, even where it is the largest
    assert parameter_spec("seq.stacked_0_conv_weight", (64, 6, 40), MeshShape(1, 4, 1)) == (None, None, "fsdp")


def test_hlo_shardings_number_the_devices_as_the_mesh():
    assert hlo_sharding(("fsdp", None), MeshShape(1, 4, 1)) == "{devices=[4,1]0,1,2,3}"
    assert hlo_sharding((None,), MeshShape(1, 4, 1)) == "{replicated}"
    # fsdp inside data: the pieces of a parameter repeat over data (devices 0,2 hold the same piece)
    assert hlo_sharding(("fsdp", None), MeshShape(2, 2, 1)) == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    assert hlo_sharding((("data", "fsdp"), None), MeshShape(2, 2, 1)) == "{devices=[4,1]0,1,2,3}"
    assert hlo_sharding(("tensor", "fsdp"), MeshShape(1, 2, 2)) == "{devices=[2,2]0,2,1,3}"


@pytest.mark.parametrize(
    "spec, mesh",
    [
        (("fsdp", None), MeshShape(1, 4, 1)),
        (("fsdp", None), MeshShape(2, 2, 1)),
        ((("data", "fsdp"), None), MeshShape(2, 2, 1)),
        (("tensor", "fsdp"), MeshShape(1, 2, 2)),
        ((None, "fsdp"), MeshShape(2, 2, 2)),
        ((None, None), MeshShape(1, 4, 1)),
    ],
)
def test_host_pieces_are_the_tiles_the_hlo_sharding_gives_each_device(spec, mesh):
    """The pieces ShardedWriter sends each device (sharding.host_pieces) against the compiler's reading of the same
    split (hlo_sharding: tile dims, then the devices in tile order, the last dim repeating over unused axes)."""
    value = torch.arange(8 * 12).reshape(8, 12)
    pieces = sharding.host_pieces(value, spec, mesh)
    text = hlo_sharding(spec, mesh)
    if text == "{replicated}":
        assert all(torch.equal(piece, value) for piece in pieces)
        return
    dims_text, devices_text = text[len("{devices=[") :].split(" ")[0].rstrip("}").split("]")
    dims = [int(d) for d in dims_text.split(",")]
    tiles = torch.tensor([int(d) for d in devices_text.split(",")]).reshape(dims)
    rows, cols = 8 // dims[0], 12 // dims[1]
    for (i, j, *_), device in zip(
        torch.cartesian_prod(*[torch.arange(n) for n in dims]).reshape(-1, len(dims)).tolist(), tiles.flatten()
    ):
        want = value[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
        assert torch.equal(pieces[int(device)], want), (spec, mesh, int(device))


def test_host_pieces_refuse_a_split_that_does_not_divide():
    with pytest.raises(ShardingError, match="does not split 4 ways"):
        sharding.host_pieces(torch.zeros(6, 4), ("fsdp", None), MeshShape(1, 4, 1))


def test_pieces_on_a_backend_without_spmd_point_to_torchrun():
    cpu = backends.backend_for(torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="no SPMD partitioner.*torchrun"):
        cpu.from_host_pieces([torch.zeros(2)], None, (None,))


def test_a_batch_that_does_not_split_is_named():
    with pytest.raises(ShardingError, match="the batch of 6 rows does not split over the mesh's data x fsdp = 2 x 2"):
        sharding.check_batch(6, MeshShape(2, 2, 1))
    sharding.check_batch(8, MeshShape(2, 2, 2))  # tensor does not split the batch


# ----------------------------------------------------------------------------------------------------------------
# Training over 4 CPU SPMD devices: ONE child process runs every case (tests/backends/spmd_cases.py)


@pytest.fixture(scope="module")
def spmd(tmp_path_factory):
    out = tmp_path_factory.mktemp("spmd")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "spmd_cases.py"), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_xla
def test_spmd_steps_equal_the_cpu_steps_with_a_quarter_of_the_parameters_per_device(spmd):
    assert spmd["devices"] == 4
    assert set(spmd["cases"]) == {
        "plain data x fsdp x tensor",
        "reversible data x fsdp",
        "checkpoint + offloaded optimizer fsdp",
        "plan fsdp",
        "scan fsdp x tensor",
    }
    for name, case in spmd["cases"].items():
        loss, reference = case["loss"]
        assert math.isclose(loss, reference, rel_tol=1e-12), name
        assert case["grad_rel_err"] < 1e-10, name  # float64: the partitioned sums only reorder additions
        for got, want in zip(*case["losses"]):
            assert math.isclose(got, want, rel_tol=1e-10), name
        assert case["weight_rel_err"] < 1e-9, name
        compiles = case["compiles"]
        assert compiles[-1] == compiles[1], f"{name}: compiled again after the second step: {compiles}"
    # parameters split 1/4 per device (norm scales, 1.5% of the elements, stay whole); over data they repeat
    assert 0.25 <= spmd["cases"]["checkpoint + offloaded optimizer fsdp"]["fraction"] < 0.27
    assert 0.25 <= spmd["cases"]["plain data x fsdp x tensor"]["fraction"] < 0.27  # fsdp 2 x tensor 2
    assert 0.5 <= spmd["cases"]["reversible data x fsdp"]["fraction"] < 0.52  # fsdp 2, repeated over data 2
    specs = spmd["cases"]["plain data x fsdp x tensor"]["specs"]
    assert specs["layers.0.attn.self_attn.q_proj.weight"] == "{devices=[2,2]0,2,1,3}"  # (tensor, fsdp)


@pytest.mark.slow
@needs_xla
def test_weights_are_initialised_on_the_mesh_piece_by_piece_equal_to_the_unsplit_init(spmd):
    """build_model under a mesh draws each weight whole on the host, in the unsplit init's order, and sends each
    device only its piece (sharding.ShardedWriter): the weights equal the CPU init bit for bit, and no device
    receives a whole weight it does not keep."""
    for name, case in spmd["cases"].items():  # (the stacked LM is built apart: spmd_cases.stacked_model)
        assert case["initial_equal"] is (None if name.startswith("scan") else True), name
    quarters = spmd["cases"]["checkpoint + offloaded optimizer fsdp"]  # fsdp 4: each device a quarter of each matrix
    assert sorted(sum(pieces) for pieces in quarters["sent"]) == quarters["whole"]
    assert all(len(pieces) == 4 and len(set(pieces)) == 1 for pieces in quarters["sent"])
    tiles = spmd["cases"]["plain data x fsdp x tensor"]  # fsdp 2 x tensor 2: a quarter each, tiled
    assert sorted(sum(pieces) for pieces in tiles["sent"]) == tiles["whole"]
    halves = spmd["cases"]["reversible data x fsdp"]  # fsdp 2, repeated over data 2: each device half of each
    assert sorted(sum(pieces) for pieces in halves["sent"]) == [2 * n for n in halves["whole"]]


@pytest.mark.slow
@needs_xla
def test_stacked_layers_train_under_a_mesh_split_as_their_layers(spmd):
    # the scanned reversible LM (one [layers, ...] parameter per name) over fsdp 2 x tensor 2 equals the unstacked
    # LM on the CPU (checked above); each stack keeps its layer dimension whole and splits each layer as unstacked
    case = spmd["cases"]["scan fsdp x tensor"]
    assert 0.25 <= case["fraction"] < 0.27
    mesh = MeshShape(1, 2, 2)
    stacked = {n: s for n, s in case["specs"].items() if ".stacked_" in n}
    assert len(stacked) == 9
    want = {
        "q_proj": (None, "tensor", "fsdp"),
        "gate_proj": (None, "tensor", "fsdp"),
        "o_proj": (None, "fsdp", "tensor"),
    }
    for owner, spec in want.items():
        found = [s for n, s in stacked.items() if owner in n]
        assert found and all(s == hlo_sharding(spec, mesh) for s in found), (owner, found)
    # the layer dimension is never split (the norm scales, whole when marked, take the compiler's sharding of
    # their updated values, read here after the steps)
    assert all(s.startswith("{devices=[1,") for s in stacked.values()), stacked


@pytest.mark.slow
@needs_xla
def test_the_planned_step_runs_under_a_mesh_with_a_schedule_for_each_devices_quarter(spmd):
    # strategy.activations=plan over fsdp=4 (the stages sized from shapes: torch_xla 2.9 cannot export the stage
    # programs under SPMD); the planner solves for the whole batch within 4x the per-device budget, and recomputes
    got, reference = spmd["cases"]["plan fsdp"]["schedule"]
    forwards = sum(n for kind, n in got.items() if kind in ("Fn", "CF", "Fe", "Fr"))
    assert forwards > 4, got  # 4 stages: storing everything runs each forward once
    assert got and reference


@pytest.mark.slow
@needs_xla
def test_revlib_xla_train_applies_the_mesh_and_compiles_once(spmd):
    run = spmd["train"]
    assert run["recompilations"] == 0 and not run["warnings"]
    assert len(run["losses"]) == 4 and all(math.isfinite(v) for v in run["losses"])
    assert 0.25 <= run["fraction"] < 0.27


@pytest.mark.slow
@needs_xla
def test_spmd_refusals_at_the_point_of_use(spmd):
    assert "the batch of 6 rows does not split over the mesh's data x fsdp = 1 x 4" in spmd["odd_batch"]
    assert "strategy.offload.params=true streams whole layers" in spmd["offload_params"]


# ----------------------------------------------------------------------------------------------------------------
# Per-chip HBM of a slice without the slice: the sharded deviceless compile

SIZED = [
    # every piece a multiple of the TPU's (8, 128) tiles, so that the per-chip bytes carry no layout padding
    "model.overrides={vocab_size: 256, dim: 512, n_layers: 1, n_heads: 4, n_kv_heads: 2, ffn_dim: 1024}",
    "data.seq_len=32",
    "data.batch_size=8",
    "strategy=reversible",
]


@pytest.mark.slow
@needs_xla
@needs_libtpu
def test_per_chip_parameters_are_a_quarter_on_four_chips_and_one_chip_is_unchanged():
    from revlib_xla.fit import chips
    from revlib_xla.fit.report import compile_steps
    from revlib_xla.fit.strategies import trace_config
    from revlib_xla.fit.trace import OPTIMIZER, PARAMETERS

    one = trace_config(load_config(None, SIZED))
    four = sharding.shard_step(one, MeshShape(1, 4, 1))
    assert sharding.shard_step(one, MeshShape(1, 1, 1)) is one  # one chip: today's program, untouched
    assert four.partitions == 4 and 'mhlo.sharding = "{devices=[1,4]0,1,2,3}"' in four.stablehlo
    assert "mhlo.num_partitions = 4" in four.stablehlo
    single, split = compile_steps([one], chips.chip("v5e")) + compile_steps([four], chips.chip("v5e"))
    params = one.argument_bytes(PARAMETERS)
    norms = sum(a.nbytes for a in one.arguments if a.role == PARAMETERS and len(a.shape) == 1)
    assert split.parameters == (params - norms) // 4 + norms  # the norm scales stay whole
    assert split.optimizer < single.optimizer / 3
    # The compiler's own argument bytes per chip agree: what is not parameters, state or the batch (the rotary
    # tables, whole on every chip, and scalars) is the same on one chip and on each of four, to within the
    # compiler's padding of small arguments to its alignment
    assert split.other > 0 and abs(split.other - single.other) <= 512 * len(one.arguments)
    assert split.inputs == single.inputs // 4
    assert split.total < single.total
    assert four.argument_bytes(OPTIMIZER) == split.optimizer
