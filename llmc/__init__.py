"""
llmc: the host infrastructure both trainers share, one module per concern, as llm.c keeps its
in llmc/*.h. Nothing here is the algorithm: gpt2_cpu.py defines that, and gpt2_cuda.py runs it on
a GPU. The dependency runs one way: llmc never imports gpt2_cpu or gpt2_cuda; where it needs the
model's shape it takes it as an argument (a config object, a parameter table). Inside llmc/ the
imports run one way too, in layers: cuda, then comm, then multinode, then cli (doc/llmc_map.md,
"Layers"; tests/test_import_layers.py).

    utils.py       InputError (bad input: one line, exit 1), atomic writes, stale temporaries
    launcher.py    who started this process: rank, size, local rank from mpiexec's or Slurm's variables
    argparser.py   the argument parser of every tool: a bad flag is one line, with the flag meant
    interrupt.py   Ctrl-C while a program still imports its packages: exit 130, no traceback
    paths.py       where the default data lives (data/)
    formats.py     file headers, model and debug-state files, token shards, bf16 bit patterns
    tokenizer.py   the tokenizer file, decoding, the GPT-2 BPE (tiktoken) for encoding
    dataloader.py  batches from token shards, split across ranks, optionally shuffled
    evalloader.py  the multiple-choice (HellaSwag) file, its rows and its scoring rule
    checkpoint.py  training state files, DONE markers, saving and resuming a run
    comm.py        data parallelism: MPI (mpi4py) on the host, NCCL on GPUs
    multinode.py   one node or many: the NCCL id's rendezvous by MPI, tcp or a shared file system
    logger.py      llm.c's main.log
    outlier.py     z-scores of the loss and gradient norm, for skipping outlier steps (-sl, -sg)
    sampler.py     llm.c's xorshift* RNG and the token draw (temperature, top-k)
    check.py       check_tensor and the one table of tolerances
    cli.py         the shared flags and the loop around the training step (validate, eval,
                   sample, checkpoint, print)
    cuda.py        CuPy plumbing: lazy import, NVRTC options, kernel cache, launch, argument
                   checks, cuBLAS (through nvmath-python where installed: capturable)
    cublaslt.py    cuBLASLt matmuls with fused epilogues (bias, GELU, bias gradient) through
                   nvmath-python (optional; gpt2_cuda --cublaslt 1)
    cudnn_attention.py  cuDNN's fused attention through the cudnn frontend package (optional;
                   gpt2_cuda --attention cudnn)
    mfu.py         model FLOPs utilization
    openblas.py    how long NumPy's idle OpenBLAS threads spin, set before NumPy loads (the CUDA
                   trainers: the emulated device's kernels want the cores)
    debugger/      the visual debugger (python -m llmc.debugger): the reference trainer's step op
                   by op in the browser; it imports the trainer it runs when it runs, as
                   cuda_check.py imports gpt2_cpu

Files are byte-compatible with llm.c's (doc/file_formats.md).
"""
