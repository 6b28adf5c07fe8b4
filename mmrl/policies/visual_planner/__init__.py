"""Visual planner (VPRL, arXiv 2505.11409, visual mode): a causal LM over VQ image codes.

`configuration` holds the typed settings and the token vocabulary, `vq` the image tokenizer
(trained here on rendered frames), `modeling` the policy adapter `VisualPlannerPolicy`.
"""

from .configuration import VisualPlannerConfig, Vocabulary, VQConfig
from .vq import VQTokenizer, train_vq

__all__ = ["VQConfig", "VQTokenizer", "VisualPlannerConfig", "VisualPlannerPolicy", "Vocabulary", "train_vq"]


def __getattr__(name: str):
    if name == "VisualPlannerPolicy":  # transformers is imported only when the policy is used
        from .modeling import VisualPlannerPolicy

        return VisualPlannerPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
