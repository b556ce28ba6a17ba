"""Rollout engine tensor-parallel groups: layouts, placement on GPUs, errors, and real gloo groups."""

import json

import pytest

from conftest import run_torchrun
from rl2.engines.tp_group import TPGroupLayout, all_tp_groups, plan_this_rank, plan_tp_group


def layouts(nodes: int, gpus_per_node: int, tp_size: int) -> list[TPGroupLayout]:
    """Every rank's layout, ranks numbered node by node as torchrun does."""
    world = nodes * gpus_per_node
    return [
        plan_tp_group(node * gpus_per_node + local, world, local, gpus_per_node, tp_size)
        for node in range(nodes)
        for local in range(gpus_per_node)
    ]


def as_tuple(layout: TPGroupLayout) -> tuple:
    return (layout.tp_size, layout.group_index, layout.ranks, layout.tp_rank, layout.base_gpu_id)


# --- one node of 8 GPUs ---------------------------------------------------------------------------


def test_one_node_tp1_every_rank_is_its_own_engine():
    got = [as_tuple(layout) for layout in layouts(1, 8, 1)]
    assert got == [(1, r, (r,), 0, r) for r in range(8)]
    assert all(layout.is_leader for layout in layouts(1, 8, 1))
    assert [layout.leader for layout in layouts(1, 8, 1)] == list(range(8))


def test_one_node_tp2_exact_layouts():
    got = [as_tuple(layout) for layout in layouts(1, 8, 2)]
    assert got == [
        (2, 0, (0, 1), 0, 0),
        (2, 0, (0, 1), 1, 0),
        (2, 1, (2, 3), 0, 2),
        (2, 1, (2, 3), 1, 2),
        (2, 2, (4, 5), 0, 4),
        (2, 2, (4, 5), 1, 4),
        (2, 3, (6, 7), 0, 6),
        (2, 3, (6, 7), 1, 6),
    ]
    assert [layout.leader for layout in layouts(1, 8, 2)] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert [layout.is_leader for layout in layouts(1, 8, 2)] == [True, False] * 4


def test_one_node_tp4_exact_layouts():
    got = [as_tuple(layout) for layout in layouts(1, 8, 4)]
    assert got == [(4, 0, (0, 1, 2, 3), r, 0) for r in range(4)] + [(4, 1, (4, 5, 6, 7), r, 4) for r in range(4)]
    assert [layout.is_leader for layout in layouts(1, 8, 4)] == [True, False, False, False] * 2


def test_one_node_tp8_is_a_single_engine():
    got = [as_tuple(layout) for layout in layouts(1, 8, 8)]
    assert got == [(8, 0, tuple(range(8)), r, 0) for r in range(8)]
    assert {layout.leader for layout in layouts(1, 8, 8)} == {0}
    assert [layout.is_leader for layout in layouts(1, 8, 8)] == [True] + [False] * 7


def test_single_rank_world():
    assert as_tuple(plan_tp_group(0, 1, 0, 1, 1)) == (1, 0, (0,), 0, 0)


# --- two nodes of 8 GPUs (world 16) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "tp_size, expected",
    [
        (2, (2, 6, (12, 13), 1, 4)),
        (4, (4, 3, (12, 13, 14, 15), 1, 4)),
        (8, (8, 1, tuple(range(8, 16)), 5, 0)),
    ],
)
def test_two_nodes_rank13(tp_size, expected):
    # rank 13 is local rank 5 on node 1
    layout = plan_tp_group(13, 16, 5, 8, tp_size)
    assert as_tuple(layout) == expected
    assert layout.leader == expected[2][0]
    assert layout.is_leader is False


