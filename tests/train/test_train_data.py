"""revlib_xla.train.data: byte and token streams, the resumable sampler, errors naming data.* keys."""

import numpy as np
import pytest
import torch

from revlib_xla.demo import load_corpus
from revlib_xla.train.config import ConfigError, load_config
from revlib_xla.train.data import BatchSampler, SamplerState, eval_batches, load_data


def _cfg(*overrides):
    return load_config(None, ["data.seq_len=8", "data.batch_size=3", "data.val_fraction=0.25", *overrides])


def test_default_bytes_are_the_standard_library_source():
    data = load_data(_cfg(), 256)
    corpus = np.frombuffer(load_corpus(), dtype=np.uint8)
    assert np.array_equal(np.concatenate([data.train, data.val]), corpus)
    assert len(data.val) == len(corpus) - int(len(corpus) * 0.75)


def test_bytes_from_a_directory_and_from_a_file(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world" * 20)
    (tmp_path / "a.txt").write_bytes(b"hello" * 20)
    data = load_data(_cfg(f"data.path={tmp_path}"), 256)
    assert bytes(np.concatenate([data.train, data.val])) == b"hello" * 20 + b"\n\n" + b"world" * 20
    one = load_data(_cfg(f"data.path={tmp_path / 'a.txt'}"), 256)
    assert bytes(np.concatenate([one.train, one.val])) == b"hello" * 20


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_are_memory_mapped_and_checked_against_the_vocabulary(tmp_path, dtype):
    ids = (np.arange(400) * 7 % 1000).astype(dtype)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    cfg = _cfg("data.kind=tokens", f"data.path={path}", f"data.token_dtype={dtype}")
    data = load_data(cfg, 1000)
    assert isinstance(data.train, np.memmap) and np.array_equal(np.concatenate([data.train, data.val]), ids)
    with pytest.raises(ConfigError, match=r"token id 995, but the model has vocab_size=500; set model.overrides"):
        load_data(cfg, 500)


def test_a_late_bad_token_is_found_in_its_batch(tmp_path, monkeypatch):
    ids = np.zeros(400, dtype=np.uint16)
    ids[200] = 300
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    monkeypatch.setattr("revlib_xla.train.data._CHECK_AT_LOAD", 16)  # as if the file were too large to scan
    data = load_data(_cfg("data.kind=tokens", f"data.path={path}"), 256)
    sampler = BatchSampler(data, 8, 3)
    with pytest.raises(ConfigError, match="a training batch .* holds token id 300"):
        for _ in range(100):
            sampler.next_batch()


@pytest.mark.parametrize(
    "overrides, vocab, expected",
    [
        (["data.path=/no/such/dir"], 256, r"data.path='/no/such/dir': no such file or directory"),
        (["data.kind=tokens", "data.path=/no/such/file"], 256, r"data.path='/no/such/file': no such file"),
        ([], 100, r"data.kind=bytes needs a vocabulary of at least 256.*model.overrides.vocab_size=256"),
        (["data.seq_len=100000000"], 256, r"fewer than data.seq_len=100000000"),
        (["data.kind=hf", "data.hf_dataset=wikitext"], 256, r"needs the 'datasets' package"),
    ],
)
def test_bad_data_names_the_key(overrides, vocab, expected):
    if "data.kind=hf" in overrides:
        try:
            import datasets  # noqa: F401

            pytest.skip("datasets is installed here")
        except ImportError:
            pass
    with pytest.raises(ConfigError, match=expected):
        load_data(_cfg(*overrides), vocab)


def test_a_token_file_of_the_wrong_size_for_its_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 101)
    with pytest.raises(ConfigError, match="not a whole number of uint16 ids; check data.token_dtype"):
        load_data(_cfg("data.kind=tokens", f"data.path={path}"), 256)


def _stream(tmp_path, n=200):
    path = tmp_path / "tokens.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    return load_data(_cfg("data.kind=tokens", f"data.path={path}", "data.val_fraction=0.2"), 1000)


def test_the_sampler_visits_every_window_once_per_epoch_in_a_new_order(tmp_path):
    data = _stream(tmp_path)  # 160 training tokens: 20 windows of 8
    sampler = BatchSampler(data, 8, 4, seed=5)
    epoch0 = torch.cat([sampler.next_batch() for _ in range(5)])
    epoch1 = torch.cat([sampler.next_batch() for _ in range(5)])
    for epoch in (epoch0, epoch1):
        assert epoch.dtype == torch.int64 and epoch.shape == (20, 8)
        assert sorted(epoch[:, 0].tolist()) == list(range(0, 160, 8))
        assert torch.equal(epoch - epoch[:, :1], torch.arange(8).expand(20, 8))
    assert not torch.equal(epoch0, epoch1)
    assert sampler.state == SamplerState(epoch=1, index=20, seed=5)


def test_the_sampler_resumes_from_its_state(tmp_path):
    data = _stream(tmp_path)
    a = BatchSampler(data, 8, 3, seed=1)
    for _ in range(8):  # crosses an epoch boundary
        a.next_batch()
    b = BatchSampler(data, 8, 3, seed=1)
    b.state = SamplerState.from_dict(a.state.to_dict())
    for _ in range(10):
        assert torch.equal(a.next_batch(), b.next_batch())


def test_eval_batches_are_the_first_whole_batches_of_the_validation_text(tmp_path):
    data = _stream(tmp_path)  # 40 validation tokens: 5 windows of 8
    batches = eval_batches(data, 8, 2, batches=4)
    assert [b.shape for b in batches] == [(2, 8), (2, 8)]
    assert torch.equal(torch.cat(batches).flatten(), torch.arange(160, 192))
