"""Planning envs: generators, splits, BFS/optimal paths, dynamics, renderer/parser, gymnasium."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mmrl.envs.planning import (
    INF,
    UNPARSEABLE,
    Action,
    Cell,
    Layout,
    ParsedState,
    ParseFailure,
    batch_step,
    canonical_task,
    generate_layouts,
    is_optimal_plan,
    load_paper_test_split,
    make_splits,
    optimal_paths,
    pack_layouts,
    parse,
    parse_batch,
    parse_batch_array,
    render_batch,
    render_state,
    shortest_path,
    state_array,
    step_state,
)
from mmrl.envs.planning import frozenlake, minibehavior
from mmrl.envs.planning.grid import WALL_BITS, passable
from mmrl.envs.planning.render import PALETTE, Colour

if "torch" in sys.modules:  # keep any torch pulled in by mmrl imports to one thread
    sys.modules["torch"].set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def paper_dir(shared_input) -> Path:
    """The VPRL paper's test-split metadata (../shared/vprl): skipped with the reason where it is absent."""
    return shared_input("vprl")

SIZES = {"frozenlake": [3, 4, 5, 6, 7, 9], "maze": [3, 4, 5, 6, 7, 9], "minibehavior": [5, 6]}
TASK_SIZES = [(t, s) for t, sizes in SIZES.items() for s in sizes]


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- names, layouts


def test_task_names() -> None:
    assert canonical_task("FrozenLake") == "frozenlake"
    assert canonical_task("minibehaviour") == "minibehavior"
    with pytest.raises(ValueError, match="valid tasks: frozenlake, maze, minibehavior"):
        canonical_task("sokoban")


def test_layout_validation_names_bad_values() -> None:
    with pytest.raises(ValueError, match="start"):
        Layout("frozenlake", np.array([[0, 1]]), (0, 5), (0, 1))
    with pytest.raises(ValueError, match="goal"):
        Layout("frozenlake", np.array([[0, 0]]), (0, 0), (0, 1))
    with pytest.raises(ValueError, match="must be a floor cell"):
        Layout("frozenlake", np.array([[2, 1]]), (0, 0), (0, 1))
    with pytest.raises(ValueError, match="unknown FrozenLake cell"):
        frozenlake.from_text(["SX", "FG"])
    walls = np.zeros((2, 2), np.uint8)
    walls[0, 0] = WALL_BITS[Action.RIGHT]  # not mirrored by (0, 1)
    with pytest.raises(ValueError, match="not mirrored"):
        Layout("maze", np.array([[0, 1], [0, 0]]), (0, 0), (0, 1), walls=walls)


def test_layout_key_is_stable_and_identifies() -> None:
    a = frozenlake.from_text(["SFF", "FHF", "FFG"])
    b = frozenlake.from_text(["SFF", "FHF", "FFG"])
    c = frozenlake.from_text(["FSF", "FHF", "FFG"])
    assert a.key() == b.key() and a == b and hash(a) == hash(b)
    assert a.key() != c.key()
    assert a.key() == "%s" % a.key()  # a plain string
    assert len({a, b, c}) == 2


# ----------------------------------------------------------------------------- generators, splits


@pytest.mark.parametrize("task,size", TASK_SIZES)
def test_generator_layouts_solvable_and_deterministic(task: str, size: int) -> None:
    lays = generate_layouts(task, size, 25, seed=7)
    assert [x.key() for x in lays] == [x.key() for x in generate_layouts(task, size, 25, seed=7)]
    assert [x.key() for x in lays] != [x.key() for x in generate_layouts(task, size, 25, seed=8)]
    assert len({x.key() for x in lays}) == 25
    for lay in lays:
        assert lay.level == size
        assert 1 <= lay.optimal_length < INF
        assert lay.dist_of(lay.start_state()) == lay.optimal_length
        if task != "minibehavior":
            assert lay.start != lay.goal
            assert lay.grid[lay.start] == Cell.FLOOR
        else:
            assert lay.shape == (size + 2, size + 2)
            assert lay.start != lay.printer and lay.start not in lay.table
            assert len(lay.table) == 6


