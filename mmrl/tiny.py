"""Tiny models and locally built tokenizers, for tests and the CPU demo.

Nothing here touches a hub: a byte-level BPE is trained on a corpus with the `tokenizers`
library, and the model is built from a config with random weights. `save_pretrained` output of
both loads back through the same `from_pretrained(local_dir)` path that real checkpoints use.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# The Qwen special tokens, so the same prompts and masks work on a real Qwen checkpoint.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` and wrap it as a transformers fast tokenizer.

    The 256 byte symbols are always in the vocabulary, so any text round-trips.
    """
    tok = Tokenizer(models.BPE())
    # Digits stay single tokens, as in Qwen's tokenizer, so numbers are read digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


TINY_QWEN2 = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def build_tiny_qwen2(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **overrides):
    """A Qwen2-architecture causal LM with random weights, sized by `overrides`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    params = {**TINY_QWEN2, **overrides}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **params,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model
