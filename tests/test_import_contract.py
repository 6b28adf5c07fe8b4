"""The import contract (issue 32, "One-way domains"): each module imports only its own layer and the
layers below it, counting every import, at module level or inside a function, method or
`if TYPE_CHECKING:` block. The sources are parsed with `ast`, never imported.

Layers, lowest first (a module belongs to the layer of its longest matching prefix in `LAYERS`):

    0 core      mmrl.algos, mmrl.rollout, mmrl.flow, mmrl.distributed, mmrl.logger, mmrl.hub, mmrl.tiny,
                mmrl.tiny_vlm, mmrl.hf_compat (what differs between the transformers releases supported),
                mmrl.checkpoint, mmrl.run_config (the typed config), mmrl.config_checks, mmrl.stages,
                mmrl.episodes (the episode loop a VLA policy rolls out with, in its task's env factory)
    1 domains   the pure world models of a domain, which a policy or a reward may read: the planning
                grid, renderer / frame parser, step judge and text plans; the caption scenes; the
                video clip specs (`DOMAIN_CORES`)
    2 policies  mmrl.policies.*
    3 rewards   mmrl.rewards.*
    4 envs      mmrl.envs.*  (the tasks)
    5 config    mmrl.config: loading a config, with the checks of the names it gives the registries
    6 trainer   mmrl.trainer and its stages of the step: mmrl.collect, mmrl.update, mmrl.sft, mmrl.run_control;
                mmrl.assemble (task + policy from a config, for the trainer's callers and the evals)
    7 evals     mmrl.evals.*
    8 cli       mmrl (the package: load_config / build / train), mmrl.cli, mmrl.plan

Why: the typed config (run_config) and checkpoint are read by every layer, so they sit in core;
loading a config checks the names it gives the policy, task and reward registries, so `mmrl.config`
sits above them. The trainer sits above the tasks because it is handed a task and never imports
one, while a task must not build a trainer.

Reading a failure: each line is

    mmrl.policies.base:123 imports mmrl.envs (policies may import only: core, domains, policies)

i.e. file mmrl/policies/base.py, line 123, imports a higher layer. Move the imported code down to a
layer the importer may use (or the importing code up), or pass the object in from the caller.
`KNOWN_VIOLATIONS` lists the upward imports allowed for now, each with what removes it (none today).
It only shrinks: a pair that no longer occurs fails `test_known_violations_still_exist` until it is
deleted from the list.
A new module must match a prefix in `LAYERS` (`test_every_module_has_a_layer`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject's package-dir).
ROOTS = {"mmrl": "mmrl", "envs": "mmrl.envs", "evals": "mmrl.evals"}

# Modules of envs/ that model a domain's world and import nothing above core: the rewards and
# policies of the domain read them (a frame parser, a step judge), so they sit below both.
DOMAIN_CORES = ("mmrl.envs.planning.grid", "mmrl.envs.planning.render", "mmrl.envs.planning.judge",
                "mmrl.envs.planning.text_plan", "mmrl.envs.captioning.scenes", "mmrl.envs.video.clips")

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("mmrl.algos", "mmrl.rollout", "mmrl.flow", "mmrl.distributed", "mmrl.logger", "mmrl.hub",
              "mmrl.tiny", "mmrl.tiny_vlm", "mmrl.hf_compat", "mmrl.checkpoint", "mmrl.run_config", "mmrl.config_checks", "mmrl.stages",
              "mmrl.episodes")),
    ("domains", DOMAIN_CORES),
    ("policies", ("mmrl.policies",)),
    ("rewards", ("mmrl.rewards",)),
    ("envs", ("mmrl.envs",)),
    ("config", ("mmrl.config",)),
    ("trainer", ("mmrl.trainer", "mmrl.collect", "mmrl.update", "mmrl.sft", "mmrl.run_control", "mmrl.assemble")),
    ("evals", ("mmrl.evals",)),
    ("cli", ("mmrl", "mmrl.cli", "mmrl.plan")),
]

# (importer, imported) pairs allowed to go upward, each with a comment saying what removes it. Empty:
# every import follows the contract. The list only shrinks (test_known_violations_still_exist).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # the deepest module the statement names (a package when it imports a name from it)
    line: int


def module_name(rel: Path) -> str:
    """envs/vqa/task.py -> mmrl.envs.vqa.task; mmrl/__init__.py -> mmrl."""
    parts = list(rel.with_suffix("").parts)
    parts[0] = ROOTS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(overrides: dict[Path, str] | None = None) -> dict[Path, str]:
    """{path relative to the repo: source} of every module, with `overrides` replacing or adding files."""
    found = {p.relative_to(REPO): p.read_text() for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))}
    return found | (overrides or {})


def import_graph(overrides: dict[Path, str] | None = None) -> list[Import]:
    """Every import of an mmrl module in the tree (module level and inside functions alike)."""
    srcs = sources(overrides)
    modules = {module_name(rel) for rel in srcs}
    out = []
    for rel, text in srcs.items():
        name = module_name(rel)
        package = name if rel.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(text, filename=str(rel))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: strip level - 1 trailing parts off the package
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import sub` names the submodule when there is one, else a name in pkg.
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            else:
                continue
            out += [Import(name, t, node.lineno) for t in sorted(set(targets)) if t == "mmrl" or t.startswith("mmrl.")]
    return out


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix matching `module` ("mmrl" matches only itself)."""
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or (prefix != "mmrl" and module.startswith(prefix + "."))]
    if not matches:
        raise ValueError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return max(matches)[1]