@pytest.mark.parametrize("task,size", [("frozenlake", 4), ("maze", 5), ("minibehavior", 6)])
def test_splits_disjoint_and_deterministic(task: str, size: int) -> None:
    sp = make_splits(task, size, n_train=150, n_test=40, seed=3)
    assert len(sp.train) == 150 and len(sp.test) == 40
    assert not sp.keys("train") & sp.keys("test")
    assert len(sp.keys("train")) == 150 and len(sp.keys("test")) == 40
    again = make_splits(task, size, n_train=150, n_test=40, seed=3)
    assert [x.key() for x in again.train] == [x.key() for x in sp.train]
    # the test split does not depend on the train size
    assert [x.key() for x in make_splits(task, size, 10, 40, seed=3).test] == [x.key() for x in sp.test]
    # excluded layouts (e.g. the paper's test split) never appear
    excl = make_splits(task, size, 150, 40, seed=3, exclude=sp.train[:20])
    assert not {x.key() for x in sp.train[:20]} & (excl.keys("train") | excl.keys("test"))


@pytest.mark.parametrize("task,size", [("frozenlake", 3), ("minibehavior", 5)])
def test_paper_sized_splits(task: str, size: int) -> None:
    sp = make_splits(task, size)  # the paper's 1,000 train / 250 test per size
    assert len(sp.train) == 1000 and len(sp.test) == 250
    assert not sp.keys("train") & sp.keys("test")


def test_split_errors() -> None:
    with pytest.raises(RuntimeError, match="distinct"):
        generate_layouts("maze", 2, 100, seed=0, max_draws=400)  # a 2x2 maze has 48 instances
    with pytest.raises(ValueError, match="valid tasks"):
        make_splits("nope", 3)


# ----------------------------------------------------------------------------- BFS, optimal paths


