"""
llmc/cuda_check.py: `gpt2_cuda.py --check` (and `llama3_cuda.py --check`: check_llama3_against_cpu,
the same comparison against llama3_cpu.py), llm.c's test_gpt2.cu for the GPU trainer: one batch
through gpt2_cpu.py and through the GPU model, every activation (forward order), the logits, the
loss and every parameter gradient (backward order) compared with llmc.check's TOLERANCES, one
TENSOR OK / NOT OK line each; an activation the backward recomputes (-r 1, 2) is
kept for one layer, the last, and compared there. The GPU trainer is passed in (`trainer`, the gpt2_cuda module), so
this module imports neither trainer when it loads. With the classifier in chunks of sequences
(--classifier-chunk), the logits compared are the last chunk's, the rows its buffer keeps.
"""

import numpy as np

from llmc import cuda
from llmc.check import check_against, save_comparison
from llmc.cli import check_args
from llmc.dataloader import DataLoader


def tolerance_group(model):
    """The row of llmc.check.TOLERANCES for --check: 'cuda_fp32' for full fp32 matmuls, else
    'cuda_bf16' (bf16 storage, or TF32 matmuls)."""
    return "cuda_fp32" if model.precision == "fp32" and not model.matmul.tf32 else "cuda_bf16"


def attention_lse(qkv, NH):
    """The log-sum-exp over keys j <= t of the scaled scores s q_t . k_j, s = 1/sqrt(HS), per
    (b, head, t): (B,NH,T) from qkv (B,T,3C) (any float dtype; computed in its precision). What the
    flash and cuDNN paths keep for the backward (Dao et al. 2022, Alg. 1's m + log l)."""
    import gpt2_cpu                                    # the reference (llmc never imports it at load)
    q, k, _ = gpt2_cpu.split_heads(qkv, NH)                                  # each (B,NH,T,HS)
    scores = gpt2_cpu.causal_scores(q, k)                                     # (B,NH,T,T), masked
    top = scores.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]


LORA_CHECK_B_STD = 0.02               # --check's lora_B where it is all 0 (fresh): see lora_reference


def lora_reference(trainer, model, cpu, reference, cpu_dtype, verbose):
    """With LoRA (model.lora, llmc/lora_device.py): give the reference model `cpu` the device's
    adapters (gpt2_cpu.LoRA in cpu_dtype, the device's values) and freeze it. A fresh adapter's
    lora_B is 0, which makes every dlora_A 0 whatever the backward computes: then lora_B is first
    drawn ~ N(0, LORA_CHECK_B_STD^2) on the device too, so that every gradient is exercised.
    `reference`: gpt2_cpu (its LoRA and freeze serve Llama 3 as well). Returns the names of the
    adapters' tensors in backward order (the last target's first)."""
    lora = model.lora
    params = trainer.download_parameters(lora, master=False)
    views = reference.tensor_views(params, lora.param_shapes)
    fresh = [name for name, _ in lora.param_shapes if name.endswith("lora_B") and not views[name].any()]
    if fresh:
        if verbose:
            print(f"LoRA: {len(fresh)} fresh lora_B (all 0): drawn ~ N(0, {LORA_CHECK_B_STD}^2) for the check")
        rng = np.random.default_rng(0)
        for name in fresh:
            views[name][...] = rng.standard_normal(views[name].shape) * LORA_CHECK_B_STD
        trainer.upload_parameters(lora, params)
        params = trainer.download_parameters(lora, master=False)          # rounded to floatX as the device's
    cpu.lora = reference.LoRA(lora.targets, cpu.config.num_layers, lora.rank, lora.alpha, dtype=cpu_dtype)
    cpu.lora.params[...] = params
    reference.freeze(cpu)
    return [name for name, _ in reversed(lora.param_shapes)]


