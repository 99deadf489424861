"""Trains the demo tokenizer once, from text that is on every Debian/Python machine.

The result, `tokenizer.json`, is committed; this script documents how it was made and can
rebuild it: `python engine/demo/train_tokenizer.py`. Nothing is downloaded.
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HERE = Path(__file__).resolve().parent


def corpus() -> list[str]:
    """English prose from the license texts plus docstrings of the standard library."""
    texts = [p.read_text(errors="ignore") for p in sorted(Path("/usr/share/common-licenses").glob("*")) if p.is_file()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return texts


def train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    # Byte-level: every UTF-8 string has an encoding, so no input is ever <unk>.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


if __name__ == "__main__":
    out = HERE / "tokenizer.json"
    train().save(str(out))
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)
