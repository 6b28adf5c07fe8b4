"""Write the procedural VQA set to files, as a dataset of one's own: the input of configs/vqa_your_data.yaml.

    python scripts/make_vqa_files.py data/my_vqa                 # train.jsonl, test.jsonl, images/
    python scripts/make_vqa_files.py data/my_vqa_pq --format parquet

The columns (question, image, choices, label, rationale, type) are not mmrl's record keys, so the
config names them in `task.params.column_map`; docs/your_data.md walks through it. The training
rationales come from a teacher that over-counts by one on 60% of the counting questions (the labels
are right), the error GRPO on the verifiable answer has to undo.
"""

from __future__ import annotations

import argparse
import sys

from mmrl.envs.vqa.export import FORMATS, write_synthetic


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the folder to write (created)")
    p.add_argument("--format", default="jsonl", choices=FORMATS)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="the data seed (not the training seed)")
    p.add_argument("--image-size", type=int, default=56)
    p.add_argument("--teacher-overcount", type=float, default=0.6,
                   help="share of counting rationales that say one more than the image shows")
    args = p.parse_args(argv)
    try:
        files = write_synthetic(args.out, args.format, args.n_train, args.n_test, args.seed,
                                image_size=args.image_size, teacher_overcount=args.teacher_overcount)
    except ValueError as exc:
        print(f"make_vqa_files: error: {exc}", file=sys.stderr)
        return 2
    for split, file in files.items():
        print(f"{split}: {file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
