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


@pytest.fixture(scope="session")
def local_inputs(tmp_path_factory):
    """`overrides(config_path) -> [key=value]` pointing a shipped config's local inputs (a pretrained
    checkpoint folder, data files a GPU config expects on the user's disk) at tiny ones written
    here, so the test exercises the same `from_pretrained(dir)` and file-loading paths."""
    from pathlib import Path

    from mmrl.config import read_config_file

    root = tmp_path_factory.mktemp("local_inputs")
    made: dict[str, str] = {}

    def tiny_qwen_vl() -> str:
        if "qwen_vl" not in made:
            from mmrl.envs.vqa.synthetic import generate
            from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer

            corpus = [r["problem"] + " " + r["solution"] for r in generate(200, 0, image_size=56)]
            tok = build_tokenizer(corpus + ["<think> </think> <answer> </answer> \\boxed{}"], vocab_size=400)
            build_tiny_qwen_vl(tok, "qwen2_5_vl", seed=0).save_pretrained(root / "qwen_vl")
            build_qwen_vl_processor(tok, "qwen2_5_vl").save_pretrained(root / "qwen_vl")
            made["qwen_vl"] = str(root / "qwen_vl")
        return made["qwen_vl"]

    def geometry3k_parquet() -> str:
        """A few records in EasyR1's geometry3k layout: images [{"bytes"}], problem with <image>, answer."""
        if "geometry3k" not in made:
            import io

            import datasets
            from PIL import Image

            from mmrl.envs.vqa.synthetic import generate

            def png(a):
                buf = io.BytesIO()
                Image.fromarray(a).save(buf, format="PNG")
                return buf.getvalue()

            rows = generate(8, 3, categories=("geometry",), difficulties=(1,), image_size=56)
            datasets.Dataset.from_dict({
                "images": [[{"bytes": png(r["images"][0]), "path": None}] for r in rows],
                "problem": [r["problem"] for r in rows], "answer": [r["answer"] for r in rows],
            }).to_parquet(root / "geometry3k.parquet")
            made["geometry3k"] = str(root / "geometry3k.parquet")
        return made["geometry3k"]

    def overrides(path) -> list[str]:
        raw = read_config_file(Path(path))
        model, task = raw.get("model", {}), raw.get("task", {})
        out = []
        if model.get("source") == "pretrained" and model.get("policy") == "qwen_vl":
            out += [f"model.path={tiny_qwen_vl()}", "model.dtype=float32", "sampling.max_new_tokens=16"]
        if task.get("name") == "vqa" and task.get("params", {}).get("source") == "files":
            data = geometry3k_parquet()
            out += [f"task.params.data_path={data}", f"task.params.eval_path={data}",
                    "task.params.min_pixels=3136", "task.params.max_pixels=12544"]
        return out

    return overrides
