"""
tests/test_reliability_tools.py: every tool keeps the one-line promise (issue "Reliability III",
section 5): a bad flag, a bad file or bad values are one `error:` line and exit 1, never an
argparse usage dump, a traceback or a file half-written; Ctrl-C while a program is still importing
its packages exits 130 without a traceback; a learning rate that overflows ends the run with one
line naming the step.

The files a tool cannot read are simulated in-process (open() raising PermissionError for that
one path), since this suite may run as root, for whom no file mode makes a file unreadable.
"""

import builtins
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev", "data"))
sys.path.insert(0, os.path.join(ROOT, "dev", "eval"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import gpt2_cpu as g  # noqa: E402

TINY = g.GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=1, num_heads=2, channels=16)
# every program a user runs from the README or doc/, as (how it is started)
TOOLS = ["gpt2_cpu.py", "gpt2_cuda.py", "tests/check_gpt2.py", "dev/data/tinyshakespeare.py",
         "dev/data/tinystories.py", "dev/data/fineweb.py", "dev/data/hellaswag.py", "dev/eval/import_hf.py",
         "dev/eval/export_hf.py", "dev/bench.py", "dev/bench_cpu.py", "dev/bench_emulator.py",
         "dev/bench_generate.py", "dev/vislog.py", "dev/run_gpu_tests.py", "dev/torch_reference.py",
         "dev/setup_env.py", "dev/cuda/nvrtc_compile.py", "dev/cuda/run_all.py", "dev/cuda/layernorm.py",
         "-m llmc.multinode", "llama3_cpu.py", "llama3_cuda.py", "dev/torch_reference_llama3.py",
         "dev/eval/import_hf_llama3.py", "dev/eval/export_hf_llama3.py", "dev/sanitize_kernels.py",
         "doc/llama3.py", "doc/attention.py", "-m llmc.debugger", "dev/bench_debugger.py", "dev/bench_compare.py"]


def run(argv, timeout=120, env=None):
    """Run `python argv...` in the repository root."""
    return subprocess.run([sys.executable] + argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env=env)


def one_error_line(stderr):
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("error: ")


def unreadable(monkeypatch, path):
    """Make open() of `path` fail as a file without read permission does."""
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if os.fspath(file) == os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", guarded_open)


# ----------------------------------------------------------------------------
# a bad flag: one line, exit 1 (argparse alone prints its usage and exits 2)

@pytest.mark.parametrize("tool", TOOLS)
def test_a_bad_flag_is_one_line(tool):
    r = run(tool.split() + ["--no-such-flag"])
    named = "--no-such-flag" in r.stderr or "the following arguments are required" in r.stderr   # checked first
    assert r.returncode == 1 and one_error_line(r.stderr) and named, (r.returncode, r.stderr)


# ----------------------------------------------------------------------------
# dev/eval/import_hf.py: a config.json our GPT-2 cannot be is refused before anything is written

GOOD_HF_CONFIG = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 100,
                  "n_positions": 32}


@pytest.mark.parametrize("config, said", [
    ([1, 2], "not a JSON object"),
    ({**GOOD_HF_CONFIG, "n_layer": -1}, "n_layer -1: must be a positive integer"),
    ({**GOOD_HF_CONFIG, "n_embd": 16.5}, "n_embd 16.5: must be a positive integer"),
    ({**GOOD_HF_CONFIG, "n_embd": "16"}, "n_embd '16': must be a positive integer"),
    ({**GOOD_HF_CONFIG, "n_head": True}, "n_head True: must be a positive integer"),
    ({**GOOD_HF_CONFIG, "n_head": 3}, "n_head 3 does not divide n_embd 16"),
    ({**GOOD_HF_CONFIG, "vocab_size": 2 ** 31}, "vocab_size 2147483648: larger than a checkpoint header holds"),
    ({**GOOD_HF_CONFIG, "vocab_size": 2_000_000_000, "n_embd": 1024, "n_head": 16}, "GiB of memory"),
])
def test_import_hf_refuses_impossible_configs_before_writing(tmp_path, config, said):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    r = run(["dev/eval/import_hf.py", "-i", str(hf_dir), "-o", str(out / "m")])
    assert r.returncode == 1 and one_error_line(r.stderr) and said in r.stderr, r.stderr
    assert not out.exists()