def test_frozenlake_distances_and_optimal_path_set() -> None:
    lay = frozenlake.from_text(["SFF", "FFF", "FFG"])
    assert lay.optimal_length == 4
    paths = optimal_paths(lay)
    assert len(paths) == 6  # C(4, 2) monotone paths in an open 3x3 grid
    assert all(is_optimal_plan(p, lay) for p in paths)
    assert len({tuple(map(tuple, p[:, :2])) for p in paths}) == 6
    detour = [(0, 0), (0, 1), (0, 0), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert not is_optimal_plan(detour, lay)
    holes = frozenlake.from_text(["SFH", "FHF", "FFG"])
    assert holes.distance[0][0, 2] == INF and holes.distance[0][1, 1] == INF
    assert holes.optimal_length == 4 and len(optimal_paths(holes)) == 1
    cut = frozenlake.from_text(["SFH", "FHF", "HFG"])
    assert cut.distance[0][0, 0] == INF  # the start cannot reach the goal


def test_maze_walls_block_moves_and_bfs() -> None:
    grid = np.array([[0, 0], [0, 1]], np.uint8)
    walls = np.zeros((2, 2), np.uint8)
    walls[0, 1] |= WALL_BITS[Action.DOWN]  # wall between (0, 1) and (1, 1)
    walls[1, 1] |= WALL_BITS[Action.UP]
    lay = Layout("maze", grid, (0, 1), (1, 1), walls=walls)
    assert lay.optimal_length == 3  # around through (0, 0), (1, 0)
    s, valid, _ = step_state(lay, lay.start_state(), Action.DOWN)
    assert not valid and tuple(s[:2]) == (0, 1)
    s, valid, _ = step_state(lay, lay.start_state(), Action.LEFT)
    assert valid and tuple(s[:2]) == (0, 0)


@pytest.mark.parametrize("size", [3, 5, 8])
def test_maze_generator_is_perfect(size: int) -> None:
    for lay in generate_layouts("maze", size, 10, seed=size):
        n_open = sum(bin(int(w) ^ 15).count("1") for w in lay.walls.ravel())
        assert n_open // 2 == size * size - 1  # a spanning tree: cells - 1 open sides
        assert (lay.distance[0] < INF).all()
        assert len(optimal_paths(lay)) == 1


def test_minibehavior_pick_drop_dynamics() -> None:
    # interior 5: printer at (1, 1), table rows 3-4 x cols 1-3 (paper record coordinates)
    lay = minibehavior.make_layout(5, (2, 4), (1, 1), [(r, c) for r in (3, 4) for c in (1, 2, 3)])
    s = lay.start_state()
    assert s.tolist() == [3, 5, 0, 2, 2]
    assert lay.optimal_length == 5  # 3 moves, pick, drop (the paper record's plan)
    _, valid, _ = step_state(lay, s, Action.PICK)
    assert not valid  # not next to the printer
    for a in (Action.LEFT, Action.LEFT, Action.LEFT):
        s, valid, _ = step_state(lay, s, a)
        assert valid
    blocked, valid, _ = step_state(lay, s, Action.UP)  # into the printer
    assert not valid and np.array_equal(blocked, s)
    s, valid, _ = step_state(lay, s, Action.PICK)
    assert valid and s[2] == 1 and s[3] == -1
    moved, valid, _ = step_state(lay, s, Action.UP)  # the printer's cell is free once carried
    assert valid and tuple(moved[:2]) == (2, 2)
    s, valid, done = step_state(lay, s, Action.DROP)
    assert valid and done and s.tolist() == [3, 2, 2, 4, 2]  # printer on the table cell below
    assert lay.is_goal(s)
    assert is_optimal_plan(shortest_path(lay), lay)


def test_batch_step_matches_single_steps() -> None:
    rng = _rng(1)
    lays = []
    for task, size in (("frozenlake", 4), ("maze", 5), ("minibehavior", 5), ("frozenlake", 7)):
        lays += generate_layouts(task, size, 16, seed=2)
    pack = pack_layouts(lays)
    states = np.stack([x.start_state() for x in lays])
    singles = [x.start_state() for x in lays]
    n_act = np.array([x.n_actions for x in lays])
    for _ in range(30):
        acts = (rng.random(len(lays)) * n_act).astype(np.int64)
        nxt, valid, done = batch_step(pack, states, acts)
        for i, lay in enumerate(lays):
            s, v, d = step_state(lay, singles[i], int(acts[i]))
            assert np.array_equal(nxt[i], s) and valid[i] == v and done[i] == d, (i, lay, acts[i])
            singles[i] = s
        states = nxt
    with pytest.raises(ValueError, match="out of range"):
        batch_step(pack, states, np.full(len(lays), 5))  # DROP does not exist for FrozenLake


# ----------------------------------------------------------------------------- gymnasium


def test_frozenlake_agrees_with_gymnasium() -> None:
    gym = pytest.importorskip("gymnasium")
    rng = _rng(2)
    n_maps = 0
    for size in (3, 4, 5, 6, 8):
        for lay in generate_layouts("frozenlake", size, 12, seed=size, hole_prob=0.25):
            env = gym.make("FrozenLake-v1", desc=frozenlake.to_gym_desc(lay), is_slippery=False)
            obs, _ = env.reset(seed=0)
            assert divmod(int(obs), size) == lay.start
            s = lay.start_state()
            for _ in range(40):
                a = int(rng.integers(4))
                obs, reward, term, trunc, _ = env.step(a)
                s, _, done = step_state(lay, s, a)
                assert divmod(int(obs), size) == tuple(s[:2])
                assert term == done and (reward == 1.0) == (done and lay.is_goal(s))
                if term:
                    obs, _ = env.reset()
                    s = lay.start_state()
            env.close()
            n_maps += 1
    assert n_maps == 60


@pytest.mark.filterwarnings("ignore:.*alternative render modes")
def test_gym_env_api() -> None:
    pytest.importorskip("gymnasium")
    from gymnasium.utils.env_checker import check_env

    from mmrl.envs.planning import PlanningEnv, register_envs

    for task, size in (("frozenlake", 4), ("maze", 4), ("minibehavior", 5)):
        env = PlanningEnv(task, size, cell_size=24)
        check_env(env, skip_render_check=False)
        obs, info = env.reset(seed=5)
        obs2, info2 = env.reset(seed=5)
        assert np.array_equal(obs, obs2) and info["layout"] == info2["layout"]
        assert env.observation_space.contains(obs) and obs.dtype == np.uint8
        assert parse(obs, info["layout"]) == info["parsed_state"]
        plan = shortest_path(info["layout"])
        total = 0.0
        for prev, nxt in zip(plan[:-1], plan[1:]):
            action = next(a for a in range(env.action_space.n)
                          if np.array_equal(step_state(info["layout"], prev, a)[0], nxt))
            obs, r, term, trunc, info = env.step(action)
            total += r
        assert term and info["is_success"] and total == len(plan) - 1
        assert np.array_equal(env.render(), obs)
    ids = register_envs()
    import gymnasium

    env = gymnasium.make(ids[0], size=3)
    assert env.reset(seed=0)[0].shape == (96, 96, 3)
    with pytest.raises(ValueError, match="reward_mode"):
        PlanningEnv("maze", 3, reward_mode="dense")


def test_batch_env() -> None:
    pytest.importorskip("gymnasium")
    from mmrl.envs.planning import BatchPlanningEnv

    lays = generate_layouts("frozenlake", 4, 8, seed=0) + generate_layouts("minibehavior", 5, 8, seed=0)
    env = BatchPlanningEnv(lays)
    plans = [shortest_path(x) for x in lays]
    acts_per_env = []
    for lay, plan in zip(lays, plans):
        acts = [next(a for a in range(lay.n_actions) if np.array_equal(step_state(lay, p, a)[0], n))
                for p, n in zip(plan[:-1], plan[1:])]
        acts_per_env.append(acts)
    horizon = max(len(a) for a in acts_per_env)
    total = np.zeros(len(lays))
    for t in range(horizon):
        acts = np.array([a[t] if t < len(a) else 0 for a in acts_per_env])
        out = env.step(acts)
        total += np.where([t < len(a) for a in acts_per_env], out.reward, 0)
    assert out.done.all() and out.success.all()
    assert np.array_equal(total, [len(a) for a in acts_per_env])
    assert out.cells.shape == (16, 2)
    env.reset()
    assert np.array_equal(env.states, np.stack([x.start_state() for x in lays]))
    frames = BatchPlanningEnv(lays[:8]).render()
    assert frames.shape == (8, 128, 128, 3)


# ----------------------------------------------------------------------------- renderer / parser


def _all_states(lay: Layout) -> list[np.ndarray]:
    """Every state the agent can be in (FrozenLake: holes and goal too)."""
    h, w = lay.shape
    out = []
    if lay.task != "minibehavior":
        return [state_array((r, c), lay) for r in range(h) for c in range(w)]
    for phase in (0, 1):
        ok = passable(lay, phase)
        out += [state_array((r, c, phase), lay) for r, c in zip(*np.nonzero(ok))]
    adj = (lay.table_dir >= 0) & passable(lay, 1)
    out += [state_array((r, c, 2), lay) for r, c in zip(*np.nonzero(adj))]
    return out


def _noisy(frames: np.ndarray, rng: np.random.Generator, sigma: float = 25.0) -> np.ndarray:
    return np.clip(frames + rng.normal(0, sigma, frames.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("task,size", [(t, s) for t, s in TASK_SIZES if s != 7])
def test_parser_round_trip_all_states(task: str, size: int) -> None:
    rng = _rng(size)
    for lay in generate_layouts(task, size, 2, seed=11):
        states = np.stack(_all_states(lay))
        frames = render_batch([lay] * len(states), states)
        clean = parse_batch_array(frames, [lay] * len(states))
        assert np.array_equal(clean, states)
        noisy = parse_batch_array(_noisy(frames, rng), [lay] * len(states))
        assert np.array_equal(noisy, states)


@pytest.mark.parametrize("task,size", [("frozenlake", 6), ("maze", 6), ("minibehavior", 6)])
def test_parser_robust_to_blur_and_jpeg(task: str, size: int) -> None:
    image = pytest.importorskip("PIL.Image")
    filt = pytest.importorskip("PIL.ImageFilter")
    rng = _rng(3)
    lay = generate_layouts(task, size, 1, seed=5)[0]
    states = np.stack(_all_states(lay))[::2]
    frames = _noisy(render_batch([lay] * len(states), states), rng)
    out = []
    for f in frames:
        blurred = np.asarray(image.fromarray(f).filter(filt.GaussianBlur(1.0)))
        buf = io.BytesIO()
        image.fromarray(blurred).save(buf, format="JPEG", quality=40)
        out.append(np.asarray(image.open(buf)))
    assert np.array_equal(parse_batch_array(np.stack(out), [lay] * len(states)), states)


def test_parser_other_frame_sizes_and_float_frames() -> None:
    lay = generate_layouts("minibehavior", 5, 1, seed=0)[0]  # 7 cells in 256 px: fractional cells
    s = shortest_path(lay)[-2]
    f = render_state(lay, s, image_size=256)
    assert f.shape == (256, 256, 3)
    assert parse(f, lay) == ParsedState.from_array(s)
    assert parse(f.astype(np.float32) / 255.0, lay) == ParsedState.from_array(s)
    with pytest.raises(ValueError, match="too small"):
        parse(render_state(lay, s, cell_size=4), lay)


def _cell_block(frame: np.ndarray, lay: Layout, rc: tuple[int, int]) -> tuple[slice, slice]:
    ch, cw = frame.shape[0] // lay.shape[0], frame.shape[1] // lay.shape[1]
    return slice(rc[0] * ch, (rc[0] + 1) * ch), slice(rc[1] * cw, (rc[1] + 1) * cw)


def _reason(frame: np.ndarray, lay: Layout) -> int:
    return int(parse_batch_array(frame[None], [lay], return_reasons=True)[1][0])


def test_parser_rejects_garbage() -> None:
    rng = _rng(4)
    for task, size in (("frozenlake", 5), ("maze", 5), ("minibehavior", 5)):
        lay = generate_layouts(task, size, 1, seed=9)[0]
        f = render_state(lay)
        assert parse(rng.integers(0, 256, f.shape, dtype=np.uint8), lay) is UNPARSEABLE
        assert parse(np.zeros_like(f), lay) is UNPARSEABLE
        assert parse(f[:, :-8], lay) is UNPARSEABLE  # wrong width for the grid's cells
        # two agents: paste the agent cell of another frame
        other = shortest_path(lay)[1]
        g = render_state(lay, other)
        two = f.copy()
        two[_cell_block(f, lay, tuple(other[:2]))] = g[_cell_block(f, lay, tuple(other[:2]))]
        assert parse(two, lay) is UNPARSEABLE and _reason(two, lay) == ParseFailure.AGENT_COUNT
        # no agent: paste the start cell from the frame where the agent has left it
        none = f.copy()
        none[_cell_block(f, lay, lay.start)] = g[_cell_block(f, lay, lay.start)]
        assert parse(none, lay) is UNPARSEABLE and _reason(none, lay) == ParseFailure.AGENT_COUNT
        assert parse(f, lay) == ParsedState.from_array(lay.start_state())


def test_parser_rejects_changed_static_cells() -> None:
    fl = frozenlake.from_text(["SFH", "FFF", "HFG"])
    f = render_state(fl)
    f[_cell_block(f, fl, (0, 2))] = PALETTE[Colour.FLOOR].astype(np.uint8)  # hole painted over
    assert parse(f, fl) is UNPARSEABLE and _reason(f, fl) == ParseFailure.STATIC_CHANGED
    g = render_state(fl)
    g[_cell_block(g, fl, (2, 2))] = PALETTE[Colour.HOLE].astype(np.uint8)  # goal became a hole
    assert _reason(g, fl) == ParseFailure.STATIC_CHANGED
    mz = generate_layouts("maze", 4, 1, seed=1)[0]
    m = render_state(mz)
    m[:, :, :] = np.where((m == PALETTE[Colour.WALL]).all(-1, keepdims=True), PALETTE[Colour.FLOOR], m)
    assert parse(m, mz) is UNPARSEABLE and _reason(m, mz) == ParseFailure.STATIC_CHANGED
    mb = generate_layouts("minibehavior", 5, 1, seed=1)[0]
    b = render_state(mb)
    t = mb.table[0]
    b[_cell_block(b, mb, t)] = PALETTE[Colour.FLOOR].astype(np.uint8)  # a table cell vanished
    assert _reason(b, mb) == ParseFailure.STATIC_CHANGED


def test_parser_minibehavior_printer_checks() -> None:
    lay = minibehavior.make_layout(5, (2, 4), (1, 1), [(r, c) for r in (3, 4) for c in (1, 2, 3)])
    plan = shortest_path(lay)
    carrying = render_state(lay, plan[4])
    assert parse(carrying, lay).carrying
    start = render_state(lay)
    # carried and still at home: two printers
    dup = carrying.copy()
    dup[_cell_block(dup, lay, lay.printer)] = start[_cell_block(dup, lay, lay.printer)]
    assert _reason(dup, lay) == ParseFailure.PRINTER
    # printer vanished without being carried
    gone = start.copy()
    gone[_cell_block(gone, lay, lay.printer)] = PALETTE[Colour.FLOOR].astype(np.uint8)
    assert _reason(gone, lay) == ParseFailure.PRINTER
    done = parse(render_state(lay, plan[-1]), lay)
    assert done.phase == 2 and done.printer in lay.table


def test_parse_batch_matches_per_frame_loop_mixed_sizes() -> None:
    rng = _rng(6)
    lays, frames = [], []
    for task, size in (("frozenlake", 3), ("maze", 6), ("minibehavior", 6), ("frozenlake", 3)):
        for lay in generate_layouts(task, size, 3, seed=1):
            s = shortest_path(lay)[1]
            lays.append(lay)
            frames.append(_noisy(render_state(lay, s), rng))
    frames.append(rng.integers(0, 256, frames[0].shape, dtype=np.uint8))
    lays.append(lays[0])
    batched = parse_batch(frames, lays)
    assert batched == [parse(f, lay) for f, lay in zip(frames, lays)]
    assert batched[-1] is UNPARSEABLE and all(batched[:-1])


# ----------------------------------------------------------------------------- paper split


@pytest.mark.parametrize("task,n,levels", [("frozenlake", 1000, {3, 4, 5, 6}), ("minibehavior", 403, {5, 6})])
def test_paper_split_bfs_matches_reference_lengths(paper_dir: Path, task: str, n: int, levels: set) -> None:
    sp = load_paper_test_split(paper_dir, task)
    assert len(sp) == n and set(sp.levels.tolist()) == levels
    for lay, plan, level in zip(sp.layouts, sp.plans, sp.levels):
        assert lay.level == level
        assert np.array_equal(plan[0], lay.start_state())
        ours = shortest_path(lay)
        assert len(ours) == len(plan) == lay.optimal_length + 1
        assert is_optimal_plan(plan, lay)


def test_paper_frozenlake_distance_maps_agree(paper_dir: Path) -> None:
    records = json.loads((paper_dir / "vprl_frozenlake_test_meta.json").read_text())
    sp = load_paper_test_split(paper_dir / "vprl_frozenlake_test_meta.json", "frozenlake")
    for rec, lay in zip(records, sp.layouts):
        level = rec["level"]
        for cell, d in rec["distance_map"].items():
            assert lay.distance[0][divmod(int(cell), level)] == d


def test_paper_split_loader_errors(paper_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="covers frozenlake, minibehavior"):
        load_paper_test_split(paper_dir, "maze")
    with pytest.raises(FileNotFoundError):
        load_paper_test_split(tmp_path, "frozenlake")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"level": 3}]))
    with pytest.raises(ValueError, match="record 0"):
        load_paper_test_split(bad, "frozenlake")


