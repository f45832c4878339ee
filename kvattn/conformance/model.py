"""A random-weight Llama (GQA, untied embeddings) and a byte-level tokenizer, written as a local
Hugging Face model directory for the engines: no hub download. Run with the engine's environment's
Python (its transformers writes a config that its engine reads):

    python -m kvattn.conformance.model OUT_DIR [--geometry tiny|smollm-135m] [--family FAMILY]

``tiny`` is the model of the conformance suite and of the engine tests (2 layers, 4 heads over 2
KV heads of 32 dims, a vocabulary of the 256 byte tokens plus BOS/EOS). ``smollm-135m`` has the
shapes of SmolLM-135M (30 layers, 9 heads over 3 KV heads of 64, hidden 576, a 49152-token
vocabulary), for speed measurements only. Weights are drawn with a fixed seed and a wide
initialiser (0.2), so greedy tokens vary with the context instead of collapsing onto one token.

``--family`` writes, at the tiny shapes, a model of another family whose attention has a score
switch of :mod:`kvattn.variants` instead: ``mistral`` (a sliding window of ``MISTRAL_WINDOW``
tokens in every layer), ``gemma2`` (logit soft-cap, every layer full attention), ``bloom``
(ALiBi) or ``gpt-oss`` (sinks, no sliding window; 4 experts); ``gemma2-hybrid`` and
``gpt-oss-hybrid`` alternate window and full layers, as the released models do (two KV cache
groups in vLLM). ``llama-narrow`` is the tiny Llama drawn with a narrow initialiser (0.02): its
greedy answers settle into short loops, so an n-gram proposer finds drafts that are accepted.
"""

from __future__ import annotations

import argparse

VOCAB = 256  # the byte tokens (BOS and EOS come after them)

GEOMETRIES = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "smollm-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
    ),
}


# The score switch each family's attention layers hand vLLM's attention backend.
FAMILIES = {
    "llama": None,
    "llama-narrow": None,
    "mistral": "sliding_window",
    "gemma2": "logits_soft_cap",
    "bloom": "alibi_slopes",
    "gpt-oss": "sinks",
    "gemma2-hybrid": "sliding_window",
    "gpt-oss-hybrid": "sliding_window",
    "deepseek-v2": None,
    "deepseek-v2-576": None,
}
MISTRAL_WINDOW = 48  # tokens: the query and the 47 before it