def test_two_nodes_group_leaders_and_first_ranks_of_node1():
    leader = plan_tp_group(8, 16, 0, 8, 8)
    assert as_tuple(leader) == (8, 1, tuple(range(8, 16)), 0, 0)
    assert leader.is_leader and leader.leader == 8
    # the last rank of node 0 never shares an engine with node 1
    assert as_tuple(plan_tp_group(7, 16, 7, 8, 2)) == (2, 3, (6, 7), 1, 6)
    assert as_tuple(plan_tp_group(7, 16, 7, 8, 4)) == (4, 1, (4, 5, 6, 7), 3, 4)
    assert as_tuple(plan_tp_group(7, 16, 7, 8, 8)) == (8, 0, tuple(range(8)), 7, 0)
    assert as_tuple(plan_tp_group(15, 16, 7, 8, 4)) == (4, 3, (12, 13, 14, 15), 3, 4)


@pytest.mark.parametrize(
    "nodes, gpus, tp_size",
    [(1, 8, 1), (1, 8, 2), (1, 8, 4), (1, 8, 8), (2, 8, 1), (2, 8, 2), (2, 8, 4), (2, 8, 8), (4, 4, 2), (3, 2, 2)],
)
def test_groups_are_consistent_over_all_ranks(nodes, gpus, tp_size):
    world = nodes * gpus
    by_group: dict[int, list[tuple[int, TPGroupLayout]]] = {}
    for node in range(nodes):
        for local in range(gpus):
            rank = node * gpus + local
            layout = plan_tp_group(rank, world, local, gpus, tp_size)
            assert layout.tp_size == tp_size
            assert layout.ranks[layout.tp_rank] == rank
            # TP rank i runs on GPU base_gpu_id + i, which is this rank's own GPU
            assert layout.base_gpu_id + layout.tp_rank == local
            assert 0 <= layout.base_gpu_id and layout.base_gpu_id + tp_size <= gpus
            # all members on one node
            assert {member // gpus for member in layout.ranks} == {node}
            by_group.setdefault(layout.group_index, []).append((rank, layout))

    assert sorted(by_group) == list(range(world // tp_size))
    groups = all_tp_groups(world, tp_size)
    assert len(groups) == world // tp_size
    for index, members in by_group.items():
        assert len(members) == tp_size
        ranks = {layout.ranks for _, layout in members}
        leaders = {layout.leader for _, layout in members}
        bases = {layout.base_gpu_id for _, layout in members}
        assert len(ranks) == 1 and len(leaders) == 1 and len(bases) == 1  # every member agrees
        (group_ranks,) = ranks
        assert group_ranks == groups[index]
        assert [rank for rank, _ in members] == list(group_ranks)
        assert [layout.tp_rank for _, layout in members] == list(range(tp_size))
        assert [layout.is_leader for _, layout in members] == [True] + [False] * (tp_size - 1)
        assert leaders == {group_ranks[0]}
        # the leader's local rank is the base GPU
        assert bases == {group_ranks[0] % gpus}
    # every rank in exactly one group
    assert sorted(r for g in groups for r in g) == list(range(world))


def test_all_tp_groups_exact():
    assert all_tp_groups(8, 1) == [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]
    assert all_tp_groups(8, 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all_tp_groups(8, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all_tp_groups(8, 8) == [tuple(range(8))]
    assert all_tp_groups(16, 4) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]


def test_layout_is_frozen():
    layout = plan_tp_group(3, 8, 3, 8, 2)
    with pytest.raises(AttributeError):
        layout.tp_rank = 0


# --- errors ---------------------------------------------------------------------------------------


def test_tp_not_dividing_world_raises():
    with pytest.raises(ValueError, match=r"rollout\.tp_size=3 must divide the number of ranks \(world size 8\)"):
        plan_tp_group(0, 8, 0, 8, 3)


def test_tp_not_dividing_gpus_per_node_raises():
    # 16 divides the world of 16, but an engine cannot span the two nodes of 8 GPUs
    with pytest.raises(ValueError, match=r"rollout\.tp_size=16 must divide the GPUs per node \(8 ranks on this node"):
        plan_tp_group(3, 16, 3, 8, 16)
    with pytest.raises(ValueError, match=r"rollout\.tp_size=4 must divide the GPUs per node \(6 ranks on this node"):
        plan_tp_group(0, 12, 0, 6, 4)


@pytest.mark.parametrize("tp_size", [0, -2])
def test_tp_below_one_raises(tp_size):
    with pytest.raises(ValueError, match=rf"rollout\.tp_size must be >= 1, got {tp_size}$"):
        plan_tp_group(0, 8, 0, 8, tp_size)


@pytest.mark.parametrize(
    "rank, local_rank, local_world_size",
    [
        (9, 0, 8),  # node 1 numbered from local rank 0 at rank 9
        (1, 0, 8),  # two ranks claiming local rank 0 on one node
        (3, 3, 2),  # local rank beyond the node
    ],
)
def test_rank_not_numbered_node_by_node_raises(rank, local_rank, local_world_size):
    with pytest.raises(
        ValueError,
        match=rf"rollout\.tp_size=2: rank {rank} has local rank {local_rank} with {local_world_size} ranks per node "
        r"in a world of 16: ranks are not numbered node by node",
    ):
        plan_tp_group(rank, 16, local_rank, local_world_size, 2)


def test_single_gpu_engines_take_any_numbering_and_ranks_must_be_in_the_world():
    """With tp_size 1 every rank runs its own engine on its own GPU, whatever the numbering."""
    layout = plan_tp_group(5, 8, 1, 4, 1)
    assert layout.ranks == (5,) and layout.base_gpu_id == 1 and layout.is_leader
    with pytest.raises(ValueError, match="rank 9 is outside the world of 8 ranks"):
        plan_tp_group(9, 8, 1, 8, 2)


def test_plan_this_rank_without_torchrun(monkeypatch):
    # no process group and no torchrun environment: one rank on one node
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert as_tuple(plan_this_rank(1)) == (1, 0, (0,), 0, 0)
    with pytest.raises(ValueError, match=r"rollout\.tp_size=2 must divide the number of ranks \(world size 1\)"):
        plan_this_rank(2)


# --- real process groups --------------------------------------------------------------------------


def test_new_tp_group_with_two_ranks(tmp_path):
    out = tmp_path / "tp_groups.json"
    run_torchrun(["tests/workers/tp_group_check.py", str(out)], nproc=2, timeout=60)
    seen = json.loads(out.read_text())
    assert seen == [
        {
            "tp2": {"layout": [0, [0, 1], 0, 0], "members": [[0, 0, 0], [1, 1, 0]], "sum": 1.0},
            "tp1": {"layout": [0, [0], 0, 0], "members": [[0, 0, 0]], "sum": 0.0},
        },
        {
            "tp2": {"layout": [0, [0, 1], 1, 0], "members": [[0, 0, 0], [1, 1, 0]], "sum": 1.0},
            "tp1": {"layout": [1, [1], 0, 1], "members": [[1, 0, 1]], "sum": 1.0},
        },
    ]


def test_split_placement_plans_the_rollout_side_on_its_own_gpus(monkeypatch):
    """Under split placement the rollout ranks' default group is theirs (ranks 0..N-1) while LOCAL_RANK names
    the GPU: with 1 trainer and 2 rollout ranks on one node, the TP-2 engine starts on GPU 1."""
    from rl2.engines import tp_group

    monkeypatch.setattr(tp_group, "rank", lambda: 1)
    monkeypatch.setattr(tp_group, "world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("WORLD_SIZE", "3")
    layout = tp_group.plan_this_rank(2)
    assert (layout.ranks, layout.tp_rank, layout.base_gpu_id) == ((0, 1), 1, 1)
    monkeypatch.setenv("WORLD_SIZE", "6")  # two nodes of 3
    with pytest.raises(ValueError, match="runs on one node"):
        tp_group.plan_this_rank(2)