def test_import_hf_unreadable_config_is_one_line(tmp_path, monkeypatch, capsys):
    import import_hf
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(GOOD_HF_CONFIG))
    unreadable(monkeypatch, hf_dir / "config.json")
    assert import_hf.main(["-i", str(hf_dir), "-o", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert one_error_line(err) and "Permission denied" in err, err


# ----------------------------------------------------------------------------
# dev/data/hellaswag.py: unreadable, non-UTF-8 or malformed jsonl; an -o that cannot be written

GOOD_RECORD = {"ctx": "A man sits", "endings": ["down.", "up.", "still.", "on a chair."], "label": 0}


@pytest.mark.parametrize("content, said", [
    (b"\xff\xfe{}\n", "line 1: not UTF-8 text"),
    (b"[1, 2]\n", "line 1: needs 'ctx', 'endings' and an integer 'label'"),
    (json.dumps({**GOOD_RECORD, "endings": 5}).encode() + b"\n", "line 1: 'endings' must be a list of 4 strings"),
    (json.dumps({**GOOD_RECORD, "endings": [1, 2, 3, 4]}).encode() + b"\n", "line 1: 'endings' must be a list of 4 strings"),
    (json.dumps({**GOOD_RECORD, "ctx": 7}).encode() + b"\n", "line 1: 'ctx' must be a string"),
    (json.dumps(GOOD_RECORD).encode() + b"\n{\"ctx\n", "line 2: not JSON"),
])
def test_hellaswag_malformed_jsonl_is_one_line(tmp_path, content, said):
    jsonl = tmp_path / "h.jsonl"
    jsonl.write_bytes(content)
    r = run(["dev/data/hellaswag.py", "-i", str(jsonl), "-o", str(tmp_path / "out" / "h.bin")])
    assert r.returncode == 1 and one_error_line(r.stderr) and said in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_hellaswag_an_output_that_cannot_be_written_is_one_line(tmp_path):
    jsonl = tmp_path / "h.jsonl"
    jsonl.write_text(json.dumps(GOOD_RECORD) + "\n")
    (tmp_path / "afile").write_text("")
    for output in (tmp_path / "afile" / "h.bin", "/proc/llmc_hellaswag.bin"):   # under a file; read-only /proc
        r = run(["dev/data/hellaswag.py", "-i", str(jsonl), "-o", str(output)])
        assert r.returncode == 1 and one_error_line(r.stderr), r.stderr


def test_hellaswag_unreadable_jsonl_is_one_line(tmp_path, monkeypatch, capsys):
    import hellaswag
    jsonl = tmp_path / "h.jsonl"
    jsonl.write_text(json.dumps(GOOD_RECORD) + "\n")
    unreadable(monkeypatch, jsonl)
    assert hellaswag.main(["-i", str(jsonl), "-o", str(tmp_path / "h.bin")]) == 1
    err = capsys.readouterr().err
    assert one_error_line(err) and "Permission denied" in err, err


# ----------------------------------------------------------------------------
# tests/check_gpt2.py: files it cannot read

@pytest.mark.parametrize("which", ["model", "debug state"])
def test_check_gpt2_unreadable_files_are_one_line(tmp_path, monkeypatch, capsys, which):
    import check_gpt2
    model = tmp_path / "m.bin"
    g.write_model(str(model), g.gpt2_init(TINY, 0))
    state = tmp_path / "s.bin"
    state.write_bytes(b"\0" * 2048)
    unreadable(monkeypatch, model if which == "model" else state)
    assert check_gpt2.main(["-e", str(model), "-s", str(state)]) == 1
    err = capsys.readouterr().err
    assert one_error_line(err) and "Permission denied" in err, err


# ----------------------------------------------------------------------------
# python -m llmc.multinode (and the trainers' same -p flags)

@pytest.mark.parametrize("argv, said", [
    (["-pm", "tcp", "-pn", "2", "-pr", "1", "--rendezvous-timeout", "inf"], "--rendezvous-timeout inf: must be a finite"),
    (["-pm", "fs", "-pn", "2", "-pr", "0", "-pj", "job1", "-pp", "/proc"], "-pp /proc: not a directory this process can write"),
    (["-pm", "fs", "-pn", "2", "-pr", "0", "-pj", "a/b", "-pp", "."], "-pj a/b: a job id names files: no '/'"),
])
def test_multinode_bad_values_are_one_line(argv, said):
    r = run(["-m", "llmc.multinode"] + argv, timeout=60)
    assert r.returncode == 1 and one_error_line(r.stderr) and said in r.stderr, r.stderr


# ----------------------------------------------------------------------------
# a learning rate that overflows, and Ctrl-C during the imports

def test_an_overflowing_learning_rate_is_one_line_naming_the_step(tmp_path):
    from llmc import formats
    import numpy as np
    formats.write_shard(str(tmp_path / "train.bin"), np.random.default_rng(0).integers(0, 100, 3000))
    g.write_model(str(tmp_path / "m.bin"), g.gpt2_init(TINY, 0))
    r = run(["gpt2_cpu.py", "-e", str(tmp_path / "m.bin"), "-i", str(tmp_path / "train.bin"), "-j", "",
             "-b", "2", "-t", "16", "-x", "3", "-l", "1e308", "-s", "0"])
    assert r.returncode == 1 and one_error_line(r.stderr), r.stderr
    assert "step 2: the loss is nan" in r.stderr or "step 1:" in r.stderr, r.stderr


PROGRAMS = ["gpt2_cpu.py", "gpt2_cuda.py", "llama3_cpu.py", "llama3_cuda.py", "tests/check_gpt2.py",
            "dev/eval/import_hf.py", "dev/data/hellaswag.py"]


@pytest.mark.parametrize("tool", PROGRAMS)
def test_ctrl_c_during_the_imports_exits_130_without_a_traceback(tmp_path, tool):
    """A stand-in numpy, first on the path, interrupts its own import as a Ctrl-C would, and, as
    NumPy's C extension does, turns whatever that raises into an ImportError: the program must
    exit 130 (128 + SIGINT, the shell's convention) and print no traceback."""
    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os, signal, time\n"
                                      "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n"
                                      "except BaseException as e:\n"
                                      "    raise ImportError('PyCapsule_Import could not import module') from e\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = run(tool.split() + ["--help"], timeout=60, env=env)
    assert r.returncode == 130 and "Traceback" not in r.stderr, (r.returncode, r.stderr)


@pytest.mark.parametrize("tool", ["gpt2_cpu.py", "gpt2_cuda.py", "llama3_cpu.py", "llama3_cuda.py"])
def test_a_python_without_numpy_is_one_line_naming_it(tmp_path, tool):
    """The trainers run by a Python without NumPy: one error line naming the pip package and the
    command that installs it, exit 1 (a stand-in numpy, first on the path, is missing as an
    uninstalled one is; tests/test_newcomer.py has the case of no environment active)."""
    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = run([tool, "--help"], timeout=60, env=env)
    assert r.returncode == 1 and one_error_line(r.stderr), r.stderr
    assert "needs the pip package numpy" in r.stderr and "`make train` installs it" in r.stderr


def test_quiet_ctrl_c_leaves_a_debuggers_handler_alone():
    """Under pdb (which sets its own SIGINT handler so that Ctrl-C breaks into the debugger) the
    program's quiet Ctrl-C during imports must not replace it, and restore_ctrl_c must not either."""
    import signal
    from llmc import interrupt
    previous = signal.getsignal(signal.SIGINT)
    debuggers = lambda signum, frame: None                          # noqa: E731  (a stand-in for pdb's)
    try:
        signal.signal(signal.SIGINT, debuggers)
        interrupt.quiet_ctrl_c_while_importing("__main__")
        interrupt.restore_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is debuggers
        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupt.quiet_ctrl_c_while_importing("__main__")
        assert signal.getsignal(signal.SIGINT) is interrupt.exit_on_interrupt
        interrupt.restore_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("tool, model", [("gpt2_cuda.py", "d2"), ("llama3_cuda.py", "llama3:d2")])
@pytest.mark.parametrize("flags", [["-b", "0"], ["-t", "0"], ["-b", "-2"]])
def test_check_refuses_the_flags_a_training_run_refuses(tool, model, flags):
    """--check runs llmc.cli.check_args as training does: -b 0 was an internal ZeroDivisionError."""
    r = run([tool, "--device", "cpu", "-e", model, "--check"] + flags, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "error: batch size and sequence length must be positive"), r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("tool", ["gpt2_cpu.py", "llama3_cpu.py"])
def test_generate_with_a_tokenizer_the_model_cannot_use_is_one_line_before_any_output(tmp_path, tool):
    """--generate with a model of V=100 and the GPT-2 tokenizer (50,257 tokens): one line naming
    both sizes, nothing printed before it (it used to print the prompt, then fail on its ids)."""
    path = str(tmp_path / "m.bin")
    if tool == "gpt2_cpu.py":
        g.write_model(path, g.gpt2_init(TINY, 0))
    else:
        import llama3_cpu
        config = llama3_cpu.LlamaConfig(max_seq_len=32, vocab_size=100, num_layers=1, num_heads=2, num_kv_heads=1,
                                        channels=16, multiple_of=16)
        llama3_cpu.write_model(path, llama3_cpu.llama3_init(config, 0))
    r = run([tool, "-e", path, "--generate", "3", "--prompt", "hello world"])
    assert r.returncode == 1 and one_error_line(r.stderr) and r.stdout == "", (r.stdout, r.stderr)
    assert "the tokenizer has 50,257 tokens, but the model's vocabulary is V=100" in r.stderr


# ----------------------------------------------------------------------------
# a named pipe (or another file that is not a regular one) as an input: refused in one line, never
# opened (opening a FIFO waits for a writer forever)

FIFO_INPUTS = [  # (argv with {fifo} where the input goes; what the line must call it)
    ["gpt2_cpu.py", "-e", "d2", "-x", "1", "-i", "{fifo}"],
    ["gpt2_cpu.py", "-e", "d2", "-x", "1", "-j", "{fifo}"],
    ["gpt2_cpu.py", "-e", "{fifo}.bin", "-x", "1"],
    ["gpt2_cpu.py", "-e", "d2", "--eval-only", "-j", "", "-h", "1", "--hellaswag-file", "{fifo}"],
    ["llama3_cpu.py", "-e", "llama3:d2", "-x", "1", "-i", "{fifo}"],
    ["llama3_cpu.py", "-e", "{fifo}.bin", "-x", "1"],
    ["gpt2_cuda.py", "--device", "cpu", "-e", "{fifo}.bin", "-x", "1"],
    ["dev/eval/export_hf.py", "-i", "{fifo}.bin", "-o", "{tmp}/hf"],
    ["dev/eval/export_hf_llama3.py", "-i", "{fifo}.bin", "-o", "{tmp}/hf"],
    ["dev/eval/import_hf.py", "-i", "{tmp}", "-o", "{tmp}/m"],               # {tmp}/config.json is the FIFO
    ["dev/eval/import_hf_llama3.py", "-i", "{tmp}", "-o", "{tmp}/m"],
    ["dev/vislog.py", "{fifo}", "-o", "{tmp}/loss.png"],
    ["dev/torch_reference.py", "-e", "{fifo}.bin", "-x", "1"],
    ["dev/torch_reference.py", "-e", "d2", "-x", "1", "-i", "{fifo}"],
    ["dev/torch_reference_llama3.py", "-e", "{fifo}.bin", "-x", "1"],
    ["tests/check_gpt2.py", "-e", "{fifo}.bin", "-s", "{fifo}"],
    ["dev/bench_cpu.py", "-e", "{fifo}.bin"],
    ["dev/data/hellaswag.py", "-i", "{fifo}", "-o", "{tmp}/h.bin"],
    ["dev/data/tinyshakespeare.py", "--data-dir", "{tmp}/data", "--tokenizer-model", "{fifo}"],
]
FIFO_TIMEOUT_S = 120                   # a refusal takes seconds (the imports); a hang takes forever


@pytest.mark.parametrize("argv", FIFO_INPUTS, ids=[" ".join(a[:3]) for a in FIFO_INPUTS])
def test_a_named_pipe_as_an_input_is_refused_in_one_line(tmp_path, argv):
    fifo = str(tmp_path / "config.json") if "import_hf" in argv[0] else str(tmp_path / "pipe")
    for path in (fifo, fifo + ".bin"):
        os.mkfifo(path)
    argv = [a.format(fifo=fifo, tmp=tmp_path) for a in argv]
    r = run(argv, timeout=FIFO_TIMEOUT_S)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "not a regular file (a FIFO, a device or a socket)" in lines[0] and fifo in lines[0], lines[0]


def test_a_named_pipe_as_the_tokenizer_is_a_note_and_the_samples_print_ids(tmp_path):
    """A missing or unreadable tokenizer only changes how samples print (the run trains on)."""
    os.mkfifo(tmp_path / "pipe")
    r = run(["gpt2_cpu.py", "-e", "d2", "-x", "1", "-t", "16", "-b", "2", "-v", "0", "-s", "1", "-g", "2",
             "--tokenizer", str(tmp_path / "pipe")], timeout=FIFO_TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    assert f"note: {tmp_path / 'pipe'}: not a regular file (a FIFO, a device or a socket), so not a tokenizer file" \
        in r.stdout


def test_bench_generate_refuses_an_unknown_model_in_one_line():
    r = run(["dev/bench_generate.py", "-e", "d3"])
    assert r.returncode == 1 and one_error_line(r.stderr) and "unknown model 'd3'" in r.stderr, r.stderr


def test_a_named_pipe_in_a_run_directory_is_refused_on_resume(tmp_path):
    base = ["gpt2_cpu.py", "-e", "d2", "-t", "16", "-b", "2", "-v", "0", "-s", "0", "-o", str(tmp_path / "run"), "-n", "1"]
    assert run(base + ["-x", "1"]).returncode == 0
    state = tmp_path / "run" / "state_00000001_00000.bin"
    state.unlink()
    os.mkfifo(state)
    r = run(base + ["-x", "2", "-y", "1"], timeout=FIFO_TIMEOUT_S)
    assert r.returncode == 1 and one_error_line(r.stderr), r.stderr
    assert r.stderr.strip() == f"error: {state}: not a regular file (a FIFO, a device or a socket), so not a state file: " \
                               f"pass the file itself"
