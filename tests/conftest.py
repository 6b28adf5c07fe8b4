import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# The robot domain (VLA policies, the MuJoCo tabletop, LIBERO) needs lerobot's stack, whose pins hold
# torch and transformers back; the newest-stack lane runs everything else: `pytest -m "not robot"`.
# These files are robot tests throughout (a few tests elsewhere carry @pytest.mark.robot, and a
# config-wide test's case for a shipped VLA config, `[vla_...]`, is marked here).
ROBOT_FILES = {"test_action_vla.py", "test_conv_keypoints.py", "test_diffusion_policy.py", "test_lerobot_dataset.py",
               "test_libero_assets.py", "test_libero_benchmark.py", "test_libero_env.py", "test_smolvla.py",
               "test_srpo.py", "test_tabletop.py", "test_vla_demo.py", "test_vla_grounding.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "robot: the robot domain, which needs lerobot's stack (deselect: -m 'not robot')")


def pytest_ignore_collect(collection_path, config):
    # Robot files import their simulators at module level: under -m "not robot" they are not imported.
    return True if config.getoption("markexpr") == "not robot" and collection_path.name in ROBOT_FILES else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ROBOT_FILES or "[vla_" in item.name:
            item.add_marker(pytest.mark.robot)


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

    def geometry3k_folder() -> str:
        """A few records in EasyR1's geometry3k layout (images [{"bytes"}], problem with <image>, answer),
        as its hub snapshot holds them: data/train-00000-of-00001.parquet and data/test-..."""
        if "geometry3k" not in made:
            import io

            import datasets
            from PIL import Image

            from mmrl.envs.vqa.synthetic import generate

            def png(a):
                buf = io.BytesIO()
                Image.fromarray(a).save(buf, format="PNG")
                return buf.getvalue()

            (root / "geometry3k" / "data").mkdir(parents=True)
            for split, seed in (("train", 3), ("test", 4)):
                rows = generate(8, seed, categories=("geometry",), difficulties=(1,), image_size=56)
                datasets.Dataset.from_dict({
                    "images": [[{"bytes": png(r["images"][0]), "path": None}] for r in rows],
                    "problem": [r["problem"] for r in rows], "answer": [r["answer"] for r in rows],
                }).to_parquet(root / "geometry3k" / "data" / f"{split}-00000-of-00001.parquet")
            made["geometry3k"] = str(root / "geometry3k")
        return made["geometry3k"]

    def your_vqa_files() -> str:
        """configs/vqa_your_data.yaml's input: scripts/make_vqa_files.py's layout, a few records."""
        if "your_vqa" not in made:
            from mmrl.envs.vqa.export import write_synthetic

            write_synthetic(root / "my_vqa", "jsonl", n_train=16, n_test=4)
            made["your_vqa"] = str(root / "my_vqa")
        return made["your_vqa"]

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
            from mmrl.tiny import save_clip

            save_clip(root / "clip", [ln for ln in (Path(__file__).parent.parent / "configs/prompts/video_prompts.txt")
                                      .read_text().splitlines() if not ln.startswith("#")])
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
        if task.get("name") == "vqa" and task.get("params", {}).get("column_map"):
            out += [f"task.params.data_path={your_vqa_files()}"]  # the demo's files, as its script writes them
        elif task.get("name") == "vqa" and task.get("params", {}).get("source") == "files":
            out += [f"task.params.data_path={geometry3k_folder()}", "task.params.min_pixels=3136",
                    "task.params.max_pixels=12544"]
        return out

    # The builders themselves, for tests that need a local input without a config (`local_inputs.tiny_qwen_vl()`).
    overrides.tiny_qwen_vl, overrides.geometry3k_folder = tiny_qwen_vl, geometry3k_folder
    return overrides


# Inputs some tests read from the workplace folder beside the checkout (`../shared`, or MMRL_SHARED):
# large or licensed files no fresh clone has. A test asks for one through `shared_input`, which skips
# it with the reason when the file is absent, so a user's run of the suite says what it did not check.
SHARED_INPUTS = {
    "vprl": "the VPRL paper's test-split metadata (vprl_*_test_meta.json)",
    "libero/assets": "LIBERO's scene and object assets (docs/libero.md says where they come from)",
}


def shared_dir() -> "Path":
    from pathlib import Path

    return Path(os.environ.get("MMRL_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))


# LIBERO's assets are in no package (docs/libero.md): the tests take them from MMRL_LIBERO_ASSETS,
# else from the shared folder's copy (set here, so that env worker processes inherit it; mmrl itself
# never looks there). Tests that need them ask for the `libero_assets` fixture, which skips without them.
if not os.environ.get("MMRL_LIBERO_ASSETS") and (shared_dir() / "libero" / "assets" / "scenes").is_dir():
    os.environ["MMRL_LIBERO_ASSETS"] = str(shared_dir() / "libero" / "assets")


@pytest.fixture(scope="session")
def shared_input():
    """`shared_input(name)` -> the path of a `SHARED_INPUTS` entry, or a skip naming what is missing."""
    def get(name: str):
        path = shared_dir() / name
        if not path.exists():
            pytest.skip(f"needs {SHARED_INPUTS[name]}: {name} is not in {shared_dir()} (set MMRL_SHARED)")
        return path

    return get


@pytest.fixture(scope="session")
def libero_assets(shared_input):
    """The LIBERO assets folder the tests use: MMRL_LIBERO_ASSETS when set (a user's copy, or the
    shared folder's, see above), else the test is skipped with the reason."""
    from mmrl.envs.libero.assets import default_assets_dir, missing_parts

    if not os.environ.get("MMRL_LIBERO_ASSETS"):
        shared_input("libero/assets")  # skips, saying what is missing
    path = default_assets_dir()
    if missing_parts(path):
        pytest.skip(f"LIBERO assets are not at {path}: set MMRL_LIBERO_ASSETS=DIR or run `mmrl fetch-assets "
                    f"libero` (docs/libero.md)")
    return path
