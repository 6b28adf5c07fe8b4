"""Devices: `train.device: auto` in the shipped GPU configs, and a CUDA device this machine cannot
see (train.device, or a `device` in model / task / reward params) refused in one line when the
config loads, before anything is built."""

from pathlib import Path

import pytest
import torch

from mmrl.cli import main
from mmrl.config import ConfigError, load_config, read_config_file

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
GPU = torch.cuda.is_available()
# A device this machine lacks: CUDA without a GPU, or one index past the GPUs it has.
ABSENT = f"cuda:{torch.cuda.device_count()}" if GPU else "cuda"


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_train_on_an_absent_gpu_is_one_line_before_anything_is_built(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(CONFIGS / "digit_sort_grpo.yaml"), f"train.device={ABSENT}",
                 f"train.output_dir={out}"]) == 2
    line = _one_line(capsys.readouterr().err)
    if GPU:
        assert line.startswith(f"mmrl: error: train.device: '{ABSENT}' but {torch.cuda.device_count()} CUDA GPU")
    else:
        assert line == ("mmrl: error: train.device: 'cuda' but no CUDA GPU is visible here "
                        "(torch.cuda.is_available() is False); use train.device=auto or cpu")
    assert not out.exists()  # refused at load: no run folder, no model, no tokenizer


@pytest.mark.skipif(GPU, reason="every cuda:N is out of range only without a GPU")
def test_any_cuda_index_without_a_gpu_and_a_malformed_one(capsys):
    with pytest.raises(ConfigError, match=r"train.device: 'cuda:0' but no CUDA GPU is visible here"):
        load_config(CONFIGS / "digit_sort_grpo.yaml", ["train.device=cuda:0"])
    with pytest.raises(ConfigError, match=r"train.device: invalid value 'cuda:one'; valid: auto, cpu, cuda, cuda:N"):
        load_config(CONFIGS / "digit_sort_grpo.yaml", ["train.device=cuda:one"])


def test_a_visible_device_is_accepted():
    assert load_config(CONFIGS / "digit_sort_grpo.yaml", ["train.device=cpu"]).train.device == "cpu"
    if GPU:
        assert load_config(CONFIGS / "digit_sort_grpo.yaml", ["train.device=cuda:0"]).train.device == "cuda:0"


@pytest.mark.parametrize("name", ["video_wan_gpu.yaml", "vqa_geometry3k_gpu.yaml", "vla_libero_grpo.yaml"])
def test_shipped_gpu_configs_run_where_the_gpu_is(name):
    """auto: the GPU when one is visible, else the CPU (the configs load on a machine without one)."""
    from mmrl.distributed import resolve_device

    train = read_config_file(CONFIGS / name)["train"]
    assert train["device"] == "auto"
    assert resolve_device(train["device"]).type == ("cuda" if GPU else "cpu")


def test_no_shipped_config_names_cuda_for_training():
    for path in sorted(CONFIGS.glob("*.yaml")):
        assert read_config_file(path).get("train", {}).get("device", "auto") in ("auto", "cpu"), path.name


def test_a_device_in_reward_task_or_model_params_is_checked_too(capsys, local_inputs):
    # The video GPU config's CLIP reward names cuda (a reward's device is handed to torch as it is:
    # the suggestion is cpu, not auto); it is refused before the CLIP model would be loaded.
    wan = CONFIGS / "video_wan_gpu.yaml"
    local = [o for o in local_inputs(wan) if not o.startswith("rewards.0.params.device=")]
    capsys.readouterr()  # what building the stand-in inputs printed is not the CLI's output
    assert main(["train", str(wan), *local, f"rewards.0.params.device={ABSENT}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"mmrl: error: rewards.0.params.device: '{ABSENT}' but ")
    if not GPU:
        assert line.endswith("use rewards.0.params.device=cpu")
    assert load_config(wan, [*local, "rewards.0.params.device=cpu"]).rewards[0].params["device"] == "cpu"
    # Nested: a judge's own params (the captioning task builds its judge from task.params.judge).
    with pytest.raises(ConfigError, match=rf"task.params.judge.device: '{ABSENT}' but "):
        load_config(CONFIGS / "caption_grpo.yaml", [f"task.params.judge={{name: hf, path: x, device: '{ABSENT}'}}"])
    # A reward's encoder params (SRPO's video encoder).
    with pytest.raises(ConfigError, match=rf"rewards.1.params.encoder_params.device: '{ABSENT}' but "):
        load_config(CONFIGS / "vla_tabletop_srpo.yaml", [f"rewards.1.params.encoder_params={{device: '{ABSENT}'}}"])
