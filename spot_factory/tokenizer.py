"""Train the bundled byte-level BPE tokenizer on the corpus and save it in Hugging Face format.

The files are the ones a real checkpoint ships (tokenizer.json, tokenizer_config.json with the
chat template, special_tokens_map.json), so `AutoTokenizer.from_pretrained(dir)` loads the
bundled targets through the same path as a downloaded one, offline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from spot.builtin import builtin_root
from spot_common.corpus import examples, heldout_prompt_set, write_jsonl
from spot_factory.cli import chosen_output, output_options

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEFAULT_VOCAB_SIZE = 1280
DEFAULT_TRAINING_EXAMPLES = 20_000


def chat_prompt(prompt: str) -> str:
    """The chat template applied to one user turn, ready for the assistant's answer (the
    same string `apply_chat_template(..., add_generation_prompt=True)` renders)."""
    return f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"


def _training_text(seed: int, count: int) -> Iterator[str]:
    stream = examples(seed, "train")
    for _ in range(count):
        item = next(stream)
        yield chat_prompt(item.prompt) + item.completion + IM_END


def train_tokenizer(
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    count: int = DEFAULT_TRAINING_EXAMPLES,
) -> Tokenizer:
    """Byte-level BPE (GPT-2/Qwen style pre-tokenization) over `count` training examples; the
    special tokens get the first ids, the mask token among them."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(seed, count), trainer=trainer, length=count)
    return tokenizer


def save_hf(tokenizer: Tokenizer, directory: Path, model_max_length: int = 512) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))

    def entry(token: str) -> dict:
        return {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    added = {str(tokenizer.token_to_id(t)): entry(t) for t in SPECIAL_TOKENS}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "mask_token": MASK,
        "model_max_length": model_max_length,
        "pad_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    short = {k: v for k, v in entry(EOS).items() if k != "special"}
    special = {
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "eos_token": short,
        "mask_token": {**short, "content": MASK},
        "pad_token": short,
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


@click.command("build-corpus")
@output_options
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, show_default=True)
@click.option("--heldout", type=int, default=400, show_default=True, help="held-out prompts")
def build_corpus_command(
    output: Path | None, into_package: bool, seed: int, vocab_size: int, heldout: int
) -> None:
    """Train the bundled tokenizer on the corpus and write the held-out prompt set
    (OUTPUT/tokenizer, OUTPUT/prompts/heldout.jsonl)."""
    output = chosen_output(output, into_package, builtin_root())
    save_hf(train_tokenizer(seed, vocab_size), output / "tokenizer")
    write_jsonl(output / "prompts" / "heldout.jsonl", heldout_prompt_set(seed, heldout))
    click.echo(f"wrote {output / 'tokenizer'} and {output / 'prompts' / 'heldout.jsonl'}")
