"""A character-level tokenizer with LLaDA's special tokens and chat template, built offline with `tokenizers`.

Real LLaDA tokenizers cannot be downloaded here; tests, the demo and the tiny trained model use this one. It
keeps LLaDA-8B-Instruct's special-token names and chat format, so prompts look like the real thing:

    <|startoftext|><|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\n\n
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS, EOS, EOT, MASK = "<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = [EOS, BOS, EOT, MASK, HEADER_START, HEADER_END, UNK]
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Special tokens get ids 0..6 (EOS = 0, BOS = 1, EOT = 2, MASK = 3), then one id per character.

    Padding is on the left with EOS as the pad token, as LLaDA does.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in CHARACTERS:
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=UNK,
        mask_token=MASK,
        additional_special_tokens=[EOT, HEADER_START, HEADER_END],
        padding_side="left",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
