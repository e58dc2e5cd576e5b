"""The engine's routing tables (algo.routing_replay=rollout) travel only to the ranks that
train their sequences: the gather of responses carries none, and the bytes a rank receives
are its own share's tables, whatever the world size."""
import json
import pickle

import numpy as np
import pytest

from tests.torchrun import run_function

pytestmark = pytest.mark.distributed

RESPONSES_PER_REPLICA = 6
LAYERS, TOP_K, EXPERTS = 3, 2, 8


def table(replica: int, index: int) -> np.ndarray:
    """A recognisable routing table: its positions, and its expert ids, depend on both."""
    positions = 20 + 7 * index + replica
    rng = np.random.default_rng(1000 * replica + index)
    return rng.integers(-1, EXPERTS, size=(positions, LAYERS, TOP_K)).astype(np.int16)


def exchange(out: str, tps: list[int], lose_a_table: bool = False) -> None:
    """For each TP size of ``tps`` in turn, in one process group: every rank a replica (one
    per ``tp`` ranks), each with its responses and tables; the responses gathered as the
    engine gathers them, then split over the data-parallel ranks (the actor's TP groups of
    ``tp`` ranks) and the tables delivered. Rank 0 writes ``{tp: what it saw}``, and with
    ``lose_a_table`` then ``"lost"``: :func:`_lost_table`'s result."""
    import torch

    from rlep_megatron import distributed

    distributed.init_process_group()
    results: dict = {tp: _exchange(tp) for tp in tps}
    if lose_a_table:
        results["lost"] = _lost_table()
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    distributed.destroy()


def _exchange(tp: int) -> dict:
    import torch

    from rlep_megatron import distributed
    from rlep_megatron.data.batch import Sample
    from rlep_megatron.actor import routing_store
    from rlep_megatron.rollout.colocated.engine import RolloutEngine
    from rlep_megatron.rollout.response import Response

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    replica = rank // tp
    local = [[Response(i, [1, 2, 3], [0.0] * 3, "", "stop", routing=table(replica, i))]
             for i in range(RESPONSES_PER_REPLICA)]
    engine = RolloutEngine.__new__(RolloutEngine)
    engine.__dict__.update(rank=rank, tp_size=tp, dp_size=world // tp,
                           gather_group=distributed.rollout_group())
    sent = len(pickle.dumps(local))
    merged = engine.all_gather(local, RESPONSES_PER_REPLICA * world // tp)
    gathered_bytes = len(pickle.dumps(merged))
    seqs = [Sample(g, r.token_ids, "", "fresh", routing=r.routing, routing_key=r.routing_key)
            for g, group in enumerate(merged) for r in group]
    origin = [(g // RESPONSES_PER_REPLICA, g % RESPONSES_PER_REPLICA)
              for g in range(len(seqs))]
    # data-parallel rank d trains every dp-th sequence, from d on
    dp = world // tp
    shares = [seqs[d::dp] for d in range(dp)]
    share_of_rank = [r // tp for r in range(world)]
    received = routing_store.deliver(shares, rank // tp, share_of_rank,
                                     distributed.rollout_group(), EXPERTS)
    mine = list(range(len(seqs)))[rank // tp::dp]
    equal = all(np.array_equal(seqs[i].routing, table(*origin[i])) for i in mine)
    others_untouched = all(seqs[i].routing is None for i in range(len(seqs)) if i not in mine)
    return {"received": received, "equal": equal, "others_untouched": others_untouched,
            "gather_has_routing": any(r.routing is not None for g in merged for r in g),
            "sent_with_routing": sent, "gathered_bytes": gathered_bytes,
            "dtype": str(seqs[mine[0]].routing.dtype),
            "own_share_bytes": sum(table(*origin[i]).size for i in mine)}




def _lost_table() -> dict:
    """Rank 0 no longer holds one of its tables when the step asks for it: every rank raises
    at the size exchange (none waits in the exchange that would follow)."""
    import torch

    from rlep_megatron import distributed
    from rlep_megatron.actor import routing_store
    from rlep_megatron.data.batch import Sample
    from rlep_megatron.rollout.colocated.engine import RolloutEngine
    from rlep_megatron.rollout.response import Response

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local = [[Response(i, [1, 2], [0.0] * 2, "", "stop", routing=table(rank, i))]
             for i in range(2)]
    engine = RolloutEngine.__new__(RolloutEngine)
    engine.__dict__.update(rank=rank, tp_size=1, dp_size=world,
                           gather_group=distributed.rollout_group())
    merged = engine.all_gather(local, 2 * world)
    seqs = [Sample(g, r.token_ids, "", "fresh", routing_key=r.routing_key)
            for g, group in enumerate(merged) for r in group]
    if rank == 0:
        routing_store.HOLD.tables.clear()
    try:
        routing_store.deliver([seqs[d::world] for d in range(world)], rank, list(range(world)),
                              distributed.rollout_group(), EXPERTS)
        raised = 0.0
    except RuntimeError as err:
        raised = float("rank(s) [0]" in str(err))
    everywhere = torch.tensor([raised])
    torch.distributed.all_reduce(everywhere, op=torch.distributed.ReduceOp.MIN,
                                 group=distributed.rollout_group())
    return {"raised_everywhere": everywhere.item() == 1.0}


def run(directory, nproc, tps, lose_a_table=False):
    out = directory / f"delivery-{nproc}.json"
    run_function("tests.distributed.test_routing_delivery:exchange", nproc,
                 {"out": str(out), "tps": list(tps), "lose_a_table": lose_a_table},
                 timeout_s=120 if lose_a_table else 600)  # no rank waits on a lost table
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank exchange, then (after its tables were checked) a lost table."""
    return run(tmp_path_factory.mktemp("delivery"), 2, [1], lose_a_table=True)


def test_routing_reaches_only_the_ranks_that_train_it(two_ranks, tmp_path):
    two = two_ranks["1"]
    # 4 replicas; then 2 replicas of 2 ranks (DP2 x TP2 on the actor's side)
    results = run(tmp_path, 4, [1, 2])
    four, tp2 = results["1"], results["2"]
    for result in (two, four, tp2):
        # every table of this rank's share arrived intact, in one byte per expert id (8
        # experts), and no other sequence got one
        assert result["equal"] and result["others_untouched"]
        assert result["dtype"] == "int8"
        assert not result["gather_has_routing"]
        header = 4 + 4 * 3  # each table's rank and shape
        shares = result["own_share_bytes"] + header * RESPONSES_PER_REPLICA
        assert result["received"] == shares
    # the bytes a rank receives: its share (6 sequences in every layout), not the world size
    assert four["received"] == pytest.approx(two["received"], rel=0.35)
    # the gather's payload: 4 replicas' responses without tables, less than one replica's
    # responses with its tables
    assert four["gathered_bytes"] < two["sent_with_routing"]


def test_a_lost_table_fails_every_rank_at_once(two_ranks):
    assert two_ranks["lost"]["raised_everywhere"]
