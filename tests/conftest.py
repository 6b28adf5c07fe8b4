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

    def tiny_video() -> str:
        """A diffusers-Wan-pipeline-like folder: a tiny causal Wan on a tiny AutoencoderKLWan's latents."""
        if "video" not in made:
            from mmrl.envs.video.task import read_prompt_file
            from mmrl.policies.video.configuration import VideoGenConfig
            from mmrl.policies.video.modeling import VideoGenPolicy, build_tiny_parts

            train, test = read_prompt_file(str(Path(__file__).parent.parent / "configs/prompts/video_prompts.txt"), 0)
            prompts = [p if isinstance(p, str) else p.prompt for p in train]
            parts = build_tiny_parts(prompts, chunk_frames=3, latent=True, patch_size=(1, 2, 2), local_window=2,
                                     sink_chunks=1)
            VideoGenPolicy(*parts[:3], VideoGenConfig(chunk_frames=3), num_frames=9, height=32, width=32,
                           vae=parts[3]).save(root / "video")
            made["video"] = str(root / "video")
        return made["video"]

    def tiny_clip() -> str:
        if "clip" not in made:
            from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

            from mmrl.tiny import build_tokenizer

            tok = build_tokenizer([ln for ln in (Path(__file__).parent.parent / "configs/prompts/video_prompts.txt")
                                   .read_text().splitlines() if not ln.startswith("#")], vocab_size=300)
            cfg = CLIPConfig(text_config={"vocab_size": len(tok), "hidden_size": 16, "intermediate_size": 32,
                                          "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
                                          "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
                             vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                             projection_dim=8)
            CLIPModel(cfg).save_pretrained(root / "clip")
            CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                             crop_size={"height": 32, "width": 32}),
                          tokenizer=tok).save_pretrained(root / "clip")
            made["clip"] = str(root / "clip")
        return made["clip"]

    def overrides(path) -> list[str]:
        raw = read_config_file(Path(path))
        model, task = raw.get("model", {}), raw.get("task", {})
        out = []
        if model.get("source") == "pretrained" and model.get("policy") == "qwen_vl":
            out += [f"model.path={tiny_qwen_vl()}", "model.dtype=float32", "sampling.max_new_tokens=16"]
        if model.get("source") == "pretrained" and model.get("policy") == "video_gen":
            out += [f"model.path={tiny_video()}", "model.dtype=float32", "task.params.num_frames=9",
                    "task.params.image_size=32", "model.params.text_max_length=16"]
        for i, r in enumerate(raw.get("rewards", [])):
            if r.get("name") == "clip_score":
                out += [f"rewards.{i}.params.path={tiny_clip()}", f"rewards.{i}.params.device=cpu"]
        if task.get("name") == "vqa" and task.get("params", {}).get("source") == "files":
            data = geometry3k_parquet()
            out += [f"task.params.data_path={data}", f"task.params.eval_path={data}",
                    "task.params.min_pixels=3136", "task.params.max_pixels=12544"]
        return out

    return overrides
