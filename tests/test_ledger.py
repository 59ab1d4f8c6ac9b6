"""The sample ledger (trainer/data/ledger.py): which samples every rank trained in each epoch, kept in checkpoints
and the run folder, and `trainer ledger`; the rest of an epoch dealt again on another number of ranks."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from torchyard.trainer.cli.main import main
from torchyard.trainer.data.ledger import LEDGER_FILE, SampleLedger, report
from torchyard.trainer.data.samplers import EpochSampler, ResumableBatchSampler, resume_epoch_at


def crafted(segments: list[list[int]], finished: bool = True) -> dict:
    """A ledger of one epoch of 8 samples in dataset order (positions are sample indices)."""
    order = {"kind": "seeded", "shuffle": False, "seed": 0}
    return {"version": 1, "segments": segments,
            "epochs": {"0": {"samples": 8, "order": order, "finished": finished, "planned": 8}}}


def test_a_duplicate_and_a_gap_are_reported_with_the_ranks_and_steps_that_trained_them(tmp_path, capsys):
    # Rank 0 of 2 took positions 0, 2, 4, 6 in steps 0-2; rank 1 took 1 and 3, then, resumed on one rank,
    # positions 4-5 again in steps 2-3: 4 twice, 7 never.
    ledger = crafted([[0, 0, 2, 0, 2, 0, 8, 2], [0, 1, 2, 0, 2, 1, 5, 2], [0, 0, 1, 2, 3, 4, 6, 1]])
    (tmp_path / LEDGER_FILE).write_text(json.dumps(ledger))
    assert main(["ledger", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "epoch 0: 8 samples: 6 trained once, 1 more than once, 1 missing",
        "  duplicate: sample 4 (position 4) trained 2 times: rank 0 of 2 in steps 0-2, rank 0 of 1 in steps 2-3",
        "  missing: sample 7 (position 7)",
    ]


def test_a_shuffled_order_names_the_dataset_index_and_an_unfinished_epoch_misses_nothing_yet():
    ledger = crafted([[0, 0, 1, 0, 1, 0, 3, 1], [0, 0, 1, 1, 2, 2, 4, 1]], finished=False)
    ledger["epochs"]["0"]["order"] = {"kind": "seeded", "shuffle": True, "seed": 3}
    lines, clean = report(ledger)
    index = torch.randperm(8, generator=torch.Generator().manual_seed(3))[2].item()  # DistributedSampler's draw
    assert not clean and lines[1] == (f"  duplicate: sample {index} (position 2) trained 2 times: rank 0 of 1 in "
                                      "steps 0-1, rank 0 of 1 in steps 1-2")
    ledger["segments"] = ledger["segments"][:1]
    assert report(ledger) == (["epoch 0: 3 of 8 samples trained so far, none twice (unfinished)"], True)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("samples", "before", "after", "batches_done"),
                         [(23, 2, 3, 2), (23, 3, 2, 1), (24, 2, 1, 3), (23, 2, 2, 2)])
def test_the_rest_of_an_epoch_dealt_on_another_number_of_ranks_trains_each_sample_once(samples, before, after,
                                                                                      batches_done, drop_last):
    """`before` ranks trained `batches_done` batches of 2 (the batches torch's DistributedSampler deals), then
    `after` ranks deal the rest: with what was trained, every sample once (padding and drop_last aside), in as
    many batches per rank as a fresh epoch has there."""
    dataset = list(range(samples))

    def loader(world: int, rank: int, sampler_class: type = EpochSampler) -> DataLoader:
        sampler = sampler_class(dataset, world, rank, shuffle=True, seed=4, drop_last=drop_last)
        sampler.set_epoch(1)
        return DataLoader(dataset, batch_sampler=ResumableBatchSampler(sampler, 2, drop_last))

    first = [list(loader(before, rank).batch_sampler)[:batches_done] for rank in range(before)]
    assert first == [list(loader(before, rank, DistributedSampler).batch_sampler)[:batches_done]
                     for rank in range(before)]
    trained = [index for batches in first for batch in batches for index in batch]
    rest = []
    for rank in range(after):
        resumed = loader(after, rank)
        done = resume_epoch_at(resumed, len(trained))
        assert done + len(list(resumed.batch_sampler)) == len(resumed) == len(loader(after, rank))
        if after == before:  # on as many ranks: the batches the uninterrupted epoch goes on with, padding included
            assert list(resumed.batch_sampler) == list(loader(after, rank).batch_sampler)[done:]
        rest += [index for batch in resumed.batch_sampler for index in batch]
    counts = Counter(trained + rest)
    if drop_last:
        assert max(counts.values()) == 1  # a tail left out, nothing twice
    else:
        assert set(counts) == set(dataset)
        assert sum(counts.values()) - samples < after  # repeats only to pad the ranks' shares equal


def test_a_checkpoints_stretches_join_again_and_the_first_untrained_position_is_where_a_resume_goes_on():
    ledger = SampleLedger()
    ledger.load_state_dict(crafted([[0, 0, 2, 0, 2, 0, 8, 2], [0, 0, 2, 2, 3, 8, 12, 2], [0, 1, 2, 0, 3, 1, 11, 2]],
                                   finished=False))
    state = ledger.gather(0, 0, lambda obj: [obj])
    assert state["segments"] == [[0, 0, 2, 0, 3, 0, 12, 2], [0, 1, 2, 0, 3, 1, 11, 2]]
    assert ledger.first_untrained(0) == 8  # 0..10 and 11 is past the epoch's 8 samples (padding)


def test_a_folder_without_a_ledger_is_one_line_and_status_2(tmp_path, capsys):
    assert main(["ledger", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"trainer ledger: error: {str(tmp_path / LEDGER_FILE)!r} does not exist: give a run folder "
        f"(runs/<name>/version_<n>) of a fit that saved a checkpoint or ended, or its {LEDGER_FILE}.\n")
