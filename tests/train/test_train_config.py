"""revlib_xla.train.config: the run schema, YAML + dotted overrides, and one-line errors that name the key."""

import pytest
import yaml

from revlib_xla.train.config import ConfigError, RunConfig, apply_overrides, dump_config, load_config


def test_defaults_and_the_shipped_smoke_config_load():
    cfg = load_config(None)
    assert cfg == RunConfig()
    assert cfg.strategy.activations == "none" and cfg.optim.betas == (0.9, 0.95)
    smoke = load_config("tpu_configs/cpu-smoke.yaml")
    assert smoke.model.name == "llama-tiny" and smoke.model.overrides["vocab_size"] == 256


def test_dotted_overrides_are_parsed_as_yaml():
    cfg = load_config(
        None,
        [
            "train.steps=10",
            "strategy.offload.optimizer=true",
            "optim.betas=[0.9,0.99]",
            "strategy=plan",
            "strategy.budget=8GiB",
            "model.overrides.vocab_size=256",
            "train.out_dir=/tmp/x y",
        ],
    )
    assert cfg.train.steps == 10 and isinstance(cfg.train.steps, int)
    assert cfg.strategy.offload.optimizer is True
    assert cfg.optim.betas == (0.9, 0.99)
    assert cfg.strategy.activations == "plan"
    assert cfg.strategy.budget_bytes() == 8 * 2**30
    assert cfg.model.overrides == {"vocab_size": 256}
    assert cfg.train.out_dir == "/tmp/x y"


def test_a_dumped_config_loads_back_equal(tmp_path):
    cfg = load_config(None, ["strategy=reversible", "optim.betas=[0.8,0.9]", "model.overrides.dim=96"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.stpes=3"], r"unknown key 'train.stpes' \(did you mean 'train.steps'"),
        (["trian.steps=3"], r"unknown key 'trian'.*did you mean 'train'"),
        (["train.steps=many"], r"train.steps='many': .*integer.*\(expected int\)"),
        (["strategy=reversable"], r"strategy.activations='reversable'.*one of 'none', 'checkpoint', 'reversible'"),
        (["strategy.precision=fp16"], r"strategy.precision='fp16'.*one of 'fp32', 'bf16'"),
        (["strategy.fewbit=7"], r"strategy.fewbit=7: must be 0 \(off\) or 1, 2, 3 or 4 bits"),
        (["strategy.budget=8GiB"], r"strategy.budget='8GiB' .* only to strategy.activations=plan"),
        (["strategy=plan", "strategy.budget=lots"], r"strategy.budget=.*expected a number of bytes"),
        # the key and value once (they were said twice)
        (["strategy=plan", "strategy.budget=0"], r"^strategy.budget=0: must be a positive, finite number of bytes"),
        (
            ["strategy.fused_optimizer=true", "optim.grad_accum_steps=2", "optim.grad_clip=0"],
            r"fused_optimizer=true .* optim.grad_accum_steps=2",
        ),
        (["strategy.fused_optimizer=true"], r"optim.grad_clip=1.0 cannot be applied; set optim.grad_clip=0"),
        (["data.batch_size=6", "optim.grad_accum_steps=4"], r"data.batch_size=6 .* multiple"),
        (["data.kind=tokens"], r"data.kind=tokens needs data.path"),
        (["model.name=llama-7b"], r"model.name='llama-7b' is not a known size.*llama-tiny"),
        (["model.overrides.dimm=3"], r"model.overrides: .*dimm"),
        (["train.steps"], r"expected key=value"),
        (["train.steps.x=1"], r"train.steps=\{.x.: 1\}: .*integer"),
        (["model.scan=maybe"], r"model.scan='maybe': .*\(expected bool\)"),
        (["strategy=reversible", "strategy.exact=maybe"], r"strategy.exact='maybe': .*\(expected bool\)"),
        (
            ["strategy=checkpoint", "strategy.exact=false"],
            r"strategy.exact=false .*strategy.activations=checkpoint .*set strategy.activations=reversible or momentum",
        ),
        (["model.scan=true"], r"model.scan=true .*strategy.activations=none .*Set strategy.activations=reversible"),
        (["model.scan=true", "strategy=momentum"], r"model.scan=true .*momentum form.*strategy.activations=reversible"),
        (
            ["model.scan=true", "strategy=reversible", "strategy.fused_optimizer=true", "optim.grad_clip=0"],
            r"model.scan=true cannot be combined with strategy.fused_optimizer .*set model.scan=false",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(listed)


def test_overrides_build_nested_sections():
    assert apply_overrides({}, ["a.b.c=1", "a.b.d=x"]) == {"a": {"b": {"c": 1, "d": "x"}}}
