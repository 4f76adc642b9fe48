"""``difftx tokenizer train``: train a byte-level BPE tokenizer locally (``difftx.data.train_bpe``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import check_not_input, check_not_owned, output_dir


def register(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a BPE tokenizer locally on text files",
                       description="Tokenizer tools. Nothing is downloaded.")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer and write DIR/tokenizer.json",
                        description="Train a byte-level BPE (GPT-2 style splitting, <|endoftext|> as the document "
                                    "separator) with the `tokenizers` library on local text: plain-text files, "
                                    "folders of them, or JSONL. Without --input: the bundled corpus's training split.")
    t.add_argument("--input", nargs="+", metavar="PATH", help="text file(s), folder(s) or .jsonl file(s)")
    t.add_argument("--vocab-size", type=int, default=4096,
                   help="vocabulary size, <|endoftext|> included (default 4096)")
    t.add_argument("--out", required=True, type=output_dir, metavar="DIR", help="folder to write tokenizer.json into")
    t.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    t.add_argument("--min-frequency", type=int, default=2, help="minimum pair count for a merge (default 2)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace an existing DIR/tokenizer.json (refused otherwise: runs and checkpoints trained "
                        "with it would decode with another vocabulary)")
    t.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from ..data.tokenizer import TOKENIZER_FILE, train_bpe  # lazy: numpy; --help stays fast

    check_not_owned(Path(args.out) / TOKENIZER_FILE, "--out", args.overwrite)
    check_not_input(Path(args.out) / TOKENIZER_FILE, "--out", {"--input": list(args.input or [])})
    tok = train_bpe(args.input, vocab_size=args.vocab_size, out_dir=args.out, text_field=args.text_field,
                    min_frequency=args.min_frequency)
    print(f"wrote {Path(args.out) / TOKENIZER_FILE}: vocab_size={tok.vocab_size} eos_id={tok.eos_id} name={tok.name}")
    return 0
