"""Saving converted models honestly (:mod:`revlib_xla.hf.saving`): a conversion that changes the function
(``reversible``, ``momentum``) saves a config that plain transformers refuses (``AutoModelForCausalLM``) or warns
about (the architecture's own class), and ``revlib_xla.hf.from_pretrained`` loads it converted again, in a fresh
process, computing what the saved model computed; ``plan`` saves a plain model that plain transformers loads as
it is. ``unconvert`` gives the plain model back where that keeps the function."""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import max_rel_err, require_transformers

transformers = require_transformers()

from revlib_xla.hf import HFConversionError, from_pretrained, memory_efficient, model_from_config, unconvert  # noqa: E402

IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


def tiny(name="llama-tiny", depth=3):
    torch.manual_seed(0)
    return model_from_config(name, num_hidden_layers=depth, dtype=torch.float32).train()


def trained(model, steps=3):
    """A few steps, so that the weights are not the initial ones."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(IDS, labels=IDS, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def fresh_process(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new Python process (nothing imported but what it imports)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize("strategy", ["momentum", "reversible"])
def test_a_function_changing_save_is_refused_by_plain_transformers_and_loads_converted_in_a_fresh_process(
    strategy, tmp_path
):
    model = trained(memory_efficient(tiny(), strategy))
    model.save_pretrained(tmp_path / "model")
    with torch.no_grad():
        want = model.eval()(IDS).logits
    torch.save({"ids": IDS, "logits": want}, tmp_path / "want.pt")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == f"revlib_xla:{strategy}:llama"
    assert config["revlib_xla"]["strategy"] == strategy and config["revlib_xla"]["original_model_type"] == "llama"
    assert model.config.model_type == "llama" and not hasattr(model.config, "revlib_xla")  # in memory: unchanged
    run = fresh_process(f"""
        import torch, transformers
        path = {str(tmp_path / "model")!r}
        try:
            transformers.AutoModelForCausalLM.from_pretrained(path)
            print("AUTO LOADED")
        except ValueError as exc:
            print("AUTO REFUSED:", str(exc).splitlines()[0])
        transformers.LlamaForCausalLM.from_pretrained(path)  # warns (transformers' logger, on stderr)
        from revlib_xla.hf import from_pretrained
        model = from_pretrained(path).eval()
        saved = torch.load({str(tmp_path / "want.pt")!r})
        with torch.no_grad():
            got = model(saved["ids"]).logits
        print("CONVERSION", model.revlib_xla_conversion.strategy, model.revlib_xla_conversion.options)
        print("EQUAL", bool(torch.equal(got, saved["logits"])))
    """)
    assert run.returncode == 0, run.stderr
    assert f"AUTO REFUSED: The checkpoint you are trying to load has model type `revlib_xla:{strategy}:llama`" in (
        run.stdout
    )
    assert f"You are using a model of type `revlib_xla:{strategy}:llama` to instantiate a model of type `llama`" in (
        run.stderr
    )
    assert f"CONVERSION {strategy}" in run.stdout and "EQUAL True" in run.stdout, run.stdout


def test_a_plan_save_is_a_plain_model_that_plain_transformers_loads_as_it_is(tmp_path):
    model = trained(memory_efficient(tiny(), "plan"))
    model.save_pretrained(tmp_path / "model")
    with torch.no_grad():
        torch.save({"ids": IDS, "logits": model.eval()(IDS).logits}, tmp_path / "want.pt")
    assert "revlib_xla" not in json.loads((tmp_path / "model" / "config.json").read_text())
    run = fresh_process(f"""
        import torch, transformers
        model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}).eval()
        saved = torch.load({str(tmp_path / "want.pt")!r})
        with torch.no_grad():
            print("CLOSE", float((model(saved["ids"]).logits - saved["logits"]).abs().max()))
    """)
    assert run.returncode == 0, run.stderr
    assert "You are using a model of type" not in run.stderr
    assert float(run.stdout.split("CLOSE")[1]) <= 1e-5  # float32, the same function (plan's layers are the model's)
    plain = from_pretrained(tmp_path / "model")
    assert getattr(plain, "revlib_xla_conversion", None) is None  # unmarked: loaded as plain transformers loads it


def test_trainer_saves_a_marked_checkpoint(tmp_path):
    """transformers' Trainer saves through the model's save_pretrained: its checkpoints are marked too."""
    from torch.utils.data import Dataset

    class Texts(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": IDS[i % 2], "labels": IDS[i % 2]}

    model = memory_efficient(tiny(), "momentum")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        optim="adamw_torch",
        dataloader_num_workers=0,
    )  # fmt: skip  (accelerate may place the model on XLA, torch_xla being installed: no fused AdamW there)
    transformers.Trainer(model=model, args=args, train_dataset=Texts()).train()
    config = json.loads((tmp_path / "checkpoint-2" / "config.json").read_text())
    assert config["model_type"] == "revlib_xla:momentum:llama"
    loaded = from_pretrained(tmp_path / "checkpoint-2")
    assert loaded.revlib_xla_conversion.strategy == "momentum"
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.cpu()), key


def test_unconvert_gives_the_plain_model_back_where_it_keeps_the_function():
    ref = tiny()
    planned = memory_efficient(copy.deepcopy(ref), "plan")
    trained(planned)
    trained(ref)
    plain = unconvert(planned)
    assert type(plain.model.layers) is torch.nn.ModuleList and not hasattr(plain, "revlib_xla_conversion")
    assert "save_pretrained" not in plain.__dict__
    with torch.no_grad():
        assert max_rel_err(plain.eval()(IDS).logits, ref.eval()(IDS).logits) <= 1e-5
    momentum = memory_efficient(tiny(), "momentum")
    with pytest.raises(HFConversionError, match=r"only approximately .*beta = 0.015625.*approximate=True"):
        unconvert(momentum)
    with torch.no_grad():
        converted = momentum.eval()(IDS).logits
    with pytest.warns(UserWarning, match="up to beta = 0.015625"):
        unconvert(momentum, approximate=True)
    with torch.no_grad():
        assert max_rel_err(momentum(IDS).logits, converted) <= 2**-6
    with pytest.raises(HFConversionError, match="no plain form"):
        unconvert(memory_efficient(tiny(), "reversible"))
    with pytest.raises(HFConversionError, match="was not converted"):
        unconvert(tiny())
