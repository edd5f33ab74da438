"""
tests/test_descriptors.py: -e's model descriptors map to llm.c's shapes (issue 30, section 1).

llm.c's train_gpt2.cu builds a model from three forms: the legacy "dX" and "gpt2:dX" (X the
depth, gpt2_set_hyperparameters) and "gpt3:cX" (X the channel count, gpt3_set_hyperparameters).
The expected tables below are llm.c's numbers, written out here rather than read from gpt2_cpu.py,
so a wrong entry in the trainer's table fails. Bad forms are one `error:` line from the command
line, and the smallest GPT-3 trains (gpt2_cpu.py) to a checkpoint whose header says maxT 2048.
"""

import os
import subprocess
import sys

import pytest

import gpt2_cpu as g
from llmc import formats, utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# llm.c, train_gpt2.cu, gpt_build_from_descriptor: both families use GPT-2's tokenizer
LLMC_V, LLMC_VP = 50257, 50304

# llm.c's gpt2_set_hyperparameters: depth -> (L, NH, C), maxT 1024
LLMC_GPT2 = {
    6: (6, 6, 384),        # (unofficial) gpt2-tiny (30M)
    12: (12, 12, 768),     # gpt2 (124M)
    24: (24, 16, 1024),    # gpt2-medium (350M)
    36: (36, 20, 1280),    # gpt2-large (774M)
    48: (48, 25, 1600),    # gpt2-xl (1558M)
    60: (60, 30, 1920),    # (unofficial) 2.7B
    72: (72, 30, 2880),    # (unofficial) 7.3B
    84: (84, 36, 3456),    # (unofficial) 12.2B
}

