import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_lm():
    """A tiny Qwen2 and its locally trained tokenizer (random weights)."""
    from mmrl.tiny import build_tiny_qwen2, build_tokenizer

    corpus = [f"{a}+{b}={a + b}" for a in range(60) for b in range(60)] + ["hello world", "the cat sat"]
    tok = build_tokenizer(corpus, vocab_size=300)
    model = build_tiny_qwen2(tok, seed=0, hidden_size=64, intermediate_size=128).eval()
    return model, tok
