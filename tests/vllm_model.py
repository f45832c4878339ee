"""A random-weight Llama (GQA, untied embeddings) and a byte-level tokenizer, written as a local
Hugging Face model directory for vLLM: no hub download. Run with the vLLM environment's Python
(its transformers writes a config that vLLM's reads):

    python tests/vllm_model.py OUT_DIR [--geometry tiny|smollm-135m]

``tiny`` is the model of the tests (2 layers, 4 heads over 2 KV heads of 32 dims, a vocabulary of
the 256 byte tokens plus BOS/EOS). ``smollm-135m`` has the shapes of SmolLM-135M (30 layers,
9 heads over 3 KV heads of 64, hidden 576, a 49152-token vocabulary), for speed measurements only.
Weights are drawn with a fixed seed and a wide initialiser (0.2), so greedy tokens vary with the
context instead of collapsing onto one token.
"""
from __future__ import annotations

import argparse

GEOMETRIES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "smollm-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                        vocab_size=49152),
}


def build(out_dir: str, geometry: str = "tiny", max_positions: int = 2048) -> None:
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
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                            eos_token="</s>").save_pretrained(out_dir)
    vocab_size = shape.pop("vocab_size", len(vocab))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, initializer_range=0.2,
                         bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"],
                         torch_dtype="float32", **shape)
    LlamaForCausalLM(config).save_pretrained(out_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    args = parser.parse_args()
    build(args.out_dir, args.geometry)