def prompt(seed: int, length: int) -> list[int]:
    """``length`` byte tokens drawn from ``seed`` alone: the same prompt in every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


def build(
    out_dir: str, geometry: str = "tiny", max_positions: int = 2048, family: str = "llama"
) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = dict(GEOMETRIES[geometry])
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out_dir)
    vocab_size = shape.pop("vocab_size", len(vocab))
    torch.manual_seed(0)
    if family not in ("llama", "llama-narrow"):
        _family_model(family, vocab, max_positions).save_pretrained(out_dir)
        return
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        initializer_range=0.02 if family == "llama-narrow" else 0.2,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        torch_dtype="float32",
        **shape,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)


def _family_model(family: str, vocab: dict, max_positions: int):
    import torch
    import transformers

    tiny = GEOMETRIES["tiny"]
    common = dict(
        vocab_size=len(vocab),
        initializer_range=0.2,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        torch_dtype="float32",
    )
    attention = dict(
        hidden_size=tiny["hidden_size"],
        num_hidden_layers=tiny["num_hidden_layers"],
        num_attention_heads=tiny["num_attention_heads"],
        num_key_value_heads=tiny["num_key_value_heads"],
        head_dim=tiny["head_dim"],
        max_position_embeddings=max_positions,
    )
    full = ["full_attention"] * tiny["num_hidden_layers"]
    hybrid = family.endswith("-hybrid")
    family = family.removesuffix("-hybrid")
    # Window and full layers alternating (window first, as vLLM's gpt-oss places it).
    windows = (
        dict(
            layer_types=["sliding_attention", "full_attention"] * (tiny["num_hidden_layers"] // 2),
            sliding_window=MISTRAL_WINDOW,
        )
        if hybrid
        else dict(layer_types=full)
    )
    if family == "mistral":
        config = transformers.MistralConfig(
            intermediate_size=tiny["intermediate_size"],
            sliding_window=MISTRAL_WINDOW,
            tie_word_embeddings=False,
            **attention,
            **common,
        )
        return transformers.MistralForCausalLM(config)
    if family == "gemma2":
        # A cap of the order of the scores, so that capping changes the answer (tied embeddings:
        # vLLM's Gemma 2 has no separate head). Gemma 2 scales its embeddings by sqrt(hidden):
        # the narrower initialiser keeps the answers from saturating on one token.
        common["initializer_range"] = 0.05
        config = transformers.Gemma2Config(
            intermediate_size=tiny["intermediate_size"],
            query_pre_attn_scalar=tiny["head_dim"],
            attn_logit_softcapping=1.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            **windows,
            **attention,
            **common,
        )
        return transformers.Gemma2ForCausalLM(config)
    if family == "bloom":
        config = transformers.BloomConfig(
            hidden_size=tiny["hidden_size"],
            n_layer=tiny["num_hidden_layers"],
            n_head=tiny["num_attention_heads"],
            tie_word_embeddings=True,
            **common,
        )
        return transformers.BloomForCausalLM(config)
    if family == "gpt-oss":
        # Unquantised experts of a width vLLM's portable CPU MoE takes (a multiple of 32).
        config = transformers.GptOssConfig(
            intermediate_size=tiny["hidden_size"],
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_layer_freq=1,  # DeepSeek's own config field, which SGLang reads
            tie_word_embeddings=False,
            **({} if hybrid else dict(sliding_window=None)),
            **windows,
            **attention,
            **common,
        )
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():  # initialised to 0: sinks that matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
        return model
    if family in ("deepseek-v2", "deepseek-v2-576"):
        # Multi-head latent attention with DeepSeek-V2's structure at the tiny shapes: a 32-dim
        # latent (the cache's value part) and a 16-dim RoPE key per token (``-576``: DeepSeek's
        # own 512 + 64, the only row vLLM's CPU MLA kernel takes), 4 heads of 16 + 16 query/key
        # dims and 16 value dims; every layer dense (no experts), no query LoRA.
        lora, rope = (512, 64) if family.endswith("-576") else (32, 16)
        config = transformers.DeepseekV2Config(
            hidden_size=tiny["hidden_size"],
            intermediate_size=tiny["intermediate_size"],
            num_hidden_layers=tiny["num_hidden_layers"],
            num_attention_heads=tiny["num_attention_heads"],
            num_key_value_heads=tiny["num_attention_heads"],
            kv_lora_rank=lora,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=rope,
            v_head_dim=16,
            first_k_dense_replace=tiny["num_hidden_layers"],
            n_routed_experts=4,  # unused: every layer is dense
            num_experts_per_tok=2,
            moe_layer_freq=1,  # DeepSeek's own config field, which SGLang reads
            max_position_embeddings=max_positions,
            # YaRN at factor 1 (the base frequencies): SGLang's CPU rotary takes DeepSeek's
            # YaRN only.
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=1.0,
                original_max_position_embeddings=max_positions,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            tie_word_embeddings=False,
            **common,
        )
        return transformers.DeepseekV2ForCausalLM(config)
    raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {family!r}")


def build_llava(out_dir: str) -> None:
    """A tiny random-weight LLaVA: a CLIP vision tower (two layers, 32-pixel images in 8-pixel
    patches: 16 image tokens per image) before the tiny Llama, the byte-level tokenizer with
    ``<image>``, and a processor that needs no torchvision. Weights are drawn wide (0.2; norms
    stay 1), so that the answer depends on the image."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<s>", "</s>", "<image>"):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<image>"],
    )
    images = CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=fast,
        patch_size=8,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    ).save_pretrained(out_dir)
    tiny = dict(GEOMETRIES["tiny"])
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            projection_dim=64,
        ),
        text_config=LlamaConfig(
            vocab_size=len(vocab),
            max_position_embeddings=2048,
            bos_token_id=vocab["<s>"],
            eos_token_id=vocab["</s>"],
            tie_word_embeddings=False,
            **tiny,
        ),
        image_token_index=vocab["<image>"],
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "layrnorm" not in name and not name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    # vLLM names the vision tower's weights as transformers 4 saved them (``vision_model.``).
    path = f"{out_dir}/model.safetensors"
    weights = {
        (
            f"vision_tower.vision_model.{k[len('vision_tower.') :]}"
            if k.startswith("vision_tower.")
            else k
        ): v
        for k, v in load_file(path).items()
    }
    save_file(weights, path, metadata={"format": "pt"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    parser.add_argument("--family", choices=list(FAMILIES), default="llama")
    args = parser.parse_args()
    build(args.out_dir, args.geometry, family=args.family)
