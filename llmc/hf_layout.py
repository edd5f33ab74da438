"""
llmc/hf_layout.py: where Hugging Face's Llama keeps a tensor's rows in another order than ours,
shared by dev/eval/export_hf_llama3.py and import_hf_llama3.py (whole models) and llmc/lora.py
(LoRA adapters in PEFT's files).

RoPE's channel order. llama3_cpu.rope_forward rotates adjacent pairs (x_2i, x_2i+1) of a head by
the angle t freq_i (Meta's and llm.c's layout); Hugging Face's LlamaAttention rotates the halves,
pairs (x_i, x_i+HS/2) by the same t freq_i (rotate_half). Writing both rules out, HF's channel i of
a head is our channel 2i and HF's channel i+HS/2 is our 2i+1. So the rows of q_proj and k_proj
(and of anything whose output is theirs, such as a LoRA adapter's lora_B) are permuted within each
head: HF row j of head h = our row ROPE_TO_HF[j] of head h, ROPE_TO_HF = [0, 2, .., HS-2, 1, 3, ..,
HS-1]. A query-key score is a sum over a head's channels, which the same permutation of q and k
leaves unchanged. (HF's own convert_llama_weights_to_hf.py applies this permutation to Meta's weights.)
"""

import numpy as np


def hf_rope_rows(HS):
    """ROPE_TO_HF (HS,): HF row j of a head is our row ROPE_TO_HF[j] (see the top):
    [0, 2, .., HS-2, 1, 3, .., HS-1]."""
    return np.concatenate([np.arange(0, HS, 2), np.arange(1, HS, 2)])


def rope_rows_to_hf(w, HS):
    """A q or k projection's rows (nh*HS, ...) in our pair layout -> HF's half layout, per head."""
    nh = w.shape[0] // HS
    return w.reshape(nh, HS, -1)[:, hf_rope_rows(HS)].reshape(w.shape)


def rope_rows_from_hf(w, HS):
    """rope_rows_to_hf's inverse: HF's half layout (nh*HS, ...) -> our pair layout."""
    nh = w.shape[0] // HS
    return w.reshape(nh, HS, -1)[:, np.argsort(hf_rope_rows(HS))].reshape(w.shape)
