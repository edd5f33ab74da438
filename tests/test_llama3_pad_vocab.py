"""llama3_cuda.py --pad-vocab 1: the classifier's GEMM and logits over Vp = V rounded up to a multiple
of 128 (gpt2_cpu.padded_vocab), as gpt2_cuda.py's, on the emulated device, against llama3_cpu.py
(which pads nothing):
  - --check's comparison passes in fp32 and bf16 with V = 75 padded to 128 (every activation, the
    logits' V real columns, every gradient, dwlmhead included);
  - the padded rows of the classifier, outside every parameter view, are 0 and stay 0 through
    training; their logits' gradients are 0 and masked out of the softmax (the losses are the
    unpadded run's); the parameter table, AdamW's state, the checkpoint files and the ZeRO shards
    are the unpadded model's: a padded run writes what an unpadded run writes, and llama3_cpu.py
    resumes it;
  - a resume that changes --pad-vocab is refused (llmc.cli's DEVICE_RESULT_FLAGS).
Run: python -m pytest -q tests/test_llama3_pad_vocab.py   (about a minute on 2 cores)
"""

import os

import numpy as np
import pytest

import gpt2_cuda
import llama3_cpu
import llama3_cuda
from emulated_gpu import _train_losses, _write_shards
from llmc import cuda
from llmc.cuda_check import check_llama3_against_cpu

TINY = llama3_cpu.LlamaConfig(max_seq_len=16, vocab_size=75, num_layers=2, num_heads=4, num_kv_heads=2, channels=64,
                              multiple_of=32)
VP = 128


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cuda, "_device", "cpu")
    monkeypatch.setattr(gpt2_cuda, "GLOBAL_NORM_GRID", 16)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_check_passes_with_the_padded_classifier(emulated, precision):
    model = llama3_cuda.Llama3(TINY, precision, "naive", pad_vocab=True)
    llama3_cuda.upload_parameters(model, llama3_cpu.llama3_init(TINY, seed=3).params)
    assert model.Vp == VP and model.classifier_weight.shape == (VP, TINY.channels)
    assert model.params_memory.size == model.num_parameters                  # the table is unpadded
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, TINY.vocab_size, (2, 13)), rng.integers(0, TINY.vocab_size, (2, 13))
    assert check_llama3_against_cpu(llama3_cuda, model, x, y, verbose=False)
    # the padded rows' gradient, dlogits[:, V:]^T @ lnf, is 0: the fused classifier wrote dlogits 0 there
    assert model.classifier_grad[:TINY.vocab_size].any() and not model.classifier_grad[TINY.vocab_size:].any()


def test_padded_training_is_the_unpadded_run(emulated, tmp_path, capsys):
    model = str(tmp_path / "tiny.bin")
    llama3_cpu.write_model(model, llama3_cpu.llama3_init(TINY, seed=3))
    common = ["-e", model, "-i", _write_shards(tmp_path, V=TINY.vocab_size), "-j", "", "-b", "2", "-t", "16",
              "-x", "4", "-n", "2", "-v", "0", "-s", "0", "-l", "1e-2", "-k", "constant", "-c", "0.1", "--device", "cpu"]
    runs = {}
    for pad in (0, 1):
        out = str(tmp_path / f"pad{pad}")
        trained = llama3_cuda.train(llama3_cuda.parse_args(common + ["-o", out, "--pad-vocab", str(pad)]))
        runs[pad] = out, trained
    assert "classifier over Vp=128" in capsys.readouterr().out
    padded = runs[1][1]
    assert not padded.classifier_weight[TINY.vocab_size:].any()              # the padded rows never move
    losses = [_train_losses(os.path.join(runs[pad][0], "main.log")) for pad in (0, 1)]
    assert len(losses[0]) == 4 and losses[0].keys() == losses[1].keys()
    for step in losses[0]:
        assert losses[1][step] == pytest.approx(losses[0][step], rel=1e-6), step
    for name in ("model_00000004.bin", "state_00000004_00000.bin"):
        sizes = [os.path.getsize(os.path.join(runs[pad][0], name)) for pad in (0, 1)]
        assert sizes[0] == sizes[1], name                                    # the same files
    # changing --pad-vocab on a resume is refused; llama3_cpu.py resumes the padded run's checkpoint
    assert llama3_cuda.main(common + ["-x", "8", "-y", "1", "-o", runs[1][0], "--pad-vocab", "0"]) == 1
    assert "--pad-vocab 1" in capsys.readouterr().err
    assert llama3_cpu.main(common[:-2] + ["-x", "6", "-y", "1", "-o", runs[1][0]]) == 0