def check_against_cpu(trainer, model, inputs, targets, cpu_dtype=np.float32, verbose=True, record=None):
    """Run one batch through gpt2_cpu (in cpu_dtype, with exactly the GPU's parameter values) and
    through `model` of `trainer` (the gpt2_cuda module: its forward, backward and buffers), and
    compare every activation (forward order), the loss, then every parameter gradient (backward
    order) with llmc.check's TOLERANCES. Returns True if all are within tolerance. Overwrites the
    model's gradients. record: a list to append each comparison to, as (label, kind, gpu, ref)."""
    cfg = model.config
    B, T = inputs.shape
    L, NH, C, V = cfg.num_layers, cfg.num_heads, cfg.channels, cfg.vocab_size
    group = tolerance_group(model)
    import gpt2_cpu                                    # the reference (llmc never imports it at load)
    cpu = gpt2_cpu.GPT2(cfg, cpu_dtype)
    cpu.params[...] = trainer.download_parameters(model, master=False)
    lora_names = lora_reference(trainer, model, cpu, gpt2_cpu, cpu_dtype, verbose) if model.lora else None
    gpt2_cpu.gpt2_forward(cpu, inputs, targets)
    gpt2_cpu.gpt2_zero_grad(cpu.lora or cpu)
    gpt2_cpu.gpt2_backward(cpu)
    trainer.gpt2_zero_grad(model.lora or model)
    trainer.gpt2_forward(model, inputs, targets)
    A = trainer.gpt2_activations(model, B, T)
    results = []

    def compare(label, gpu, ref, kind):
        results.append(check_against(gpu, ref, label, group, kind, verbose=verbose))
        if record is not None:
            record.append((label, kind, gpu, ref))

    CA = cpu.acts
    # the attention buffers of the path (activation_shapes), and their gpt2_cpu counterparts
    refs = model.attention.references(CA, L, B, T, C, NH)
    names = ("encoded", "ln1", "ln1_mean", "ln1_rstd") + model.attention.check_names + (
        "atty", "residual2", "ln2", "ln2_mean", "ln2_rstd", "fch", "fch_gelu", "residual3", "lnf", "lnf_mean", "lnf_rstd")
    fetch = {name: trainer.as_float32(A[name].get()) for name in names + ("losses",)}
    # the classifier runs in chunks of sequences (model.classifier_chunk): the buffer keeps the last chunk's logits
    r0, r1 = trainer.classifier_chunks(B, T, model.classifier_chunk)[-1]
    logits = trainer.as_float32(trainer.prefix(A["logits"], (r1 - r0, cfg.padded_vocab_size)).get())
    if verbose:
        print(f"forward: {B}x{T} tokens, {model.precision} vs gpt2_cpu {np.dtype(cpu_dtype).name}, "
              f"{model.attention.name} attention, tolerances '{group}'")
    # -r 1 keeps fch_gelu, -r 2 also ln1 and ln2, for one layer only (trainer.recomputed_activations):
    # after the forward that buffer holds the last layer's, compared with gpt2_cpu's layer L-1
    recomputed = trainer.recomputed_activations(model.recompute)
    if verbose and recomputed:
        print(f"-r {model.recompute}: {', '.join(recomputed)} kept for one layer: compared at layer {L - 1} only")
    for name in names:
        kind = "statistic" if name.endswith(("_mean", "_rstd")) or name == "lse" else "activation"
        ref = refs.get(name, CA.get(name))
        if name in recomputed:
            compare(f"{name}[{L - 1}]", fetch[name][0], ref[L - 1], kind)
        else:
            compare(name, fetch[name], ref, kind)
    compare("logits" if r0 == 0 else f"logits[rows {r0}:{r1}]", logits[:, :V], CA["logits"].reshape(B * T, -1)[r0:r1, :V],
            "logits")
    compare("losses", fetch["losses"], CA["losses"], "loss")
    compare("mean loss", np.array([fetch["losses"].mean(dtype=np.float64)]), np.array([cpu.mean_loss]), "loss")
    trainer.gpt2_backward(model)
    if verbose:
        print("backward:")
    if lora_names:                                     # a frozen model: the adapters' gradients only
        compare_gradients(compare, trainer, model.lora, cpu.lora, lora_names, gpt2_cpu)
        return all(results)
    backward_order = ("lnfw", "lnfb", "fcprojw", "fcprojb", "fcw", "fcb", "ln2w", "ln2b", "attprojw", "attprojb",
                      "qkvw", "qkvb", "ln1w", "ln1b", "wpe", "wte")
    compare_gradients(compare, trainer, model, cpu, backward_order, gpt2_cpu)
    return all(results)


def compare_gradients(compare, trainer, trained, reference_trained, names, reference):
    """compare(d<name>) of the device's gradients of `trained` (a model or its LoRA) with the
    reference's, for each of `names`, in that order."""
    grads = reference.tensor_views(trainer.as_float32(trained.grads.get()), trained.param_shapes)
    for name in names:
        compare(f"d{name}", grads[name], reference_trained.G[name], "grad")


