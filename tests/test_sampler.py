import pytest

from rl2.data.sampler import BatchSampler


def test_batches_cover_each_epoch_and_resume_exactly():
    sampler = BatchSampler(num_rows=10, batch_size=3, shuffle=True, seed=7)
    assert sampler.batches_per_epoch == 3
    batches = [sampler.next_batch() for _ in range(7)]
    first_epoch = sum(batches[:3], [])
    assert len(set(first_epoch)) == 9 and set(first_epoch) <= set(range(10))  # last partial batch dropped
    assert batches[:3] != batches[3:6]  # a fresh shuffle each epoch

    resumed = BatchSampler(num_rows=10, batch_size=3, shuffle=True, seed=7)
    replay = BatchSampler(num_rows=10, batch_size=3, shuffle=True, seed=7)
    for _ in range(4):
        replay.next_batch()
    resumed.load_state_dict(replay.state_dict())
    assert [resumed.next_batch() for _ in range(3)] == batches[4:7]


def test_unshuffled_order_and_too_large_batch():
    sampler = BatchSampler(num_rows=4, batch_size=2, shuffle=False)
    assert [sampler.next_batch() for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]
    with pytest.raises(ValueError, match="batch_size=5"):
        BatchSampler(num_rows=4, batch_size=5)
