"""A pretrained model converted to save memory keeps what it learned: a transformers Llama trained to a plateau on real
text (the Python standard library's sources, bytes), converted with ``momentum``, loses nothing of its validation
loss, and fine-tunes as the plain model does; the two-stream ``reversible`` form, another function, does not (the
defect that made the exact momentum form the fine-tuning strategy). A smaller run of
``bench/hf_keeps_what_it_learned.py`` (whose recorded 12-layer run is in ``bench/results``)."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from conftest import require_transformers

require_transformers()
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from hf_keeps_what_it_learned import Setting, convert, pretrained, train, validation_loss  # noqa: E402

SETTING = Setting(layers=8, hidden=64, intermediate=172, heads=4, batch=8, seq=64, pretrain_steps=400,
                  pretrain_lr=3e-3, finetune_steps=100, finetune_lr=1e-3, eval_batches=20)  # fmt: skip


@pytest.mark.slow
def test_a_trained_model_converted_with_momentum_keeps_its_loss_and_fine_tunes_as_the_plain_one():
    torch.manual_seed(0)
    base, train_text, val_text, _ = pretrained(SETTING, cache=None)
    trained = validation_loss(base, val_text, SETTING)
    assert trained < 2.6  # learned something (a uniform guess over bytes: 5.5)
    rows = {}
    for name, how in (
        ("plain", None),
        ("momentum", {"strategy": "momentum"}),
        ("reversible", {"strategy": "reversible"}),
    ):
        model = convert(copy.deepcopy(base), how)
        at_conversion = validation_loss(model, val_text, SETTING)
        train(model, train_text, SETTING.finetune_steps, SETTING.finetune_lr, 2, SETTING)
        rows[name] = (at_conversion, validation_loss(model, val_text, SETTING))
    plain_fine_tuned = rows["plain"][1]
    momentum_at_conversion, momentum_fine_tuned = rows["momentum"]
    assert abs(momentum_at_conversion / trained - 1) <= 0.005, (momentum_at_conversion, trained)
    assert abs(momentum_fine_tuned / plain_fine_tuned - 1) <= 0.005, (momentum_fine_tuned, plain_fine_tuned)
    reversible_at_conversion = rows["reversible"][0]
    assert reversible_at_conversion / trained - 1 > 0.05, (reversible_at_conversion, trained)  # what it replaces