def check_llama3_against_cpu(trainer, model, inputs, targets, cpu_dtype=np.float32, verbose=True, record=None):
    """check_against_cpu for Llama 3: one batch through llama3_cpu (in cpu_dtype, with exactly the
    GPU's parameter values) and through `model` of `trainer` (the llama3_cuda module), every
    activation (forward order), the logits, the loss, then every parameter gradient (backward
    order) compared with llmc.check's TOLERANCES. The GPU's qkv_proj is llama3_cpu's qkv; the
    attention path's buffers (qkvr, att or qkv, lse) are compared with the values they hold in
    llama3_cpu's qkv_att, GPT-2's layout. Returns True if all are within tolerance. Overwrites the
    model's gradients. record: as check_against_cpu's."""
    cfg = model.config
    B, T = inputs.shape
    L, NH, C, V = cfg.num_layers, cfg.num_heads, cfg.channels, cfg.vocab_size
    group = tolerance_group(model)
    import llama3_cpu                                  # the reference (llmc never imports it at load)
    import gpt2_cpu                                    # LoRA's reference (llama3_cpu imports it from there)
    cpu = llama3_cpu.Llama3(cfg, cpu_dtype)
    cpu.params[...] = trainer.download_parameters(model, master=False)
    lora_names = lora_reference(trainer, model, cpu, gpt2_cpu, cpu_dtype, verbose) if model.lora else None
    llama3_cpu.llama3_forward(cpu, inputs, targets)
    llama3_cpu.gpt2_zero_grad(cpu.lora or cpu)
    llama3_cpu.llama3_backward(cpu)
    trainer.gpt2_zero_grad(model.lora or model)
    trainer.llama3_forward(model, inputs, targets)
    A = trainer.llama3_activations(model, B, T)
    results = []

    def compare(label, gpu, ref, kind):
        results.append(check_against(gpu, ref, label, group, kind, verbose=verbose))
        if record is not None:
            record.append((label, kind, gpu, ref))

    CA = cpu.acts
    qkv_kept = grouped_kv_heads(CA["qkv_att"], NH, cfg.num_kv_heads) if model.attention.grouped_kv else CA["qkv_att"]
    refs = {"qkv_proj": CA["qkv"], "qkv": qkv_kept,
            **model.attention.references({"qkv": CA["qkv_att"]}, L, B, T, C, NH)}
    names = ("encoded", "ln1", "ln1_rstd", "qkv_proj") + model.attention.check_names + (
        "atty", "residual2", "ln2", "ln2_rstd", "fch", "fch2", "fch_swiglu", "residual3", "lnf", "lnf_rstd")
    if verbose:
        print(f"forward: {B}x{T} tokens, {model.precision} vs llama3_cpu {np.dtype(cpu_dtype).name}, "
              f"{model.attention.name} attention, tolerances '{group}'")
    for name in names:
        kind = "statistic" if name.endswith("_rstd") or name == "lse" else "activation"
        compare(name, trainer.as_float32(A[name].get()), refs.get(name, CA.get(name)), kind)
    logits = trainer.as_float32(trainer.prefix(A["logits"], (B, T, model.Vp)).get())[..., :V]   # Vp: --pad-vocab
    losses = trainer.as_float32(A["losses"].get())
    compare("logits", logits, CA["logits"], "logits")
    compare("losses", losses, CA["losses"], "loss")
    compare("mean loss", np.array([losses.mean(dtype=np.float64)]), np.array([cpu.mean_loss]), "loss")
    trainer.llama3_backward(model)
    if verbose:
        print("backward:")
    backward_order = ("wlmhead", "lnfw", "fcprojw", "fcw", "fcw2", "ln2w", "attprojw", "qkvw", "ln1w", "wte")
    if lora_names:                                     # a frozen model: the adapters' gradients only
        compare_gradients(compare, trainer, model.lora, cpu.lora, lora_names, gpt2_cpu)
    else:
        compare_gradients(compare, trainer, model, cpu, backward_order, gpt2_cpu)
    return all(results)


def grouped_kv_heads(qkv_att, NH, NKV):
    """llama3_cpu's qkv_att (..., 3C), the key and value heads repeated for their query heads, back
    in the qkv projection's layout (..., (NH+2NKV)*HS): the NH query heads, then key head j and
    value head j, each taken from query head j*NH/NKV, the first of the NH/NKV it serves
    (llama3_cpu.repeat_kv_forward). What a grouped_kv attention path keeps after RoPE."""
    heads = qkv_att.reshape(*qkv_att.shape[:-1], 3, NH, -1)
    group = NH // NKV
    parts = [heads[..., 0, :, :], heads[..., 1, ::group, :], heads[..., 2, ::group, :]]
    return np.concatenate([part.reshape(*qkv_att.shape[:-1], -1) for part in parts], axis=-1)


def run_check(trainer, args, model, check=check_against_cpu):
    """--check: one batch (the first of -i) through the CPU reference and the GPU with `check`
    (check_against_cpu for GPT-2, check_llama3_against_cpu for Llama 3); 0 if all tensors agree.
    Raises InputError for flags that make no sense (llmc.cli.check_args, as a training run's)."""
    check_args(args)
    loader = DataLoader(args.input_bin, args.batch_size, args.seq_len)
    x, y = loader.next_batch()
    cuda.load_modules(trainer.KERNEL_FILES + model.attention.kernel_files, model.precision)   # a first build: its progress
    record = [] if getattr(args, "check_save", None) else None
    ok = check(trainer, model, x, y, np.dtype(args.check_dtype).type, record=record)
    print("check: all tensors OK" if ok else "check: SOME TENSORS NOT OK")
    if record is not None:
        cfg = model.config
        save_comparison(args.check_save, record, tolerance_group(model), model=args.model, B=args.batch_size,
                        T=args.seq_len, L=cfg.num_layers, NH=cfg.num_heads, C=cfg.channels, V=cfg.vocab_size,
                        precision=model.precision, attention=model.attention.name, device=args.device,
                        reference_dtype=args.check_dtype, ok=bool(ok))
        print(f"check: every compared tensor saved to {args.check_save}")
    return 0 if ok else 1
