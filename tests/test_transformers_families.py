"""Many transformers model families through kvcache, as `--model DIR` users bring them. Tiny
random models of each (weights drawn wider than the default init, whose
greedy output is often one token forever), fp32 on CPU, against transformers' own `generate`:

- greedy decoding through `wrap_model` gives its tokens, and so does single-sequence speculative
  decoding with prompt lookup (every draft verified and the rejected ones rolled back); sampled,
  speculation with prompt lookup gives plain sampling's tokens for the same seed;
- a left-padded batch gives its batched tokens, and batched speculative decoding gives the same,
  or is refused up front with the reason where rows that accept different counts cannot be
  cropped or masked (the families in `REFUSED`).

tests/test_transformers_models.py runs the main layer kinds through much more (caches against
transformers' own, rollback, persistence); this matrix checks the table in docs/transformers.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

T = pytest.importorskip("transformers", minversion="5.25")

from kvcache import GenerationError  # noqa: E402
from kvcache.generation import PromptLookupDrafter, generate, speculative_generate  # noqa: E402
from kvcache.integrations.transformers import wrap_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V = 128
BASE = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "pad_token_id": 0}  # fmt: skip
SLIDING = {**BASE, "sliding_window": 8}
HEAD16 = {**BASE, "head_dim": 16}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", BASE),
    "qwen2": ("Qwen2Config", BASE),
    "qwen3": ("Qwen3Config", HEAD16),
    "qwen3_moe": ("Qwen3MoeConfig", {**HEAD16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}),
    "qwen3_5": ("Qwen3_5TextConfig", {**HEAD16, "layer_types": ["linear_attention", "full_attention"]}),
    "mistral": ("MistralConfig", SLIDING),
    "mixtral": ("MixtralConfig", {**BASE, "num_local_experts": 4}),
    "phi3": ("Phi3Config", BASE),
    "phi": ("PhiConfig", BASE),
    "gemma": ("GemmaConfig", HEAD16),
    "gemma2": ("Gemma2Config", {**HEAD16, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", {**HEAD16, "sliding_window": 8}),
    "olmo2": ("Olmo2Config", BASE),
    "olmo3": ("Olmo3Config", SLIDING),
    "granite": ("GraniteConfig", BASE),
    "smollm3": ("SmolLM3Config", BASE),
    "cohere": ("CohereConfig", BASE),
    "starcoder2": ("Starcoder2Config", BASE),
    "gpt_neox": ("GPTNeoXConfig", BASE),
    "stablelm": ("StableLmConfig", BASE),
    "glm4": ("Glm4Config", HEAD16),
    "exaone4": ("Exaone4Config", SLIDING),
    "gpt_oss": ("GptOssConfig", {**SLIDING, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt2": ("GPT2Config", {"vocab_size": V, "n_embd": 64, "n_layer": 2, "n_head": 4}),
    "gptj": ("GPTJConfig", {"vocab_size": V, "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}),
    "opt": ("OPTConfig", {"vocab_size": V, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "word_embed_proj_dim": 64}),
    "bloom": ("BloomConfig", {"vocab_size": V, "hidden_size": 64, "n_layer": 2, "n_head": 4}),
    "falcon": ("FalconConfig", {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}),
    "llama4": ("Llama4TextConfig", {**HEAD16, "num_local_experts": 2, "interleave_moe_layer_step": 2,
                                    "intermediate_size_mlp": 128, "attention_chunk_size": 8}),
    "lfm2": ("Lfm2Config", {**BASE, "layer_types": ["conv", "full_attention"]}),
    "mamba2": ("Mamba2Config", {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8,
                                "head_dim": 16, "state_size": 16, "n_groups": 1, "chunk_size": 16}),
    "qwen3_next": ("Qwen3NextConfig", {**HEAD16, "layer_types": ["linear_attention", "full_attention"],
                                       "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 32}),
    "mamba": ("MambaConfig", {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "state_size": 8}),
    "falcon_mamba": ("FalconMambaConfig", {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2,
                                           "state_size": 8}),
    "jamba": ("JambaConfig", {**BASE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                              "num_experts": 2, "mamba_d_state": 8}),
    "bamba": ("BambaConfig", {**BASE, "attn_layer_indices": [1], "mamba_d_state": 16, "mamba_n_heads": 8,
                              "mamba_d_head": 16}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {**BASE, "layer_types": ["mamba", "attention"],
                                                    "mamba_d_state": 16, "mamba_n_heads": 8, "mamba_d_head": 16,
                                                    "num_local_experts": 2, "num_experts_per_tok": 1}),
    "falcon_h1": ("FalconH1Config", {**HEAD16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
                                     "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16}),
    "nemotron_h": ("NemotronHConfig", {"vocab_size": V, "hidden_size": 64, "intermediate_size": 128,
                                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                       "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
                                       "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                                       "n_groups": 1, "chunk_size": 16}),
    "zamba2": ("Zamba2Config", {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2,
                                "layers_block_type": ["mamba", "hybrid"], "num_attention_heads": 4,
                                "mamba_d_state": 16, "mamba_headdim": 16, "n_mamba_heads": 8,
                                "hybrid_layer_ids": [1], "use_mem_rope": True}),
}  # fmt: skip
#: families whose batched speculation is refused, and the words of the reason
REFUSED = {
    "bloom": "cannot mask",  # ALiBi built from a 2-D padding mask
    "llama4": "cannot mask",  # chunked attention
    "zamba2": "per-token recurrent states",  # its mixer, asked for every state, scans an empty chunk
}


def _model(family: str) -> Any:
    name, kwargs = FAMILIES[family]
    config_class = getattr(T, name, None)
    if config_class is None:
        pytest.skip(f"transformers {T.__version__} has no {name}")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.AutoModelForCausalLM.from_config(config_class(**kwargs)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_decodes_and_speculates_as_transformers_generates(family: str) -> None:
    model = _model(family)
    wrapped = wrap_model(model)
    source = torch.randint(3, V, (1, 20), generator=torch.Generator().manual_seed(1))
    expected = model.generate(source, max_new_tokens=24, do_sample=False)
    assert torch.equal(generate(wrapped, source, max_new_tokens=24).sequences, expected)
    repeated = torch.cat([source[:, :10]] * 3, dim=1)  # prompt lookup finds drafts, some rejected
    expected = model.generate(repeated, max_new_tokens=24, do_sample=False)
    out = speculative_generate(wrapped, PromptLookupDrafter(), repeated, max_new_tokens=24, num_draft_tokens=3,
                               draft_schedule="constant")  # fmt: skip
    assert torch.equal(out.sequences, expected)
    sampling = {"do_sample": True, "temperature": 0.7, "max_new_tokens": 24}
    sampled = generate(wrapped, repeated, generator=torch.Generator().manual_seed(11), **sampling).sequences
    out = speculative_generate(wrapped, PromptLookupDrafter(), repeated, num_draft_tokens=3, draft_schedule="constant",
                               generator=torch.Generator().manual_seed(11), **sampling)  # fmt: skip
    assert torch.equal(out.sequences, sampled)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_decodes_a_left_padded_batch_and_speculates_on_it_or_says_why_not(family: str) -> None:
    model = _model(family)
    wrapped = wrap_model(model)
    source = torch.randint(3, V, (3, 14), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(source)
    mask[1, :4], mask[2, :7] = 0, 0
    source = source.masked_fill(mask == 0, 0)
    expected = model.generate(source, attention_mask=mask, max_new_tokens=16, do_sample=False)
    plain = generate(wrapped, source, attention_mask=mask, max_new_tokens=16).sequences
    assert torch.equal(plain, expected)
    run = lambda: speculative_generate(wrapped, PromptLookupDrafter(), source, attention_mask=mask,  # noqa: E731
                                       max_new_tokens=16, num_draft_tokens=3, draft_schedule="constant")  # fmt: skip
    if family in REFUSED:
        with pytest.raises(GenerationError, match=REFUSED[family]):
            run()
    else:
        assert torch.equal(run().sequences, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_decodes_a_padded_batch_quantized_as_each_row_alone(family: str) -> None:
    """`wrap_model(..., kv_bits=4)`: a left-padded batch's rows are quantized at their own positions,
    so each row's tokens are those it gets alone (float64: batch and row kernels then agree bit for
    bit; padding put the rows' first tokens into shared blocks before)."""
    model = _model(family)
    try:
        wrapped = wrap_model(model.double(), kv_bits=4)
        source = torch.randint(3, V, (3, 20), generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(source)
        mask[1, :5], mask[2, :11] = 0, 0
        source = source.masked_fill(mask == 0, 0)
        batch = generate(wrapped, source, attention_mask=mask, max_new_tokens=20).sequences[:, 20:]
    except RuntimeError as err:  # a kernel without float64 (Jamba's MoE): nothing to compare bit for bit
        pytest.skip(f"{family} does not run in float64: {str(err)[:80]}")
    for b in range(3):
        alone = generate(wrapped, source[b : b + 1, mask[b].bool()], max_new_tokens=20).sequences[0, -20:]
        assert batch[b].tolist() == alone.tolist(), b
