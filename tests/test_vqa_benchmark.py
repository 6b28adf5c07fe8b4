"""`mmrl eval --benchmark NAME --model DIR` without a training config: a tiny saved Qwen-VL on every
benchmark from the command line, the run-folder and final/ paths giving the same replies, the
provenance block, `--judge` extraction through an OpenAI-compatible endpoint (and a judge that is
down reported as a share), and `--compare` with its refusal and bootstrap interval."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest
import torch

from mmrl.cli import main
from mmrl.evals.provenance import files_sha256, weights_sha256
from mmrl.evals.vqa_benchmark import bootstrap_ci

torch.set_num_threads(1)

FAST = ["--max-new-tokens", "8", "--dtype", "float32", "--device", "cpu"]


def _eval(tmp_path, name, *args):
    out = tmp_path / name
    assert main(["eval", *args, *FAST, "--output", str(out)]) == 0
    return out, json.loads((out / f"{args[args.index('--benchmark') + 1]}.json").read_text())


def test_synthetic_set_from_a_model_folder(local_inputs, tmp_path, capsys):
    model = local_inputs.tiny_qwen_vl()
    out, rec = _eval(tmp_path, "a", "--benchmark", "synthetic", "--model", model, "--limit", "6")
    assert rec["n"] == 6 and len(rec["items"]) == 6
    rule = rec["scores"]["rule"]
    assert rule["accuracy"] == pytest.approx(np.mean([it["correct"] for it in rec["items"]]))
    assert sum(c["n"] for c in rule["breakdowns"]["category"].values()) == 6
    prov = rec["provenance"]
    assert prov["weights_sha256"] == weights_sha256(model) and len(prov["weights_sha256"]) == 64
    assert prov["data_sha256"] == "synthetic:data_seed=0:n=6" and prov["seed"] == 0
    assert prov["sampling"]["temperature"] == 0.0 and prov["sampling"]["max_new_tokens"] == 8
    assert {"torch", "transformers", "python"} <= set(prov["packages"])
    replies = [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines()]
    assert [r["id"] for r in replies] == [it["id"] for it in rec["items"]]
    assert (out / "replies.html").read_text().count('class="card"') == 6
    assert "| accuracy |" in (out / "synthetic.md").read_text()
    assert "synthetic: " in capsys.readouterr().out  # the headline table is printed


def test_weights_hash_follows_the_bytes(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"abc")
    first = weights_sha256(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"abd")
    assert weights_sha256(tmp_path / "m") != first
    assert weights_sha256("someone/some-model") == "hub:someone/some-model"
    (tmp_path / "x.json").write_text("1")
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "x.json").write_text("1")
    assert files_sha256([tmp_path / "x.json"]) == files_sha256([tmp_path / "y" / "x.json"])  # where it lies: no


class _Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint that "extracts" the answer the reply's question expects
    for even-numbered calls and says nothing useful for odd ones."""

    answers: dict[str, str] = {}

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        question = prompt.rsplit("Question: ", 1)[1].split("\nResponse:")[0]
        text = next((a for q, a in self.answers.items() if q in question), "no idea")
        data = json.dumps({"choices": [{"message": {"content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_judge_extraction_beside_the_rule_score_and_a_judge_that_is_down(local_inputs, tmp_path, capsys):
    from mmrl.envs.vqa.synthetic import make_splits

    records = make_splits(0, 2000, 200, 100)["test"][:4]
    # The judge answers the first two questions right and the others wrong.
    _Judge.answers = {r["problem"].replace("<image>", "").strip(): (r["answer"] if i < 2 else "zzz")
                      for i, r in enumerate(records)}
    server = HTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        _, rec = _eval(tmp_path, "j", "--benchmark", "synthetic", "--model", local_inputs.tiny_qwen_vl(),
                       "--limit", "4", "--judge", url)
    finally:
        server.shutdown()
    judged = rec["scores"]["judge"]
    assert judged["accuracy"] == 0.5 and judged["unjudged"] == 0.0
    assert [it["judge_correct"] for it in rec["items"]] == [True, True, False, False]
    assert "judged (extracted by the LLM judge)" in capsys.readouterr().out

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, rec = _eval(tmp_path, "down", "--benchmark", "synthetic", "--model", local_inputs.tiny_qwen_vl(),
                   "--limit", "2", "--judge", f"http://127.0.0.1:{port}/v1")
    assert rec["scores"]["judge"]["unjudged"] == 1.0 and rec["scores"]["judge"]["accuracy"] == 0.0
    assert all("connection error" in it["judge_failed"] for it in rec["items"])
    err = capsys.readouterr().err
    assert "could not extract 100%" in err and f"127.0.0.1:{port}" in err


def _write(path, rec):
    path.write_text(json.dumps(rec))
    return str(path)


def test_compare_refuses_other_data_or_grader_and_gives_a_paired_interval(tmp_path, capsys):
    prov = {"benchmark": "mathvista", "data_sha256": "d", "prompt_template": "t", "grader": "g"}
    items = lambda oks: [{"id": str(i), "correct": ok, "groups": ["task/FQA" if i % 2 else "task/GPS"]}
                         for i, ok in enumerate(oks)]
    a = {"benchmark": "mathvista", "model": "A", "provenance": prov, "items": items([0, 0, 1, 1, 0, 0, 1, 1])}
    b = {"benchmark": "mathvista", "model": "B", "provenance": prov, "items": items([1, 1, 1, 1, 0, 1, 1, 1])}
    pa, pb = _write(tmp_path / "a.json", a), _write(tmp_path / "b.json", b)
    assert main(["eval", "--compare", pa, pb]) == 0
    rows = {line.split(" | ")[0].lstrip("| "): line for line in capsys.readouterr().out.splitlines()}
    assert "| 8 | 50.0 | 87.5 | +37.5 |" in rows["all"]
    assert "| 4 | 50.0 | 75.0 | +25.0 |" in rows["task/GPS"]  # ids 0, 2, 4, 6
    assert "| 4 | 50.0 | 100.0 | +50.0 |" in rows["task/FQA"]
    for grader_or_data in ("grader", "data_sha256"):
        other = {**b, "provenance": {**prov, grader_or_data: "other"}}
        assert main(["eval", "--compare", pa, _write(tmp_path / "c.json", other)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{grader_or_data} differs" in err
    assert main(["eval", "--compare", pa, str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    small, large = rng.choice([-1.0, 0.0, 1.0], 50), rng.choice([-1.0, 0.0, 1.0], 2000)
    lo, hi = bootstrap_ci(small)
    assert lo <= small.mean() <= hi
    lo2, hi2 = bootstrap_ci(large)
    assert hi2 - lo2 < (hi - lo) / 3
    assert bootstrap_ci(np.zeros(10)) == (0.0, 0.0)


def test_bad_benchmark_inputs_are_one_line(local_inputs, tmp_path, capsys):
    model = local_inputs.tiny_qwen_vl()
    cases = [(["--benchmark", "mathvista", "--model", model], "needs --data"),
             (["--benchmark", "synthetic"], "needs --model"),
             (["--benchmark", "synthetic", "--model", str(tmp_path / "nowhere")], "nowhere"),
             (["--benchmark", "synthetic", "--model", str(tmp_path)], "neither a Hugging Face model folder"),
             (["--benchmark", "mathvista", "--model", model, "--data", str(tmp_path / "none.parquet")], "none.parquet"),
             (["--benchmark", "synthetic", "--model", model, "--device", "cuda:3"] if not torch.cuda.is_available()
              else ["--benchmark", "synthetic", "--model", model, "--batch-size", "0"], "--")]
    for args, fragment in cases:
        assert main(["eval", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("mmrl: error:") and err.count("\n") == 1 and fragment in err, (args, err)