def upward(imports: list[Import]) -> list[Import]:
    """The imports whose target sits in a higher layer than their importer."""
    return [i for i in imports if layer_of(i.imported) > layer_of(i.importer)]


def describe(i: Import) -> str:
    layer = layer_of(i.importer)
    allowed = ", ".join(LAYERS[k][0] for k in range(layer + 1))
    return f"{i.importer}:{i.line} imports {i.imported} ({LAYERS[layer][0]} may import only: {allowed})"


def test_every_module_has_a_layer():
    unplaced = []
    for name in sorted(map(module_name, sources())):
        try:
            layer_of(name)
        except ValueError:
            unplaced.append(name)
    assert not unplaced, f"add these modules to LAYERS: {unplaced}"


def test_no_new_upward_imports():
    new = [describe(i) for i in upward(import_graph()) if (i.importer, i.imported) not in KNOWN_VIOLATIONS]
    assert not new, "imports against the layer contract (see this test's docstring):\n" + "\n".join(new)


def test_known_violations_still_exist():
    current = {(i.importer, i.imported) for i in upward(import_graph())}
    gone = sorted(KNOWN_VIOLATIONS - current)
    assert not gone, f"fixed, so delete from KNOWN_VIOLATIONS: {gone}"


def test_an_added_upward_import_inside_a_function_fails():
    rel = Path("mmrl/policies/base.py")
    text = (REPO / rel).read_text()
    probe = "\n\ndef _probe():\n    from mmrl.envs import make_task\n    return make_task\n"
    line = text.count("\n") + 4  # the `from` line of the probe
    bad = [i for i in upward(import_graph({rel: text + probe}))
           if i.importer == "mmrl.policies.base" and (i.importer, i.imported) not in KNOWN_VIOLATIONS]
    assert [describe(i) for i in bad] == [
        f"mmrl.policies.base:{line} imports mmrl.envs (policies may import only: core, domains, policies)"]


def test_relative_imports_resolve_to_their_package():
    rel = Path("envs/vqa/task.py")
    probe = "from .records import load_records\nfrom ...evals import report\n"
    found = {(i.imported, i.line) for i in import_graph({rel: probe}) if i.importer == "mmrl.envs.vqa.task"}
    assert found == {("mmrl.envs.vqa.records", 1), ("mmrl.evals.report", 2)}
    assert [describe(i) for i in upward(import_graph({rel: probe})) if i.importer == "mmrl.envs.vqa.task"] == [
        "mmrl.envs.vqa.task:2 imports mmrl.evals.report (envs may import only: core, domains, policies, rewards, "
        "envs)"]