# llm.c's gpt3_set_hyperparameters: channels -> (L, NH = C / head size, C), maxT 2048
LLMC_GPT3 = {
    384: (6, 384 // 64, 384),          # (unofficial) gpt3-tiny (31M)
    768: (12, 768 // 64, 768),         # gpt3-small (125M)
    1024: (24, 1024 // 64, 1024),      # gpt3-medium (350M)
    1536: (24, 1536 // 96, 1536),      # gpt3-large (760M)
    2048: (24, 2048 // 128, 2048),     # gpt3-xl (1.3B)
    2560: (32, 2560 // 80, 2560),      # gpt3-2.7B
    4096: (32, 4096 // 128, 4096),     # gpt3-6.7B
    12288: (96, 12288 // 128, 12288),  # gpt3 (175B)
}


def shape(cfg):
    return (cfg.num_layers, cfg.num_heads, cfg.channels, cfg.max_seq_len, cfg.vocab_size, cfg.padded_vocab_size)


@pytest.mark.parametrize("depth", sorted(LLMC_GPT2))
def test_gpt2_depth_forms_are_llmc_gpt2_set_hyperparameters(depth):
    want = LLMC_GPT2[depth] + (1024, LLMC_V, LLMC_VP)
    assert shape(g.config_from_descriptor(f"d{depth}")) == want            # legacy form
    assert shape(g.config_from_descriptor(f"gpt2:d{depth}")) == want       # explicit form


@pytest.mark.parametrize("channels", sorted(LLMC_GPT3))
def test_gpt3_channel_form_is_llmc_gpt3_set_hyperparameters(channels):
    assert shape(g.config_from_descriptor(f"gpt3:c{channels}")) == LLMC_GPT3[channels] + (2048, LLMC_V, LLMC_VP)


def test_smallest_gpt3_is_31M_parameters():
    # gpt3:c384 is d6 with a position embedding twice as long: 30,357,504 + 1024 * 384
    n = g.num_elements(g.parameter_shapes(g.config_from_descriptor("gpt3:c384")))
    assert n == g.num_elements(g.parameter_shapes(g.config_from_descriptor("d6"))) + 1024 * 384 == 30_750_720


def test_the_projects_own_names_still_work():
    for name, (L, NH, C) in {"d2": (2, 4, 128), "d4": (4, 4, 256), "gpt2:d4": (4, 4, 256)}.items():
        assert shape(g.config_from_descriptor(name)) == (L, NH, C, 1024, LLMC_V, LLMC_VP)
    for size, depth in {"124M": 12, "350M": 24, "774M": 36, "1558M": 48}.items():
        assert g.config_from_descriptor(size) == g.config_from_descriptor(f"d{depth}")


def test_the_trainers_read_one_table():
    # gpt2_cuda.py builds its model through gpt2_cpu's model_config / build_model
    import gpt2_cuda
    assert gpt2_cuda.model_config is g.model_config and gpt2_cuda.build_model is g.build_model
    assert g.model_config("gpt3:c768") == g.config_from_descriptor("gpt3:c768")


@pytest.mark.parametrize("name", ["gpt3:c", "gpt3:cabc", "gpt3:c1000", "gpt2:c768", "gpt3:d12", "d13", "gpt2:d",
                                  "gpt3:c+384", "d", "gpt2:d12x", "GPT3:c768"])
def test_bad_forms_are_refused_listing_what_is_accepted(name):
    with pytest.raises(utils.InputError, match="unknown model") as e:
        g.config_from_descriptor(name)
    said = str(e.value)
    assert "\n" not in said and f"'{name}'" in said
    assert "gpt3:cX" in said and "12288" in said and "gpt2:dX" in said and "84" in said and "124M" in said


def test_gpt3_13B_is_refused_naming_the_broken_head_size():
    # llm.c's table has channels 5140, head size 128: 5140 / 128 is not whole (llm.c asserts)
    with pytest.raises(utils.InputError, match="'gpt3:c5140' is refused") as e:
        g.config_from_descriptor("gpt3:c5140")
    said = str(e.value)
    assert "\n" not in said and "head size 128" in said and "5140" in said


def run(args, script="gpt2_cpu.py", timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, script)] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("script", ["gpt2_cpu.py", "gpt2_cuda.py"])
def test_bad_form_is_one_error_line_from_the_command_line(script):
    extra = ["--device", "cpu"] if script == "gpt2_cuda.py" else []
    r = run(["-e", "gpt3:c1000", "-x", "1"] + extra, script)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: unknown model 'gpt3:c1000'") and "Traceback" not in r.stderr


def test_help_names_the_three_forms():
    out = " ".join(run(["--help"]).stdout.split())                     # the help's lines joined
    assert "gpt2:dX" in out and "gpt3:cX" in out
    # and lists every entry of the trainers' tables (llmc/ cannot import them, so it is written out)
    assert f"(X = {' '.join(d[1:] for d in g.MODEL_DESCRIPTORS)};" in out
    assert f"(X = {' '.join(map(str, g.GPT3_DESCRIPTORS))};" in out


def test_smallest_gpt3_trains_and_its_checkpoint_says_maxT_2048(tmp_path):
    # gpt2_cpu.py only: gpt2_cuda.py --device cpu took 108 s for the same two steps (the emulated
    # kernels), and builds its model through the same build_model (test_the_trainers_read_one_table)
    if not os.path.exists(os.path.join(ROOT, "data", "tinyshakespeare", "tiny_shakespeare_train.bin")):
        pytest.skip("no Shakespeare data: run dev/data/tinyshakespeare.py")
    r = run(["-e", "gpt3:c384", "-b", "1", "-t", "64", "-x", "2", "-v", "0", "-s", "0", "-n", "2", "-o", str(tmp_path)])
    assert r.returncode == 0, r.stderr
    assert "maxT=2048" in r.stdout and "step    2/2" in r.stdout
    header = formats.read_model_shape(str(tmp_path / "model_00000002.bin"))
    assert shape(g.config_from_header(header)) == LLMC_GPT3[384] + (2048, LLMC_V, LLMC_VP)


def test_a_model_of_the_other_family_names_its_trainer():
    """-e llama3:d4 to the GPT-2 trainer, -e d4 to the Llama 3 one: the line says which trainer."""
    import llama3_cpu
    with pytest.raises(utils.InputError, match="train it with llama3_cpu.py"):
        g.config_from_descriptor("llama3:d4")
    for name in ("d4", "gpt2:d12", "gpt3:c768", "124M"):
        with pytest.raises(utils.InputError, match="train it with gpt2_cpu.py"):
            llama3_cpu.config_from_descriptor(name)
