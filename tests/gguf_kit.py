"""A tiny Llama written as a GGUF file, as llama.cpp's converter lays one out (its tensor names, the
rotary permutation of the query and key weights, the tokenizer and chat template in the metadata;
the 2-D weights quantized to Q8_0): what a llama.cpp or Ollama user has on disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from serve_kit import tiny_model_dir

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}  # fmt: skip


def _permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a rotary projection's rows (its rotation pairs adjacent features)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)  # fmt: skip


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{NAMES[rest.rsplit('.', 1)[0]]}.weight"


def llama_gguf(path: Path) -> Path:
    """`path` (a .gguf file) holding `tiny_model_dir`'s Llama and tokenizer."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    source = tiny_model_dir(path.parent / f"{path.stem}-source", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if index in special else 1 for _, index in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]  # (pairs, or "a b" strings)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(True)
    writer.add_chat_template(tokenizer.chat_template)
    for name, tensor in model.state_dict().items():
        weight = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            weight = _permuted(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _permuted(weight, config.num_key_value_heads)
        if weight.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(weight, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
