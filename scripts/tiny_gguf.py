"""Write tiny random-weight llama-architecture GGUF models that llama-server really loads,
and LoRA adapters of them (`--lora`).

    python scripts/tiny_gguf.py OUT.gguf [--seed N] [--layers 2] [--embd 64] [--lora]

A byte-fallback SentencePiece vocabulary (with <s>, </s> and <unk>), a chat template and
random F32 weights: it loads in milliseconds and answers chat completions with gibberish.
Send `"ignore_eos": true` with `max_tokens` to get a fixed length. Nothing is downloaded.
Needs the `gguf` package (a test dependency).
"""

from __future__ import annotations

import argparse
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tiny_gguf(path: str | Path, seed: int = 0, layers: int = 2, embd: int = 64,
                    heads: int = 4, ff: int = 128, context: int = 512) -> Path:
    """Write the model to `path` (different seeds give different weights); return it."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    words = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581the", "\u2581a", "\u2581corral"]
    tokens += words
    types += [gguf.TokenType.NORMAL] * len(words)
    scores = [0.0] * (len(tokens) - len(words)) + [-float(i) for i in range(len(words))]
    n_vocab = len(tokens)

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-{seed}")
    writer.add_context_length(context)
    writer.add_embedding_length(embd)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(embd // heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weights(*shape: int) -> object:  # numpy order: the reverse of ggml's ne
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weights(n_vocab, embd))
    writer.add_tensor("output_norm.weight", np.ones(embd, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, embd))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights(embd, embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(ff, embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(ff, embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(embd, ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_lora(path: str | Path, seed: int = 0, layers: int = 2, embd: int = 64,
                    rank: int = 4) -> Path:
    """Write a LoRA adapter of `write_tiny_gguf`'s model (same `layers` and `embd`) to
    `path`: random A and B for every layer's attn_q and attn_v, strong enough that an
    answer with it applied differs from one without; return it."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(1000 + seed)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    for i in range(layers):
        for name in ("attn_q", "attn_v"):  # numpy order: A is (rank, in), B is (out, rank)
            writer.add_tensor(f"blk.{i}.{name}.weight.lora_a",
                              (rng.standard_normal((rank, embd)) * 0.5).astype(np.float32))
            writer.add_tensor(f"blk.{i}.{name}.weight.lora_b",
                              (rng.standard_normal((embd, rank)) * 0.5).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--lora", action="store_true", help="write a LoRA adapter of that model")
    args = p.parse_args()
    write = write_tiny_lora if args.lora else write_tiny_gguf
    print(write(args.out, args.seed, args.layers, args.embd))


if __name__ == "__main__":
    main()
