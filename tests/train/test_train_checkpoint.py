"""revlib_xla.train.checkpoint: complete, atomic checkpoints (safetensors weights, tied tensors once), keep-last-K."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from revlib_xla.train import checkpoint as ck


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(3))


def _trained(seed):
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.head(model.proj(model.embed(torch.arange(5)))).sum().backward()
    opt.step()
    return model, opt


def _state(step):
    return ck.Checkpoint(step, {"epoch": 0, "index": step, "seed": 0}, ck.rng_state(torch.device("cpu")), {"loss": 1.0})


def test_round_trip_restores_weights_optimizer_and_state(tmp_path):
    model, opt = _trained(0)
    path = ck.save_checkpoint(tmp_path, model, opt, _state(7), "train:\n  steps: 9\n")
    assert path.name == "step_00000007" and ck.latest_checkpoint(tmp_path) == path
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["count", "embed.weight", "proj.bias", "proj.weight"]  # the tied head once
        assert json.loads(f.metadata()["tied"]) == {"head.weight": "embed.weight"}
    assert (path / "config.yaml").read_text() == "train:\n  steps: 9\n"
    modes = {file.name: oct(file.stat().st_mode & 0o777) for file in path.iterdir()}
    assert len(set(modes.values())) == 1, modes  # model.safetensors was 0600, the others 0644

    other, other_opt = _trained(1)
    restored = ck.load_checkpoint(path, other, other_opt)
    assert other.head.weight is other.embed.weight
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(opt.state.values(), other_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert restored.step == 7 and restored.sampler["index"] == 7 and restored.metrics == {"loss": 1.0}


def test_random_states_are_restored():
    state = ck.rng_state(torch.device("cpu"))
    expected = (torch.rand(3), np.random.rand(), __import__("random").random())
    torch.rand(5), np.random.rand(2)
    ck.set_rng_state(state, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(), __import__("random").random())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


@pytest.mark.parametrize("fail_at", ["optimizer.pt", "rename", "latest"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint_as_latest(tmp_path, monkeypatch, fail_at):
    model, opt = _trained(0)
    first = ck.save_checkpoint(tmp_path, model, opt, _state(1), "")
    real_save, real_rename, real_replace = torch.save, ck.os.rename, ck.os.replace

    def boom(*args, **kwargs):
        raise OSError("disk full (injected)")

    if fail_at == "optimizer.pt":
        monkeypatch.setattr(ck.torch, "save", boom)
    elif fail_at == "rename":
        monkeypatch.setattr(ck.os, "rename", boom)
    else:
        monkeypatch.setattr(ck.os, "replace", boom)
    with pytest.raises(OSError, match="injected"):
        ck.save_checkpoint(tmp_path, model, opt, _state(2), "")
    monkeypatch.setattr(ck.torch, "save", real_save)
    monkeypatch.setattr(ck.os, "rename", real_rename)
    monkeypatch.setattr(ck.os, "replace", real_replace)
    assert ck.latest_checkpoint(tmp_path) == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]  # the partial directory is gone
    if fail_at != "latest":
        assert not (tmp_path / "step_00000002").exists()
    restored = ck.load_checkpoint(first, *_trained(3))
    assert restored.step == 1


def test_only_the_newest_k_are_kept(tmp_path):
    model, opt = _trained(0)
    for step in range(1, 6):
        ck.save_checkpoint(tmp_path, model, opt, _state(step), "", keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert ck.latest_checkpoint(tmp_path).name == "step_00000005"


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = _trained(0)
    path = ck.save_checkpoint(tmp_path, model, opt, _state(1), "")
    other = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="do not match the model .*another model or strategy"):
        ck.load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))
    assert ck.latest_checkpoint(tmp_path / "nothing") is None