# ----------------------------------------------------------------------------- bench


def test_bench_envs_smoke() -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "envs.py"), "--smoke"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    keys = {"env_steps_per_s_batched", "env_steps_per_s_loop", "env_speedup", "parser_fps_batched",
            "parser_fps_loop", "parser_speedup"}
    assert set(result) == keys
    assert all(result[k] > 0 for k in keys)


def test_sparse_reward_is_paid_once_like_gymnasium() -> None:
    """Stepping again after reaching the goal pays 0, as gymnasium's FrozenLake does."""
    gym = pytest.importorskip("gymnasium")
    from mmrl.envs.planning import PlanningEnv

    for lay in generate_layouts("frozenlake", 4, 6, seed=3, hole_prob=0.25):
        env = PlanningEnv("frozenlake", 4, layout=lay, reward_mode="sparse")
        ref = gym.make("FrozenLake-v1", desc=frozenlake.to_gym_desc(lay), is_slippery=False)
        env.reset(seed=0)
        ref.reset(seed=0)
        plan = shortest_path(lay)
        actions = [next(a for a in range(4) if np.array_equal(step_state(lay, p, a)[0], n))
                   for p, n in zip(plan[:-1], plan[1:])]
        ours = [env.step(a)[1] for a in actions + [0, 1]]  # two more steps from the goal
        theirs = [ref.unwrapped.step(a)[1] for a in actions + [0, 1]]
        assert ours == theirs == [0.0] * (len(actions) - 1) + [1.0, 0.0, 0.0]
