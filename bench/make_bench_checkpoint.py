"""Writes the checkpoint of the serving benchmarks against other servers (docs/benchmarks.md):
a tiny Llama with random weights (seeded), saved by transformers' `save_pretrained`, plus a
tokenizer.json that both servers load.

    python -m bench.make_bench_checkpoint DIR [--layers 8 --hidden 512 --heads 8
        --kv-heads 4 --vocab 8000 --seed 0]

The tokenizer is a word-level vocabulary of exactly --vocab tokens (`<unk>`, `<s>`, `</s>`,
then `w3` ... ), so every id the benchmark draws decodes to a word and a decoded prompt
tokenizes back to the same ids: text prompts and token-id prompts are the same workload.
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")


def write_tokenizer(root: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIALS), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 1 << 20}
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_checkpoint(root: Path, layers: int, hidden: int, heads: int, kv_heads: int,
                     vocab: int, intermediate: int, max_positions: int, seed: int) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    model = tf.LlamaForCausalLM(config).to(torch.float32).eval()
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root, safe_serialization=True)
    write_tokenizer(root, vocab)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.make_bench_checkpoint",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("dir", type=Path, help="where to write the checkpoint")
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    p.add_argument("--vocab", type=int, default=8000, help="vocabulary size")
    p.add_argument("--intermediate", type=int, default=1536, help="MLP size")
    p.add_argument("--max-positions", type=int, default=2048, help="context window")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(argv)
    if args.vocab <= len(SPECIALS) or args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("need --vocab > 3, --hidden divisible by --heads, --heads by --kv-heads")
    write_checkpoint(args.dir, args.layers, args.hidden, args.heads, args.kv_heads, args.vocab,
                     args.intermediate, args.max_positions, args.seed)
    print(f"wrote {args.dir}: Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} "
          f"heads / {args.kv_heads} KV heads, vocab {args.vocab}, float32", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
